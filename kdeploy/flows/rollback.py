"""``kdeploy rollback`` of one server (a single host is its one-node case): re-activate an older release
(and its unit) on every node, gated as it was deployed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kdeploy.core import provisional
from kdeploy.core.errors import InvalidInput, KdeployError, PreflightRefused
from kdeploy.core.inventory import HostConfig, Inventory, Server
from kdeploy.core.layout import service_dir
from kdeploy.core.report import Cancelled, HostResult, PhaseFailed, Result
from kdeploy.core.state import HostState
from kdeploy.flows.membership import behind_router
from kdeploy.flows.options import Options, recorded_command
from kdeploy.flows.pairing import pair_for
from kdeploy.flows.record import confirmed_line, finish_command
from kdeploy.flows.session import connect, inventory_spec, lock_and_read, overridden
from kdeploy.flows.switch import Node, Outcome, revert_after, switch_and_gate
from kdeploy.host import lock, parity
from kdeploy.host.pair import Pairing
from kdeploy.ssh.remote import Remote

if TYPE_CHECKING:
    from kdeploy.host.router import RouterClient


@dataclass
class _Held:
    """One node under the rollback's lock: what its end records."""

    host: HostConfig
    result: HostResult
    remote: Remote
    held: lock.HeldLock | None = None
    state: HostState | None = None
    target: str = ""
    recorded: bool = True


def rollback_server(inventory: Inventory, server: Server, opts: Options, results: Mapping[str, HostResult],
                    router: RouterClient | None = None,
                    before_change: Callable[[HostConfig, HostResult, str, str | None], bool] | None = None,
                    to: Mapping[str, str] | None = None) -> None:
    """Every node of ``server`` back to an older release, restarted and gated together as it was deployed;
    drained from ``router`` by its head meanwhile. The release: ``to`` (each node's, the way back of a failed
    canary), else ``--to`` (one node's release id: a single host only), else each node's previous one. Locks
    are taken in rank order. ``before_change(host, result, target, current)``: the pre_host hook, under the
    locks; False ends the server untouched. A node refused (no such release, the hook) gets no history line;
    neither do its peers. This is the one way back of a whole server (``rollback``, a failed canary)."""
    started = time.monotonic()
    command = recorded_command(opts, "rollback")
    if to is None and opts.to_release and server.spans:
        raise InvalidInput(f"rollback --to: {server.name} spans {len(server.nodes)} nodes, each with its own "
                           "release ids: roll it back without --to (to each node's previous release)")
    with ExitStack() as stack:
        nodes = [_Held(inventory.hosts[n], results[n],
                       stack.enter_context(connect(inventory, inventory.hosts[n], results[n], opts.reach)))
                 for n in server.nodes]
        try:
            for node in nodes:
                with node.result.phase("preflight") as phase:
                    node.held, node.state = lock_and_read(node.remote, node.host, opts.lock_wait,
                                                          with_history=True, command=command)
                    node.target = _target(node.host, node.state,
                                          to[node.host.name] if to is not None else opts.to_release)
                    phase.detail = f"{node.state.current} -> {node.target}"
                    if node.state.pending:
                        phase.detail += f" ({node.state.pending.describe()})"
            for node in nodes:
                assert node.state is not None
                if before_change is not None and not before_change(node.host, node.result, node.target,
                                                                   node.state.current):
                    for other in nodes:
                        other.recorded = False
                        if other is not node:
                            other.result.finish(node.result.result, f"server {server.name}: the pre_host hook "
                                                                    f"refused node {node.host.name}")
                    return
            for node in nodes:
                node.result.release = node.target

            def restart(pair: Pairing | None) -> Outcome:  # the reverts' deadline counts from here, not the drain
                contexts = [_node(inventory, n, opts, pair if i == 0 else None, started=started, command=command)
                            for i, n in enumerate(nodes)]
                head = contexts[0]
                return switch_and_gate([head, *(replace(c, pending=c.pending.joined(head.pending))
                                                for c in contexts[1:])], verify=opts.verify, success=Result.RESTORED)

            head = nodes[0]
            with pair_for(inventory, head.host, router, opts.reach) as pair:
                behind_router(head.remote, head.host, head.result, router, threading.Event(), lambda: restart(pair))
        except (InvalidInput, PreflightRefused) as exc:
            for node in nodes:
                node.recorded = False
                node.result.fail(exc)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            for node in nodes:
                node.result.fail(exc)
        finally:
            for node in nodes:
                if node.held is not None:
                    state = node.state
                    keep = {state.current, state.confirmed} if state else set()
                    node.held.release(finish_command(node.host, node.result, started,
                                                     state.releases if state else [], keep=keep, command=command)
                                      if node.recorded and state is not None else "")


def _node(inventory: Inventory, node: _Held, opts: Options, pair: Pairing | None = None, *, started: float,
          command: str) -> Node:
    """The node's part of the switch: its target gated as it was deployed, its parity baseline (the head's)
    the target's own record; ``pair``: the head's partner, when it is a prefill or decode server."""
    state = node.state
    assert state is not None
    fallback = inventory_spec(inventory, node.host, opts.workers, opts.timeout)
    spec = overridden(state.gates.get(node.target, fallback), opts.workers, opts.timeout)
    baseline = parity.baseline(node.remote, service_dir(node.host.service), node.result, spec, node.target,
                               None, pair) if spec.serves else None
    pending = provisional.new_pending(state.confirmed, node.target, revert_after(node.host, fallback))
    return Node(node.remote, node.host, node.result, pending, spec, state.gates.get(state.confirmed or "", fallback),
                baseline=baseline, pair=pair, record=lambda success, gated: confirmed_line(
                    node.host, node.result, started, command=command, success=success, gated=gated))


def _target(host: HostConfig, state: HostState, wanted: str | None) -> str:
    """The release to go back to: ``--to``, else the one before the current."""
    target = wanted or state.previous()
    if not target:
        raise PreflightRefused(f"{host.name}: no older release to roll back to")
    if target not in state.releases:
        raise InvalidInput(f"{host.name}: no release {target!r} (have: {', '.join(state.releases) or 'none'})")
    return target
