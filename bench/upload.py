#!/usr/bin/env python3
"""Upload throughput (issue 16 item 5): kdeploy's stage phase against scp and rsync of the same payload to
the same sandbox hosts, in one run.

For 1 MB / 50 MB / 200 MB payloads (one file of random bytes) and 1 and 8 hosts at once:

  scp            ``scp`` of the file to every host at once (one process per host)
  rsync          ``rsync --whole-file`` over ssh, the same way
  kdeploy-ssh    kdeploy's SSH layer alone: the payload's tar stream into ``cat > /dev/null`` (one thread
                 and connection per host, in this process, like a push)
  kdeploy-stage  kdeploy's whole stage phase: the tar stream into ``release.stage_script`` (hard links to
                 ``current``, ``tar -x``, sha256 of every file, fsync), into a fresh service dir

Connections are made before the clock starts (a push has them already); MB/s is the payload's bytes per
host over the wall time. ``--where`` adds where the time goes for 50 MB to one host: OpenSSH's ``ssh``
against kdeploy's SSH layer with each cipher, and the stage script's own work on the host. Uses a free
sandbox instance with 8 hosts; always torn down. Results: a table on stdout and bench/results/upload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kdeploy.core import inventory, release  # noqa: E402
from kdeploy.ssh import remote, sshconfig  # noqa: E402
from kdeploy_lab.demo import demo_service, project_dir  # noqa: E402
from kdeploy_lab.sandbox import Sandbox, free_sandbox  # noqa: E402

HOSTS = 8
DEST = "/tmp/bench-upload.bin"  # where scp and rsync write
SIZES_MB = (1, 50, 200)
BENCH_DIR = "/srv/kdeploy-bench-upload"



def make_payload(root: Path, mb: int) -> release.Payload:
    path = root / f"p{mb}" / "kernels.so"
    path.parent.mkdir(parents=True)
    with path.open("wb") as fh:
        for _ in range(mb):
            fh.write(os.urandom(1 << 20))
    return release.scan_payload(path.parent)


def timed_parallel(jobs: list[Callable[[], None]]) -> float:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # reported after the clock stops
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall


def ssh_opts(box: Sandbox) -> list[str]:
    return ["-i", str(box.key_path), "-o", f"UserKnownHostsFile={box.known_hosts_path}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]


def tool(argv_for: Callable[[str], list[str]], addresses: list[str]) -> Callable[[], float]:
    def go() -> float:
        return timed_parallel([lambda a=a: subprocess.run(argv_for(a), check=True, capture_output=True)
                               for a in addresses])
    return go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--where", action="store_true", help="also break the 50 MB upload down by layer")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MB)))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "upload.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    box = free_sandbox()
    tmp = Path(tempfile.mkdtemp(prefix="kdeploy-bench-upload-"))
    rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        box.up(HOSTS)
        print(f"sandbox {box.instance}: {HOSTS} hosts up in {time.perf_counter() - t0:.1f}s", flush=True)
        inv_path = tmp / "inventory.yaml"
        box.write_inventory(inv_path, demo_service(project_dir(), sglang=False, name="kdbench"))
        inv = inventory.load(inv_path)
        hosts = [inv.hosts[n] for n in inv.resolve("all")][:HOSTS]
        conns = {h.name: remote.Remote.connect(h, sshconfig.target_for(inv, h)) for h in hosts}
        opts = ssh_opts(box)
        payloads = {mb: make_payload(tmp, mb) for mb in sizes}

        def kdeploy(payload: release.Payload, names: list[str], command: Callable[[str], str]) -> Callable[[], float]:
            meta = release.release_meta(payload.manifest, payload.modes, "[Unit]\n", "kdbench.service")

            def one(name: str) -> None:
                out = conns[name].run(command(name), stdin=release.TarStream(payload, list(payload.files), meta),
                                      timeout=600)
                assert out.ok, out.stderr

            def go() -> float:
                for name in names:
                    conns[name].run(f"rm -rf {BENCH_DIR}", timeout=60)
                return timed_parallel([lambda n=n: one(n) for n in names])
            return go

        stage = release.stage_script(BENCH_DIR, "r1", False, release.Delta())
        for mb in sizes:
            payload = payloads[mb]
            src = str(next(iter(payload.files.values())).source)
            for count in (1, HOSTS):
                names = [h.name for h in hosts[:count]]
                addresses = [str(h.address) for h in hosts[:count]]
                methods = {
                    "scp": tool(lambda a, src=src: ["scp", "-q", *opts, src, f"root@{a}:{DEST}"], addresses),
                    "rsync": tool(lambda a, src=src: ["rsync", "--whole-file", "-e", shlex.join(["ssh", *opts]),
                                                      src, f"root@{a}:{DEST}"], addresses),
                    "kdeploy-ssh": kdeploy(payload, names, lambda _: "cat > /dev/null"),
                    "kdeploy-stage": kdeploy(payload, names, lambda _: stage),
                }
                for method, go in methods.items():
                    wall = go()
                    rows.append({"mb": mb, "hosts": count, "method": method, "seconds": round(wall, 3),
                                 "mb_per_s_per_host": round(mb / wall, 1)})
                    print(f"{mb:>4} MB  {count} host(s)  {method:<14} {wall:7.2f} s  {mb / wall:7.1f} MB/s per host",
                          flush=True)
        where: list[dict] = []
        if args.where:
            where = breakdown(inv, hosts[0], payloads.get(50) or make_payload(tmp, 50), opts)
        for conn in conns.values():
            conn.close()
        Path(args.out).write_text(json.dumps({"rows": rows, "where": where}, indent=1) + "\n")
        print_table(rows)
    finally:
        box.down()


def breakdown(inv: inventory.Inventory, host: inventory.HostConfig, payload: release.Payload,
              opts: list[str]) -> list[dict]:
    """50 MB to one host through each layer alone: OpenSSH's ``ssh host 'cat > /dev/null'`` against kdeploy's
    SSH layer doing the same with each cipher, and the stage script's own work on the host."""
    meta = release.release_meta(payload.manifest, payload.modes, "[Unit]\n", "kdbench.service")
    src = next(iter(payload.files.values())).source
    out = []

    def row(label: str, wall: float) -> None:
        out.append({"variant": label, "seconds": round(wall, 3), "mb_per_s": round(50 / wall, 1)})
        print(f"where: {label:<44} {wall:6.2f} s  {50 / wall:6.1f} MB/s", flush=True)

    with src.open("rb") as fh:
        start = time.perf_counter()
        subprocess.run(["ssh", *opts, f"root@{host.address}", "cat > /dev/null"], stdin=fh, check=True)
        row("OpenSSH ssh, cat > /dev/null", time.perf_counter() - start)
    for cipher in ("aes128-gcm@openssh.com", "aes128-ctr", "aes256-gcm@openssh.com"):
        saved = remote.PREFERRED_CIPHERS
        remote.PREFERRED_CIPHERS = (cipher,)
        try:
            with remote.Remote.connect(host, sshconfig.target_for(inv, host)) as conn:
                start = time.perf_counter()
                assert conn.run("cat > /dev/null", stdin=release.TarStream(payload, list(payload.files), meta),
                                timeout=600).ok
                row(f"kdeploy SSH layer ({conn.transport.local_cipher}), cat", time.perf_counter() - start)
        finally:
            remote.PREFERRED_CIPHERS = saved
    with remote.Remote.connect(host, sshconfig.target_for(inv, host)) as conn:
        conn.run(f"rm -rf {BENCH_DIR}; head -c 50M /dev/urandom > /tmp/bench-local.bin", timeout=60)
        start = time.perf_counter()
        assert conn.run(f"tar -cf - -C /tmp bench-local.bin | (mkdir -p {BENCH_DIR} && cd {BENCH_DIR} && "
                        "tar -xf - && sync -- bench-local.bin)", timeout=600).ok
        row("on the host alone: tar -x + fsync", time.perf_counter() - start)
        for what, command in (("sha256sum (staging before)", "sha256sum bench-local.bin"),
                              ("python3 hashlib (staging now)", "python3 -c 'import hashlib; "
                               "hashlib.sha256(open(\"bench-local.bin\", \"rb\").read()).hexdigest()'")):
            start = time.perf_counter()
            assert conn.run(f"cd {BENCH_DIR} && {command} > /dev/null", timeout=600).ok
            row(f"on the host alone: {what}", time.perf_counter() - start)
        start = time.perf_counter()
        assert conn.run(f"cd {BENCH_DIR} && sync -f .", timeout=600).ok
        row("on the host alone: sync -f (what staging did before)", time.perf_counter() - start)
    return out


def print_table(rows: list[dict]) -> None:
    print("\nMB/s per host (wall time); kdeploy-stage as % of scp")
    print(f"{'payload':>8} {'hosts':>5} {'scp':>8} {'rsync':>8} {'kd-ssh':>8} {'kd-stage':>9} {'stage/scp':>9}")
    for mb in dict.fromkeys(r["mb"] for r in rows):
        for count in dict.fromkeys(r["hosts"] for r in rows):
            got = {r["method"]: r for r in rows if r["mb"] == mb and r["hosts"] == count}
            if not got:
                continue
            speed = {m: got[m]["mb_per_s_per_host"] for m in got}
            ratio = got["scp"]["seconds"] / got["kdeploy-stage"]["seconds"] * 100
            print(f"{mb:>6}MB {count:>5} {speed['scp']:>8} {speed['rsync']:>8} {speed['kdeploy-ssh']:>8} "
                  f"{speed['kdeploy-stage']:>9} {ratio:>8.0f}%")


if __name__ == "__main__":
    main()
