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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, ClassVar

from kdeploy import gate, history, lock, parity, probe, provisional, release, sshconfig, systemd
from kdeploy import secrets as secret
from kdeploy.errors import InvalidInput, KdeployError, LockHeld, PreflightRefused, RemoteTimeout, Unreachable
from kdeploy.gatespec import GateSpec, gate_spec, load_payload_gate
from kdeploy.inventory import HostConfig, Inventory
from kdeploy.policy import Policy
from kdeploy.remote import InputFailed, Remote
from kdeploy.render import service_dir, unit_filename
from kdeploy.report import Cancelled, HostResult, PhaseFailed, Result
from kdeploy.state import (
    Decision,
    HostState,
    decide,
    drift,
    parse_running,
    parse_state,
    parse_status,
    running_script,
    state_script,
    status_script,
)

if TYPE_CHECKING:  # router and tunnel import httpx: only commands that speak HTTP pay for it
    from kdeploy.router import RouterClient
    from kdeploy.tunnel import ServiceHttp

RELOCK_WAIT = 30.0  # after a reconnect: the host's own revert may be holding the lock while it runs


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
    policy: Policy = field(default_factory=Policy)  # --canary, --batch, --max-fail (push, set-env, set, rollback)
    skip_preflight: bool = False
    ssh_config: str | None = None  # --ssh-config: overrides KDEPLOY_SSH_CONFIG and the inventory's
    router_add_missing: bool = False  # a host the router does not know is registered after its deploy
    command: str | None = None  # what the lock and history record (the CLI's own command line; see recorded_command)
    parity: bool = False  # verify --parity: compare the running release with its parity record
    accept_parity_change: bool = False  # push: the served model changes, its answers become the new reference


def recorded_command(opts: Options, verb: str) -> str:
    """The command the lock and history record: the CLI's (``Options.command``), else the library call.
    Never ``sys.argv``: a wrapper script calling the library may hold secrets in its own arguments."""
    return opts.command or f"kdeploy {verb} (library)"


def open_remote(inventory: Inventory, host: HostConfig, opts: Options) -> Remote:
    return Remote.connect(host, sshconfig.target_for(inventory, host, opts.ssh_config),
                          accept_new_host_keys=opts.accept_new_host_keys)


def connect(inventory: Inventory, host: HostConfig, result: HostResult, opts: Options) -> Remote:
    with result.phase("connect") as phase:
        remote = open_remote(inventory, host, opts)
        phase.detail = remote.describe()
    return remote


def lock_and_read(remote: Remote, host: HostConfig, wait: float, *, command: str, with_history: bool = False,
                  with_files: bool = False, first: str = "") -> tuple[lock.HeldLock, HostState]:
    """Take the deploy lock (recording ``command``) and read the host's state under it, in one round trip
    (``first`` runs before the read, under the lock; ``with_history``, ``with_files``: see ``state_script``)."""
    then = "\n".join(c for c in (first, state_script(host, with_history=with_history, with_files=with_files)) if c)
    held = lock.acquire(remote, service_dir(host.service), wait=wait, then=then, command=command,
                        timeout=host.service.lock_timeout)
    return held, parse_state(held.output)


def _check(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise Cancelled("interrupted")


@dataclass
class Local:
    """What the controller computes once per host before touching it."""

    unit_text: str
    payload: release.Payload
    spec: GateSpec  # what this push's gate checks; stored with the release it stages
    secrets: secret.Secrets | None = None  # what the environment file must hold (None: not kdeploy's)

    def masked_secrets(self) -> dict[str, str]:
        return self.secrets.masked() if self.secrets else {}


def inventory_spec(inventory: Inventory, host: HostConfig, opts: Options) -> GateSpec:
    """The gate the inventory asks for now (with --workers/--timeout), for runs that have no stored one."""
    return gate_spec(host.service, load_payload_gate(inventory.payload_dir(host)), workers=opts.workers,
                     timeout=opts.timeout)


def _overridden(spec: GateSpec, opts: Options) -> GateSpec:
    """A stored spec with this command's --workers/--timeout, where given."""
    update = {k: v for k, v in (("workers", opts.workers), ("timeout", opts.timeout)) if v}
    return spec.model_copy(update=update) if update else spec


@dataclass(frozen=True)
class Plan:
    key: ClassVar[str] = "plan"
    add: list[str]
    change: list[str]
    remove: list[str]
    unit_diff: str
    daemon_reload: bool
    restart: bool
    reasons: list[str]  # why the host needs a restart (the words of preflight and status drift)
    secrets: dict[str, str] = field(default_factory=dict)  # name -> "***" (never a value)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StatusView:
    key: ClassVar[str] = "status"
    active: str
    sub: str
    since: str
    env: dict[str, str]  # the unit's live flags (kdeploy's own PYTHONPATH/PYTHONUNBUFFERED left out)
    last_deploy: dict | None
    drift: list[str]
    secrets: dict[str, str] = field(default_factory=dict)  # name -> "***" (never a value)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class History:
    key: ClassVar[str] = "history"
    records: list[dict]

    def to_json(self) -> list[dict]:
        return self.records


@dataclass(frozen=True)
class LockView:
    key: ClassVar[str] = "lock"
    state: str  # free | held | stale
    holder: lock.LockInfo | None

    def to_json(self) -> dict:
        return {"state": self.state, "holder": asdict(self.holder) if self.holder else None}


def plan_host(inventory: Inventory, host: HostConfig, local: Local, opts: Options, result: HostResult) -> None:
    """Show what a push would do; reads only (no lock, no directories created)."""
    with connect(inventory, host, result, opts) as remote:
        with result.phase("preflight") as phase:
            state = parse_state(remote.run(state_script(host, with_files=True), timeout=60).stdout)
            phase.detail = f"current {state.current or 'none'}, unit {state.unit.summary}"
        decision = decide(local.payload.identity, local.unit_text, state, force_restart=opts.force_restart,
                          secrets=local.secrets)
        delta = decision.delta
        unit_diff = "".join(difflib.unified_diff(
            (state.unit_text or "").splitlines(keepends=True), local.unit_text.splitlines(keepends=True),
            fromfile=f"{host.name}:{unit_filename(host.service)}", tofile="rendered"))
        result.details = Plan(delta.added, delta.changed, delta.removed, unit_diff, decision.install_unit,
                              decision.restart, decision.reasons, local.masked_secrets())
        result.release = state.current
        result.finish("planned")


# Results of a host that staged but never switched (not its turn, Ctrl-C, a refusing pre_host hook): its
# staged release is removed when it ends, so it is left as it was.
NEVER_SWITCHED = ("skipped", "interrupted", "preflight_refused")


class HostPush:
    """One host's push in two passes, so a fleet can stage everywhere before the first restart, while a host
    holds a connection only while one of its passes runs (bounded by ``--parallel``, not by the fleet).

    ``prepare`` (the stage pass) connects, takes the lock, reads the state, runs the preflight and stages,
    then lets go of lock and connection: a host that is done (no-op, refused, failed) records its history
    first; a staged host leaves its release on disk, not yet current. ``activate`` (its batch's turn)
    connects again, retakes the lock, re-reads the state and checks nothing moved meanwhile (else decides
    again, and stages again if needed), then switches, restarts and gates (rolling back on failure), records
    and lets go. ``close`` lets go of whatever is still held; a host that never got its turn (skipped,
    interrupted) gets its staged release removed, over a connection of its own.

    ``hold``: a staged host keeps its connection and lock between the passes (no reconnect), for a rollout
    whose hosts all fit in ``--parallel``: it holds no more connections at once than that either way.
    """

    def __init__(self, inventory: Inventory, host: HostConfig, local: Local, opts: Options,
                 result: HostResult, cancel: threading.Event, router: RouterClient | None = None,
                 hold: bool = False) -> None:
        """``cancel``: Ctrl-C; checked before each change and during the upload. ``router``: the host's
        router, which ``activate`` drains it from and admits it to again."""
        self.inventory, self.host, self.local, self.opts, self.result = inventory, host, local, opts, result
        self.cancel = cancel
        self.router = router
        self.hold = hold
        self.remote: Remote | None = None
        self.held: lock.HeldLock | None = None
        self.state: HostState | None = None
        self.target: str | None = None
        self.install_unit = False
        self.ship_secrets = False
        self.staged: str | None = None
        self.leftover: str | None = None  # staged by this push, then superseded: removed when it ends
        self.switch: provisional.Pending | None = None  # armed by activate()
        self.started = time.monotonic()

    @property
    def pending(self) -> bool:
        """Prepared and waiting for its turn to restart."""
        return self.target is not None and not self.result.done

    def prepare(self) -> None:
        """The stage pass; ends holding nothing."""
        host, local, result = self.host, self.local, self.result
        try:
            self.remote = connect(self.inventory, host, result, self.opts)
            with result.phase("preflight") as phase:
                self.held, state = lock_and_read(self.remote, host, self.opts.lock_wait, with_files=True,
                                                 command=recorded_command(self.opts, "push"))
                decision = self._decide(state)
                phase.detail = f"lock taken; current {state.current or 'none'}; {state.unit.summary}"
                if not decision.no_op:
                    phase.detail += parity.model_change(host.name, state.current, state.gates.get(state.current or ""),
                                                        local.spec, self.opts.accept_parity_change)
                if decision.reasons:
                    phase.detail += "; " + "; ".join(decision.reasons)
                if self.held.stale:
                    phase.detail += f"; took over STALE lock left by {self.held.stale.describe()} (holder gone)"
                # The checks start the service's python, nvidia-smi and journalctl: only worth it before a change.
                if not decision.no_op and not self.opts.skip_preflight:
                    upload = sum(local.payload.files[p].size for p in decision.delta.upload)
                    out = self.remote.run(preflight_command(host), timeout=120)
                    phase.detail += "; " + preflight_verdict(host, out.stdout, upload,
                                                             release.entries(local.payload.files))
            _check(self.cancel)
            self._stage_if_needed(decision)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            result.fail(exc)
        finally:
            if result.done:
                self.close()
            elif not self.hold:
                self._let_go()

    def _decide(self, state: HostState) -> Decision:
        self.state = state
        decision = decide(self.local.payload.identity, self.local.unit_text, state,
                          force_restart=self.opts.force_restart, secrets=self.local.secrets)
        self.install_unit = decision.install_unit
        self.ship_secrets = decision.secrets_changed
        return decision

    def _stage_if_needed(self, decision: Decision) -> None:
        """Finish a no-op host; else stage what the decision asks for (nothing for a restart alone)."""
        assert self.state is not None
        if decision.no_op:
            with self.result.phase("stage") as phase:
                phase.detail = "nothing changed: no upload, no restart"
            self.result.release = self.state.current
            self.result.finish("unchanged")
            return
        self.target = self.state.current
        if decision.stage:
            self._stage(decision.delta)

    def _let_go(self) -> None:
        """Between the passes: release the lock (nothing to record yet) and disconnect. The staged release
        stays in ``releases/``, not current; ``activate`` checks it is still there."""
        if self.held is not None:
            self.held.release()
            self.held = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _resume(self) -> None:
        """Connect again, retake the lock, re-read the state (one round trip) and check that nothing moved
        since the stage pass (another push or a rollback may have run meanwhile). If something did, decide
        again: a host now in sync is ``unchanged``; else the staged release is used if it is still intact
        (it holds every file, whatever is current), or a new one is staged."""
        before, staged = self.state, self.staged
        assert before is not None
        with self.result.phase("resume") as phase:
            self.remote = open_remote(self.inventory, self.host, self.opts)
            self.held, state = lock_and_read(self.remote, self.host, self.opts.lock_wait, with_files=True,
                                             command=recorded_command(self.opts, "push"))
            moved = _moved(before, state, staged)
            phase.detail = f"lock taken again; {moved + ', decided again' if moved else 'nothing moved since staging'}"
        if not moved:
            self.state = state
            return
        decision = self._decide(state)
        intact = staged is not None and staged in state.releases
        if decision.stage and intact:
            self.target = staged
            return
        self.target = self.staged = None
        self.leftover = staged if intact else None
        self._stage_if_needed(decision)

    def _stage(self, delta: release.Delta) -> None:
        """Stage the new release. A failure leaves the host unchanged (the staging dir is removed) and is no
        bug of kdeploy's: a payload file edited during the push is invalid input (exit 2), anything else on
        the host refuses it (exit 7), like a full disk."""
        host, local, state = self.host, self.local, self.state
        assert self.remote is not None and state is not None
        with self.result.phase("stage") as phase:
            target = release.release_id(local.payload.manifest, local.unit_text)
            meta = release.release_meta(local.payload.manifest, local.payload.modes, local.unit_text,
                                        unit_filename(host.service), local.spec.to_json())
            self.result.attempted = target
            try:
                tarball = release.TarStream(local.payload, delta.upload, meta)
                out = self.remote.run(release.stage_script(service_dir(host.service), target,
                                                           state.has_release, delta),
                                      stdin=tarball, timeout=600, cancel=self.cancel)
                failure = None if out.ok and "STAGED" in out.stdout else release.parse_stage_failure(out.stderr, out.rc)
            except InputFailed as exc:  # a payload file vanished or shrank while the tar read it
                failure = release.StageFailure(f"cannot read the payload: {exc}")
            if failure:
                changed = release.changed_since_scan(local.payload, delta.upload)
                if changed:
                    more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
                    raise InvalidInput(f"{host.name}: payload file {local.payload.files[changed[0]].source}{more} "
                                       "changed during the push, host unchanged: push again")
                raise PreflightRefused(failure.describe(f"{service_dir(host.service)}/releases"))
            self.target = self.staged = target
            phase.detail = (f"{target}: {delta.describe()} files, {tarball.sent} bytes sent"
                            f"{', unit changed' if self.install_unit else ''}")

    def activate(self) -> None:
        """The batch pass; ends holding nothing."""
        try:
            if self.remote is None:
                _check(self.cancel)
                self._resume()
                if self.result.done:
                    return
            _check(self.cancel)
            assert self.remote is not None and self.state is not None and self.target is not None
            self.result.release = self.target
            previous = self.state.confirmed
            remote, target = self.remote, self.target

            def restart() -> None:  # the revert's deadline counts from here, not from before the drain
                baseline = parity.baseline(remote, service_dir(self.host.service), self.result, self.local.spec,
                                           target, (self.state.current, self._spec_of(self.state.current))
                                           ) if self.opts.verify else None
                self.switch = provisional.new_pending(previous, target, revert_after(self.host, self.local.spec))
                activate_and_gate(remote, self.host, self.result, self.opts, target=target,
                                  install_unit=self.install_unit, pending=self.switch, spec=self.local.spec,
                                  previous_spec=self._spec_of(previous),
                                  secrets=self.local.secrets if self.ship_secrets else None, baseline=baseline)
                self.staged = None

            behind_router(remote, self.host, self.result, self.router, self.cancel, restart)
        except Unreachable as exc:
            self._reconnect_and_roll_back(exc)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            self.result.fail(exc)
        finally:
            self.close()

    def _spec_of(self, release_id: str | None) -> GateSpec:
        """How ``release_id`` was gated when it was deployed; this push's spec for releases kdeploy staged
        before it stored one (less its config line, which reflects the new settings)."""
        assert self.state is not None
        stored = self.state.gates.get(release_id or "")
        return stored or self.local.spec.model_copy(update={"config_line": None, "config": {}})

    def _reconnect_and_roll_back(self, lost: Unreachable) -> None:
        """The link dropped after the switch began: reconnect, take the lock again, and put the last confirmed
        release back, unless the host already did so by itself."""
        assert self.state is not None and self.remote is not None
        if self.switch is None or not any(p.name == "activate" for p in self.result.phases):
            self.result.fail(lost)
            return
        pending = self.switch
        try:
            remote = connect(self.inventory, self.host, self.result, self.opts)
        except Unreachable as exc:
            self.result.finish("unreachable", f"connection lost after switching to {self.target}; reconnect "
                                              f"failed ({exc}); the host goes back to "
                                              f"{pending.previous or 'nothing (first deploy)'} by itself at "
                                              f"{time.strftime('%H:%M:%S', time.localtime(pending.deadline))}")
            return
        self.remote.close()
        self.remote = remote
        sdir = service_dir(self.host.service)
        try:
            with self.result.phase("relock") as phase:
                if self.held is not None and self.held.remote_pid:
                    remote.run(lock.end_holder_command(sdir, self.held.remote_pid), timeout=30)
                # Holding the lock, no revert can be half way: one waiting for it would end us, stop it.
                waiting = provisional.stop_revert_service(provisional.timer_unit(self.host.service.name))
                self.held, state = lock_and_read(remote, self.host, RELOCK_WAIT, first=waiting,
                                                 command=recorded_command(self.opts, "push"))
                phase.detail = f"lock taken again; current {state.current or 'none'}"
        except KdeployError as exc:
            self.held = None
            self.result.finish("unreachable", f"connection lost after switching to {self.target}; {exc}; the "
                                              "host goes back by itself at the deadline unless confirmed")
            return
        if state.pending is None or state.pending.token != pending.token:
            self.result.release = state.current
            self.result.finish("rolled_back", f"connection lost during the deploy ({lost}); the host had already "
                                              f"gone back to {state.current or 'nothing'} by itself")
            return
        rollback_after_failure(remote, self.host, self.result, self.opts, pending,
                               f"connection lost during the deploy ({lost})", self._spec_of(pending.previous))

    def skip(self, why: str, result: str = "skipped") -> None:
        if not self.result.done:
            self.result.finish(result, why)

    def close(self) -> None:
        """Record and clean up through the lock holder (no extra round trip), then let go of the host. A host
        that never got its turn holds nothing by now: its staged release is removed over a new connection."""
        try:
            if self.held is None and self.staged and self.result.result in NEVER_SWITCHED:
                self._remove_staged()
            elif self.held is not None and self.remote is not None:
                finish = self._finish_command()
                if not self.held.release(finish) and finish:  # the holder's link died (we reconnected)
                    self.remote.run(finish, timeout=60)
        except KdeployError as exc:
            self.result.log.append(f"could not record history or clean up after the push: {exc}")
        finally:
            self.held = None
            if self.remote is not None:
                self.remote.close()
                self.remote = None

    def _remove_staged(self) -> None:
        """Connect and take the lock again (never waiting) to remove the release this push staged and never
        activated; if someone made it current or pending meanwhile, it is theirs now and stays."""
        self.remote = open_remote(self.inventory, self.host, self.opts)
        held, state = lock_and_read(self.remote, self.host, 0, command=recorded_command(self.opts, "push"))
        theirs = self.staged in (state.current, state.pending.target if state.pending else None)
        held.release("" if theirs else release.prune_command(service_dir(self.host.service), [str(self.staged)]))
        self.result.release = state.current

    def _finish_command(self) -> str:
        sdir = service_dir(self.host.service)
        if self.result.result in NEVER_SWITCHED and self.staged:
            self.result.release = self.state.current if self.state else None
            return release.prune_command(sdir, [self.staged])
        if self.result.result == "preflight_refused":  # a refused host is left exactly as it was
            return ""
        state = self.state
        keep = {state.current, state.confirmed} if state else set()
        drop = release.prune_command(sdir, [self.leftover] if self.leftover not in (None, *keep) else [])
        return "\n".join(c for c in (finish_command(self.host, self.result, self.started,
                                                     state.releases if state else [], self.local, keep,
                                                     command=recorded_command(self.opts, "push"),
                                                     secrets="changed" if self.ship_secrets else None),
                                      drop) if c)


def _moved(before: HostState, now: HostState, staged: str | None) -> str:
    """What changed on a host between the stage pass and its batch (empty: nothing), in words."""
    if now.current != before.current:
        return f"current moved from {before.current or 'none'} to {now.current or 'none'}"
    if (now.pending and now.pending.token) != (before.pending and before.pending.token):
        return "the host's pending switch changed"
    if now.unit_text != before.unit_text or now.manifest != before.manifest:
        return "the installed unit or the current release changed"
    if staged and staged not in now.releases:
        return f"staged release {staged} was removed"
    return ""


def preflight_command(host: HostConfig) -> str:
    sv = host.service
    return probe.preflight_command(python=sv.python, unit=unit_filename(sv), port=sv.sglang.port,
                                   remote_root=sv.remote_root, environment_file=sv.environment_file,
                                   probe_cache=f"{service_dir(sv)}/{probe.CACHE}",
                                   kv_from_journal=(sv.hicache.enabled and sv.hicache.size_gb is None
                                                    and sv.hicache.device_kv_gb_per_rank is None))


def preflight_checks(host: HostConfig, output: str, upload_bytes: int, entries: int = 0) -> list[probe.Check]:
    """Every preflight check of one host. A service that does not launch SGLang itself (the sandbox's
    reference server) only gets a warning when SGLang is missing or incompatible."""
    sv = host.service
    hc = sv.hicache
    checks = list(probe.parse_preflight(
        output, unit=unit_filename(sv), port=sv.sglang.port, tp=sv.sglang.tp, payload_bytes=upload_bytes,
        entries=entries,
        hicache_enabled=hc.enabled, hicache_ratio=hc.ratio, hicache_size_gb=hc.size_gb,
        device_kv_gb_per_rank=hc.device_kv_gb_per_rank, environment_file=sv.environment_file,
        secrets_written=sv.secrets.configured).all_checks())
    if not sv.module.startswith("sglang.") and checks[0].status == "fail":
        checks[0] = probe.Check("sglang", "warn", f"service runs {sv.module}, not SGLang: {checks[0].detail}")
    return checks


def preflight_verdict(host: HostConfig, output: str, upload_bytes: int, entries: int = 0) -> str:
    """One line of every check; a failing one refuses the host (exit 7) before anything changes."""
    checks = preflight_checks(host, output, upload_bytes, entries)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightRefused(f"{host.name}: preflight refused: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    return "preflight " + ", ".join(f"{c.name} {c.status}" for c in checks) + "".join(
        f"; {c.name}: {c.detail}" for c in checks if c.status == "warn")


def drain(remote: Remote, host: HostConfig, result: HostResult, client: RouterClient,
          cancel: threading.Event) -> None:
    """Take the host's worker out of the router, then wait (up to ``drain_timeout``) until SGLang's gauges show
    no request running or queued, so the restart cuts none off."""
    from kdeploy.router import POLL, api_key, arm_readmit_command, readmit_after
    from kdeploy.tunnel import ServiceHttp

    assert host.router is not None and host.worker_url is not None
    with result.phase("drain") as phase:
        key = api_key(host.router)
        out = remote.run(arm_readmit_command(host, key is not None), stdin=key.encode() if key else None, timeout=30)
        if not out.ok:
            raise PhaseFailed(f"could not arm the host's re-admit, host not drained: {out.last_error()}")
        was_in = client.remove(host.worker_url, cancel=lambda: _check(cancel))
        result.router = "out"
        phase.detail = f"{host.worker_url} removed from the router" if was_in else f"{host.worker_url} was not in"
        phase.detail += f"; the host re-admits itself after {readmit_after(host):.0f}s unless kdeploy decides first"
        deadline = time.monotonic() + host.router.drain_timeout
        with ServiceHttp(remote, host.service.sglang.host, host.service.sglang.port) as http:
            while True:
                _check(cancel)
                left = _in_flight(http)
                if left is None:
                    phase.detail += "; no /metrics (--enable-metrics): SGLang's SIGTERM drain finishes them"
                    return
                if left == 0:
                    phase.detail += "; no request in flight"
                    return
                if time.monotonic() > deadline:
                    phase.detail += f"; {left} request(s) still in flight after {host.router.drain_timeout:g}s"
                    return
                time.sleep(POLL)


def _in_flight(http: ServiceHttp) -> int | None:
    import httpx

    from kdeploy.router import in_flight

    try:
        response = http.client.get("/metrics")
    except httpx.HTTPError:
        return None
    return in_flight(response.text) if response.status_code == 200 else None


def admit(host: HostConfig, result: HostResult, client: RouterClient) -> None:
    """Register the host's worker again and wait until the router lists it healthy (Ctrl-C does not stop it:
    the host serves again, it must not stay out)."""
    assert host.worker_url is not None
    with result.phase("admit") as phase:
        client.add(host.worker_url)
        result.router = "in"
        phase.detail = f"{host.worker_url} healthy in the router"


def admit_serving(host: HostConfig, result: HostResult, client: RouterClient) -> None:
    """``admit`` a host that serves; when the router does not take it, the host ends ``failed`` (if it had
    ended well) and says it is out."""
    try:
        admit(host, result, client)
    except KdeployError as exc:
        result.finish(Result.FAILED if result.ok else result.result,
                      f"{result.error + '; ' if result.error else ''}left OUT of the router: {exc}")


def behind_router(remote: Remote, host: HostConfig, result: HostResult, client: RouterClient | None,
                  cancel: threading.Event, restart: Callable[[], None]) -> None:
    """``restart`` (switch, restart, gate, maybe roll back) with the host out of the router: drained first,
    admitted only when it ended serving (deployed, or rolled back and its rollback gated). A host that needs
    a person stays out, and says so."""
    if client is None:
        restart()
        return
    from kdeploy.router import disarm_readmit_command

    drain(remote, host, result, client, cancel)
    restart()
    if result.result in (Result.DEPLOYED, Result.RESTORED, Result.ROLLED_BACK):
        admit_serving(host, result, client)
    elif result.router == "out":
        result.log.append(f"left OUT of the router: fix the host, then `kdeploy router admit {host.name}`")
    try:  # decided: in, or out on purpose (a failed host stays out): the host's own re-admit is not needed
        remote.run(disarm_readmit_command(host), timeout=30)
    except KdeployError as exc:
        result.log.append(f"could not cancel the host's re-admit timer ({exc}): it re-admits the host itself "
                          "if it serves a confirmed release then")


def router_phase(inventory: Inventory, host: HostConfig, result: HostResult, opts: Options) -> bool:
    """Phase ``router``: is the host registered in its router, and healthy there? Sets ``result.router``."""
    from kdeploy import router as routing

    assert host.router is not None
    with result.phase("router") as phase, routing.connect(
            inventory, host.router, accept_new_host_keys=opts.accept_new_host_keys, ssh_config=opts.ssh_config
    ) as client:
        member = routing.membership(client, host)
        result.router = "in" if member.member else "out"
        phase.detail = member.describe()
        return member.member and member.healthy


def restart_and_follow(remote: Remote, host: HostConfig, result: HostResult, old: str,
                       timeout: float) -> systemd.UnitState:
    """Wait on the host for the run that replaces ``old`` (the activation stopped it and queued the restart:
    ``systemd.follow_command``); its state feeds the gate."""
    unit = unit_filename(host.service)
    with result.phase("restart") as phase:
        out = remote.run(systemd.follow_command(unit, old, timeout, min(0.1, host.service.gate.poll_interval)),
                         timeout=timeout + 30)
        if not out.ok:
            raise PhaseFailed(f"following the restart failed: {out.last_error()}")
        restarted = systemd.parse_restart(out.stdout)
        state = restarted.state
        if not restarted.followed:
            raise PhaseFailed(f"no new run of {unit} after {timeout:.0f}s (still {state.summary})")
        phase.detail = (f"new invocation {state.invocation[:12]} {state.summary}"
                        + (" after the old run stopped" if restarted.stopping else ""))
        return state


def revert_after(host: HostConfig, spec: GateSpec) -> float:
    """Seconds the host waits for the confirmation before it reverts by itself."""
    return host.service.gate.revert_after or provisional.deadline_seconds(host.service.unit.timeout_stop_sec,
                                                                          spec.timeout)


def _activate(remote: Remote, host: HostConfig, result: HostResult, target: str, install_unit: bool,
              pending: provisional.Pending, *, secrets: secret.Secrets | None = None, restore: bool = False) -> str:
    """Arm the host's revert, then write ``secrets`` (over stdin) or, with ``restore``, put the last confirmed
    ones back, then switch ``current`` (and the unit) and restart: one round trip. Returns the run it
    replaces."""
    sv = host.service
    sdir = service_dir(sv)
    unit = unit_filename(sv)
    arm = provisional.arm_script(sdir, unit, provisional.timer_unit(sv.name), pending, sv.on_first_deploy_failure,
                                 sv.environment_file if sv.secrets.configured else None)
    env_step, stdin = "", None
    if secrets is not None and sv.environment_file:
        salt = secret.new_salt()
        env_step, stdin = secret.write_script(sdir, sv.environment_file, salt), secret.write_stdin(secrets, salt)
    elif restore and sv.environment_file and sv.secrets.configured:
        env_step = secret.restore_script(sdir, sv.environment_file)
    with result.phase("activate") as phase:
        out = remote.run(release.activate_script(sdir, target, unit, install_unit, arm, env_step), stdin=stdin,
                         timeout=120)
        if not out.ok:
            raise PhaseFailed(f"switching to {target} failed: {out.last_error()}")
        phase.detail = (f"current -> {target}" + ("; unit installed, daemon-reload" if install_unit else "")
                        + "; old run stopping, restart queued"
                        + (f"; secrets written ({', '.join(secrets.masked())} = {secret.MASK})" if stdin else "")
                        + f"; reverts to {pending.previous or 'nothing'} by itself unless confirmed within "
                          f"{max(0, pending.deadline - time.time()):.0f}s")
    return systemd.parse_old_run(out.stdout)


def confirm(remote: Remote, host: HostConfig, result: HostResult, pending: provisional.Pending) -> None:
    """Keep the switch: disarm the host's revert (it acts only on a ``pending`` that is still ours)."""
    with result.phase("confirm") as phase:
        out = remote.run(provisional.confirm_command(service_dir(host.service),
                                                     provisional.timer_unit(host.service.name), pending.token),
                         timeout=60)
        if "CONFIRMED" not in out.stdout:
            raise PhaseFailed(f"the switch to {pending.target} was no longer pending: the host reverted by itself "
                              f"or another deploy took over ({out.last_error() if not out.ok else 'LOST'})")
        phase.detail = f"{pending.target} kept; revert disarmed"


def activate_and_gate(remote: Remote, host: HostConfig, result: HostResult, opts: Options, *, target: str,
                      install_unit: bool, pending: provisional.Pending, spec: GateSpec,
                      previous_spec: GateSpec, secrets: secret.Secrets | None = None,
                      success: Result = Result.DEPLOYED, baseline: parity.Baseline | None = None) -> None:
    """Switch to ``target`` (and ``secrets``) provisionally, restart, gate, confirm and end ``success``; on a
    failed gate go back to the last confirmed release (``pending.previous``) and secrets by itself.
    ``baseline``: what the gate's parity phase compares with (taken before the switch)."""
    result.attempted = target
    try:
        old = _activate(remote, host, result, target, install_unit, pending, secrets=secrets)
        started = restart_and_follow(remote, host, result, old, host.service.unit.timeout_stop_sec + 60)
        record = gate.run_gate(remote, spec, result, release=target, started=started,
                               baseline=baseline) if opts.verify else None
    except (PhaseFailed, RemoteTimeout) as exc:
        rollback_after_failure(remote, host, result, opts, pending, getattr(exc, "detail", str(exc)), previous_spec)
        return
    confirm(remote, host, result, pending)
    parity.keep(remote, service_dir(host.service), result, target, record)
    result.finish(success)


def rollback_after_failure(remote: Remote, host: HostConfig, result: HostResult, opts: Options,
                           pending: provisional.Pending, why: str, spec: GateSpec) -> None:
    """Back to the last confirmed release, gated as it was deployed (``spec``), then disarm the revert.

    The revert is re-armed for the rollback's own restart and gate, so a controller that dies now still
    leaves the host going back by itself. Its phases are reported as ``rollback <phase>``.
    """
    previous = pending.previous
    unit = shlex.quote(unit_filename(host.service))
    with result.phase("rollback") as phase:
        if previous is None:
            if host.service.on_first_deploy_failure == "stop":
                restore = (secret.restore_script(service_dir(host.service), host.service.environment_file)
                           if host.service.secrets.configured and host.service.environment_file else "true")
                remote.run(f"systemctl disable --quiet {unit}; systemctl stop --no-block {unit}; {restore}",
                           timeout=60)
                state = "stopped and disabled"
            else:
                state = "left running as it is"
            _disarm(remote, host, result, pending)
            phase.ok = False
            phase.detail = f"first deploy failed ({why}); nothing to roll back to: service {state}"
            result.finish("rollback_failed", phase.detail)
            return
        again = provisional.new_pending(previous, previous, revert_after(host, spec), pending.token)
        try:
            with result.prefixed("rollback "):
                old = _activate(remote, host, result, previous, True, again, restore=True)
                started = restart_and_follow(remote, host, result, old, host.service.unit.timeout_stop_sec + 60)
                gate.run_gate(remote, spec, result, release=previous, started=started,
                              baseline=parity.own_record(remote, service_dir(host.service), spec, previous))
                confirm(remote, host, result, again)
        except (PhaseFailed, KdeployError) as exc:
            _disarm(remote, host, result, again)
            phase.ok = False
            phase.detail = (f"gate failed ({why}); rollback to {previous} FAILED: {exc}; "
                            f"host needs a human: current -> {previous}, unit of {previous} installed")
            result.release = previous
            result.finish("rollback_failed", phase.detail)
            return
        phase.detail = f"gate failed ({why}); back on {previous}, its gate passed"
        result.release = previous
        result.finish("rolled_back", why)


def _disarm(remote: Remote, host: HostConfig, result: HostResult, pending: provisional.Pending) -> None:
    """The controller decided the host's end state itself: no revert may act on it later."""
    try:
        remote.run(provisional.confirm_command(service_dir(host.service), provisional.timer_unit(host.service.name),
                                               pending.token), timeout=60)
    except KdeployError as exc:
        result.log.append(f"could not disarm the host's revert timer: {exc}")


def finish_command(host: HostConfig, result: HostResult, started: float, releases: list[str],
                   local: Local | None = None, keep: set[str | None] = frozenset(), *, command: str,
                   secrets: str | None = None) -> str:
    """Append the history line and prune old releases (sent to the lock holder, run under the lock).

    Never pruned: the release now current, the one attempted, and ``keep`` (what ran before the command
    and the last confirmed release: a rollback's targets). ``secrets``: "changed" when the push wrote them.
    """
    sdir = service_dir(host.service)
    attempted = result.attempted
    who = lock.holder_info(command)
    entry = {
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "user": who.user, "controller": who.controller, "command": who.command,
        "payload_hash": release.sha256_text(release.manifest_text(local.payload.manifest))[:16] if local else None,
        "unit_hash": release.sha256_text(local.unit_text)[:16] if local else None,
        "duration": round(time.monotonic() - started, 2),
        "result": result.result, "release": result.release, "attempted": attempted, "error": result.error,
    }
    if secrets:
        entry["secrets"] = secrets
    protect = {str(r) for r in (result.release, attempted, *keep) if r}
    prune = release.releases_to_prune(sorted(set(releases) | ({attempted} if attempted else set())),
                                      host.service.keep_releases, protect)
    return "\n".join(c for c in (history.append_command(sdir, entry), release.prune_command(sdir, prune)) if c)


def rollback_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult,
                  router: RouterClient | None = None,
                  before_change: Callable[[str, str | None], bool] | None = None) -> None:
    """Re-activate an older release (and its unit), restart and gate it as it was deployed; drained from
    ``router`` meanwhile. ``before_change(target, current)``: the pre_host hook, under the lock; False ends
    the host (its result set) untouched."""
    started = time.monotonic()
    with connect(inventory, host, result, opts) as remote:
        held = None
        state = None
        try:
            with result.phase("preflight") as phase:
                held, state = lock_and_read(remote, host, opts.lock_wait, with_history=True,
                                            command=recorded_command(opts, "rollback"))
                target = opts.to_release or state.previous()
                if not target:
                    raise PreflightRefused(f"{host.name}: no older release to roll back to")
                if target not in state.releases:
                    raise InvalidInput(f"{host.name}: no release {target!r} "
                                       f"(have: {', '.join(state.releases) or 'none'})")
                phase.detail = f"{state.current} -> {target}"
                if state.pending:
                    phase.detail += f" ({state.pending.describe()})"
            if before_change is not None and not before_change(target, state.current):
                return
            result.release = target
            fallback = inventory_spec(inventory, host, opts)
            previous = state.confirmed

            def restart() -> None:  # the revert's deadline counts from here, not from before the drain
                spec = _overridden(state.gates.get(target, fallback), opts)
                baseline = parity.baseline(remote, service_dir(host.service), result, spec, target, None)
                activate_and_gate(remote, host, result, opts, target=target, install_unit=True,
                                  pending=provisional.new_pending(previous, target, revert_after(host, fallback)),
                                  spec=spec, previous_spec=state.gates.get(previous or "", fallback),
                                  success=Result.RESTORED, baseline=baseline)

            behind_router(remote, host, result, router, threading.Event(), restart)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            result.fail(exc)
        finally:
            if held is not None:
                recorded = state is not None and result.result not in ("invalid", "preflight_refused")
                keep = {state.current, state.confirmed} if state else set()
                held.release(finish_command(host, result, started, state.releases, keep=keep,
                                            command=recorded_command(opts, "rollback")) if recorded else "")


def verify_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """The gate against what runs now, as its release was deployed (else as the inventory says); changes
    nothing."""
    with connect(inventory, host, result, opts) as remote:
        running = parse_running(remote.run(running_script(host), timeout=30).stdout)
        result.release = running.current
        if running.pending:
            result.log.append(running.pending.describe())
        spec = _overridden(running.gate, opts) if running.gate else inventory_spec(inventory, host, opts)
        baseline = None
        if opts.parity:
            if spec.parity is None:
                raise InvalidInput(f"{host.name}: --parity: parity is off for this release (gate.parity: false)")
            baseline = parity.own_record(remote, service_dir(host.service), spec, running.current, required=True)
        try:
            gate.run_gate(remote, spec, result, release=result.release, baseline=baseline)
        except PhaseFailed as exc:
            result.finish("unhealthy", exc.detail)
            return
    if host.router is not None and not router_phase(inventory, host, result, opts):
        result.finish("unhealthy", result.phases[-1].detail)
        return
    result.finish("healthy")


def history_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts) as remote:
        out = remote.run(history.read_command(service_dir(host.service), opts.history_limit), timeout=30)
        result.details = History(history.parse(out.stdout))
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
        result.details = LockView(status.state, status.info)
    if why:
        raise LockHeld(f"{host.name}: lock still held: {why}")
    result.finish("ok")


def status_host(inventory: Inventory, host: HostConfig, local: Local, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts) as remote, result.phase("status") as phase:
        status = parse_status(remote.run(status_script(host), timeout=60).stdout)
    state = status.state
    found = drift(local.payload.identity, local.unit_text, status, local.secrets)
    result.release = state.current
    result.details = StatusView(state.unit.active, state.unit.sub, state.unit.active_since,
                                {k: v for k, v in status.env.items() if k not in ("PYTHONPATH", "PYTHONUNBUFFERED")},
                                status.last_deploy, found, local.masked_secrets())
    phase.detail = "; ".join(found) or "in sync with the inventory"
    if host.router is not None:
        try:
            router_phase(inventory, host, result, opts)
        except KdeployError as exc:  # the router's state is unknown, not the host's: status still answers
            result.log.append(f"router membership unknown: {exc}")
    result.finish("ok")


def probe_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """What the host's service python offers the payload (SGLang version, loader, hooks, registry)."""
    with connect(inventory, host, result, opts) as remote, result.phase("probe") as phase:
        out = remote.run(probe.probe_command(host.service.python), timeout=60)
        report = probe.parse_probe(out.stdout, out.stderr, out.rc)
        phase.detail = report.summary()
    result.details = report
    result.finish("ok" if report.compatible else "incompatible", None if report.compatible else report.summary())
