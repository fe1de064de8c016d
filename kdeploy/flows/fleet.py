"""Commands over many hosts: bounded parallel fan-out, one report. This is the library API CI jobs call.

    from kdeploy.flows import fleet
    from kdeploy.core import inventory
    report = fleet.push(inventory.load("inventory.yaml"), "all")
    sys.exit(report.exit_code)
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from functools import partial
from pathlib import Path

from kdeploy.core import secrets as secret
from kdeploy.core.defaults import DEFAULT_PARALLEL
from kdeploy.core.errors import InvalidInput, KdeployError, PreflightRefused
from kdeploy.core.gatespec import PayloadGate, gate_spec, load_payload_gate
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.policy import Policy
from kdeploy.core.release import Payload, scan_payload
from kdeploy.core.render import render_unit
from kdeploy.core.report import Cancelled, HostResult, Listener, PhaseFailed, Report, Result
from kdeploy.flows import canary, hooks, settings, views
from kdeploy.flows.membership import admit_serving
from kdeploy.flows.options import Options
from kdeploy.flows.push import HostPush, ServerPush
from kdeploy.flows.rollback import rollback_server
from kdeploy.flows.session import Wanted

HostFn = Callable[[HostConfig, HostResult], None]


def run_parallel(jobs: list[tuple[HostResult, Callable[[], None]]], parallel: int,
                 cancel: threading.Event) -> None:
    """Run each host's job, at most ``parallel`` at once. Ctrl-C stops starting new jobs (they end
    ``interrupted``); jobs already running finish. One host's bug never takes the others down."""

    def one(result: HostResult, job: Callable[[], None]) -> None:
        if cancel.is_set():
            result.fail(Cancelled("not started: interrupted"))
            return
        try:
            job()
        except (KdeployError, PhaseFailed, Cancelled) as exc:
            result.fail(exc)
        except Exception as exc:
            result.traceback = traceback.format_exc()
            result.finish("failed", f"internal error: {type(exc).__name__}: {exc}")

    if not jobs:
        return
    pool = ThreadPoolExecutor(max_workers=max(1, min(parallel, len(jobs))), thread_name_prefix="kdeploy")
    futures = [pool.submit(one, result, job) for result, job in jobs]
    try:
        while not all(f.done() for f in futures):
            wait(futures, timeout=0.2)
    except KeyboardInterrupt:
        cancel.set()
        wait(futures)
    finally:
        pool.shutdown(wait=True)


def fan_out(inventory: Inventory, names: list[str], command: str, fn: HostFn, *, parallel: int = DEFAULT_PARALLEL,
            listener: Listener | None = None, cancel: threading.Event | None = None) -> Report:
    """Run ``fn`` for every host, at most ``parallel`` at once."""
    results = [inventory.result(name, listener) for name in names]
    run_parallel([(r, partial(fn, inventory.hosts[r.host], r)) for r in results], parallel,
                 cancel or threading.Event())
    return Report(command, results)


def interleaved(heads: list[str], role: Callable[[str], str]) -> list[str]:
    """``heads`` with the roles taking turns (prefill, decode, prefill, ...; each role in its own order), so
    that consecutive batches take out servers of every role rather than all of one: the router's
    ``min_serving`` is kept per role. A fleet of one role keeps its order."""
    by_role: dict[str, list[str]] = {}
    for head in heads:
        by_role.setdefault(role(head), []).append(head)
    queues = list(by_role.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def rollout_policy(inventory: Inventory, names: list[str], policy: Policy) -> Policy:
    """The policy a rollout of ``names`` runs with: behind a router, one host at a time unless ``--batch``."""
    return policy.routed() if any(inventory.hosts[n].router for n in names) else policy


def rollout(inventory: Inventory, names: list[str], local: dict[str, Wanted], opts: Options, *, parallel: int,
            listener: Listener | None = None, cancel: threading.Event | None = None,
            command: str = "push", pre_deploy: bool = True) -> Report:
    """Stage on every host in parallel, then restart canary and batches in turn, each gated before the next.

    Behind a router, without ``--batch``, one host at a time (``Policy.routed``). A failing canary stops the
    rollout; more than ``max_fail`` failures stop new batches. Hosts that are
    not started end ``skipped`` with their staged release removed, so they are left as they were. A host
    holds its connection and lock only while one of its passes runs (``HostPush``), so at most
    ``parallel`` hosts are connected at once, however many there are (when all fit in ``parallel``, they
    keep them between the passes). The inventory's ``pre_deploy`` hook runs first (unless ``pre_deploy`` is
    False: the way back of a failed edit), ``pre_host`` right before a host's turn, ``post_host`` once its
    outcome is known.
    """
    cancel = cancel or threading.Event()
    opts = replace(opts, policy=rollout_policy(inventory, names, opts.policy))
    results = {name: inventory.result(name, listener) for name in names}
    refused = _pre_deploy(inventory, command, names, results, cancel) if pre_deploy else None
    if refused is not None:
        return refused
    servers = inventory.servers(names)
    # a server is known by its head (router, analysis, batches); a PD fleet's roles take turns in the batches
    heads = interleaved([server.head for server in servers], lambda h: inventory.hosts[h].service.role)
    try:
        analysis = canary.Analysis.plan(inventory, heads, opts, results, listener, cancel)
        routers = open_routers(inventory, heads, opts, opts.policy.batches(heads, parallel), results)
    except KdeployError as exc:  # refused analysis or router, unreachable router: no host was touched
        for result in results.values():
            result.fail(exc)
        return Report(command, [results[n] for n in names])
    hold = len(names) <= parallel  # every host fits in --parallel: no need to let go between the passes
    steps = {name: HostPush(inventory, inventory.hosts[name], local[name], opts, results[name], cancel,
                            router=routers.get(name), hold=hold)
             for name in names}
    by_head = {s.head: s for s in servers}
    units = {h: ServerPush([steps[n] for n in by_head[h].nodes], by_head[h].name) for h in heads}
    runner = hooks.Runner(inventory, command, cancel)

    def activate(head: str, batch: int) -> None:
        unit = units[head]
        if all(runner.pre_host(step.host, step.result, step.target, step.state.current if step.state else None,
                               batch) for step in unit.nodes):
            unit.activate()
        else:
            unit.skip(f"not restarted: the pre_host hook refused a node of server {unit.name}", "preflight_refused")
            unit.close()
        for step in unit.nodes:
            runner.post_host(step.host, step.result)

    try:
        _rollout(units, results, opts, parallel, cancel, activate, analysis, routers)
        if opts.router_add_missing:  # an unchanged host has no turn, yet it serves: register it if the router lacks it
            run_parallel([(results[n], partial(admit_serving, inventory.hosts[n], results[n], routers[n]))
                          for n in heads if n in routers and results[n].result == Result.UNCHANGED
                          and results[n].router == "out"], parallel, cancel)
    except KeyboardInterrupt:  # between batches: what has not started is skipped, the report still prints
        cancel.set()
        for step in steps.values():
            step.skip("not restarted: interrupted", "interrupted")
    finally:
        run_parallel([(results[n], steps[n].close) for n in names], parallel, threading.Event())
        close_routers(routers)
        run_parallel([(results[n], partial(runner.post_host, s.host, results[n], s.state.current if s.state else None))
                      for n, s in steps.items()], parallel, runner.stop)
    return Report(command, [results[n] for n in names])


def _pre_deploy(inventory: Inventory, command: str, names: list[str], results: dict[str, HostResult],
                cancel: threading.Event) -> Report | None:
    """Run the ``pre_deploy`` hooks before any host is touched; the report of the refused run when one failed."""
    runs, failed = hooks.pre_deploy(inventory, command, names, cancel)
    if failed is None:
        return None
    hooks.refuse_run(list(results.values()), failed)
    return Report(command, [results[n] for n in names], {"pre_deploy": runs})


def open_routers(inventory: Inventory, names: list[str], opts: Options, batches: list[list[str]],
                 results: dict[str, HostResult] | None = None) -> dict:
    """The router client of each host (a server's head) that has one, after the router preflight: every worker
    healthy, each host registered (or ``--router-add-missing``), and ``router.min_serving`` of each role left
    serving while any of ``batches`` is out. A refusal raises (exit 7) before any host is touched. ``results``:
    each gets its host's membership as read here (a host without a turn, e.g. unchanged, keeps it)."""
    configs = {name: config for name in names if (config := inventory.hosts[name].router) is not None}
    if not configs:
        return {}
    from kdeploy.host import router as routing  # httpx: ~60 ms of start-up that a fleet without routers skips

    groups: dict[tuple, list[str]] = {}
    for name, config in configs.items():
        groups.setdefault(routing.key_of(config), []).append(name)
    clients: dict[str, routing.RouterClient] = {}
    try:
        for members in groups.values():
            client = routing.connect(inventory, configs[members[0]], accept_new_host_keys=opts.accept_new_host_keys,
                                     ssh_config=opts.ssh_config)
            clients.update(dict.fromkeys(members, client))
            wanted = {m: str(inventory.hosts[m].worker_url) for m in members}
            workers = client.workers()
            for member in members if results is not None else ():
                results[member].router = "in" if routing.membership(client, inventory.hosts[member], workers).member \
                    else "out"
            roles = {m: inventory.hosts[m].service.role for m in members}
            why = routing.preflight_verdict(workers, wanted, batches, opts.router_add_missing, roles,
                                            configs[members[0]].min_serving)
            if why:
                raise PreflightRefused(f"router {client.label}: preflight refused: {why}")
    except BaseException:
        close_routers(clients)
        raise
    return clients


def close_routers(clients: dict) -> None:
    """Close each router client once (hosts share them)."""
    for client in {id(c): c for c in clients.values()}.values():
        client.close()


def _rollout(units: dict[str, ServerPush], results: dict[str, HostResult], opts: Options,
             parallel: int, cancel: threading.Event, activate: Callable[[str, int], None],
             analysis: canary.Analysis | None = None, routers: dict | None = None) -> None:
    """``units``: each server's push by its head's name; ``activate(head, batch)``: one server's turn in its
    batch (numbered from 1, the canary's first); ``analysis``: the canary analysis, checked once the servers
    to restart are known, before the first."""
    run_parallel([(results[h], u.prepare) for h, u in units.items()], parallel, cancel)
    failed = sum(1 for h, u in units.items() if results[h].done and not u.ok)
    pending = [h for h, u in units.items() if u.pending]
    after = None
    if analysis is not None:
        refused = analysis.before(opts.policy.batches(pending, parallel))
        if refused:  # a required analysis that cannot be done: no host restarts
            for head in pending:
                units[head].skip(refused, "preflight_refused")
            return
        after = partial(analysis.after, previous=lambda head: units[head].confirmed(), routers=routers or {})
    in_batches(pending, results, opts.policy, parallel, cancel, activate,
               lambda head, why, result: units[head].skip(why, result), failed=failed, total=len(units),
               after_canary=after, ok=lambda head: units[head].ok)


def in_batches(names: list[str], results: dict[str, HostResult], policy: Policy, parallel: int,
               cancel: threading.Event, turn: Callable[[str, int], None], skip: Callable[[str, str, str], None],
               *, failed: int = 0, total: int | None = None,
               after_canary: Callable[[list[str], list[str]], str | None] | None = None,
               ok: Callable[[str], bool] | None = None) -> None:
    """The one batch loop of every command that restarts: ``turn(name, batch)`` for the canary alone, then
    each batch (numbered from 1) in parallel, each finished before the next starts. A failed canary stops
    the rest, and so does ``after_canary(canary, rest)`` (the canary analysis) when it says why; more than
    ``max_fail`` failures (of ``total`` hosts, ``failed`` of them already) stop new batches; Ctrl-C stops them
    too. ``skip(name, why, result)`` ends a host that gets no turn; ``ok(name)``: how it ended (its result's,
    unless given: a server is ok only when every node is)."""
    ok = ok or (lambda name: results[name].ok)
    max_fail = policy.failures_allowed(len(names) if total is None else total)
    batches = policy.batches(names, parallel)
    for index, batch in enumerate(batches):
        if cancel.is_set():
            for name in batch:
                skip(name, "not restarted: interrupted", "interrupted")
            continue
        if failed > max_fail:
            for name in batch:
                skip(name, f"not restarted: max-fail exceeded ({failed} failed > {max_fail})", "skipped")
            continue
        run_parallel([(results[n], partial(turn, n, index + 1)) for n in batch], min(len(batch), parallel), cancel)
        batch_failed = sum(1 for n in batch if not ok(n))
        failed += batch_failed
        if index == 0 and policy.canary and batch_failed:
            for name in (n for later in batches[1:] for n in later):
                skip(name, "not restarted: the canary failed", "skipped")
            return
        rest = [n for later in batches[1:] for n in later]
        if index == 0 and policy.canary and after_canary and (why := after_canary(batch, rest)):
            for name in rest:
                skip(name, why, "interrupted" if cancel.is_set() else "skipped")
            return


def prepare(inventory: Inventory, names: list[str], opts: Options | None = None) -> dict[str, Wanted]:
    """Render every unit, hash every payload, decide every gate and read every secret before any host is
    touched (bad input, e.g. a flag value the payload's manifest does not accept or a secret's environment
    variable that is not set, fails here)."""
    opts = opts or Options()
    payloads: dict[Path, tuple[Payload, PayloadGate | None]] = {}
    out = {}
    for name in names:
        host = inventory.hosts[name]
        path = inventory.payload_dir(host)
        if path not in payloads:
            payloads[path] = (scan_payload(path), load_payload_gate(path))
        payload, manifest = payloads[path]
        spec = gate_spec(host.service, manifest, workers=opts.workers, timeout=opts.timeout,
                         place=inventory.server_of(name).place(name))
        out[name] = Wanted(render_unit(inventory, host), payload, spec, secret.resolve(inventory, host))
    return out


def push(inventory: Inventory, target: str | None, opts: Options | None = None, *, dry_run: bool = False,
         parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None,
         cancel: threading.Event | None = None) -> Report:
    """``cancel``: set it (or press Ctrl-C in the main thread) to stop before the next change."""
    opts = opts or Options()
    names = inventory.resolve(target)
    local = prepare(inventory, names, opts)
    if dry_run:
        return fan_out(inventory, names, "plan",
                       lambda host, result: views.plan_host(inventory, host, local[host.name], opts, result),
                       parallel=parallel, listener=listener, cancel=cancel)
    check_rollout(inventory, names, "push", opts.policy)
    report = rollout(inventory, names, local, opts, parallel=parallel, listener=listener, cancel=cancel)
    hooks.post_rollout(inventory, report)
    return report


def check_rollout(inventory: Inventory, names: list[str], command: str, policy: Policy) -> None:
    """Before any host is touched, for every command that restarts: it takes whole servers (a selection of part
    of one is refused, exit 2) and its policy fits the servers selected (a canary or batch counts servers)."""
    policy.check(len(inventory.servers(inventory.whole(names, command))))


def _each(inventory: Inventory, target: str | None, command: str, step: Callable, opts: Options | None,
          parallel: int, listener: Listener | None) -> Report:
    opts = opts or Options()
    return fan_out(inventory, inventory.resolve(target), command,
                   lambda host, result: step(inventory, host, opts, result),
                   parallel=parallel, listener=listener)


def verify(inventory: Inventory, target: str | None, opts: Options | None = None, *,
           parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "verify", views.verify_host, opts, parallel, listener)


def rollback(inventory: Inventory, target: str | None, opts: Options | None = None, *,
             parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    """In the batches of ``opts.policy`` (behind a router without ``--batch``: one host at a time, each drained,
    restarted, gated, admitted), after the router preflight. The inventory's hooks run as for a push:
    ``pre_host`` once the target is known, before the host changes."""
    opts = opts or Options()
    names = inventory.resolve(target)
    check_rollout(inventory, names, "rollback", opts.policy)
    servers = {s.head: s for s in inventory.servers(names)}
    if opts.policy.analysis is not None:
        raise InvalidInput("rollback: --analysis is for push, set-env and set (a rollout to a new release)")
    cancel = threading.Event()
    refused = _pre_deploy(inventory, "rollback", names, {n: inventory.result(n, listener) for n in names}, cancel)
    if refused is not None:
        hooks.post_rollout(inventory, refused)
        return refused
    opts = replace(opts, policy=rollout_policy(inventory, names, opts.policy))
    order = interleaved(list(servers), lambda h: inventory.hosts[h].service.role)
    routers = open_routers(inventory, order, opts, opts.policy.batches(order, parallel))
    runner = hooks.Runner(inventory, "rollback", cancel)
    results = {name: inventory.result(name, listener) for name in names}

    def one(head: str, batch: int) -> None:
        server = servers[head]
        try:
            rollback_server(inventory, server, opts, results, router=routers.get(head),
                            before_change=partial(runner.pre_host, batch=batch))
        except (KdeployError, PhaseFailed, Cancelled) as exc:  # ended here, so that post_host sees the result
            for node in server.nodes:
                results[node].fail(exc)
        for node in server.nodes:
            runner.post_host(inventory.hosts[node], results[node])

    def skip(head: str, why: str, result: str) -> None:
        for node in servers[head].nodes:
            results[node].finish(result, why)
            runner.post_host(inventory.hosts[node], results[node])

    try:
        in_batches(order, results, opts.policy, parallel, cancel, one, skip,
                   ok=lambda head: all(results[n].ok for n in servers[head].nodes))
    except KeyboardInterrupt:
        cancel.set()
        for name, result in results.items():
            if not result.done:
                result.finish("interrupted", "not restarted: interrupted")
                runner.post_host(inventory.hosts[name], result)
    finally:
        close_routers(routers)
    report = Report("rollback", [results[n] for n in names])
    hooks.post_rollout(inventory, report)
    return report


def probe(inventory: Inventory, target: str | None, opts: Options | None = None, *,
          parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "probe", views.probe_host, opts, parallel, listener)


def history(inventory: Inventory, target: str | None, opts: Options | None = None, *,
            parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    return _each(inventory, target, "history", views.history_host, opts, parallel, listener)


def lock(inventory: Inventory, target: str | None, opts: Options | None = None, *, release: bool = False,
         parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    step = partial(views.lock_host, release_it=release)
    return _each(inventory, target, "lock release" if release else "lock status", step, opts, parallel, listener)


def status(inventory: Inventory, target: str | None, opts: Options | None = None, *,
           parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None) -> Report:
    opts = opts or Options()
    names = inventory.resolve(target)
    local = prepare(inventory, names)
    return fan_out(inventory, names, "status",
                   lambda host, result: views.status_host(inventory, host, local[host.name], opts, result),
                   parallel=parallel, listener=listener)


def router(inventory: Inventory, target: str | None, action: str, opts: Options | None = None, *,
           listener: Listener | None = None) -> Report:
    """``kdeploy router admit|drain``: put hosts back in their router (waiting until it lists them healthy),
    or take them out (the restart-free half of a rollout's drain), by hand, one at a time."""
    from kdeploy.host import router as routing

    opts = opts or Options()
    names = inventory.resolve(target)
    without = [n for n in names if inventory.hosts[n].router is None]
    if without:
        raise InvalidInput(f"{', '.join(without)}: no router in the inventory (add a router: section)")
    # the router knows a server by its head: a whole server selected is its head; a follower alone is refused
    if alone := [n for n in names if not inventory.routed(n) and inventory.server_of(n).head not in names]:
        server = inventory.server_of(alone[0])
        raise InvalidInput(f"{', '.join(alone)}: not a server's head: the router knows server {server.name} by its "
                           f"head {server.head} (`kdeploy router {action} {server.name}`)")
    names = [n for n in names if inventory.routed(n)]
    results = []
    for name in names:
        host, result = inventory.hosts[name], inventory.result(name, listener)
        results.append(result)
        assert host.router is not None and host.worker_url is not None
        try:
            with routing.connect(inventory, host.router, accept_new_host_keys=opts.accept_new_host_keys,
                                 ssh_config=opts.ssh_config) as client, \
                    result.phase(action) as phase:
                if action == "admit":
                    client.add(host.worker_url, body=routing.registration(host))
                    result.router, phase.detail = "in", f"{host.worker_url} healthy in the router"
                else:
                    was_in = client.remove(host.worker_url)
                    result.router = "out"
                    phase.detail = f"{host.worker_url} {'removed from' if was_in else 'was not in'} the router"
                    if not was_in:  # a worker_url that does not match what the router lists looks the same
                        listed = ", ".join(w.url for w in client.workers()) or "none"
                        phase.detail += f" (it lists: {listed}; check router.worker_url)"
            result.finish("ok")
        except KdeployError as exc:
            result.fail(exc)
    return Report(f"router {action}", results)


def changed_hosts(old: Inventory, new: Inventory) -> list[str]:
    """Hosts whose rendered unit or payload an inventory edit changes, with every node of their servers: the
    only ones to roll out to."""
    changed = {name for name, host in new.hosts.items()
               if name not in old.hosts or render_unit(old, old.hosts[name]) != render_unit(new, host)
               or old.payload_dir(old.hosts[name]) != new.payload_dir(host)}
    changed |= {n for s in new.servers(sorted(changed)) for n in s.nodes}
    return [name for name in new.hosts if name in changed]


def check_edit(edit: settings.Edit) -> dict[str, Wanted]:
    """What the edit's rollout computes locally (units, payload hashes) for the hosts it changes, before the
    file is written: a value that validates but cannot be pushed (a missing payload) fails here."""
    return prepare(edit.new, changed_hosts(edit.old, edit.new))


def apply_edit(edit: settings.Edit, local: dict[str, Wanted], command: str, opts: Options | None = None, *,
               parallel: int = DEFAULT_PARALLEL, listener: Listener | None = None,
               cancel: threading.Event | None = None) -> Report:
    """Write an inventory edit and push it to the hosts it changes (``local``, from ``check_edit``); a failed
    rollout reverts the edit.

    The revert undoes this edit's keys on the file as it is then, so what others changed meanwhile survives
    (a key they changed too is theirs: left, and named under ``conflicts``). Hosts that took the new config
    are then pushed the old one again, so inventory and hosts agree.
    """
    opts = opts or Options()
    names = list(local)
    check_rollout(edit.new, names, command, opts.policy)  # before the file is written
    facts: dict = {"inventory": {"path": str(edit.path), "level": edit.level, "diff": edit.diff(),
                                 "rolled_out_to": names, "reverted": False}}
    settings.write(edit)
    if not names:
        return Report(command, [], facts)
    report = rollout(edit.new, names, local, opts, parallel=parallel, listener=listener,
                     cancel=cancel or threading.Event(), command=command)
    facts.update(report.extra)  # the pre_deploy runs
    report.extra = facts
    if not report.ok:
        _revert(edit, report, opts, parallel, listener)
    hooks.post_rollout(edit.new, report)
    return report


def _revert(edit: settings.Edit, report: Report, opts: Options, parallel: int, listener: Listener | None) -> None:
    """A failed edit's way back: the file, then the hosts that took the new config, in a rollout of their own
    (its hooks run with the command ``<command> revert``; the post_rollout hook runs once, after it)."""
    facts = report.extra
    try:
        conflicts = settings.revert(edit)
    except (KdeployError, OSError) as exc:  # the file was made unreadable, is being written, the disk is full
        facts["inventory"]["conflicts"] = [f"the edit could not be reverted: {exc}"]
    else:
        facts["inventory"].update(reverted=True, conflicts=conflicts)
    moved = [h.host for h in report.hosts if h.result == Result.DEPLOYED]
    if moved:
        # Its own cancel state: the Ctrl-C that stopped the rollout must not stop the way back (a new one
        # does). No canary or max-fail either: every host that moved goes back.
        back_opts = replace(opts, policy=replace(opts.policy, canary=0, max_fail=None, analysis=None))
        try:
            names = edit.old.resolve(",".join(moved))
            back = rollout(edit.old, names, prepare(edit.old, names, back_opts), back_opts, parallel=parallel,
                           listener=listener, cancel=threading.Event(), command=f"{report.command} revert",
                           pre_deploy=False).hosts
        except KdeployError as exc:  # the old payload or template is gone or unreadable by now
            back = [HostResult(name).finish("failed", str(exc)) for name in moved]
        facts["inventory"]["restored_hosts"] = {h.host: h.result for h in back}
        for host, restored in zip(moved, back, strict=True):
            match = next(h for h in report.hosts if h.host == host)
            match.restored = restored.result
            match.release = restored.release or match.release  # what the host runs after the command
            if not restored.ok:
                match.finish("rollback_failed", f"put back to the old config failed: {restored.error}")
