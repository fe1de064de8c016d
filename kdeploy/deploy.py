"""Per-host operations: push (with plan), rollback, verify, history and lock handling.

Each works over one connection and reports into a :class:`HostResult`; ``kdeploy.fleet`` runs them over
many hosts. One round trip per phase: the state read rides on the lock acquisition, staging is one
streamed tar, activation one script.
"""

from __future__ import annotations

import difflib
import shlex
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kdeploy import gate, history, lock, probe, release, systemd
from kdeploy.errors import InvalidInput, KdeployError, LockHeld, PreflightRefused, Unreachable
from kdeploy.inventory import HostConfig, Inventory
from kdeploy.remote import Remote
from kdeploy.render import current_path, service_dir, unit_filename
from kdeploy.report import Cancelled, HostResult, PhaseFailed


@dataclass
class Options:
    accept_new_host_keys: bool = False
    lock_wait: float = 0
    force_restart: bool = False
    verify: bool = True
    workers: int | None = None
    timeout: float | None = None
    to_release: str | None = None
    force: bool = False
    history_limit: int = 20
    canary: int = 0
    batch: str | None = None  # N or N%: hosts restarting at once (default: --parallel)
    max_fail: str | None = None  # N or N%: failures tolerated before new batches stop (default: no limit)
    skip_preflight: bool = False
    command: str | None = None  # what the lock and history record (the CLI's own command line; see recorded_command)
    cancel: threading.Event = field(default_factory=threading.Event)


def recorded_command(opts: Options, verb: str) -> str:
    """The command the lock and history record: the CLI's (``Options.command``), else the library call.
    Never ``sys.argv``: a wrapper script calling the library may hold secrets in its own arguments."""
    return opts.command or f"kdeploy {verb} (library)"


@dataclass(frozen=True)
class HostState:
    current: str | None
    manifest: dict[str, str]  # path -> "<sha256> <mode>" of the current release (release.file_identity)
    unit_text: str | None
    releases: list[str]
    unit: systemd.UnitState

    def previous(self) -> str | None:
        """The release before ``current`` (what a rollback returns to)."""
        ordered = sorted(r for r in self.releases if not r.startswith("."))
        if self.current not in ordered:
            return ordered[-1] if ordered else None
        index = ordered.index(self.current)
        return ordered[index - 1] if index > 0 else None


def state_script(host: HostConfig) -> str:
    """Read everything push and plan decide on, without changing anything."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(f"{systemd.UNIT_DIR}/{unit_filename(host.service)}")
    return "\n".join([
        f"echo @@current; r=$(readlink {d}/current 2>/dev/null) && basename \"$r\"",
        f"echo @@manifest; cat {d}/current/{release.META}/manifest.sha256 2>/dev/null",
        f"echo @@modes; cat {d}/current/{release.META}/modes 2>/dev/null",
        f"if [ -f {unit} ]; then echo @@unit; cat {unit}; echo; fi",
        f"echo @@releases; ls -1 {d}/releases 2>/dev/null",
        f"echo @@show; {systemd.show_command(unit_filename(host.service))}",
        "true",
    ])


def parse_state(text: str) -> HostState:
    sections = lock.split_sections(text)
    unit_text = sections.get("unit")  # `cat unit; echo` ends it with one extra empty line
    return HostState(
        current=sections.get("current", "").strip() or None,
        manifest=release.parse_identity(sections.get("manifest", ""), sections.get("modes", "")),
        unit_text=None if unit_text is None else unit_text.removesuffix("\n") + "\n",
        releases=[r for r in sections.get("releases", "").split() if r],
        unit=systemd.parse_show(sections.get("show", "")),
    )


def connect(inventory: Inventory, host: HostConfig, result: HostResult, opts: Options) -> Remote:
    with result.phase("connect") as phase:
        remote = Remote.connect(
            host,
            known_hosts=inventory.local_path(host.known_hosts) if host.known_hosts else None,
            identity_file=inventory.local_path(host.identity_file) if host.identity_file else None,
            accept_new_host_keys=opts.accept_new_host_keys,
        )
        phase.detail = f"{host.user}@{host.address}:{host.port}"
        if remote.new_host_key:
            phase.detail += f" (new host key recorded: {remote.new_host_key})"
    return remote


def _check(opts: Options) -> None:
    if opts.cancel.is_set():
        raise Cancelled("interrupted")


@dataclass
class Local:
    """What the controller computes once per host before touching it."""

    unit_text: str
    payload: release.Payload


def plan_host(inventory: Inventory, host: HostConfig, local: Local, opts: Options, result: HostResult) -> None:
    """Show what a push would do; reads only (no lock, no directories created)."""
    with connect(inventory, host, result, opts) as remote:
        with result.phase("preflight") as phase:
            state = parse_state(remote.run(state_script(host), timeout=60).stdout)
            phase.detail = f"current {state.current or 'none'}, unit {state.unit.summary}"
        delta = release.diff(local.payload.identity, state.manifest)
        unit_changed = local.unit_text != state.unit_text
        restart = bool(not delta.empty or unit_changed or opts.force_restart or not state.unit.running
                       or state.current is None)
        unit_diff = "".join(difflib.unified_diff(
            (state.unit_text or "").splitlines(keepends=True), local.unit_text.splitlines(keepends=True),
            fromfile=f"{host.name}:{unit_filename(host.service)}", tofile="rendered"))
        result.data["plan"] = {
            "add": delta.added, "change": delta.changed, "remove": delta.removed,
            "unit_diff": unit_diff, "daemon_reload": unit_changed, "restart": restart,
        }
        result.release = state.current
        result.finish("planned")


class HostPush:
    """One host's push in three steps, so a fleet can stage everywhere before the first restart.

    ``prepare`` connects, takes the lock, reads the state and stages; ``activate`` switches, restarts and
    gates (rolling back on failure); ``close`` records history, drops a staged-but-never-activated release,
    releases the lock and disconnects. Between the steps the host holds its lock and connection.
    """

    def __init__(self, inventory: Inventory, host: HostConfig, local: Local, opts: Options,
                 result: HostResult) -> None:
        self.inventory, self.host, self.local, self.opts, self.result = inventory, host, local, opts, result
        self.remote: Remote | None = None
        self.held: lock.HeldLock | None = None
        self.state: HostState | None = None
        self.target: str | None = None
        self.unit_changed = False
        self.staged: str | None = None
        self.started = time.monotonic()

    @property
    def pending(self) -> bool:
        """Prepared and waiting for its turn to restart."""
        return self.target is not None and not self.result.done

    def prepare(self) -> None:
        host, local, result = self.host, self.local, self.result
        sdir = service_dir(host.service)
        try:
            self.remote = connect(self.inventory, host, result, self.opts)
            with result.phase("preflight") as phase:
                self.held = lock.acquire(self.remote, sdir, wait=self.opts.lock_wait, then=state_script(host),
                                         command=recorded_command(self.opts, "push"))
                state = self.state = parse_state(self.held.output)
                delta = release.diff(local.payload.identity, state.manifest)
                self.unit_changed = local.unit_text != state.unit_text
                changed = not delta.empty or self.unit_changed or state.current is None
                no_op = not changed and state.unit.running and not self.opts.force_restart
                phase.detail = f"lock taken; current {state.current or 'none'}; {state.unit.summary}"
                if self.held.stale:
                    phase.detail += f"; took over STALE lock left by {self.held.stale.describe()} (holder gone)"
                # The checks start the service's python, nvidia-smi and journalctl: only worth it before a change.
                if not no_op and not self.opts.skip_preflight:
                    upload = sum(local.payload.files[p].size for p in delta.upload)
                    out = self.remote.run(preflight_command(host), timeout=120)
                    phase.detail += "; " + preflight_verdict(host, out.stdout, upload)
            _check(self.opts)
            if no_op:
                with result.phase("stage") as phase:
                    phase.detail = "nothing changed: no upload, no restart"
                result.release = state.current
                result.finish("unchanged")
                return
            self.target = state.current
            if changed:
                self._stage(delta)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            result.fail(exc)

    def _stage(self, delta: release.Delta) -> None:
        """Stage the new release. A failure leaves the host unchanged (the staging dir is removed) and is no
        bug of kdeploy's: a payload file edited during the push is invalid input (exit 2), anything else on
        the host refuses it (exit 7), like a full disk."""
        host, local, state = self.host, self.local, self.state
        assert self.remote is not None and state is not None
        with self.result.phase("stage") as phase:
            target = release.release_id(local.payload.manifest, local.unit_text)
            meta = release.release_meta(local.payload.manifest, local.payload.modes, local.unit_text,
                                        unit_filename(host.service))
            try:
                tarball = release.build_tarball(local.payload, delta.upload, meta)
                out = self.remote.run(release.stage_script(service_dir(host.service), target,
                                                           state.current is not None, delta),
                                      stdin=tarball, timeout=600)
                error = "" if out.ok and "STAGED" in out.stdout else out.last_error()
            except OSError as exc:  # a payload file vanished or shrank while the tar read it
                error = f"cannot read the payload: {exc}"
            if error:
                changed = release.changed_since_scan(local.payload, delta.upload)
                if changed:
                    more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
                    raise InvalidInput(f"{host.name}: payload file {local.payload.files[changed[0]].source}{more} "
                                       "changed during the push, host unchanged: push again")
                if "No space left" in error:
                    raise PreflightRefused(f"disk full on the host, host unchanged: {error}")
                raise PreflightRefused(f"staging failed, host unchanged: {error}")
            self.target = self.staged = target
            phase.detail = (f"{target}: {delta.describe()} files, {len(tarball)} bytes sent"
                            f"{', unit changed' if self.unit_changed else ''}")

    def activate(self) -> None:
        assert self.remote is not None and self.state is not None and self.target is not None
        self.result.data["attempted"] = self.target
        self.result.release = self.target
        try:
            _check(self.opts)
            activate_and_gate(self.remote, self.host, self.result, self.opts, target=self.target,
                              install_unit=self.unit_changed, previous=self.state.current)
            self.staged = None
        except Unreachable as exc:
            self._reconnect_and_roll_back(exc)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            self.result.fail(exc)

    def _reconnect_and_roll_back(self, lost: Unreachable) -> None:
        """The link dropped after the switch began: reconnect once and put the old release back."""
        assert self.state is not None
        if not any(p.name == "activate" for p in self.result.phases):
            self.result.fail(lost)
            return
        try:
            remote = connect(self.inventory, self.host, self.result, self.opts)
        except Unreachable as exc:
            self.result.finish("unreachable", f"connection lost after switching to {self.target}; reconnect "
                                              f"failed ({exc}): the host may be on the new, ungated release")
            return
        self.remote.close()
        self.remote = remote
        rollback_after_failure(remote, self.host, self.result, self.opts, self.state.current,
                               f"connection lost during the deploy ({lost})")

    def skip(self, why: str, result: str = "skipped") -> None:
        if not self.result.done:
            self.result.finish(result, why)

    def close(self) -> None:
        """Record and clean up through the lock holder (no extra round trip), then let go of the host."""
        try:
            if self.held is not None and self.remote is not None:
                finish = self._finish_command()
                if not self.held.release(finish) and finish:  # the holder's link died (we reconnected)
                    self.remote.run(finish, timeout=60)
        except KdeployError as exc:
            self.result.log.append(f"could not record history or clean up after the push: {exc}")
        finally:
            if self.remote is not None:
                self.remote.close()

    def _finish_command(self) -> str:
        sdir = service_dir(self.host.service)
        if self.result.result in ("skipped", "interrupted") and self.staged:
            self.result.release = self.state.current if self.state else None
            return release.prune_command(sdir, [self.staged])
        if self.result.result == "preflight_refused":  # a refused host is left exactly as it was
            return ""
        return finish_command(self.host, self.result, self.started, self.state.releases if self.state else [],
                              self.local, command=recorded_command(self.opts, "push"))


def preflight_command(host: HostConfig) -> str:
    sv = host.service
    return probe.preflight_command(python=sv.python, unit=unit_filename(sv), port=sv.sglang.port,
                                   remote_root=sv.remote_root)


def preflight_checks(host: HostConfig, output: str, upload_bytes: int) -> list[probe.Check]:
    """Every preflight check of one host. A service that does not launch SGLang itself (the sandbox's
    reference server) only gets a warning when SGLang is missing or incompatible."""
    sv = host.service
    hc = sv.hicache
    checks = list(probe.parse_preflight(
        output, unit=unit_filename(sv), port=sv.sglang.port, tp=sv.sglang.tp, payload_bytes=upload_bytes,
        hicache_enabled=hc.enabled, hicache_ratio=hc.ratio, hicache_size_gb=hc.size_gb,
        device_kv_gb_per_rank=hc.device_kv_gb_per_rank).all_checks())
    if not sv.module.startswith("sglang.") and checks[0].status == "fail":
        checks[0] = probe.Check("sglang", "warn", f"service runs {sv.module}, not SGLang: {checks[0].detail}")
    return checks


def preflight_verdict(host: HostConfig, output: str, upload_bytes: int) -> str:
    """One line of every check; a failing one refuses the host (exit 7) before anything changes."""
    checks = preflight_checks(host, output, upload_bytes)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightRefused(f"{host.name}: preflight refused: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    return "preflight " + ", ".join(f"{c.name} {c.status}" for c in checks) + "".join(
        f"; {c.name}: {c.detail}" for c in checks if c.status == "warn")


def restart_and_follow(remote: Remote, host: HostConfig, result: HostResult, timeout: float) -> systemd.UnitState:
    """Restart and wait for the new run on the host (``systemd.restart_command``); its state feeds the gate."""
    unit = unit_filename(host.service)
    with result.phase("restart") as phase:
        out = remote.run(systemd.restart_command(unit, timeout, min(0.1, host.service.gate.poll_interval)),
                         timeout=timeout + 30)
        if not out.ok:
            raise PhaseFailed(f"systemctl restart failed: {out.last_error()}")
        restarted = systemd.parse_restart(out.stdout)
        state = restarted.state
        if not restarted.followed:
            raise PhaseFailed(f"no new run of {unit} after {timeout:.0f}s (still {state.summary})")
        phase.detail = (f"new invocation {state.invocation[:12]} {state.summary}"
                        + (" after the old run stopped" if restarted.stopping else ""))
        return state


def activate_and_gate(remote: Remote, host: HostConfig, result: HostResult, opts: Options, *, target: str,
                      install_unit: bool, previous: str | None) -> None:
    """Switch to ``target``, restart, gate; on a failed gate return to ``previous`` by itself."""
    sdir = service_dir(host.service)
    unit = unit_filename(host.service)
    try:
        with result.phase("activate") as phase:
            out = remote.run(release.activate_script(sdir, target, unit, install_unit), timeout=120)
            if not out.ok:
                raise PhaseFailed(f"activation failed: {out.last_error()}")
            phase.detail = f"current -> {target}" + ("; unit installed, daemon-reload" if install_unit else "")
        started = restart_and_follow(remote, host, result, host.service.unit.timeout_stop_sec + 60)
        if opts.verify:
            gate.run_gate(remote, host.service, result, workers=opts.workers, timeout=opts.timeout, started=started)
    except PhaseFailed as exc:
        rollback_after_failure(remote, host, result, opts, previous, exc.detail)
        return
    result.finish("deployed")


def rollback_after_failure(remote: Remote, host: HostConfig, result: HostResult, opts: Options,
                           previous: str | None, why: str) -> None:
    sdir = service_dir(host.service)
    unit = shlex.quote(unit_filename(host.service))
    with result.phase("rollback") as phase:
        if previous is None:
            if host.service.on_first_deploy_failure == "stop":
                remote.run(f"systemctl disable --quiet {unit}; systemctl stop --no-block {unit}", timeout=60)
                state = "stopped and disabled"
            else:
                state = "left running as it is"
            phase.ok = False
            phase.detail = f"first deploy failed ({why}); nothing to roll back to: service {state}"
            result.finish("rollback_failed", phase.detail)
            return
        try:
            out = remote.run(release.activate_script(sdir, previous, unit_filename(host.service), True),
                             timeout=120)
            if not out.ok:
                raise PhaseFailed(f"re-activating {previous} failed: {out.last_error()}")
            sub = HostResult(result.host)
            started = restart_and_follow(remote, host, sub, host.service.unit.timeout_stop_sec + 60)
            gate.run_gate(remote, host.service, sub, workers=opts.workers, timeout=opts.timeout, started=started)
        except (PhaseFailed, KdeployError) as exc:
            phase.ok = False
            phase.detail = (f"gate failed ({why}); rollback to {previous} FAILED: {exc}; "
                            f"host needs a human: current -> {previous}, unit of {previous} installed")
            result.release = previous
            result.finish("rollback_failed", phase.detail)
            return
        phase.detail = f"gate failed ({why}); back on {previous}, its gate passed"
        result.release = previous
        result.finish("rolled_back", why)


def finish_command(host: HostConfig, result: HostResult, started: float, releases: list[str],
                   local: Local | None = None, *, command: str) -> str:
    """Append the history line and prune old releases (sent to the lock holder, run under the lock)."""
    sdir = service_dir(host.service)
    attempted = result.data.get("attempted")
    who = lock.holder_info(command)
    entry = {
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "user": who.user, "controller": who.controller, "command": who.command,
        "payload_hash": release.sha256_text(release.manifest_text(local.payload.manifest))[:16] if local else None,
        "unit_hash": release.sha256_text(local.unit_text)[:16] if local else None,
        "duration": round(time.monotonic() - started, 2),
        "result": result.result, "release": result.release, "attempted": attempted, "error": result.error,
    }
    protect = {str(result.release), str(attempted)}
    prune = release.releases_to_prune(sorted(set(releases) | {str(attempted)} - {"None"}),
                                      host.service.keep_releases, protect)
    return "\n".join(c for c in (history.append_command(sdir, entry), release.prune_command(sdir, prune)) if c)


def rollback_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """Re-activate an older release (and its unit), restart and gate."""
    started = time.monotonic()
    with connect(inventory, host, result, opts) as remote:
        held = None
        state = None
        try:
            with result.phase("preflight") as phase:
                held = lock.acquire(remote, service_dir(host.service), wait=opts.lock_wait,
                                    then=state_script(host), command=recorded_command(opts, "rollback"))
                state = parse_state(held.output)
                target = opts.to_release or state.previous()
                if not target:
                    raise PreflightRefused(f"{host.name}: no older release to roll back to")
                if target not in state.releases:
                    raise InvalidInput(f"{host.name}: no release {target!r} "
                                       f"(have: {', '.join(state.releases) or 'none'})")
                phase.detail = f"{state.current} -> {target}"
            result.release = target
            activate_and_gate(remote, host, result, opts, target=target, install_unit=True,
                              previous=state.current)
            if result.result == "deployed":
                result.finish("restored")
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            result.fail(exc)
        finally:
            if held is not None:
                recorded = state is not None and result.result not in ("invalid", "preflight_refused")
                held.release(finish_command(host, result, started, state.releases,
                                            command=recorded_command(opts, "rollback")) if recorded else "")


def verify_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """The gate against what runs now; changes nothing."""
    with connect(inventory, host, result, opts) as remote:
        current = remote.run(f"readlink {shlex.quote(current_path(host.service))}", timeout=30).stdout.strip()
        result.release = current.rsplit("/", 1)[-1] or None
        try:
            gate.run_gate(remote, host.service, result, workers=opts.workers, timeout=opts.timeout)
        except PhaseFailed as exc:
            result.finish("unhealthy", exc.detail)
            return
    result.finish("healthy")


def history_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts) as remote:
        out = remote.run(history.read_command(service_dir(host.service), opts.history_limit), timeout=30)
        result.data["history"] = history.parse(out.stdout)
    result.finish("ok")


def lock_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult, release_it: bool) -> None:
    with connect(inventory, host, result, opts) as remote:
        sdir = service_dir(host.service)
        status = lock.parse_status(remote.run(lock.status_command(sdir), timeout=30).stdout)
        why = None
        if release_it:
            if status.held and not opts.force:
                raise LockHeld(f"{host.name}: lock is held by a live deploy "
                               f"({status.info.describe() if status.info else 'unknown'}); use --force to end it")
            out = remote.run(lock.release_command(sdir, status, opts.force), timeout=lock.FORCE_WAIT + 30).stdout
            why = lock.release_failure(out, status.info)
            status = lock.parse_status(out)
        result.data["lock"] = {"state": status.state, "holder": status.info.__dict__ if status.info else None}
    if why:
        raise LockHeld(f"{host.name}: lock still held: {why}")
    result.finish("ok")


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


def drift(local: Local, state: HostState, edited: list[str], extra: list[str]) -> list[str]:
    """How the host differs from what the inventory would deploy now (empty: no drift)."""
    found = []
    if state.current is None:
        return ["never deployed"]
    if state.unit_text != local.unit_text:
        found.append("unit differs from the inventory")
    if state.unit.need_reload:
        found.append("unit file changed on disk but not reloaded")
    delta = release.diff(local.payload.identity, state.manifest)
    if not delta.empty:
        found.append(f"payload differs from the inventory ({delta.describe()})")
    if edited:
        found.append(f"release files edited on the host: {', '.join(p.removeprefix('./') for p in edited[:5])}")
    if extra:
        found.append(f"extra files in the release: {', '.join(p.removeprefix('./') for p in extra[:5])}")
    return found


def status_host(inventory: Inventory, host: HostConfig, local: Local, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts) as remote, result.phase("status") as phase:
        text = remote.run(status_script(host), timeout=60).stdout
    sections = lock.split_sections(text)
    state = parse_state(text)
    env = systemd.parse_environment(sections.get("env", ""))
    last = history.parse(sections.get("last", ""))
    edited = sorted({line for line in sections.get("edited", "").splitlines() if line.startswith("./")})
    found = drift(local, state, edited, sections.get("extra", "").split())
    result.release = state.current
    result.data["status"] = {
        "active": state.unit.active, "sub": state.unit.sub, "since": state.unit.active_since,
        "env": {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONUNBUFFERED")},
        "last_deploy": last[-1] if last else None, "drift": found,
    }
    phase.detail = "; ".join(found) or "in sync with the inventory"
    result.finish("ok")


def probe_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """What the host's service python offers the payload (SGLang version, loader, hooks, registry)."""
    with connect(inventory, host, result, opts) as remote, result.phase("probe") as phase:
        out = remote.run(probe.probe_command(host.service.python), timeout=60)
        report = probe.parse_probe(out.stdout, out.stderr, out.rc)
        phase.detail = report.summary()
    result.data["probe"] = report.to_json()
    result.finish("ok" if report.compatible else "incompatible", None if report.compatible else report.summary())
