"""The provisional switch of one server and its ends: Switched -> Confirmed, or -> RolledBack (the controller
went back).

A server is one node or several (SGLang's multi-node mode); a single host is the one-node case of the same
code. Every node arms its own revert, under one token and deadline, before any node's ``current`` moves, so a
controller that dies leaves nodes that go back by themselves (docs/push.md, "provisional"); ``Reverted`` is the
end where they did, ``NotSwitched`` the one where a node could not arm its revert (a full disk) and nothing
moved. The confirm writes each node's history line in the same command, so a node reset or a controller
gone right after it still has the line that says its release passed. The nodes switch head first (the head's
stop broadcasts the shutdown its followers wait for), restart and are gated together, are confirmed only once
every node passed, and go back together when any node fails, so no server is left with ranks on different
releases. Each transition returns its typed outcome; the ``HostResult`` of each node only reports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TypeVar

from kdeploy.core import provisional, release, systemd
from kdeploy.core import secrets as secret
from kdeploy.core.errors import KdeployError, RemoteTimeout, Unreachable
from kdeploy.core.gatespec import GateSpec
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.report import HostResult, PhaseFailed, Result
from kdeploy.host import gate, parity
from kdeploy.host.pair import Pairing
from kdeploy.ssh.remote import Remote


@dataclass(frozen=True)
class Confirmed:
    """The switch to ``release`` passed its gate and is kept."""

    release: str
    serving: bool = True


@dataclass(frozen=True)
class RolledBack:
    """The controller put the last confirmed release back; ``serving``: it runs and passed its gate again."""

    release: str | None
    serving: bool


@dataclass(frozen=True)
class Reverted:
    """The host went back to ``release`` by itself (its revert timer, or at boot) before the controller did."""

    release: str | None
    serving: bool = False


@dataclass(frozen=True)
class NotSwitched:
    """The host refused the switch before anything changed (a full disk: the revert could not be armed); its last
    confirmed ``release`` still runs, as it did."""

    release: str | None
    serving: bool = True


Outcome = Confirmed | RolledBack | Reverted | NotSwitched
_T = TypeVar("_T")


@dataclass(frozen=True)
class Node:
    """One node's part of a server's switch: what its steps share, instead of a (remote, host, result) trio
    threaded through every call. ``pending``'s token is the server's; ``baseline`` is the head's parity
    baseline (followers answer no HTTP)."""

    remote: Remote
    host: HostConfig
    result: HostResult
    pending: provisional.Pending
    spec: GateSpec  # how the target is gated on this node
    previous_spec: GateSpec  # how ``pending.previous`` was gated when it was deployed
    install_unit: bool = True
    secrets: secret.Secrets | None = None
    baseline: parity.Baseline | None = None
    pair: Pairing | None = None  # the head of a prefill or decode server: the partner its gate goes through
    # the history line the confirm writes (``record.confirmed_line``): (the result it ends with, whether gated)
    record: Callable[[Result, bool], str] | None = None


def revert_after(host: HostConfig, spec: GateSpec) -> float:
    """Seconds the host waits for the confirmation before it reverts by itself."""
    return host.service.gate.revert_after or provisional.deadline_seconds(host.service.unit.timeout_stop_sec,
                                                                          spec.timeout)


def _arm_script(node: Node, pending: provisional.Pending) -> str:
    sv = node.host.service
    return provisional.arm_script(service_dir(sv), unit_filename(sv), provisional.timer_unit(sv.name), pending,
                                  sv.on_first_deploy_failure, sv.environment_file if sv.secrets.configured else None)


def _reverts(pending: provisional.Pending) -> str:
    return (f"reverts to {pending.previous or 'nothing'} by itself unless confirmed within "
            f"{max(0, pending.deadline - time.time()):.0f}s")


def arm(node: Node, pending: provisional.Pending) -> None:
    """Phase ``arm``: the node's revert alone, ahead of its switch, so a server's nodes are all armed before any
    moves (a node armed in its own activation would have none while its head, already moved, reverts)."""
    with node.result.phase("arm") as phase:
        node.remote.ask(release.arm_step(service_dir(node.host.service), pending.target, _arm_script(node, pending)))
        phase.detail = _reverts(pending)


def switch(node: Node, target: str, install_unit: bool, pending: provisional.Pending, *,
           secrets: secret.Secrets | None = None, restore: bool = False, restart: bool = True,
           armed: bool = True) -> str:
    """Arm the node's revert (unless not ``armed``: armed ahead, or on a way back without one), then write
    ``secrets`` (over stdin) or, with ``restore``, put the last confirmed ones back, then switch ``current``
    (and the unit) and restart (without ``restart``: stop only): one round trip. Returns the run it replaces."""
    sv = node.host.service
    sdir = service_dir(sv)
    env_step, stdin = "", None
    if secrets is not None and sv.environment_file:
        salt = secret.new_salt()
        env_step, stdin = secret.write_script(sdir, sv.environment_file, salt), secret.write_stdin(secrets, salt)
    elif restore and sv.environment_file and sv.secrets.configured:
        env_step = secret.restore_script(sdir, sv.environment_file)
    with node.result.phase("activate") as phase:
        old = node.remote.ask(release.activate_step(sdir, target, unit_filename(sv), install_unit,
                                                    _arm_script(node, pending) if armed else "", env_step, restart),
                              stdin=stdin)
        phase.detail = (f"current -> {target}" + ("; unit installed, daemon-reload" if install_unit else "")
                        + ("; old run stopping, restart queued" if restart else "; old run stopping")
                        + (f"; secrets written ({', '.join(secrets.masked())} = {secret.MASK})" if stdin else "")
                        + (f"; {_reverts(pending)}" if armed else ""))
    return old


def restart_and_follow(node: Node, old: str, timeout: float) -> systemd.UnitState:
    """Wait on the host for the run that replaces ``old`` (the activation stopped it and queued the restart:
    ``systemd.follow_command``); its state feeds the gate."""
    unit = unit_filename(node.host.service)
    with node.result.phase("restart") as phase:
        restarted = node.remote.ask(systemd.follow_step(unit, old, timeout,
                                                        min(0.1, node.host.service.gate.poll_interval)))
        state = restarted.state
        if not restarted.followed:
            raise PhaseFailed(f"no new run of {unit} after {timeout:.0f}s (still {state.summary})")
        phase.detail = (f"new invocation {state.invocation[:12]} {state.summary}"
                        + (" after the old run stopped" if restarted.stopping else ""))
        return state


def confirm(node: Node, pending: provisional.Pending, success: Result | None = None, gated: bool = False,
            armed: bool = True) -> None:
    """Keep the switch: disarm the node's revert (it acts only on a ``pending`` that is still ours). With
    ``success``, the node's history line (its ``record``) is written in the same command, as ``success``.
    ``gated``: the gate passed before; the result keeps which release that was (:attr:`HostResult.gated`).
    Not ``armed`` (a way back the host could not arm): nothing pending is no loss."""
    line = node.record(success, gated) if success is not None and node.record is not None else ""
    with node.result.phase("confirm") as phase:
        lost, recorded = node.remote.ask(provisional.confirm_step(
            service_dir(node.host.service), provisional.timer_unit(node.host.service.name), pending.token, line))
        if recorded:
            node.result.recorded = success
        if lost and (armed or lost != provisional.LOST):
            raise PhaseFailed(f"the switch to {pending.target} was no longer pending: the host reverted by itself "
                              f"or another deploy took over ({lost})")
        if gated:
            node.result.gated = pending.target
        phase.detail = f"{pending.target} kept; " + ("revert disarmed" if armed else "no revert was armed")


def disarm(node: Node, pending: provisional.Pending) -> None:
    """The controller decided the node's end state itself: no revert may act on it later."""
    try:
        node.remote.ask(provisional.confirm_step(service_dir(node.host.service),
                                                 provisional.timer_unit(node.host.service.name), pending.token))
    except KdeployError as exc:
        node.result.log.append(f"could not disarm the host's revert timer: {exc}")


def on_each(nodes: Sequence[Node], step: Callable[[Node], _T]) -> list[_T]:
    """``step`` on every node at once (a single node in this thread), each to its end; then the first failure
    in rank order is raised, a lost link or other error before a failed phase (nothing can be taken back over
    a link that is gone), a failed phase named after its node when the server spans hosts."""
    if len(nodes) == 1:
        return [step(nodes[0])]
    with ThreadPoolExecutor(len(nodes), thread_name_prefix="kdeploy-node") as pool:
        futures = [pool.submit(step, node) for node in nodes]
    failures = [(node, f.exception()) for node, f in zip(nodes, futures, strict=True) if f.exception()]
    for _, exc in failures:
        if not isinstance(exc, PhaseFailed):
            raise exc
    for node, exc in failures:
        assert isinstance(exc, PhaseFailed)
        raise PhaseFailed(f"{node.host.name}: {exc.detail}") from exc
    return [f.result() for f in futures]


def _switch_all(nodes: Sequence[Node], *, restore: bool = False, secrets: bool = True,
                unarmed: set[str] | None = None) -> list[str]:
    """Switch every node to its ``pending.target`` and restart it; returns each node's old run. A single host
    arms its revert in its activation (one round trip). A server of several nodes arms every node first (phase
    ``arm``): a controller killed between two activations then leaves every node to its revert at the one
    deadline, and the node that had not moved yet is started there, its run ended by its head's stop. It restarts
    as SGLang's nodes must: stopped head first (its shutdown broadcast is what a follower's stop waits for), every
    old run gone, then every node started; a follower's old run still waiting for a head would otherwise join the
    new group.

    ``unarmed`` (the way back): a node that refuses its revert (a full disk) is switched without one, and named
    there. It goes to its last confirmed release, where the revert would take it: a server left stopped because
    one node could not write a file would be worse than a way back with no net under that node."""
    def without_revert(n: Node, exc: release.SwitchRefused) -> None:
        if unarmed is None:  # nothing moved on any node yet: the refusal is the whole server's
            raise release.SwitchRefused(f"{n.host.name}: {exc.detail}") if len(nodes) > 1 else exc
        n.result.log.append(f"its revert could not be armed ({exc.detail}): the way back goes on without it")
        unarmed.add(n.host.name)

    def activate(n: Node, *, restart: bool, armed: bool) -> str:
        return switch(n, n.pending.target, n.install_unit or restore, n.pending,
                      secrets=n.secrets if secrets else None, restore=restore, restart=restart, armed=armed)

    if len(nodes) == 1:
        try:
            return [activate(nodes[0], restart=True, armed=True)]
        except release.SwitchRefused as exc:
            without_revert(nodes[0], exc)
            return [activate(nodes[0], restart=True, armed=False)]

    def arm_ahead(n: Node) -> release.SwitchRefused | None:
        try:
            arm(n, n.pending)
        except release.SwitchRefused as exc:
            return exc
        return None

    for n, refusal in zip(nodes, on_each(nodes, arm_ahead), strict=True):
        if refusal is not None:
            without_revert(n, refusal)
    olds = []
    for rank, n in enumerate(nodes):
        try:
            olds.append(activate(n, restart=False, armed=False))
        except release.SwitchRefused as exc:
            raise release.SwitchRefused(f"{n.host.name}: {exc.detail}", first=rank == 0) from exc
    runs = dict(zip((n.host.name for n in nodes), olds, strict=True))
    on_each(nodes, lambda n: _stopped(n, runs[n.host.name]))
    for node in nodes:
        node.remote.ask(systemd.start_step(unit_filename(node.host.service)))
    return olds


def _stopped(node: Node, old: str) -> None:
    """Phase ``stop``: the node's old run is gone (within the unit's TimeoutStopSec and a margin)."""
    timeout = node.host.service.unit.timeout_stop_sec + 60
    with node.result.phase("stop") as phase:
        if not old or node.remote.ask(systemd.gone_step(unit_filename(node.host.service), old, timeout, 0.1)):
            phase.detail = "old run gone; the server's nodes start together"
            return
        raise PhaseFailed(f"the old run {old[:12]} still runs after {timeout:.0f}s")


def _restart_and_gate(node: Node, old: str, verify: bool, target: str, spec: GateSpec,
                      baseline: parity.Baseline | None, peers: gate.Peers | None) -> parity.Record | None:
    """Follow the node's restart, then gate it (its head through its pair, when it has one)."""
    try:
        started = restart_and_follow(node, old, node.host.service.unit.timeout_stop_sec + 60)
    except BaseException:
        if peers is not None:
            peers.failed.set()
        raise
    return gate.run_gate(node.remote, spec, node.result, release=target, started=started,
                         baseline=baseline, peers=peers, pair=node.pair) if verify else None


def _peers(nodes: Sequence[Node]) -> gate.Peers | None:
    return gate.Peers() if len(nodes) > 1 else None


def switch_and_gate(nodes: Sequence[Node], *, verify: bool, success: Result = Result.DEPLOYED) -> Outcome:
    """Switch the server's nodes to their ``pending.target`` (and ``secrets``) provisionally, restart, gate
    (unless not ``verify``), confirm and end ``success``; when any node fails, every node goes back to its
    last confirmed release (``pending.previous``) and secrets. The head (``nodes[0]``) answers the gate's HTTP
    phases, with its ``baseline`` (taken before the switch) for parity; every node shows its own ranks'
    markers."""
    for node in nodes:
        node.result.attempted = node.pending.target
    try:
        olds = dict(zip((n.host.name for n in nodes), _switch_all(nodes), strict=True))
    except release.SwitchRefused as exc:
        if exc.first:  # the first node to switch refused: none switched, the server is as it was
            return refused(nodes, exc.detail)
        return go_back(nodes, exc.detail)
    except (PhaseFailed, RemoteTimeout) as exc:
        return go_back(nodes, getattr(exc, "detail", str(exc)))
    try:
        peers = _peers(nodes)
        records = on_each(nodes, lambda n: _restart_and_gate(n, olds[n.host.name], verify, n.pending.target, n.spec,
                                                             n.baseline, peers))
    except (PhaseFailed, RemoteTimeout) as exc:
        return go_back(nodes, getattr(exc, "detail", str(exc)))
    try:
        on_each(nodes, lambda n: confirm(n, n.pending, success, verify))
    except PhaseFailed as exc:  # a node went back by itself (a reset before confirm): its peers follow it
        if len(nodes) == 1:
            raise
        return go_back(nodes, exc.detail)
    head = nodes[0]
    parity.keep(head.remote, service_dir(head.host.service), head.result, head.pending.target, records[0])
    for node in nodes:
        node.result.finish(success)
    return Confirmed(head.pending.target)


def refused(nodes: Sequence[Node], why: str) -> NotSwitched:
    """No node switched (the first refused): each ends ``preflight_refused`` on its last confirmed release, and
    whatever of the revert was armed is taken away."""
    for node in nodes:
        disarm(node, node.pending)
        node.result.release = node.pending.previous
        node.result.finish(Result.PREFLIGHT_REFUSED, f"{why}; host unchanged")
    return NotSwitched(nodes[0].pending.previous)


def go_back(nodes: Sequence[Node], why: str) -> RolledBack:
    """Every node back to its last confirmed release, gated as it was deployed (``previous_spec``), then disarm
    the reverts. The reverts are re-armed for the rollback's own restart and gate, so a controller that dies
    now still leaves the nodes going back by themselves. Phases are reported as ``rollback <phase>``.

    A node with nothing confirmed (a first deploy) cannot go back, and a server is only whole on one release:
    then every node is stopped or left as ``on_first_deploy_failure`` says, ``rollback_failed``."""
    with ExitStack() as stack:
        phases = [stack.enter_context(n.result.phase("rollback")) for n in nodes]
        if any(n.pending.previous is None for n in nodes):
            for node, phase in zip(nodes, phases, strict=True):
                state = _stop_first_deploy(node)
                disarm(node, node.pending)
                phase.ok = False
                phase.detail = f"first deploy failed ({why}); nothing to roll back to: service {state}"
                node.result.finish(Result.ROLLBACK_FAILED, phase.detail)
            return RolledBack(None, serving=False)
        again = [provisional.new_pending(n.pending.previous, n.pending.previous,
                                         revert_after(n.host, n.previous_spec), n.pending.token) for n in nodes]
        back = [replace(n, pending=p, baseline=None) for n, p in zip(nodes, again, strict=True)]
        try:
            for node in back:
                stack.enter_context(node.result.prefixed("rollback "))
            unarmed: set[str] = set()
            olds = dict(zip((n.host.name for n in back), _switch_all(back, restore=True, secrets=False,
                                                                      unarmed=unarmed), strict=True))
            peers = _peers(back)
            on_each(back, lambda n: _restart_and_gate(
                n, olds[n.host.name], True, n.pending.target, n.previous_spec,
                parity.own_record(n.remote, service_dir(n.host.service), n.previous_spec, n.pending.target)
                if n.previous_spec.serves else None, peers))
            on_each(back, lambda n: confirm(n, n.pending, gated=True, armed=n.host.name not in unarmed))
        except Unreachable:  # the link is gone (a node reset): the caller reconnects, else the nodes go back alone
            raise
        except (PhaseFailed, KdeployError) as exc:
            for node, phase in zip(back, phases, strict=True):
                disarm(node, node.pending)
                phase.ok = False
                phase.detail = (f"gate failed ({why}); rollback to {node.pending.target} FAILED: {exc}; "
                                f"host needs a human: current -> {node.pending.target}, unit of "
                                f"{node.pending.target} installed")
                node.result.release = node.pending.target
                node.result.finish(Result.ROLLBACK_FAILED, phase.detail)
            return RolledBack(back[0].pending.target, serving=False)
        for node, phase in zip(back, phases, strict=True):
            phase.detail = f"gate failed ({why}); back on {node.pending.target}, its gate passed"
            node.result.release = node.pending.target
            node.result.finish(Result.ROLLED_BACK, why)
        return RolledBack(back[0].pending.target, serving=True)


def _stop_first_deploy(node: Node) -> str:
    """A first deploy failed: stop the service (``on_first_deploy_failure: stop``) or leave it; in words."""
    sv = node.host.service
    if sv.on_first_deploy_failure != "stop":
        return "left running as it is"
    restore = (secret.restore_script(service_dir(sv), sv.environment_file)
               if sv.secrets.configured and sv.environment_file else "true")
    node.remote.ask(systemd.disable_and_stop_step(unit_filename(sv), then=restore))
    return "stopped and disabled"
