"""A host's deploy state in one read, and the one decision push, plan and status make from it.

``state_script`` is sent under the deploy lock (or alone, by plan and status); ``parse_state`` reads its
output; ``decide`` says what a push must do. Pure functions, unit-tested on captured real output.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kdeploy import history, provisional, release, systemd
from kdeploy import secrets as secret
from kdeploy.gatespec import GateSpec
from kdeploy.inventory import HostConfig
from kdeploy.lock import split_sections
from kdeploy.render import service_dir, unit_filename

HISTORY_LINES = 200
# Results after which the history's ``release`` is what ran from then on.
_RAN = ("deployed", "restored", "rolled_back", "reverted")


@dataclass(frozen=True)
class HostState:
    current: str | None
    manifest: dict[str, str]  # path -> "<sha256> <mode>" of the current release (release.file_identity)
    unit_text: str | None
    releases: list[str]
    unit: systemd.UnitState
    pending: provisional.Pending | None = None
    gates: dict[str, GateSpec] = field(default_factory=dict)  # release -> what it was deployed with
    history: list[dict] = field(default_factory=list)
    secrets: secret.Stamp | None = None  # the environment file kdeploy last wrote, as a salted digest

    @property
    def confirmed(self) -> str | None:
        """The last release whose switch was confirmed: what a failed deploy returns to."""
        return self.pending.previous if self.pending else self.current

    def previous(self) -> str | None:
        """What ran before the confirmed release (a rollback's default target): from the history, else the
        newest older release by name."""
        now = self.confirmed
        for record in reversed(self.history):
            ran = record.get("release")
            if record.get("result") in _RAN and ran and ran != now and ran in self.releases:
                return str(ran)
        ordered = sorted(r for r in self.releases if not r.startswith("."))
        older = [r for r in ordered if now is None or r < now]
        return older[-1] if older else None


def _current(d: str) -> str:
    """The release ``current`` points at (a shell builtin takes its last part: every process spawned for
    a read costs each host of a fleet ~1.5 ms of CPU)."""
    return f"echo @@current; r=$(readlink {d}/current 2>/dev/null) && echo \"${{r##*/}}\""


def state_script(host: HostConfig, *, with_history: bool = False) -> str:
    """Read everything push, plan, rollback and status decide on, without changing anything."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(f"{systemd.UNIT_DIR}/{unit_filename(host.service)}")
    lines = [
        _current(d),
        f"echo @@manifest; cat {d}/current/{release.META}/manifest.sha256 2>/dev/null",
        f"echo @@modes; cat {d}/current/{release.META}/modes 2>/dev/null",
        f"if [ -f {unit} ]; then echo @@unit; cat {unit}; echo; fi",
        f"echo @@releases; ls -1 {d}/releases 2>/dev/null",
        f"echo @@pending; {provisional.read_command(service_dir(host.service))}",
        f"echo @@gates; grep -H . {d}/releases/*/{release.META}/gate.json 2>/dev/null",
    ]
    sv = host.service
    if sv.secrets.configured and sv.environment_file:
        lines.append(f"echo @@secrets; {secret.read_command(service_dir(sv), sv.environment_file)}")
    if with_history:
        lines.append(f"echo @@history; {history.read_command(service_dir(host.service), HISTORY_LINES)}")
    lines += [f"echo @@show; {systemd.show_command(unit_filename(host.service))}", "true"]
    return "\n".join(lines)


def parse_gates(text: str) -> dict[str, GateSpec]:
    """``grep -H`` lines ``.../releases/<id>/.kdeploy/gate.json:<json>``."""
    out = {}
    marker = f"/{release.META}/gate.json:"
    for line in text.splitlines():
        path, sep, body = line.partition(marker)
        spec = GateSpec.from_json(body) if sep else None
        if spec is not None:
            out[path.rsplit("/", 1)[-1]] = spec
    return out


def parse_state(text: str) -> HostState:
    sections = split_sections(text)
    unit_text = sections.get("unit")  # `cat unit; echo` ends it with one extra empty line
    return HostState(
        current=sections.get("current", "").strip() or None,
        manifest=release.parse_identity(sections.get("manifest", ""), sections.get("modes", "")),
        unit_text=None if unit_text is None else unit_text.removesuffix("\n") + "\n",
        releases=[r for r in sections.get("releases", "").split() if r],
        unit=systemd.parse_show(sections.get("show", "")),
        pending=provisional.parse_pending(sections.get("pending", "")),
        gates=parse_gates(sections.get("gates", "")),
        history=history.parse(sections.get("history", "")),
        secrets=secret.parse_stamp(sections.get("secrets", "")),
    )


@dataclass(frozen=True)
class Decision:
    """What a push does to a host, and why (the same words in push, plan and status)."""

    delta: release.Delta
    unit_changed: bool
    stage: bool  # a new release must be built
    restart: bool
    install_unit: bool  # write the unit and daemon-reload
    reasons: list[str]
    secrets_changed: bool = False  # the activation writes the environment file

    @property
    def no_op(self) -> bool:
        return not self.restart


def secrets_changed(wanted: secret.Secrets | None, state: HostState) -> bool:
    """The host's environment file is not what kdeploy would write now (or kdeploy never wrote it)."""
    if wanted is None:
        return False
    return state.secrets is None or wanted.digest(state.secrets.salt) != state.secrets.digest


def decide(identity: dict[str, str], unit_text: str, state: HostState, *, force_restart: bool = False,
           secrets: secret.Secrets | None = None) -> Decision:
    """``identity``: the payload's files as ``Payload.identity`` (content and mode) against the host's;
    ``secrets``: what the environment file must hold (None: kdeploy does not manage it)."""
    delta = release.diff(identity, state.manifest)
    unit_changed = unit_text != state.unit_text
    reasons = []
    if state.current is None:
        reasons.append("never deployed")
    if not delta.empty:
        reasons.append(f"payload differs from the inventory ({delta.describe()})")
    if unit_changed:
        reasons.append("unit differs from the inventory")
    stage = bool(reasons)
    ship = secrets_changed(secrets, state)
    if ship:
        reasons.append("secrets: changed")
    if state.pending:
        reasons.append(state.pending.describe())
    if state.unit.need_reload:
        reasons.append("unit file changed on disk but not reloaded")
    if not state.unit.running and state.current is not None:
        reasons.append(f"service is {state.unit.summary}")
    if force_restart:
        reasons.append("--force-restart")
    return Decision(delta, unit_changed, stage, bool(reasons), unit_changed or state.unit.need_reload, reasons,
                    ship)


def status_script(host: HostConfig) -> str:
    """The push state plus what status shows: live Environment, last deploy, hand edits in the release."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(unit_filename(host.service))
    return "\n".join([
        state_script(host),
        f"echo @@env; systemctl show -p Environment --value {unit}",
        f"echo @@last; tail -n 1 {d}/history.jsonl 2>/dev/null",
        f"echo @@edited; cd {d}/current 2>/dev/null && sha256sum -c --quiet {release.META}/manifest.sha256 2>&1"
        " | sed 's/: FAILED.*//'",
        f"echo @@extra; cd {d}/current 2>/dev/null && find . -type f ! -path './{release.META}/*' "
        f"! -path '*/__pycache__/*' | LC_ALL=C sort | comm -23 - {release.META}/files",
        "true",
    ])


@dataclass(frozen=True)
class Status:
    state: HostState
    env: dict[str, str]  # the unit's live Environment
    last_deploy: dict | None
    edited: list[str]  # release files whose content no longer matches the manifest
    extra: list[str]  # files in the release the manifest does not list


def parse_status(text: str) -> Status:
    sections = split_sections(text)
    last = history.parse(sections.get("last", ""))
    return Status(
        state=parse_state(text), env=systemd.parse_environment(sections.get("env", "")),
        last_deploy=last[-1] if last else None,
        edited=sorted({line for line in sections.get("edited", "").splitlines() if line.startswith("./")}),
        extra=sections.get("extra", "").split())


def drift(identity: dict[str, str], unit_text: str, status: Status, secrets: secret.Secrets | None = None) -> list[str]:
    """How the host differs from what the inventory would deploy now (empty: no drift): the reasons a push
    would act on, plus hand edits inside the release."""
    if status.state.current is None:
        return ["never deployed"]
    found = decide(identity, unit_text, status.state, secrets=secrets).reasons
    if status.edited:
        found.append("release files edited on the host: "
                     + ", ".join(p.removeprefix("./") for p in status.edited[:5]))
    if status.extra:
        found.append(f"extra files in the release: {', '.join(p.removeprefix('./') for p in status.extra[:5])}")
    return found


def running_script(host: HostConfig) -> str:
    """What verify needs: the release that runs, an unconfirmed switch, and the gate it was deployed with."""
    d = shlex.quote(service_dir(host.service))
    return "\n".join([
        _current(d),
        f"echo @@pending; {provisional.read_command(service_dir(host.service))}",
        f"echo @@gate; cat {d}/current/{release.META}/gate.json 2>/dev/null",
        "true",
    ])


@dataclass(frozen=True)
class Running:
    current: str | None
    pending: provisional.Pending | None
    gate: GateSpec | None


def parse_running(text: str) -> Running:
    sections = split_sections(text)
    return Running(sections.get("current", "").strip() or None,
                   provisional.parse_pending(sections.get("pending", "")), GateSpec.from_json(sections.get("gate", "")))
