#!/usr/bin/env python3
"""Zero-downtime rollouts (issue 15): steady streamed load through the real SGLang router while
``kdeploy push all --batch 1`` rolls a real change (a new payload file) over 4 sandbox hosts.

Three ways, in one run, on the same hosts:

Each way rolls ROUNDS[way] times back to back (a new payload file each time), under the same load.

  a  ``router:`` in the inventory (drain, restart, gate, admit), router started with ``--disable-retries``
  b  the same, router retries on (its default)
  c  no ``router:`` (restart in place) as the reference; router retries on

For each way: a no-rollout baseline (BASELINE_S of load), then load until the rollout has ended (+2 s).
The client keeps CONCURRENCY streams of TOKENS tokens (REFSERVER_TOKEN_DELAY per token on the hosts), each
prompt different (the policy is round_robin anyway). Every request's start, end, status, bytes and
whether its stream ended with ``[DONE]`` is recorded; an error, a non-200 or a stream without ``[DONE]`` is
a failure. The router runs as ``kdeploy sandbox up --router`` runs it (a systemd unit on a fifth sandbox
host, restarted per way with that way's flags); the load only targets that router at its sandbox address,
and stops by itself (MAX_REQUESTS, MAX_SECONDS).

Results: bench/results/rollout.json (every request), bench/results/rollout.png (throughput over time with
each host's window shaded: drain start -> admit end, or restart start -> gate end without a router).
Uses sandbox instance 6; the hosts and the router are always torn down.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from kdeploy.core import inventory  # noqa: E402
from kdeploy.core.policy import Policy  # noqa: E402
from kdeploy.flows import fleet  # noqa: E402
from kdeploy.flows.options import Options  # noqa: E402
from kdeploy_lab import sandbox_router  # noqa: E402
from kdeploy_lab.sandbox import SandboxError  # noqa: E402

HOSTS = 4
CONCURRENCY = 16
TOKENS = 32
TOKEN_DELAY = 0.02
BASELINE_S = 20.0
# Rollouts back to back per way (a new payload each), so that >= 2,000 requests meet one ((a): four met 1,984
# in one run); (c) once: its hosts stop only at TimeoutStopSec (the demo service's 20 s: the router keeps
# feeding a server that drains on SIGTERM, so it never runs dry; see docs/router.md).
ROUNDS = {"a": 5, "b": 4, "c": 1}
MAX_REQUESTS = 20000
MAX_SECONDS = 400.0
PORT = 30000
RESULTS = ROOT / "bench" / "results"
BIN_S = 2.0


async def _one(client: httpx.AsyncClient, url: str, n: int, t0: float) -> dict:
    body = {"model": "m", "prompt": f"request {n}", "max_tokens": TOKENS, "stream": True}
    rec = {"n": n, "start": time.monotonic() - t0, "status": None, "bytes": 0, "done": False, "error": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            async for line in resp.aiter_lines():
                rec["bytes"] += len(line) + 1
                if line == "data: [DONE]":
                    rec["done"] = True
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    rec["end"] = time.monotonic() - t0
    rec["ok"] = rec["status"] == 200 and rec["done"] and rec["error"] is None
    return rec


async def load(url: str, t0: float, stop: threading.Event, records: list[dict]) -> None:
    """CONCURRENCY streams back to back until ``stop``, MAX_REQUESTS or MAX_SECONDS."""
    counter = iter(range(MAX_REQUESTS))
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def worker() -> None:
            while not stop.is_set() and time.monotonic() - t0 < MAX_SECONDS:
                n = next(counter, None)
                if n is None:
                    return
                records.append(await _one(client, url, n, t0))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def _pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] if values else float("nan")


def _summary(records: list[dict]) -> dict:
    lat = [r["end"] - r["start"] for r in records if r["ok"]]
    span = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0
    return {"requests": len(records), "failed": sum(not r["ok"] for r in records),
            "p50": round(_pct(lat, 50), 3), "p99": round(_pct(lat, 99), 3),
            "throughput": round(len(records) / span, 1) if span else 0}


def run_way(bench: sandbox_router.BenchFleet, way: str) -> dict:
    url = sandbox_router.install(bench.box, bench.router_host, workers=bench.worker_urls(PORT), retries=way != "a")
    sandbox_router.set_router(bench.inventory, {"url": url, "drain_timeout": 60} if way in ("a", "b") else None)
    sandbox_router.wait_healthy(url, HOSTS)
    t0 = time.monotonic()
    records: list[dict] = []
    stop = threading.Event()
    marks: list[tuple[str, str, str, float]] = []
    rollout: dict = {}

    def listener(host: str, phase: str, status: str) -> None:
        marks.append((host, phase, status, time.monotonic() - t0))

    def driver() -> None:
        try:
            time.sleep(BASELINE_S)
            rollout["start"] = time.monotonic() - t0
            rollout["results"] = []
            for n in range(ROUNDS[way]):
                (bench.payload / "rev.txt").write_text(f"{way}-{n}-{time.time()}")
                report = fleet.push(inventory.load(bench.inventory), "all", Options(policy=Policy(batch="1")),
                                    listener=listener)
                rollout["results"].append({h.host: str(h.result) for h in report.hosts})
            rollout["end"] = time.monotonic() - t0
            time.sleep(2)
        except BaseException as exc:  # the load stops with the driver, and main() says why
            rollout["error"] = exc
        finally:
            stop.set()

    thread = threading.Thread(target=driver)
    thread.start()
    asyncio.run(load(url, t0, stop, records))
    stop.set()
    thread.join()
    if "error" in rollout:
        raise RuntimeError(f"way {way}: the rollout failed: {rollout['error']!r}") from rollout["error"]
    windows: dict[str, list[tuple[float, float]]] = {}
    restart_time = 0.0
    for host in (h.name for h in bench.hosts):
        begin: float | None = None
        restarted: float | None = None
        for h, phase, status, t in marks:
            if h != host:
                continue
            if phase in ("drain", "restart") and status == "start" and begin is None:
                begin = t
            if phase == "restart" and status == "start":
                restarted = t
            if phase == "restart" and status == "ok" and restarted is not None:
                restart_time += t - restarted
            if status == "ok" and phase == ("admit" if way != "c" else "confirm") and begin is not None:
                windows.setdefault(host, []).append((begin, t))
                begin = None
    base = [r for r in records if r["start"] < rollout["start"]]
    during = [r for r in records if rollout["start"] <= r["start"] <= rollout["end"]]
    return {"way": way, "rollout": rollout, "windows": windows, "baseline": _summary(base),
            "during": _summary(during), "all": _summary(records),
            "rollout_seconds": round(rollout["end"] - rollout["start"], 1),
            "restart_seconds_sum": round(restart_time, 1),
            "failures": [r for r in records if not r["ok"]][:50], "records": records}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), sharex=True)
    labels = {"a": "(a) router:, retries off", "b": "(b) router:, retries on", "c": "(c) no router: (in place)"}
    for ax, res in zip(axes, results, strict=True):
        recs = res["records"]
        bins = int(max(r["end"] for r in recs) / BIN_S) + 1  # 2 s bins: requests end in lockstep
        ok = [0.0] * bins
        bad = [0.0] * bins
        for r in recs:
            (ok if r["ok"] else bad)[int(r["end"] / BIN_S)] += 1 / BIN_S
        ax.plot([i * BIN_S for i in range(bins)], ok, label="completed OK / s")
        ax.plot([i * BIN_S for i in range(bins)], bad, color="red", label="failed / s")
        for i, (host, spans) in enumerate(res["windows"].items()):
            for j, (begin, end) in enumerate(spans):
                ax.axvspan(begin, end, alpha=0.15, color=f"C{i + 2}", label=None if j else f"{host} out/restarting")
        ax.axvline(res["rollout"]["start"], color="grey", ls="--")
        ax.set_title(f"{labels[res['way']]}: {res['during']['failed']} failed of {res['during']['requests']} "
                     f"during the rollout; p99 {res['during']['p99']}s vs baseline {res['baseline']['p99']}s")
        ax.set_ylabel("requests / s")
        ax.legend(loc="lower left", fontsize=7, ncol=3)
    axes[-1].set_xlabel("seconds since the load started (dashed: rollout starts)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    results = []
    try:
        with sandbox_router.bench_fleet(HOSTS, port=PORT, env={"REFSERVER_TOKEN_DELAY": str(TOKEN_DELAY)},
                                        gate={}) as bench:
            for way in ("a", "b", "c"):  # each way (re)starts the router with that way's flags
                res = run_way(bench, way)
                results.append(res)
                print(json.dumps({k: res[k] for k in ("way", "baseline", "during", "rollout_seconds",
                                                      "restart_seconds_sum")}), flush=True)
            stop_sec = bench.service["unit"]["timeout_stop_sec"]
    except SandboxError as exc:
        print(exc, file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rollout.json").write_text(json.dumps(
        {"config": {"hosts": HOSTS, "concurrency": CONCURRENCY, "tokens": TOKENS, "token_delay": TOKEN_DELAY,
                    "baseline_s": BASELINE_S, "rounds": ROUNDS,
                    "timeout_stop_sec": stop_sec},
         "ways": results}, indent=1))
    plot(results, RESULTS / "rollout.png")
    for res in results:
        b, d = res["baseline"], res["during"]
        ratio = d["p99"] / b["p99"] if b["p99"] else float("nan")
        print(f"({res['way']}) during rollout: {d['failed']} failed of {d['requests']}; p50 {d['p50']}s "
              f"p99 {d['p99']}s (baseline p50 {b['p50']}s p99 {b['p99']}s, p99 x{ratio:.2f}); "
              f"rollout {res['rollout_seconds']}s, restarts {res['restart_seconds_sum']}s; "
              f"results {res['rollout']['results']}")
    return 0 if results and results[0]["during"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
