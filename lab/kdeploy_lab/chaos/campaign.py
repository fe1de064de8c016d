"""One fault campaign: iterations drawn from a seed (:mod:`.plan`), each a kdeploy command run as a child process
with a fault fired at a moment of its run (:mod:`.faults`), then the invariants read out of band once every
host-side deadline has passed (:mod:`.invariants`), then a plain push that must converge. docs/chaos.md.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ruamel.yaml import YAML

from kdeploy_lab.chaos import invariants as inv
from kdeploy_lab.chaos.controller import Controller
from kdeploy_lab.chaos.faults import Injector
from kdeploy_lab.chaos.fleet import READMIT_AFTER, REVERT_AFTER, SERVERS, SERVICE, Fleet
from kdeploy_lab.chaos.plan import (
    CONTROLLER_FAULTS,
    KILLS_IN_FLIGHT,
    PHASE_MOMENT,
    RELEASE_FAULTS,
    Iteration,
    anchor,
    moment,
    windows,
)
from kdeploy_lab.traffic import Traffic

THREADS = 4  # the traffic client's streams: at most this many requests are in flight at once
CONTROLLER_WAIT = 300.0  # a controller still running after this long (a signal's rollback included) is hung
SETTLE_WAIT = REVERT_AFTER + READMIT_AFTER + 90.0  # every host-side deadline, and the way back's own run
# Seconds each command takes on the campaign's fleet, until one run was measured (then: the median of its runs).
FIRST_ESTIMATE = {"push": 10.0, "set-env": 10.0, "set": 10.0, "rollback": 10.0, "canary": 25.0, "noop": 1.0,
                  "two-controllers": 10.0}


@dataclass
class Outcome:
    """What one iteration did and found."""

    it: Iteration
    moment: str
    delay: float | None  # seconds after the start at which the fault fired (None: a release fault or none)
    exits: list[int | None]
    results: list[dict[str, str]]
    seconds: float  # the command's run (the first controller's)
    violations: list[str]
    lost: int  # requests that failed
    lost_apart: int  # of those, the ones a host- or router-killing fault may take (bounded)
    requests: int  # sent (refused connections aside)
    refused: int  # connections refused (the router down), retried by the client
    settle: float  # seconds until every host-side deadline had passed
    missed: str | None = None  # the fault could not be injected (the lab's failure, not kdeploy's)
    journals: dict[str, str] = field(default_factory=dict)  # host -> journal lines, for a violation's case

    def as_json(self) -> dict:
        return {"iteration": self.it.index, **self.it.as_json(), "moment": self.moment, "delay": self.delay,
                "exits": self.exits, "results": self.results, "seconds": round(self.seconds, 2),
                "violations": self.violations, "lost": self.lost, "lost_apart": self.lost_apart,
                "requests": self.requests, "refused": self.refused, "settle": round(self.settle, 1),
                "missed": self.missed}


def release_moment(fault: str, failed: str | None) -> str:
    """Where a release-borne fault hit: the phase kdeploy caught it in; a release that ignores SIGTERM passes its
    gate and hits at its stop, the next restart's."""
    if failed is not None:
        return PHASE_MOMENT.get(failed.rpartition(" ")[2], failed)
    return "restart" if fault == "ignore-sigterm" else "gate"


def _yaml() -> YAML:
    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def prepare(fleet: Fleet, it: Iteration) -> list[list[str]]:
    """Edit the payload and the inventory for the iteration's command (its release fault in the env of its
    server's nodes); the argv of the controller(s) it runs."""
    fleet.reset_inventory()
    change = f"{it.seed}/{it.index}/{it.value}\n"
    if it.fault in RELEASE_FAULTS:
        yaml = _yaml()
        doc = yaml.load(fleet.inventory.read_text())
        env = {**doc["defaults"]["service"]["env"], **RELEASE_FAULTS[it.fault]}
        doc["groups"]["chaos_fault"] = {"hosts": list(it.nodes), "service": {"env": env}}
        with fleet.inventory.open("w") as fh:
            yaml.dump(doc, fh)
    roll = ["--batch", "1"]
    if it.command in ("push", "canary", "two-controllers"):
        (fleet.payload / "chaos_rev.txt").write_text(change)
    if it.command == "push":
        return [["push", "all", *roll]]
    if it.command == "canary":
        return [["push", "all", "--canary", "1", "--analysis", "10s", *roll]]
    if it.command == "two-controllers":
        return [["push", "all", *roll], ["push", "all", *roll]]
    if it.command == "set-env":
        return [["set-env", f"CHAOS_GEN={it.value}", *roll]]
    if it.command == "set":
        return [["set", f"sglang.mem_fraction_static=0.{80 + it.value % 19:02d}", *roll]]
    if it.command == "rollback":
        return [["rollback", "all", *roll]]
    return [["push", "all", *roll]]  # noop: nothing changed since the last convergence


def facts(fleet: Fleet) -> dict[str, inv.HostFacts]:
    names = [h.name for h in fleet.hosts]
    return dict(zip(names, _parallel(lambda n: inv.read_host(fleet.box, n, fleet.service_dir, SERVICE), names),
                    strict=True))


def _parallel(fn, items: list) -> list:  # type: ignore[no-untyped-def]
    out: list = [None] * len(items)

    def one(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def settle(fleet: Fleet) -> tuple[dict[str, inv.HostFacts], bool]:
    """Poll the hosts until every host-side deadline has passed (or SETTLE_WAIT is over)."""
    deadline = time.monotonic() + SETTLE_WAIT
    while True:
        now = facts(fleet)
        ok = all(isinstance(f, inv.HostFacts) and inv.settled(f) for f in now.values())
        if ok or time.monotonic() > deadline:
            return now, ok
        time.sleep(1.0)


def check(fleet: Fleet, now: dict[str, inv.HostFacts]) -> list[str]:
    """The invariants over settled hosts and the router."""
    out: list[str] = []
    for name, f in now.items():
        out += inv.host_violations(f) if isinstance(f, inv.HostFacts) else [f"{name}: cannot be read: {f}"]
    for server, nodes in SERVERS.items():
        if all(isinstance(now[n], inv.HostFacts) for n in nodes):
            out += inv.server_violations(server, [now[n] for n in nodes])
    heads = fleet.heads()
    serving = {url for server, url in heads.items() if inv.serves(url)
               and all(isinstance(now[n], inv.HostFacts) and now[n].state == "active" for n in SERVERS[server])}
    out += _router(fleet, serving)
    return out


def _router(fleet: Fleet, serving: set[str]) -> list[str]:
    """The router's list against the serving heads; it may take one health round to see a server come back."""
    deadline = time.monotonic() + 20
    while True:
        try:
            found = inv.router_violations(inv.router_workers(fleet.router_url), serving)
        except Exception as exc:
            found = [f"router: /workers cannot be read: {exc}"]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def journals(fleet: Fleet, since: str) -> dict[str, str]:
    out = {}
    for h in [*fleet.hosts, fleet.router_host]:
        try:
            out[h.name] = fleet.box.exec(h.name, ["journalctl", "--no-pager", "-o", "short-precise", "--since",
                                                  since], check=False, timeout=60).stdout
        except Exception as exc:
            out[h.name] = f"cannot read the journal: {exc}"
    return out


class Campaign:
    """The iterations on one fleet, with what they measured so far (each command's durations and moments)."""

    def __init__(self, fleet: Fleet, traffic: Traffic) -> None:
        self.fleet, self.traffic = fleet, traffic
        self.durations: dict[str, list[float]] = {}
        self.windows: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}  # (command, head) -> moment windows

    def estimate(self, command: str) -> float:
        seen = self.durations.get(command)
        return statistics.median(seen) if seen else FIRST_ESTIMATE[command]

    def aim(self, it: Iteration) -> tuple[str | None, float]:
        """Where the fault fires: (the moment it is anchored on, None for the command's start; seconds after
        that). "anywhere" is within the command's measured duration; a moment within its window as the last run
        of this command measured it on the server's head (at its very start before one was measured)."""
        if it.aim == "anywhere":
            return None, round(it.at * self.estimate(it.command), 3)
        start, end = self.windows.get((it.command, it.nodes[0]), {}).get(it.aim, (0.0, 0.0))
        return it.aim, round(it.at * max(0.0, end - start), 3)

    @staticmethod
    def wait_for(run: Controller, head: str, aim: tuple[str | None, float]) -> None:
        """Until the aimed time (its moment's start on ``head``, as its line arrives, then the offset), or the
        run's end, whichever comes first."""
        on, offset = aim
        while run.proc.poll() is None:
            began = 0.0 if on is None else anchor(run.starts.get(head, []), on)
            if began is not None and time.monotonic() - run.started >= began + offset:
                return
            time.sleep(0.002)

    def run(self, it: Iteration, delay: float | None = None) -> Outcome:
        """One iteration; ``delay`` replays a recorded firing time (seconds after the start) instead of its aim."""
        fleet = self.fleet
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        before = Counter(self.traffic.codes)
        argvs = prepare(fleet, it)
        injector = Injector(fleet, it)
        fires = it.fault not in RELEASE_FAULTS and it.fault != "none"
        aim = (None, delay) if delay is not None else self.aim(it)
        violations: list[str] = []
        missed: str | None = None
        runs = [Controller.start(fleet.inventory, argv) for argv in argvs]
        first = runs[0]
        try:
            if fires:
                self.wait_for(first, it.nodes[0], aim)
                if first.proc.poll() is not None and first.ended is None:
                    first.ended = time.monotonic() - first.started
                hit = time.monotonic() - first.started
                try:
                    injector.fire([r.proc for r in runs])
                except Exception as exc:  # the harness failed (a host that would not boot again): said apart
                    missed = f"{it.fault} could not be injected: {exc}"
            else:
                where, hit = "none", 0.0
            exits = [r.wait(CONTROLLER_WAIT) for r in runs]
            if fires:  # named once the run ended: whether the head's part was over then is known only now
                where = moment(first.starts.get(it.nodes[0], []), hit, first.ended_for(it.nodes[0]))
            if it.fault in RELEASE_FAULTS:  # it hits when the release starts (or, ignoring SIGTERM, stops)
                caught = [f for r in runs if (f := r.failed_phase(it.nodes))]  # of two controllers, the one that
                later = [f for f in caught if release_moment(it.fault, f) not in ("before-lock", "staging")]
                where = release_moment(it.fault, (later or caught or [None])[0])  # switched, not the one locked out
        finally:
            for r in runs:
                if r.proc.poll() is None:
                    r.proc.kill()
            injector.heal()
        for r, code in zip(runs, exits, strict=True):
            if code is None:
                violations.append(f"controller `kdeploy {' '.join(r.argv)}` still ran after {CONTROLLER_WAIT:.0f}s")
            elif r.crashed():
                violations.append(f"controller `kdeploy {' '.join(r.argv)}` ended with an internal error: "
                                  + " | ".join(r.stderr[-3:]))
        if it.fault not in CONTROLLER_FAULTS and it.fault not in RELEASE_FAULTS and all(c is not None for c in exits):
            self.durations.setdefault(it.command, []).append(first.ended or 0.0)
            for head in {nodes[0] for nodes in SERVERS.values()}:
                if first.starts.get(head):
                    self.windows[(it.command, head)] = windows(first.starts[head], first.ended_for(head) or 0.0)
        started_settle = time.monotonic()
        now, ok = settle(fleet)
        settle_s = time.monotonic() - started_settle
        if not ok:
            violations.append(f"hosts not settled {SETTLE_WAIT:.0f}s after the run: " + "; ".join(
                f"{n}: pending={f.pending} timers={' '.join(f.timers)} lock={f.lock_held} state={f.state}"
                for n, f in now.items() if isinstance(f, inv.HostFacts) and not inv.settled(f)))
        violations += check(fleet, now)
        violations += self.converge()
        after = Counter(self.traffic.codes) - before
        requests = sum(after.values())
        refused = after.get("ConnectError", 0)  # never sent: the router was down (router-restart)
        lost = requests - after.get(200, 0) - refused
        apart = min(lost, THREADS) if injector.killed_host and it.fault in KILLS_IN_FLIGHT else 0
        if lost > apart:
            violations.append(f"traffic: {lost} of {requests} requests failed ({dict(after)}), "
                              f"{apart} allowed to this fault")
        out = Outcome(it, where, round(hit, 3) if fires else None, exits, [r.results() for r in runs],
                      first.ended or 0.0, violations, lost, apart, requests - refused, refused, settle_s, missed)
        if violations:
            out.journals = journals(fleet, since)
            out.journals["controller"] = "\n".join(line for r in runs for line in r.stderr)
        return out

    def converge(self) -> list[str]:
        """A plain push of the campaign's inventory converges (exit 0) and verify passes; then no staging is left
        and the router lists exactly the serving heads."""
        fleet = self.fleet
        fleet.reset_inventory()
        out = []
        push = Controller.start(fleet.inventory, ["push", "all", "--batch", "1"])
        code = push.wait(CONTROLLER_WAIT)
        if code != 0:
            out.append(f"convergence: push exited {code}: {push.results()} " + " | ".join(push.stderr[-2:]))
            # the next iteration starts clean (a server left out of the router included), not counted
            again = Controller.start(fleet.inventory, ["push", "all", "--batch", "1", "--router-add-missing"])
            again.wait(CONTROLLER_WAIT)
        verify = Controller.start(fleet.inventory, ["verify", "all"])
        if (code := verify.wait(CONTROLLER_WAIT)) != 0:
            out.append(f"convergence: verify exited {code}: {verify.results()}")
        now = facts(fleet)
        out += inv.staging_violations([f for f in now.values() if isinstance(f, inv.HostFacts)])
        out += _router(fleet, {url for url in fleet.heads().values() if inv.serves(url)})
        return out

