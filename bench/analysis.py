#!/usr/bin/env python3
"""Canary analysis (issue 29): two ``--canary 1 --analysis`` rollouts over 4 sandbox hosts behind the real
SGLang router, under steady load through the router, and what the analysis saw over its window.

  slow  the canary's new config adds REFSERVER_LATENCY=0.07 s before the first token (+50% TTFT): the
        analysis must roll it back, the 3 other hosts untouched
  good  the same payload change without the fault: the analysis must promote it, the rollout goes on

The load keeps CONCURRENCY clients sending TOKENS-token completions (REFSERVER_TOKEN_DELAY per token) to the
router (round robin), so the canary gets about a quarter of it. The analysis scrapes every host's
``/metrics`` every INTERVAL s over DURATION s; its ``analysis`` phase in the report carries the series.

Results: bench/results/analysis.json (each run's report: the analysis phase's data, results, phase times,
the client's request counts), bench/results/analysis.png (canary vs baseline over the window, per metric,
each run a column). Uses sandbox instance 6; the hosts and the router are always torn down.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from kdeploy.core import inventory  # noqa: E402
from kdeploy.core.policy import Policy  # noqa: E402
from kdeploy.flows import fleet  # noqa: E402
from kdeploy.flows.options import Options  # noqa: E402
from kdeploy_lab import sandbox_router  # noqa: E402
from kdeploy_lab.sandbox import SandboxError, edit_inventory  # noqa: E402
from kdeploy_lab.traffic import Traffic  # noqa: E402

HOSTS = 4
CONCURRENCY = 12
TOKENS = 3
TOKEN_DELAY = 0.14  # TTFT ~0.14 s, in SGLang's (0.1, 0.2] bucket; +50% lands in (0.2, 0.4]
LATENCY = 0.07
DURATION = 30.0
INTERVAL = 2.0
PORT = 30000
RESULTS = ROOT / "bench" / "results"
PANELS = (("error_rate", "error rate"), ("p99_ttft_seconds", "p99 TTFT (s)"), ("p99_itl_seconds", "p99 ITL (s)"),
          ("tokens_per_second_per_request", "tokens/s per request"), ("requests", "requests in the window"))


def run(inv_path: Path, payload: Path, url: str, name: str) -> dict:
    canary = inventory.load(inv_path).resolve("all")[0]
    env = {"REFSERVER_TOKEN_DELAY": str(TOKEN_DELAY), **({"REFSERVER_LATENCY": str(LATENCY)} if name == "slow" else {})}
    edit_inventory(inv_path, lambda doc: doc["hosts"][canary].update(service={"env": env}))
    (payload / "rev.txt").write_text(f"{name}-{time.time()}")
    with Traffic(url, CONCURRENCY, TOKENS, timeout=60) as load:
        time.sleep(3)  # every host busy before the rollout starts
        started = time.monotonic()
        report = fleet.push(inventory.load(inv_path), "all", Options(policy=Policy(canary=1, batch="1",
                                                                                   analysis=DURATION)))
        seconds = time.monotonic() - started
    doc = report.as_json()
    phase = next(p for h in doc["hosts"] for p in h["phases"] if p["name"] == "analysis")
    return {"run": name, "exit_code": report.exit_code, "seconds": round(seconds, 1),
            "results": {h["host"]: h["result"] for h in doc["hosts"]}, "analysis": phase,
            "client": {str(code): n for code, n in load.codes.items()}}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), len(runs), figsize=(5.5 * len(runs), 2.2 * len(PANELS)), sharex=True,
                             squeeze=False)
    for col, res in enumerate(runs):
        data = res["analysis"]["data"]
        series = data["series"]
        t = [p["t"] for p in series]
        for row, (key, label) in enumerate(PANELS):
            ax = axes[row][col]
            for side, style in (("canary", "C3"), ("baseline", "C0")):
                ax.plot(t, [p[side][key] for p in series], color=style, marker=".",
                        label=f"{side} ({', '.join(data[side])})")
            ax.set_ylabel(label, fontsize=8)
            if row == 0:
                failed = data["failed"]
                verdict = (f"{data['decision']}: {failed['metric']} {failed['canary']:.3g} vs {failed['baseline']:.3g}"
                           if failed else data["decision"])
                ax.set_title(f"{res['run']}: {verdict}", fontsize=9)
                ax.legend(fontsize=7)
        axes[-1][col].set_xlabel("seconds into the analysis window")
    fig.suptitle(f"canary vs baseline over a {DURATION:.0f} s window (each point: the window so far; TTFT "
                 f"buckets 0.1/0.2/0.4 s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    runs = []
    try:
        with sandbox_router.bench_fleet(HOSTS, port=PORT, env={"REFSERVER_TOKEN_DELAY": str(TOKEN_DELAY)},
                                        gate={"analysis": {"interval": INTERVAL}}) as bench:
            url = sandbox_router.install(bench.box, bench.router_host, workers=bench.worker_urls(PORT))
            sandbox_router.set_router(bench.inventory, {"url": url, "drain_timeout": 60})
            sandbox_router.wait_healthy(url, HOSTS)
            for name in ("slow", "good"):
                res = run(bench.inventory, bench.payload, url, name)
                runs.append(res)
                print(json.dumps({k: res[k] for k in ("run", "exit_code", "seconds", "results", "client")}),
                      flush=True)
                print(f"  {res['analysis']['detail']}", flush=True)
    except SandboxError as exc:
        print(exc, file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "analysis.json").write_text(json.dumps(
        {"config": {"hosts": HOSTS, "concurrency": CONCURRENCY, "tokens": TOKENS, "token_delay": TOKEN_DELAY,
                    "latency": LATENCY, "duration": DURATION, "interval": INTERVAL}, "runs": runs}, indent=1))
    plot(runs, RESULTS / "analysis.png")
    ok = [r["exit_code"] for r in runs] == [4, 0]
    print("as expected: slow rolled back (exit 4), good promoted (exit 0)" if ok else "UNEXPECTED exit codes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
