"""Commands over many hosts: bounded parallel fan-out, one report. This is the library API CI jobs call.

    from kdeploy import fleet, inventory
    report = fleet.push(inventory.load("inventory.yaml"), "all")
    sys.exit(report.exit_code)
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path

from kdeploy import deploy, inventory, settings
from kdeploy.deploy import Local, Options
from kdeploy.errors import KdeployError
from kdeploy.inventory import HostConfig, Inventory
from kdeploy.release import Payload, scan_payload
from kdeploy.render import render_unit
from kdeploy.report import Cancelled, HostResult, Listener, PhaseFailed, Report

DEFAULT_PARALLEL = 16

HostFn = Callable[[HostConfig, HostResult], None]


def fan_out(inventory: Inventory, names: list[str], command: str, fn: HostFn, *, parallel: int = DEFAULT_PARALLEL,
            listener: Listener | None = None, cancel: threading.Event | None = None) -> Report:
    """Run ``fn`` for every host, at most ``parallel`` at once; Ctrl-C stops starting new hosts."""
    cancel = cancel or threading.Event()
    results = [HostResult(name, listener=listener) for name in names]

    def one(result: HostResult) -> None:
        if cancel.is_set():
            result.finish("skipped", "not started: interrupted")
            return
        try:
            fn(inventory.hosts[result.host], result)
        except (KdeployError, PhaseFailed, Cancelled) as exc:
            result.fail(exc)
        except Exception as exc:  # one host's bug must not take the others down
            result.data["traceback"] = traceback.format_exc()
            result.finish("failed", f"internal error: {type(exc).__name__}: {exc}")

    pool = ThreadPoolExecutor(max_workers=max(1, min(parallel, len(results))), thread_name_prefix="kdeploy")
    futures = [pool.submit(one, r) for r in results]
    try:
        while futures and not all(f.done() for f in futures):
            wait(futures, timeout=0.2)
    except KeyboardInterrupt:
        cancel.set()
        wait(futures)
    finally:
        pool.shutdown(wait=True)
    return Report(command, results)


def prepare(inventory: Inventory, names: list[str]) -> dict[str, Local]:
    """Render every unit and hash every payload before any host is touched (bad input fails here)."""
    payloads: dict[Path, Payload] = {}
    out = {}
    for name in names:
        host = inventory.hosts[name]
        path = inventory.payload_dir(host)
        if path not in payloads:
            payloads[path] = scan_payload(path)
        out[name] = Local(render_unit(inventory, host), payloads[path])
    return out


def push(inventory: Inventory, target: str | None, opts: Options | None = None, *, dry_run: bool = False,
         parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    opts = opts or Options()
    names = inventory.resolve(target)
    local = prepare(inventory, names)
    step = deploy.plan_host if dry_run else deploy.push_host
    return fan_out(inventory, names, "plan" if dry_run else "push",
                   lambda host, result: step(inventory, host, local[host.name], opts, result),
                   parallel=parallel, listener=listener, cancel=opts.cancel)


def _each(inventory: Inventory, target: str | None, command: str, step: Callable, opts: Options | None,
          parallel: int, listener: Listener | None) -> Report:
    opts = opts or Options()
    return fan_out(inventory, inventory.resolve(target), command,
                   lambda host, result: step(inventory, host, opts, result),
                   parallel=parallel, listener=listener, cancel=opts.cancel)


def verify(inventory: Inventory, target: str | None, opts: Options | None = None, *,
           parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "verify", deploy.verify_host, opts, parallel, listener)


def rollback(inventory: Inventory, target: str | None, opts: Options | None = None, *,
             parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "rollback", deploy.rollback_host, opts, parallel, listener)


def history(inventory: Inventory, target: str | None, opts: Options | None = None, *,
            parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "history", deploy.history_host, opts, parallel, listener)


def lock(inventory: Inventory, target: str | None, opts: Options | None = None, *, release: bool = False,
         parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    step = partial(deploy.lock_host, release_it=release)
    return _each(inventory, target, "lock release" if release else "lock status", step, opts, parallel, listener)


def status(inventory: Inventory, target: str | None, opts: Options | None = None, *,
           parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    opts = opts or Options()
    names = inventory.resolve(target)
    local = prepare(inventory, names)
    return fan_out(inventory, names, "status",
                   lambda host, result: deploy.status_host(inventory, host, local[host.name], opts, result),
                   parallel=parallel, listener=listener, cancel=opts.cancel)


def changed_hosts(old: Inventory, new: Inventory) -> list[str]:
    """Hosts whose rendered unit or payload an inventory edit changes: the only ones to roll out to."""
    return [name for name, host in new.hosts.items()
            if name not in old.hosts or render_unit(old, old.hosts[name]) != render_unit(new, host)
            or old.payload_dir(old.hosts[name]) != new.payload_dir(host)]


def apply_edit(edit: settings.Edit, command: str, opts: Options | None = None, *, parallel: int = DEFAULT_PARALLEL,
               listener: Listener | None = None) -> Report:
    """Write an inventory edit and push it to the hosts it changes; a failed rollout reverts the edit.

    Hosts that took the new config are then pushed the old one again, so inventory and hosts agree.
    """
    opts = opts or Options()
    old = inventory.parse(inventory.read_raw(edit.path), edit.path)
    settings.write(edit)
    new = inventory.load(edit.path)
    names = changed_hosts(old, new)
    facts: dict = {"inventory": {"path": str(edit.path), "level": edit.level, "diff": edit.diff(),
                                 "rolled_out_to": names, "reverted": False}}
    if not names:
        return Report(command, [], facts)
    report = push(new, ",".join(names), opts, parallel=parallel, listener=listener)
    report.command, report.extra = command, facts
    if report.ok:
        return report
    settings.write(edit, edit.before)
    facts["inventory"]["reverted"] = True
    moved = [h.host for h in report.hosts if h.result == "deployed"]
    if moved:
        back = push(old, ",".join(moved), opts, parallel=parallel, listener=listener)
        facts["inventory"]["restored_hosts"] = {h.host: h.result for h in back.hosts}
        for host, restored in zip(moved, back.hosts, strict=True):
            match = next(h for h in report.hosts if h.host == host)
            match.data["restored"] = restored.result
            if not restored.ok:
                match.finish("rollback_failed", f"put back to the old config failed: {restored.error}")
    return report
