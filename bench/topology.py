#!/usr/bin/env python3
"""Servers that span hosts (issue 40): a full and a no-op push of 2 servers x 2 nodes beside the same 4 hosts
as 4 single-host servers, on one sandbox fleet, with the light reference server (tp 1 per node).

A full push changes the payload (upload, switch, restart, gate on every node); a no-op push finds every node in
sync. Each figure is the wall time of ``fleet.push`` (the library call the CLI makes) over ``--rounds``
rounds, median and minimum. Uses a free sandbox instance with 4 hosts; always torn down. Results: a table on
stdout and bench/results/topology.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lab"))

from kdeploy.core import inventory  # noqa: E402
from kdeploy.flows import fleet  # noqa: E402
from kdeploy.flows.options import Options  # noqa: E402
from kdeploy_lab.demo import light_service  # noqa: E402
from kdeploy_lab.sandbox import free_sandbox  # noqa: E402

HOSTS = 4



def timed_push(path: Path, payload: Path, change: bool, round_no: int) -> float:
    if change:  # a new payload file content: every node uploads, switches, restarts and is gated
        (payload / "bench_round.txt").write_text(f"round {round_no}\n")
    inv = inventory.load(path)
    start = time.perf_counter()
    report = fleet.push(inv, "all", Options(), parallel=8)
    seconds = time.perf_counter() - start
    want = {"deployed"} if change else {"unchanged"}
    results = {h.result for h in report.hosts}
    if not report.ok or results != want:
        sys.exit(f"push failed: {[(h.host, h.result, h.error) for h in report.hosts]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "topology.json")
    args = parser.parse_args()
    box = free_sandbox()
    figures: dict[str, dict[str, dict[str, float]]] = {}
    try:
        box.up(HOSTS)
        with tempfile.TemporaryDirectory() as tmp:
            for shape, nodes in (("4 single hosts", 1), ("2 servers x 2 nodes", 2)):
                payload = Path(tmp) / f"payload-{nodes}"
                payload.mkdir()
                (payload / "bench_plugin.py").write_text("# a payload for the bench\n")
                name = f"bench-topo{nodes}"
                service = light_service(name=name, payload=str(payload))
                service["gate"] = {"workers": 1, "markers": [], "poll_interval": 0.25, "parity": False}
                path = Path(tmp) / f"inventory-{nodes}.yaml"
                box.write_inventory(path, service, nodes_per_server=nodes)
                timed_push(path, payload, True, 0)  # the first deploy: not measured
                rows = {"full": [timed_push(path, payload, True, r + 1) for r in range(args.rounds)],
                        "no-op": [timed_push(path, payload, False, r) for r in range(args.rounds)]}
                figures[shape] = {kind: {"median_s": round(statistics.median(v), 2), "min_s": round(min(v), 2)}
                                  for kind, v in rows.items()}
                for host in box.hosts():
                    box.exec(host.name, ["sh", "-c", f"systemctl disable --now {name} 2>/dev/null; true"],
                             check=False)
    finally:
        box.down()
    print(f"{'shape':<22} {'full push':>16} {'no-op push':>16}   (median / min, {args.rounds} rounds)")
    for shape, kinds in figures.items():
        print(f"{shape:<22} " + " ".join(f"{k['median_s']:>7.2f} / {k['min_s']:<6.2f}"
                                         for k in (kinds["full"], kinds["no-op"])))
    args.out.write_text(json.dumps({"hosts": HOSTS, "rounds": args.rounds, "service": "light reference server",
                                    "figures": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
