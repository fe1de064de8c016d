"""Hooks: the inventory's local commands run on the controller around a rollout (docs/hooks.md).

Like Kamal's hooks they do what kdeploy does not: silence alerts, take a host out of an external load
balancer, post to a channel. ``pre_host`` runs right before kdeploy changes a host (a failure leaves the host
untouched, ``preflight_refused``), ``post_host`` once per host when its outcome is known, ``post_rollout`` once
per command; ``pre_deploy`` once per command before any host is touched (a failure refuses the whole run).
Each runs as ``/bin/sh -c <command>`` in the inventory's directory, in its own process group (so its
timeout, or Ctrl-C, kills everything it started), with the controller's environment less the inventory's
secrets, plus the ``KDEPLOY_*`` variables built here. Its output goes to stderr, line by line, never to
stdout (``--json``).

A hook may run kdeploy itself: the variables it gets never change what that inner command does. The only
ones the CLI reads as option defaults, ``KDEPLOY_INVENTORY`` and ``KDEPLOY_SERVICE``, mean what they mean to
the CLI (the inventory and the Ansible service file of the command that runs the hook), so ``kdeploy status
all`` in a hook acts on the same inventory; every other variable is one the CLI never reads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

from kdeploy.core.errors import PreflightRefused
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.report import Cancelled, HostResult, Phase, Report

KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a hook's process group
DETAIL_MAX = 300

# Every variable a hook may be given: the ones of the controller's environment with these names are dropped,
# so each hook sees exactly what docs/hooks.md lists for it.
# The CLI's own defaults (``-i``, ``--service``): set to what the running command reads, or removed.
CLI_VARS = ("KDEPLOY_INVENTORY", "KDEPLOY_SERVICE")
HOST_VARS = ("KDEPLOY_HOOK", "KDEPLOY_COMMAND", "KDEPLOY_INVENTORY_FILE", "KDEPLOY_HOST", "KDEPLOY_ADDRESS",
             "KDEPLOY_SERVICE_NAME", "KDEPLOY_SERVICE_PORT", "KDEPLOY_WORKER_URL", "KDEPLOY_RELEASE",
             "KDEPLOY_PREVIOUS_RELEASE", "KDEPLOY_BATCH", "KDEPLOY_PRE_HOST", "KDEPLOY_RESULT",
             "KDEPLOY_EXIT_CODE", "KDEPLOY_ERROR")
ROLLOUT_VARS = ("KDEPLOY_HOSTS", "KDEPLOY_FAILED", "KDEPLOY_RESULTS")
ALL_VARS = CLI_VARS + HOST_VARS + ROLLOUT_VARS

Echo = Callable[[str], None]
_echo_lock = threading.Lock()


def to_stderr(line: str) -> None:
    """Hook output: stderr as it is now (the live view's proxy on a TTY), one line at a time."""
    with _echo_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str  # "exit 0", "exit 3: <last output line>", "timed out after 60s: ...", "interrupted: ..."
    interrupted: bool = False


def secret_names(inventory: Inventory) -> set[str]:
    """Controller variables the inventory names as holding secrets (``service.secrets.env``, a router's API
    key): never given to hooks."""
    names = {h.router.api_key_env for h in inventory.hosts.values() if h.router and h.router.api_key_env}
    return names.union(*(h.service.secrets.env for h in inventory.hosts.values()))


def base_env(environ: Mapping[str, str], inventory: Inventory) -> dict[str, str]:
    """The controller's environment (PATH, HOME, SSH_AUTH_SOCK, a webhook token of the CI job, ...) without
    the inventory's secrets and without stale ``KDEPLOY_*`` hook variables of an outer kdeploy."""
    drop = secret_names(inventory) | set(ALL_VARS)
    return {k: v for k, v in environ.items() if k not in drop}


def cli_env(inventory: Inventory) -> dict[str, str]:
    """``KDEPLOY_INVENTORY`` (and, for an Ansible inventory, ``KDEPLOY_SERVICE``) as the CLI reads them: a
    ``kdeploy`` run by the hook loads the very inventory of the command that runs the hook."""
    if inventory.source is None:
        return {"KDEPLOY_INVENTORY": str(inventory.path.absolute())}
    return {"KDEPLOY_INVENTORY": str(inventory.source.absolute()), "KDEPLOY_SERVICE": str(inventory.path.absolute())}


def _common(inventory: Inventory, hook: str, command: str) -> dict[str, str]:
    return {"KDEPLOY_HOOK": hook, "KDEPLOY_COMMAND": command, **cli_env(inventory),
            "KDEPLOY_INVENTORY_FILE": str(inventory.path.absolute())}


def host_env(inventory: Inventory, host: HostConfig, *, hook: str, command: str, release: str | None = None,
             previous: str | None = None, batch: int | None = None, pre_host: str = "",
             result: HostResult | None = None) -> dict[str, str]:
    """The ``KDEPLOY_*`` variables of ``pre_host``/``post_host`` (``result``: the host's outcome, post_host only).
    Every variable is set; an unknown value is the empty string."""
    env = {
        **_common(inventory, hook, command),
        "KDEPLOY_HOST": host.name, "KDEPLOY_ADDRESS": host.address, "KDEPLOY_SERVICE_NAME": host.service.name,
        "KDEPLOY_SERVICE_PORT": str(host.service.sglang.port), "KDEPLOY_WORKER_URL": host.worker_url or "",
        "KDEPLOY_RELEASE": release or "", "KDEPLOY_PREVIOUS_RELEASE": previous or "",
        "KDEPLOY_BATCH": str(batch) if batch else "", "KDEPLOY_PRE_HOST": pre_host,
        "KDEPLOY_RESULT": "", "KDEPLOY_EXIT_CODE": "", "KDEPLOY_ERROR": "",
    }
    if result is not None:
        env.update(KDEPLOY_RELEASE=result.release or "", KDEPLOY_RESULT=str(result.result),
                   KDEPLOY_EXIT_CODE=str(result.exit_code), KDEPLOY_ERROR=" ".join((result.error or "").split()))
    return env


def rollout_env(inventory: Inventory, report: Report, names: list[str]) -> dict[str, str]:
    """The ``KDEPLOY_*`` variables of ``post_rollout``: ``names`` are the hosts that configure this hook."""
    hosts = [h for h in report.hosts if h.host in names]
    return {
        **_common(inventory, "post_rollout", report.command), "KDEPLOY_SERVICE_NAME": _services(inventory, names),
        "KDEPLOY_HOSTS": " ".join(h.host for h in hosts),
        "KDEPLOY_FAILED": " ".join(h.host for h in hosts if not h.ok),
        "KDEPLOY_RESULTS": " ".join(f"{h.host}={h.result}" for h in hosts),
        "KDEPLOY_EXIT_CODE": str(report.exit_code),
    }


def deploy_env(inventory: Inventory, command: str, names: list[str]) -> dict[str, str]:
    """The ``KDEPLOY_*`` variables of ``pre_deploy``: ``names`` are the hosts that configure this hook."""
    return {**_common(inventory, "pre_deploy", command), "KDEPLOY_SERVICE_NAME": _services(inventory, names),
            "KDEPLOY_HOSTS": " ".join(names)}


def _services(inventory: Inventory, names: list[str]) -> str:
    return " ".join(dict.fromkeys(inventory.hosts[n].service.name for n in names))


def execute(command: str, env: Mapping[str, str], *, cwd: str, timeout: float, stop: threading.Event,
            label: str, echo: Echo = to_stderr) -> Outcome:
    """Run ``/bin/sh -c command`` until it exits, ``timeout`` passes or ``stop`` is set (Ctrl-C in the main
    thread counts too); then its whole process group is killed. Each output line goes to ``echo`` as
    ``<label>: <line>``; the last one ends the outcome's detail."""
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return Outcome(False, f"cannot start /bin/sh in {cwd}: {exc.strerror}")
    last: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=_pump, args=(proc.stdout, label, echo, last), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    why = None
    try:
        while why is None:
            try:
                proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                if stop.is_set():
                    why = "interrupted"
                elif time.monotonic() >= deadline:
                    why = f"timed out after {timeout:g}s"
    except KeyboardInterrupt:  # post_rollout runs in the main thread
        why = "interrupted"
    if why:
        _kill_group(proc)
    reader.join(timeout=1)  # a background child may keep the pipe open: its output is not waited for
    tail = f": {last[-1]}" if last else ""
    if why:
        return Outcome(False, (why + tail)[:DETAIL_MAX], interrupted=why == "interrupted")
    code = proc.returncode
    status = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    return Outcome(code == 0, (status + tail)[:DETAIL_MAX])


def _pump(stream: IO[bytes], label: str, echo: Echo, last: list[str]) -> None:
    with stream:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if line.strip():
                last[:] = [" ".join(line.split())]
                echo(f"{label}: {line}")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the hook's process group, SIGKILL to what is left of it after ``KILL_GRACE``."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Runner:
    """The per-host hooks of one command (push, rollback, set-env, set) over one inventory.

    ``cancel`` (Ctrl-C) kills a running ``pre_host``; ``post_host`` is the clean-up (put the host back in the
    load balancer), so it still runs after Ctrl-C and is killed only by ``stop`` (a Ctrl-C while kdeploy
    waits for the last post_host hooks) or its timeout.
    """

    def __init__(self, inventory: Inventory, command: str, cancel: threading.Event, echo: Echo = to_stderr,
                 environ: Mapping[str, str] | None = None) -> None:
        self.inventory, self.command, self.cancel, self.echo = inventory, command, cancel, echo
        self.stop = threading.Event()
        self.env = base_env(os.environ if environ is None else environ, inventory)
        self.seen: dict[str, dict] = {}  # host -> its previous release, batch, and how pre_host ended
        self.posted: set[str] = set()
        self.lock = threading.Lock()

    def _run(self, hook: str, host: HostConfig, env: dict[str, str], stop: threading.Event) -> Outcome:
        command = getattr(host.hooks, hook)
        return execute(command, {**self.env, **env}, cwd=str(self.inventory.base_dir), timeout=host.hooks.timeout,
                       stop=stop, label=f"{host.name} {hook}", echo=self.echo)

    def pre_host(self, host: HostConfig, result: HostResult, release: str | None, previous: str | None,
                 batch: int | None = None) -> bool:
        """Run ``pre_host`` before ``host`` is changed; False: it failed and the host ended (left untouched)."""
        self.seen[host.name] = {"previous": previous, "batch": batch, "pre_host": ""}
        if host.hooks.pre_host is None:
            return True
        env = host_env(self.inventory, host, hook="pre_host", command=self.command, release=release,
                       previous=previous, batch=batch)
        with result.phase("pre_host") as phase:
            out = self._run("pre_host", host, env, self.cancel)
            phase.ok, phase.detail = out.ok, out.detail
        self.seen[host.name]["pre_host"] = "ok" if out.ok else "failed"
        if out.ok:
            return True
        result.release = previous
        result.fail(Cancelled(f"pre_host hook {out.detail}; host untouched") if out.interrupted else
                    PreflightRefused(f"pre_host hook refused the host ({out.detail}); host untouched"))
        return False

    def post_host(self, host: HostConfig, result: HostResult, previous: str | None = None) -> None:
        """Run ``post_host`` once for ``host`` with its outcome; a failure is a failed phase, nothing more."""
        with self.lock:
            if host.name in self.posted:
                return
            self.posted.add(host.name)
        if host.hooks.post_host is None:
            return
        seen = self.seen.get(host.name, {"previous": previous})
        env = host_env(self.inventory, host, hook="post_host", command=self.command, result=result,
                       previous=seen["previous"], batch=seen.get("batch"), pre_host=seen.get("pre_host", ""))
        with result.phase("post_host") as phase:  # a failure is only this phase's: the host's result stands
            out = self._run("post_host", host, env, self.stop)
            phase.ok, phase.detail = out.ok, out.detail


def _by_command(inventory: Inventory, names: list[str], hook: str) -> dict[tuple[str, float], list[str]]:
    """The hosts of ``names`` grouped by their ``hook`` command (and timeout): one run per group."""
    groups: dict[tuple[str, float], list[str]] = {}
    for name in names:
        hooks = inventory.hosts[name].hooks
        command = getattr(hooks, hook)
        if command is not None:
            groups.setdefault((command, hooks.timeout), []).append(name)
    return groups


def pre_deploy(inventory: Inventory, command: str, names: list[str], cancel: threading.Event,
               echo: Echo = to_stderr, environ: Mapping[str, str] | None = None) -> tuple[list[dict], Outcome | None]:
    """Run each distinct ``pre_deploy`` of ``names``' hosts once, before any host is touched, in inventory
    order; the first that fails ends it. Its runs (the report's ``pre_deploy``, phase-shaped) and that failure
    (None: go on)."""
    env = base_env(os.environ if environ is None else environ, inventory)
    runs: list[dict] = []
    for (hook, timeout), members in _by_command(inventory, names, "pre_deploy").items():
        started = time.monotonic()
        out = execute(hook, {**env, **deploy_env(inventory, command, members)}, cwd=str(inventory.base_dir),
                      timeout=timeout, stop=cancel, label="pre_deploy", echo=echo)
        runs.append(Phase("pre_deploy", out.ok, round(time.monotonic() - started, 3), out.detail).to_json())
        if not out.ok:
            return runs, out
    return runs, None


def refuse_run(results: list[HostResult], out: Outcome) -> None:
    """A failed ``pre_deploy``: every host ends untouched (``preflight_refused``, or ``interrupted``)."""
    for result in results:
        result.fail(Cancelled(f"pre_deploy hook {out.detail}; no host touched") if out.interrupted else
                    PreflightRefused(f"pre_deploy hook refused the run ({out.detail}); no host touched"))


def post_rollout(inventory: Inventory, report: Report, echo: Echo = to_stderr,
                 environ: Mapping[str, str] | None = None) -> None:
    """Run each distinct ``post_rollout`` of the report's hosts once, after all of them ended; each run is
    recorded under the report's ``post_rollout`` (a failure does not change the exit code)."""
    groups = _by_command(inventory, [h.host for h in report.hosts], "post_rollout")
    if not groups:
        return
    env = base_env(os.environ if environ is None else environ, inventory)
    runs = report.extra.setdefault("post_rollout", [])
    for (command, timeout), names in groups.items():
        started = time.monotonic()
        out = execute(command, {**env, **rollout_env(inventory, report, names)}, cwd=str(inventory.base_dir),
                      timeout=timeout, stop=threading.Event(), label="post_rollout", echo=echo)
        runs.append(Phase("post_rollout", out.ok, round(time.monotonic() - started, 3), out.detail).to_json())
        if not out.ok:
            echo(f"kdeploy: post_rollout hook failed: {out.detail}")

