"""What one iteration of a fault campaign does, drawn from its seed alone: the command, the fault, where and when.

Every draw comes from ``random.Random(f"{seed}/{index}")``, so iteration ``index`` of campaign ``seed`` is the same
whatever ran before it: a violation replays from (seed, iteration) without running the iterations before it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

# The commands an iteration runs (docs/chaos.md "Commands").
COMMANDS = ("push", "set-env", "set", "rollback", "canary", "noop", "two-controllers")
# Those that make a new release (a release-borne fault rides on it).
NEW_RELEASE = frozenset({"push", "set-env", "set", "canary", "two-controllers"})

# The catalogue (docs/chaos.md "Faults"): the controller's, a host's, the new release's, the router's, and none.
CONTROLLER_FAULTS = ("sigkill", "sigint", "sigterm")
HOST_FAULTS = ("blackhole", "reset", "disk-full", "sshd-stop")
RELEASE_FAULTS = {  # the reference server's switches (docs/sandbox.md) the new release carries in its unit
    "crash-at-start": {"REFSERVER_DIE_RANK": "1"},  # one worker dies once loaded: the server fails to start
    "crash-loop": {"REFSERVER_EXIT_AT_START": "3"},  # exits at once, every restart
    "ignore-sigterm": {"REFSERVER_IGNORE_SIGTERM": "1"},  # stops only when systemd kills it (the next restart)
    "perturbed-output": {"REFSERVER_WRONG_ANSWER": "1"},  # serves, with a wrong answer
}
FAULTS = ("none", *CONTROLLER_FAULTS, *HOST_FAULTS, *RELEASE_FAULTS, "router-restart")
# Faults that kill requests in flight (on a host, or at the router): those count apart, bounded (docs/chaos.md).
KILLS_IN_FLIGHT = frozenset({"reset", "blackhole", "router-restart"})

# Where in a command's run a fault lands: the phase the target server's head was in (its last `start` line).
MOMENTS = ("before-lock", "staging", "switch", "restart", "gate", "confirm", "router-readmit", "rollback", "after")
PHASE_MOMENT = {
    "connect": "before-lock", "pre_host": "before-lock", "check": "before-lock",
    "preflight": "staging", "probe": "staging", "stage": "staging", "resume": "staging", "relock": "staging",
    "parity-baseline": "staging",
    "drain": "switch", "arm": "switch", "activate": "switch", "stop": "switch",
    "restart": "restart", "unit": "restart",
    "workers": "gate", "ready": "gate", "completion": "gate", "parity": "gate", "journal": "gate",
    "analysis": "gate", "status": "gate",
    "confirm": "confirm",
    "admit": "router-readmit", "router": "router-readmit",
    "rollback": "rollback",
    "post_host": "after",
}


def moment_of(phase: str) -> str:
    """The moment of a phase: a failed gate's way back (``rollback activate``, ...) is the rollback's."""
    return PHASE_MOMENT.get(phase) or ("rollback" if phase.startswith("rollback ") else phase)


# Where a fault is aimed: "anywhere" is uniform over the command's measured duration; a moment is anchored on the
# head's first phase of that moment as it starts, then uniform over that moment's window as the command's last run
# on the same server measured it (a confirm lasts milliseconds: aimed at so, it is hit; drawn uniformly over a 10 s
# run, almost never).
AIMED = ("before-lock", "staging", "switch", "restart", "gate", "confirm", "router-readmit")
# Moments only a command that switches a release passes through.
SWITCHING = frozenset({"switch", "restart", "gate", "confirm", "router-readmit"})
FIRING = (*CONTROLLER_FAULTS, *HOST_FAULTS, "router-restart")  # fired by the campaign, at an aim
# Each cycle of DECK iterations deals every firing fault at every aim once, and each release-borne fault and the
# control three times, in an order shuffled per cycle: 200 iterations hit each fault kind at each moment it can
# hit, where independent draws would leave cells empty by chance.
DECK = (*((f, a) for f in FIRING for a in ("anywhere", *AIMED)),
        *((f, "anywhere") for f in (*RELEASE_FAULTS, "none") for _ in range(3)))


@dataclass(frozen=True)
class Iteration:
    """One iteration's draw. ``aim``: the moment the fault is aimed at (:data:`AIMED`, or "anywhere"); ``at``:
    where in that moment's window (or in the command's measured duration, for "anywhere") it fires, as a share of it;
    ``hold``: seconds a held fault (blackhole, disk-full, sshd-stop) lasts; ``server``: the server the fault and
    a release fault's env hit (its nodes: ``nodes``, the head first); ``host``: the node a host fault hits;
    ``value``: the command's new setting (set-env, set), so each run is a change."""

    seed: int
    index: int
    command: str
    fault: str
    server: str
    nodes: tuple[str, ...]
    host: str
    aim: str
    at: float
    hold: float
    value: int

    def as_json(self) -> dict:
        return {**asdict(self), "nodes": list(self.nodes)}


def commands_for(fault: str, aim: str) -> list[str]:
    """The commands that can carry ``fault`` to ``aim``: a release-borne fault needs a new release, a switching
    moment a command that switches (a rollback too)."""
    if fault in RELEASE_FAULTS:
        return [c for c in COMMANDS if c in NEW_RELEASE]
    if aim in SWITCHING:
        return [c for c in COMMANDS if c in NEW_RELEASE or c == "rollback"]
    return list(COMMANDS)


def draw(seed: int, index: int, servers: dict[str, tuple[str, ...]]) -> Iteration:
    """Iteration ``index`` of campaign ``seed`` over ``servers`` (name -> nodes, the head first): its fault and aim
    dealt from its cycle's deck (shuffled by the seed and the cycle alone), the rest drawn from (seed, index)."""
    cycle, position = divmod(index, len(DECK))
    deck = list(DECK)
    random.Random(f"{seed}/deck/{cycle}").shuffle(deck)
    fault, aim = deck[position]
    rng = random.Random(f"{seed}/{index}")
    command = rng.choice(commands_for(fault, aim))
    server = rng.choice(sorted(servers))
    nodes = tuple(servers[server])
    return Iteration(seed=seed, index=index, command=command, fault=fault, server=server, nodes=nodes,
                     host=rng.choice(nodes), aim=aim, at=round(rng.random(), 4),
                     hold=round(rng.uniform(1.0, 12.0), 2), value=rng.randrange(1_000_000))


def anchor(starts: list[tuple[float, str]], aim: str) -> float | None:
    """When the aimed moment began on the head (its first phase's start; a run begins before its lock), from its
    phase starts so far; None while it has not."""
    if aim == "before-lock":
        return 0.0
    return next((when for when, phase in starts if moment_of(phase) == aim), None)


def windows(starts: list[tuple[float, str]], ended: float) -> dict[str, tuple[float, float]]:
    """Each moment's first window in a finished run: from the start of its first phase to the next start of a phase
    of another moment (or the run's end)."""
    out: dict[str, tuple[float, float]] = {}
    marks = [(when, moment_of(phase)) for when, phase in starts]
    for i, (when, name) in enumerate(marks):
        if name not in out:
            out[name] = (when, next((t for t, n in marks[i + 1:] if n != name), ended))
    return out


def moment(starts: list[tuple[float, str]], t: float, ended: float | None) -> str:
    """The moment a fault at ``t`` hit, from the head's phase starts (seconds since the run began, phase), in
    order, and when the run ended (None: still running at ``t``)."""
    if ended is not None and t >= ended:
        return "after"
    last = [phase for when, phase in starts if when <= t]
    return moment_of(last[-1]) if last else "before-lock"
