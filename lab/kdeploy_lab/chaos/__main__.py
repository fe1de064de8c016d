"""``python -m kdeploy_lab.chaos``: a randomized fault campaign on a sandbox fleet of its own (``make chaos``;
docs/chaos.md). Writes the JSON report (exit 0 when no invariant was violated, 1 otherwise, 2 on bad input)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kdeploy.core.errors import KdeployError
from kdeploy_lab.chaos.plan import draw

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kdeploy_lab.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="start no iteration after this many seconds (the report says how many ran)")
    p.add_argument("--report", type=Path, default=RESULTS / "chaos.json")
    p.add_argument("--cases", type=Path, default=None, help="where violations' cases go (default: beside the "
                   "report, chaos-cases/)")
    p.add_argument("--replay", type=Path, default=None, metavar="CASE",
                   help="run one saved case (its case.json) again on a fresh fleet: same seed, iteration, moment")
    p.add_argument("--first", type=int, default=0, help="the first iteration's index")
    p.add_argument("--instance", type=int, default=None, help="sandbox instance (default: the first free one)")
    a = p.parse_args(argv)
    if a.iterations < 1 or (a.budget is not None and a.budget <= 0):
        p.error("--iterations and --budget must be positive")
    return a


def _commit() -> str:
    """The checkout's commit (and "+changes" when its tree differs): what the figures were measured on."""
    where = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP (a CI cancel, a closed terminal) end the campaign as Ctrl-C does: the fleet is torn down."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    from kdeploy_lab.chaos import report
    from kdeploy_lab.chaos.campaign import THREADS
    from kdeploy_lab.chaos.fleet import SERVERS

    replay = None
    if a.replay is not None:
        try:
            replay = json.loads(a.replay.read_text())
            a.seed, a.first, a.iterations = int(replay["seed"]), int(replay["index"]), 1
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"chaos: cannot read the case {a.replay}: {exc}", file=sys.stderr)
            return 2

    def say(text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)

    started = time.monotonic()
    outcomes: list[dict] = []
    estimates: dict[str, float] = {}
    interrupted, error = False, None
    try:
        _iterations(a, replay, outcomes, estimates, started, say)
    except KeyboardInterrupt:
        interrupted = True
        say(f"interrupted after {len(outcomes)} iterations; the fleet is torn down")
    except KdeployError as exc:  # the fleet could not be brought up or torn down (a busy instance, a missing tool)
        error = str(exc)
        say(f"chaos: {exc}")
        if not outcomes:
            return 2
    doc = report.document(a.seed, outcomes, planned=a.iterations, seconds=time.monotonic() - started,
                          budget=a.budget, machine=f"{platform.node()} {os.cpu_count()} cores, kdeploy {_commit()}",
                          fleet={"servers": {k: list(v) for k, v in SERVERS.items()}, "router": "sglang-router 0.3.2",
                                 "traffic_streams": THREADS}, estimates=estimates)
    doc["interrupted"], doc["error"] = interrupted, error
    if replay is not None:  # the replayed iteration's outcome, to set beside the case's
        sys.stdout.write(json.dumps(outcomes, indent=2) + "\n")
    else:
        a.report.parent.mkdir(parents=True, exist_ok=True)
        a.report.write_text(json.dumps(doc, indent=2) + "\n")
        try:
            report.plot(doc, a.report.with_suffix(".png"))
        except ImportError:
            say("matplotlib missing: no plot (pip install matplotlib)")
        say(f"report: {a.report}")
    say(f"{len(outcomes)} iterations, {len(doc['violations'])} violated")
    return 130 if interrupted else 2 if error else 1 if doc["violations"] else 0


def _iterations(a: argparse.Namespace, replay: dict | None, outcomes: list[dict], estimates: dict[str, float],
                started: float, say: Callable[[str], None]) -> None:
    """Boot the fleet, run the iterations under traffic (each outcome appended as it ends), tear it down."""
    from kdeploy_lab.chaos import report
    from kdeploy_lab.chaos.campaign import THREADS, Campaign
    from kdeploy_lab.chaos.fleet import SERVERS, fleet
    from kdeploy_lab.traffic import Traffic

    cases = a.cases or a.report.parent / "chaos-cases"
    with fleet(a.instance) as f:
        say(f"fleet up on sandbox {f.box.instance}: router {f.router_url}; seed {a.seed}")
        with Traffic(f.router_url, threads=THREADS, tokens=4, timeout=30) as traffic:
            campaign = Campaign(f, traffic)
            try:
                for index in range(a.first, a.first + a.iterations):
                    if a.budget is not None and time.monotonic() - started > a.budget:
                        say(f"budget of {a.budget:.0f}s spent: {len(outcomes)} iterations ran")
                        break
                    it = draw(a.seed, index, SERVERS)
                    out = campaign.run(it, delay=replay.get("delay") if replay else None)
                    doc = out.as_json()
                    if out.violations and replay is None:
                        doc["case"] = str(report.save_case(cases, a.seed, doc, out.journals))
                    outcomes.append(doc)
                    fired = "" if out.delay is None else f" ({out.delay}s)"
                    say(f"#{index} {it.command} + {it.fault} on {it.server} at {out.moment}{fired}: "
                        f"exit {out.exits}, settle {out.settle:.0f}s, lost {out.lost}/{out.requests}"
                        + (f" VIOLATED: {'; '.join(out.violations)}" if out.violations else " ok"))
            finally:
                estimates.update({k: campaign.estimate(k) for k in campaign.durations})


if __name__ == "__main__":
    sys.exit(main())
