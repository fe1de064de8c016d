"""``kdeploy check``: everything about a push that can be known on the controller, without SSH (docs/check.md).

For each selected host: its unit renders (template errors at ``template:line``) and passes ``systemd-analyze
verify`` where that is installed, its payload directory exists with modes a push accepts and a valid gate
manifest (whose settings accept the host's flags), every secret it names is set on the controller (values
never shown), and every hook that names a script has one. Each problem is one ``file:line: ...`` line;
nothing connects to a host, so it runs in a merge-request job without keys or production secrets.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kdeploy.core import files
from kdeploy.core import secrets as secret
from kdeploy.core.errors import InvalidInput, KdeployError
from kdeploy.core.gatespec import gate_spec, load_payload_gate
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.release import scan_payload
from kdeploy.core.render import render_unit, unit_filename
from kdeploy.core.report import Report, Result

HOOKS = ("pre_deploy", "pre_host", "post_host", "post_rollout")
VERIFY_TIMEOUT = 60.0
# systemd-analyze runs here, not on the host: what only the host has is no finding. The service's python
# (ExecStart) is installed on the hosts only.
_HOST_ONLY = (re.compile(r"Command .* is not executable"),)
_VERIFY_LINE = re.compile(r"^(?P<path>/[^:]*\.service):(?P<line>\d+): (?P<message>.*)$")


@dataclass
class CheckView:
    """One host's findings (``--json``: the host's ``check``)."""

    key: ClassVar[str] = "check"
    findings: list[str] = field(default_factory=list)
    systemd_analyze: bool = False  # whether the unit went through systemd-analyze verify

    def to_json(self) -> dict:
        return {"findings": self.findings, "systemd_analyze": self.systemd_analyze}


Verifier = Callable[[str, str], list[tuple[int, str]]]


def systemd_verify(unit_name: str, text: str) -> list[tuple[int, str]]:
    """``systemd-analyze verify`` on ``text`` saved as ``unit_name`` in a scratch directory: each complaint as
    (line of the unit, message), those about what only the host has left out."""
    with tempfile.TemporaryDirectory(prefix="kdeploy-check-") as tmp:
        path = Path(tmp) / unit_name
        path.write_text(text)
        try:
            done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True,
                                  text=True, timeout=VERIFY_TIMEOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})
        except subprocess.TimeoutExpired:
            return [(0, f"systemd-analyze verify did not finish within {VERIFY_TIMEOUT:g}s")]
    return parse_verify(done.stdout + done.stderr)


def parse_verify(output: str) -> list[tuple[int, str]]:
    """systemd-analyze's lines as (unit line, message); 0 when a line names no line of the unit."""
    found = []
    for raw in output.splitlines():
        line = raw.strip()
        if not line or any(p.search(line) for p in _HOST_ONLY):
            continue
        match = _VERIFY_LINE.match(line)
        if match:
            found.append((int(match["line"]), match["message"]))
        else:
            found.append((0, re.sub(r"^\S+\.service: ", "", line)))
    return found


def hook_script(command: str, base: Path) -> str | None:
    """What is wrong with the script a hook command starts with, if it names one (a first word with a
    ``/``): missing, or not executable. Shell commands (``curl ...``, ``[ ... ] || ...``) are not judged."""
    try:
        first = shlex.split(command, comments=True)[0]
    except (ValueError, IndexError):
        return None
    if "/" not in first or "$" in first:
        return None
    path = Path(first).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        if not files.is_file(path, "hook script"):
            return f"{path}: not found"
    except InvalidInput as exc:
        return str(exc)
    if not os.access(path, os.X_OK):
        return f"{path}: not executable (chmod +x it, or start the hook with `sh {first}`)"
    return None


@dataclass
class Checker:
    """The checks of one inventory; what several hosts share (a payload, a unit text) is checked once."""

    inventory: Inventory
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    verify: Verifier | None = None
    _payloads: dict[Path, list[str]] = field(default_factory=dict)
    _units: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def host(self, host: HostConfig) -> CheckView:
        view = CheckView()
        view.findings += self._unit(host, view)
        view.findings += self._payload(host)
        view.findings += self._secrets(host)
        view.findings += self._hooks(host)
        return view

    def _unit(self, host: HostConfig, view: CheckView) -> list[str]:
        template = self.inventory.local_path(host.service.template)
        try:
            if not files.is_file(template, "unit template"):
                return [f"{self.inventory.where(host.name, 'service', 'template')}: {template}: unit template "
                        "not found"]
        except InvalidInput as exc:
            return [str(exc)]
        try:
            text = render_unit(self.inventory, host)
        except KdeployError as exc:
            return [str(exc)]
        if self.verify is None:
            return []
        view.systemd_analyze = True
        if text not in self._units:
            self._units[text] = self.verify(unit_filename(host.service), text)
        lines = text.splitlines()
        return [f"{template}: unit rendered for {host.name}"
                + (f", line {n} ({lines[n - 1].strip()[:80]})" if 0 < n <= len(lines) else "")
                + f": systemd-analyze verify: {message}" for n, message in self._units[text]]

    def _payload(self, host: HostConfig) -> list[str]:
        path = self.inventory.payload_dir(host)
        if path not in self._payloads:
            try:
                scan_payload(path)
                load_payload_gate(path)
                self._payloads[path] = []
            except KdeployError as exc:
                self._payloads[path] = [f"{self.inventory.where(host.name, 'service', 'payload')}: {exc}"]
        if self._payloads[path]:
            return list(self._payloads[path])
        try:  # the host's flags against the settings the payload's manifest accepts
            gate_spec(host.service, load_payload_gate(path))
        except KdeployError as exc:
            return [f"{self.inventory.where(host.name, 'service', 'env')}: {exc}"]
        return []

    def _secrets(self, host: HostConfig) -> list[str]:
        where = self.inventory.where(host.name, "service", "secrets", "env")
        missing = [n for n in host.service.secrets.env if n not in self.environ]
        if missing:
            return [f"{where}: secret {n}: environment variable {n} is not set on the controller" for n in missing]
        try:
            secret.resolve(self.inventory, host, self.environ)
        except KdeployError as exc:
            return [f"{self.inventory.where(host.name, 'service', 'secrets')}: {exc}"]
        return []

    def _hooks(self, host: HostConfig) -> list[str]:
        found = []
        for hook in HOOKS:
            command = getattr(host.hooks, hook)
            why = hook_script(command, self.inventory.base_dir) if command else None
            if why:
                found.append(f"{self.inventory.where(host.name, 'hooks', hook)}: {why}")
        return found


def run(inventory: Inventory, target: str | None, *, environ: Mapping[str, str] | None = None) -> Report:
    """``kdeploy check``: one result per host, ``ok`` or ``invalid`` (exit 2) with every finding; units go
    through ``systemd-analyze verify`` when it is installed here."""
    checker = Checker(inventory, dict(os.environ if environ is None else environ),
                      systemd_verify if shutil.which("systemd-analyze") else None)
    results = []
    for name in inventory.resolve(target):
        result = inventory.result(name)
        with result.phase("check") as phase:
            view = checker.host(inventory.hosts[name])
            phase.ok = not view.findings
            phase.detail = f"{len(view.findings)} problems" if view.findings else "ok"
        result.details = view
        if view.findings:
            result.finish(Result.INVALID, view.findings[0])
        else:
            result.finish(Result.OK)
        results.append(result)
    return Report("check", results)


def findings(report: Report) -> list[tuple[str, list[str]]]:
    """Every finding once, with the hosts it was found for, in the order first found."""
    seen: dict[str, list[str]] = {}
    for host in report.hosts:
        if isinstance(host.details, CheckView):
            for finding in host.details.findings:
                seen.setdefault(finding, []).append(host.host)
    return list(seen.items())
