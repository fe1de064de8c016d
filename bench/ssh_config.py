"""What resolving ssh_config costs per host: one `ssh -G`, kdeploy's resolution of N hosts through it (cold,
serially and from --parallel threads; warm), and the builtin parser for comparison.

    .venv/bin/python bench/ssh_config.py [--hosts 64] [--parallel 8] [--out bench/results/ssh-config.json]

The config is the parity corpus (tests/data/ssh_config/main.conf: two Includes, Match blocks, tokens, jumps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kdeploy.core import inventory
from kdeploy.ssh import sshconfig

REPO = Path(__file__).resolve().parents[1]


def corpus(into: Path) -> Path:
    """The corpus with its placeholders filled, its relative Include pointed at an absolute copy."""
    shutil.copytree(REPO / "tests/data/ssh_config", into)
    for path in into.rglob("*.conf"):
        path.write_text(path.read_text().replace("@DIR@", str(into)).replace("@REL@", str(into / "rel"))
                        .replace("@LOCALUSER@", os.environ.get("USER", "root")))
    return into / "main.conf"


def fleet(config: Path, count: int, directory: Path) -> inventory.Inventory:
    path = directory / "inventory.yaml"
    hosts = "".join(f"  h{i}: {{address: web-{i}}}\n" for i in range(count))
    path.write_text(f"defaults:\n  ssh_config: {config}\n  service:\n    name: svc\n"
                    f"    template: {REPO}/templates/sglang.service.j2\n    payload: {REPO}/tests/data/testplugin\n"
                    f"    python: /usr/bin/python3\n    sglang: {{model_path: /models/m}}\nhosts:\n{hosts}")
    return inventory.load(path)


def resolve_all(inv: inventory.Inventory, parallel: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda h: sshconfig.target_for(inv, h), inv.hosts.values()))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = corpus(Path(tmp) / "corpus")
        inv = fleet(config, args.hosts, Path(tmp))
        one = []
        for _ in range(50):
            started = time.perf_counter()
            subprocess.run(["ssh", "-G", "-F", str(config), "web-1"], capture_output=True, check=True,
                           stdin=subprocess.DEVNULL)
            one.append(time.perf_counter() - started)
        result: dict[str, object] = {"hosts": args.hosts, "parallel": args.parallel, "cpus": os.cpu_count(),
                                     "ssh -G, one process (ms, median of 50)": round(statistics.median(one) * 1e3, 2)}
        for resolver in ("openssh", "builtin"):
            os.environ[sshconfig.RESOLVER_VAR] = resolver
            for label, parallel in (("serial", 1), (f"{args.parallel} threads", args.parallel)):
                cold, warm = [], []
                for _ in range(args.runs):
                    sshconfig.clear_cache()
                    sshconfig._CONFIGS._entries.clear()
                    cold.append(resolve_all(inv, parallel))
                    warm.append(resolve_all(inv, parallel))
                per_host = 1e3 / args.hosts
                result[f"{resolver}, {label}, cold (ms per host)"] = round(statistics.median(cold) * per_host, 2)
                result[f"{resolver}, {label}, cached (ms per host)"] = round(statistics.median(warm) * per_host, 3)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
