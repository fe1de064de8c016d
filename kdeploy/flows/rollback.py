"""``kdeploy rollback`` on one host: re-activate an older release (and its unit), gated as it was deployed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kdeploy.core import provisional
from kdeploy.core.errors import InvalidInput, KdeployError, PreflightRefused
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.layout import service_dir
from kdeploy.core.report import Cancelled, HostResult, PhaseFailed, Result
from kdeploy.core.state import HostState
from kdeploy.flows.membership import behind_router
from kdeploy.flows.options import Options, recorded_command
from kdeploy.flows.record import finish_command
from kdeploy.flows.session import connect, inventory_spec, lock_and_read, overridden
from kdeploy.flows.switch import Outcome, revert_after, switch_and_gate
from kdeploy.host import lock, parity

if TYPE_CHECKING:
    from kdeploy.host.router import RouterClient


def rollback_host(inventory: Inventory, host: HostConfig, opts: Options, result: HostResult,
                  router: RouterClient | None = None,
                  before_change: Callable[[str, str | None], bool] | None = None) -> None:
    """Re-activate an older release (and its unit), restart and gate it as it was deployed; drained from
    ``router`` meanwhile. ``before_change(target, current)``: the pre_host hook, under the lock; False ends
    the host (its result set) untouched. A host refused (no such release, the hook) gets no history line."""
    started = time.monotonic()
    with connect(inventory, host, result, opts.reach) as remote:
        held: lock.HeldLock | None = None
        state: HostState | None = None
        recorded = True
        try:
            with result.phase("preflight") as phase:
                held, state = lock_and_read(remote, host, opts.lock_wait, with_history=True,
                                            command=recorded_command(opts, "rollback"))
                target = _target(host, state, opts.to_release)
                phase.detail = f"{state.current} -> {target}"
                if state.pending:
                    phase.detail += f" ({state.pending.describe()})"
            if before_change is not None and not before_change(target, state.current):
                recorded = False
                return
            result.release = target
            fallback = inventory_spec(inventory, host, opts.workers, opts.timeout)
            previous = state.confirmed
            read = state

            def restart() -> Outcome:  # the revert's deadline counts from here, not from before the drain
                spec = overridden(read.gates.get(target, fallback), opts.workers, opts.timeout)
                baseline = parity.baseline(remote, service_dir(host.service), result, spec, target, None)
                return switch_and_gate(remote, host, result, verify=opts.verify, target=target, install_unit=True,
                                       pending=provisional.new_pending(previous, target, revert_after(host, fallback)),
                                       spec=spec, previous_spec=read.gates.get(previous or "", fallback),
                                       success=Result.RESTORED, baseline=baseline)

            behind_router(remote, host, result, router, threading.Event(), restart)
        except (InvalidInput, PreflightRefused) as exc:
            recorded = False
            result.fail(exc)
        except (PhaseFailed, KdeployError, Cancelled) as exc:
            result.fail(exc)
        finally:
            if held is not None:
                keep = {state.current, state.confirmed} if state else set()
                held.release(finish_command(host, result, started, state.releases if state else [], keep=keep,
                                            command=recorded_command(opts, "rollback"))
                             if recorded and state is not None else "")


def _target(host: HostConfig, state: HostState, wanted: str | None) -> str:
    """The release to go back to: ``--to``, else the one before the current."""
    target = wanted or state.previous()
    if not target:
        raise PreflightRefused(f"{host.name}: no older release to roll back to")
    if target not in state.releases:
        raise InvalidInput(f"{host.name}: no release {target!r} (have: {', '.join(state.releases) or 'none'})")
    return target
