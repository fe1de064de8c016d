"""The read-only commands on one host: plan, verify, status, history, lock, probe. None changes the host
(``lock --release`` ends a lock record, nothing of the service)."""

from __future__ import annotations

import difflib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from kdeploy.core import history, probe
from kdeploy.core.errors import InvalidInput, KdeployError, LockHeld
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.layout import service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.report import HostResult, PhaseFailed
from kdeploy.core.state import decide, drift, running_step, state_step, status_step
from kdeploy.flows.membership import router_phase
from kdeploy.flows.options import Options
from kdeploy.flows.pairing import pair_for
from kdeploy.flows.session import Wanted, connect, inventory_spec, overridden
from kdeploy.host import gate, lock, parity


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


def plan_host(inventory: Inventory, host: HostConfig, local: Wanted, opts: Options, result: HostResult) -> None:
    """Show what a push would do; reads only (no lock, no directories created)."""
    with connect(inventory, host, result, opts.reach) as remote:
        with result.phase("preflight") as phase:
            state = remote.ask(state_step(host, with_files=True))
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


def verify_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """The gate against what runs now, as its release was deployed (else as the inventory says); changes
    nothing."""
    with connect(inventory, host, result, opts.reach) as remote:
        running = remote.ask(running_step(host))
        result.release = running.current
        if running.pending:
            result.log.append(running.pending.describe())
        spec = (overridden(running.gate, opts.workers, opts.timeout) if running.gate
                else inventory_spec(inventory, host, opts.workers, opts.timeout))
        baseline = None
        if opts.parity:
            if spec.parity is None:
                raise InvalidInput(f"{host.name}: --parity: parity is off for this release (gate.parity: false)")
            baseline = parity.own_record(remote, service_dir(host.service), spec, running.current, required=True)
        try:
            with pair_for(inventory, host, None, opts.reach) if spec.serves else nullcontext() as pair:
                gate.run_gate(remote, spec, result, release=running.current, baseline=baseline, pair=pair)
        except PhaseFailed as exc:
            result.finish("unhealthy", exc.detail)
            return
    if inventory.routed(host.name):
        member = router_phase(inventory, host, result, opts.reach)
        if not (member.member and member.healthy):
            result.finish("unhealthy", member.describe())
            return
    result.finish("healthy")


def history_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts.reach) as remote:
        result.details = History(remote.ask(history.read_step(service_dir(host.service), opts.history_limit)))
    result.finish("ok")


def lock_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult, release_it: bool) -> None:
    with connect(inventory, host, result, opts.reach) as remote:
        sdir = service_dir(host.service)
        status = remote.ask(lock.status_step(sdir))
        why = None
        if release_it:
            if status.held and not opts.force:
                raise LockHeld(f"{host.name}: lock is held by a live deploy "
                               f"({status.info.describe() if status.info else 'unknown'}); use --force to end it")
            status, why = remote.ask(lock.release_step(sdir, status, opts.force))
        result.details = LockView(status.state, status.info)
    if why:
        raise LockHeld(f"{host.name}: lock still held: {why}")
    result.finish("ok")


def status_host(inventory: Inventory, host: HostConfig, local: Wanted, opts: Options, result: HostResult) -> None:
    with connect(inventory, host, result, opts.reach) as remote, result.phase("status") as phase:
        status = remote.ask(status_step(host))
    state = status.state
    found = drift(local.payload.identity, local.unit_text, status, local.secrets)
    result.release = state.current
    result.details = StatusView(state.unit.active, state.unit.sub, state.unit.active_since,
                                {k: v for k, v in status.env.items() if k not in ("PYTHONPATH", "PYTHONUNBUFFERED")},
                                status.last_deploy, found, local.masked_secrets())
    phase.detail = "; ".join(found) or "in sync with the inventory"
    if inventory.routed(host.name):
        try:
            router_phase(inventory, host, result, opts.reach)
        except KdeployError as exc:  # the router's state is unknown, not the host's: status still answers
            result.log.append(f"router membership unknown: {exc}")
    result.finish("ok")


def probe_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult) -> None:
    """What the host's service python offers the payload (SGLang version, loader, hooks, registry)."""
    with connect(inventory, host, result, opts.reach) as remote, result.phase("probe") as phase:
        report = remote.ask(probe.probe_step(host.service.python))
        phase.detail = report.summary()
    result.details = report
    result.finish("ok" if report.compatible else "incompatible", None if report.compatible else report.summary())
