#!/usr/bin/env python3
"""SSH-layer benchmark (issue 13): 16 sandbox hosts reached directly, behind one bastion, and with
certified host keys; kdeploy before (main's tree, ``--before``) and after; paramiko against asyncssh.

Runs, each as a child process (controller CPU = user+sys of its process tree, from os.wait4):

  push-direct / push-bastion     ``kdeploy push all --force-restart``: restart + whole gate on every host
  noop-direct / noop-bastion     ``kdeploy push all``: nothing changed
  noop-certs                     the no-op push with every host key certified (known_hosts: only the CA)
  noop-before                    the no-op push with the tree given by ``--before`` (e.g. main)
  connect-paramiko / -asyncssh   connect + authenticate + verify the host key + run ``true``, 16 hosts
                                 in a row in one process (``--asyncssh-python``: a python with asyncssh)

Uses a free sandbox instance with 17 hosts (h17 is the bastion); always torn down. Results: a table on
stdout and bench/results/ssh.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from kdeploy_lab.demo import demo_service  # noqa: E402
from kdeploy_lab.sandbox import Sandbox, edit_inventory  # noqa: E402

HOSTS = 16
PLUGIN = ROOT / "tests" / "data" / "testplugin"
# Run a kdeploy tree other than the installed (editable) one: drop the editable finder, put it first.
BEFORE = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
          "sys.path.insert(0, {tree!r}); sys.argv[0] = 'kdeploy'; from kdeploy.__main__ import main; main()")
PARAMIKO_CONNECT = """
import sys, time
from kdeploy.core import inventory
from kdeploy.ssh import sshconfig
from kdeploy.ssh.remote import Remote
inv = inventory.load(sys.argv[1])
for name in inv.resolve("all"):
    host = inv.hosts[name]
    with Remote.connect(host, sshconfig.target_for(inv, host)) as remote:
        assert remote.run("true").ok
"""
ASYNCSSH_CONNECT = """
import asyncio, sys
import asyncssh
async def main(addresses, key, known):
    for address in addresses:
        async with asyncssh.connect(address, username="root", client_keys=[key], known_hosts=known,
                                    agent_path=None, config=[]) as conn:
            assert (await conn.run("true")).exit_status == 0
asyncio.run(main(sys.argv[3:], sys.argv[1], sys.argv[2]))
"""


def measure(argv: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(wall seconds, controller CPU seconds of the whole process tree, exit code)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.stderr.write(f"{argv[:4]} exited {proc.returncode}: {proc.stderr.read().decode()[-800:]}\n")
    proc.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def kdeploy(*args: str) -> list[str]:
    return [sys.executable, "-m", "kdeploy", *args]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", type=Path, help="a kdeploy source tree to compare the no-op push with")
    parser.add_argument("--asyncssh-python", type=Path, help="a python that can import asyncssh")
    args = parser.parse_args()
    box = next((b for b in (Sandbox(instance=i, sglang=False) for i in range(6, -1, -1)) if not b.hosts()), None)
    if box is None:
        sys.exit("no free sandbox instance")
    results: dict[str, dict] = {}

    def record(name: str, argv: list[str], runs: int = args.runs) -> None:
        samples = [measure(argv) for _ in range(runs)]
        if any(code not in (0,) for _, _, code in samples):
            raise SystemExit(f"{name} failed")
        results[name] = {"wall_s": round(statistics.median(s[0] for s in samples), 3),
                         "cpu_s": round(statistics.median(s[1] for s in samples), 3),
                         "cpu_ms_per_host": round(statistics.median(s[1] for s in samples) / HOSTS * 1000, 1),
                         "runs": runs}
        print(f"{name:18} wall {results[name]['wall_s']:6.2f}s  controller CPU {results[name]['cpu_s']:6.2f}s"
              f"  ({results[name]['cpu_ms_per_host']:.1f} ms/host)", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        inv = Path(tmp) / "inventory.yaml"
        try:
            box.up(HOSTS + 1)
            bastion = box.hosts()[-1]
            service = demo_service(sglang=False, name="kdbench", payload=str(PLUGIN))
            service["sglang"] = {**service["sglang"], "tp": 1, "port": 31900}
            service["gate"] = {"workers": 1, "poll_interval": 0.25, "markers": ["[kdeploy-testplugin] loaded"],
                               "timeout": 120}
            service["env"] = {}
            box.write_inventory(inv, service)
            edit_inventory(inv, lambda doc: (doc["hosts"].pop(bastion.name), doc["groups"]["sandbox"]["hosts"].pop()))
            if measure(kdeploy("push", "all", "-i", str(inv), "--ssh-config", "none"))[2]:
                raise SystemExit("first push failed")
            direct = ["-i", str(inv), "--ssh-config", "none"]
            record("noop-direct", kdeploy("push", "all", *direct))
            if args.before:
                record("noop-before", [sys.executable, "-c", BEFORE.format(tree=str(args.before.resolve())),
                                       "push", "all", "-i", str(inv)])
            record("push-direct", kdeploy("push", "all", "--force-restart", *direct), runs=1)
            record("connect-paramiko", [sys.executable, "-c", PARAMIKO_CONNECT, str(inv)])
            if args.asyncssh_python:
                addresses = [h.address for h in box.hosts()[:HOSTS]]
                record("connect-asyncssh", [str(args.asyncssh_python), "-c", ASYNCSSH_CONNECT, str(box.key_path),
                                            str(box.known_hosts_path), *addresses])
            edit_inventory(inv, lambda doc: doc["defaults"].update(proxy_jump=f"root@{bastion.address}"))
            record("noop-bastion", kdeploy("push", "all", *direct))
            record("push-bastion", kdeploy("push", "all", "--force-restart", *direct), runs=1)
            edit_inventory(inv, lambda doc: doc["defaults"].pop("proxy_jump"))
            box.certify_all(box.hosts())
            record("noop-certs", kdeploy("push", "all", *direct))
            record("connect-paramiko-certs", [sys.executable, "-c", PARAMIKO_CONNECT, str(inv)])
            if args.asyncssh_python:
                record("connect-asyncssh-certs", [str(args.asyncssh_python), "-c", ASYNCSSH_CONNECT,
                                                  str(box.key_path), str(box.known_hosts_path), *addresses])
        finally:
            box.down()
    out = ROOT / "bench" / "results" / "ssh.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hosts": HOSTS, "cpus": os.cpu_count(), "results": results}, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
