#!/usr/bin/env python3
"""kdeploy at fleet scale (issue 16): 16, 32, 64, 128 light sandbox hosts from one controller.

Boots the largest fleet once (``Sandbox(sglang=False)``, the light service of ``kdeploy sandbox up
--light``: the reference server at tp=1 from the small host venv), installs a first release on every host
(untimed), then for each fleet size N (an inventory of hosts h1..hN) measures

  full     ``kdeploy push all --json``: a new payload (one file changed) + restart + the whole gate
  noop     the same push again (asserted: every host ``unchanged``)
  verify   ``kdeploy verify all --json``
  logins   OpenSSH ``ssh host true`` to the same N hosts, 16 at a time: what any SSH tool pays first

at the default ``--parallel`` (16), and at the largest N every measurement again with each ``--parallel``
of ``--parallel-values``. Per run: wall; controller CPU = user+sys of the kdeploy process (os.wait4); host
CPU = CPU used inside all sandbox hosts (their cgroup), which share the controller's cores;
peak RSS, peak threads, peak open fds and peak sockets of the kdeploy process (/proc/PID sampled every
20 ms, kdeploy_lab.procwatch). Per measurement: the least-squares slope per added host over the sizes.
Also the boot: seconds and machine memory (MemAvailable) per host, idle and with the service running.

Results: a table on stdout with the issue's targets as pass/miss, bench/results/scale.json,
bench/results/scale.svg (or .png with matplotlib). ``--boot-sizes 16,32`` only boots and measures the
sandbox at each size. Sandbox instance 6 (``--instance``); always torn down, also on Ctrl-C or a failure.
Run it under ``flock /tmp/sandbox-heavy.lock`` (``make bench-scale`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from ruamel.yaml import YAML  # noqa: E402

from kdeploy_lab import procwatch  # noqa: E402
from kdeploy_lab.demo import light_service, project_dir  # noqa: E402
from kdeploy_lab.sandbox import Sandbox  # noqa: E402

KINDS = ("full", "noop", "verify")
# Issue item 6: N connections opened at once, one command each, all held until the last is done (as a
# rollout holds them), with paramiko's thread per connection (kdeploy's Remote) and with asyncssh.
PARAMIKO_CONNS = """
import sys, threading
from concurrent.futures import ThreadPoolExecutor
from kdeploy.core import inventory
from kdeploy.ssh import sshconfig
from kdeploy.ssh.remote import Remote
inv = inventory.load(sys.argv[1])
names = inv.resolve("all")
held, all_in = [], threading.Barrier(len(names))
def one(name):
    host = inv.hosts[name]
    remote = Remote.connect(host, sshconfig.target_for(inv, host))
    held.append(remote)
    assert remote.run("true").ok
    all_in.wait(timeout=300)
with ThreadPoolExecutor(max_workers=len(names)) as pool:
    list(pool.map(one, names))
for remote in held:
    remote.close()
"""
ASYNCSSH_CONNS = """
import asyncio, sys
import asyncssh
async def one(address, key, known):
    conn = await asyncssh.connect(address, username="root", client_keys=[key], known_hosts=known,
                                  agent_path=None, config=[])
    assert (await conn.run("true")).exit_status == 0
    return conn
async def main(key, known, addresses):
    conns = await asyncio.gather(*(one(a, key, known) for a in addresses))
    for conn in conns:
        conn.close()
        await conn.wait_closed()
asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
"""
DEFAULT_PARALLEL = 16
# The targets: (what, kind, size or None for a slope, metric, limit)
TARGETS = (
    ("no-op push, 64 hosts: wall", "noop", 64, "wall", 2.0),
    ("no-op push, 128 hosts: wall", "noop", 128, "wall", 3.0),
    ("verify, 128 hosts: wall", "verify", 128, "wall", 4.0),
    ("no-op push: controller CPU per added host", "noop", None, "cpu", 0.03),
    ("full push: controller CPU per added host", "full", None, "cpu", 0.05),
    ("full push, 128 hosts: peak RSS (MB)", "full", 128, "rss_mb", 300.0),
)


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def limits() -> dict[str, Any]:
    """The machine's limits that a fleet of containers runs into."""
    def read(path: str) -> str | None:
        with contextlib.suppress(OSError):
            return Path(path).read_text().strip()
        return None
    import resource
    return {"inotify_max_user_instances": read("/proc/sys/fs/inotify/max_user_instances"),
            "inotify_max_user_watches": read("/proc/sys/fs/inotify/max_user_watches"),
            "pid_max": read("/proc/sys/kernel/pid_max"), "threads_max": read("/proc/sys/kernel/threads-max"),
            "file_max": read("/proc/sys/fs/file-max"),
            "nofile_soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def boot(box: Sandbox, n: int) -> dict[str, Any]:
    """Boot n hosts; seconds and memory per host (MemAvailable before/after)."""
    if box.hosts() or box.leftovers():
        log(f"sandbox instance {box.instance} has leftovers: tearing them down first")
        box.down()
    before = mem_available_mb()
    t0 = time.monotonic()
    box.up(n, timeout=max(120.0, 3.0 * n))
    seconds = time.monotonic() - t0
    time.sleep(2)   # let the last hosts' boot jobs settle before reading memory
    used = before - mem_available_mb()
    entry = {"hosts": n, "boot_s": round(seconds, 1), "mem_available_before_mb": round(before),
             "mem_used_mb": round(used), "mem_per_host_mb": round(used / n, 1),
             "load1": round(os.getloadavg()[0], 2)}
    log(f"N={n}: up in {seconds:.1f}s, {used:.0f} MB used ({used / n:.1f} MB/host)")
    return entry


def run_watched(argv: list[str], log_to: Path, timeout: float = 1800) -> tuple[dict[str, Any], dict | None]:
    """Run kdeploy (or a snippet) as a child: wall, user+sys (wait4), its /proc peaks; its JSON document."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            with procwatch.ProcWatch(proc.pid) as watch:
                _, status, ru = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        peaks = watch.peaks
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    log_to.parent.mkdir(parents=True, exist_ok=True)
    log_to.write_text(f"$ {' '.join(argv)}\n# rc={proc.returncode} wall={wall:.2f}s\n--- stdout\n{stdout}\n"
                      f"--- stderr\n{stderr}\n")
    sample = {"wall": round(wall, 3), "cpu": round(ru.ru_utime + ru.ru_stime, 3), "user": round(ru.ru_utime, 3),
              "sys": round(ru.ru_stime, 3),
              "rss_mb": round(max(peaks.rss_kb, ru.ru_maxrss) / 1024, 1), "threads": peaks.threads,
              "fds": peaks.fds, "sockets": peaks.sockets, "proc_samples": peaks.samples, "rc": proc.returncode,
              "load1": round(load, 2)}
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        doc = None
        sample["error"] = (stderr.strip().splitlines() or ["no output"])[-1][:300]
    return sample, doc


class Fleet:
    """The booted sandbox, a copy of the payload and inventories for the first N hosts."""

    def __init__(self, box: Sandbox, work: Path, payload_src: Path, logs: Path) -> None:
        self.box, self.work, self.logs = box, work, logs
        self.payload = work / "payload"
        shutil.copytree(payload_src, self.payload)
        full_inv = work / "inventory-all.yaml"
        box.write_inventory(full_inv, light_service(project_dir(), payload=str(self.payload)))
        self.full_inv = full_inv.read_text()

    def stamp(self, text: str) -> None:
        """A new release: one file of the payload changes (kdeploy ships what changed)."""
        (self.payload / "bench_stamp.txt").write_text(text + "\n")

    def inventory(self, n: int) -> Path:
        """The sandbox's inventory cut to hosts h1..hN."""
        yaml = YAML()
        doc = yaml.load(self.full_inv)
        names = [f"h{i}" for i in range(1, n + 1)]
        doc["groups"]["sandbox"]["hosts"][:] = names
        for name in list(doc["hosts"]):
            if name not in names:
                del doc["hosts"][name]
        path = self.work / f"inventory-{n}.yaml"
        with path.open("w") as fh:
            yaml.dump(doc, fh)
        return path

    def connections(self, lib: str, n: int) -> dict[str, Any]:
        """Item 6: n concurrent connections + one command each, paramiko (kdeploy's Remote) or asyncssh."""
        if lib == "paramiko":
            argv = [sys.executable, "-c", PARAMIKO_CONNS, str(self.inventory(n))]
        else:
            argv = [sys.executable, "-c", ASYNCSSH_CONNS, str(self.box.key_path), str(self.box.known_hosts_path),
                    *(h.address for h in self.box.hosts()[:n])]
        sample, _doc = run_watched(argv, self.logs / f"conns-{lib}-N{n}.log")
        sample["ok"] = sample["rc"] == 0
        if sample["ok"]:
            sample.pop("error", None)   # no JSON document is expected from the snippets
        log(f"  {n} concurrent connections, {lib}: {sample['wall']:.2f}s wall, {sample['cpu']:.2f}s CPU, "
            f"{sample['rss_mb']:.0f} MB, {sample['threads']} threads, {sample['fds']} fds, rc {sample['rc']}")
        return sample

    def logins(self, n: int, parallel: int) -> dict[str, Any]:
        """What any SSH tool pays before it runs anything: OpenSSH ``ssh host true`` to hosts h1..hN,
        ``parallel`` at a time (sshd, PAM and the session on each host, on the cores the controller shares)."""
        def login(i: int) -> int:
            return subprocess.run(["ssh", "-F", str(self.box.ssh_config_path), "-o", "BatchMode=yes", f"h{i}", "true"],
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=False).returncode
        host0, t0 = self.box.cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            codes = list(pool.map(login, range(1, n + 1)))
        sample = {"hosts": n, "parallel": parallel, "wall": round(time.perf_counter() - t0, 3),
                  "host_cpu": round(self.box.cpu_seconds() - host0, 3), "ok": not any(codes)}
        log(f"  logins-N{n}: {sample['wall']:.2f}s wall, {sample['host_cpu']:.2f}s host CPU, ok {sample['ok']}")
        return sample

    def kdeploy(self, kind: str, n: int, parallel: int, tag: str) -> dict[str, Any]:
        command = ["verify"] if kind == "verify" else ["push"]
        if kind == "full":
            self.stamp(tag)
        argv = [str(BIN / "kdeploy"), *command, "all", "--inventory", str(self.inventory(n)), "--json",
                "--parallel", str(parallel)]
        host0 = self.box.cpu_seconds()
        sample, doc = run_watched(argv, self.logs / f"{tag}.log")
        sample["host_cpu"] = round(self.box.cpu_seconds() - host0, 3)
        want = {"full": "deployed", "noop": "unchanged", "verify": "healthy"}[kind]
        results = sorted({h["result"] for h in doc["hosts"]}) if doc else []
        sample["ok"] = bool(doc and doc["ok"] and results == [want] and len(doc["hosts"]) == n)
        sample["results"] = results
        if doc and not sample["ok"]:
            sample["errors"] = sorted({str(h.get("error")) for h in doc["hosts"] if not h["ok"]})[:3]
        log(f"  {tag}: {sample['wall']:.2f}s wall, {sample['cpu']:.2f}s CPU, {sample['host_cpu']:.2f}s host CPU, "
            f"{sample['rss_mb']:.0f} MB, "
            f"{sample['threads']} threads, {sample['fds']} fds ({sample['sockets']} sockets) {results}")
        return sample


def median_sample(samples: list[dict]) -> dict:
    """The run with the median wall (runs are few; keeps each figure from one real run)."""
    ordered = sorted(samples, key=lambda s: s["wall"])
    return ordered[(len(ordered) - 1) // 2]


def bench(args: argparse.Namespace, report: dict) -> None:
    box = Sandbox(instance=args.instance, sglang=False)
    top = max(args.sizes)
    work = Path(tempfile.mkdtemp(prefix="kdeploy-scale-"))
    try:
        report["boot"] = [boot(box, top)]
        if args.linger:  # root's systemd user manager stays up between logins instead of starting per login
            for host in box.hosts():
                box.exec(host.name, ["loginctl", "enable-linger", "root"])
        f = Fleet(box, work, args.payload, args.logs)
        log(f"first install on {top} hosts (untimed; every timed push replaces a running release)")
        first = f.kdeploy("full", top, DEFAULT_PARALLEL, f"first-N{top}")
        report["first_install"] = first
        if not first["ok"]:
            raise RuntimeError(f"the first install failed: {first.get('errors') or first.get('error')}")
        running = report["boot"][0]["mem_available_before_mb"] - mem_available_mb()
        report["boot"][0]["mem_running_per_host_mb"] = round(running / top, 1)
        runs: dict[str, dict] = report["runs"]
        for n in args.sizes:
            report["logins"][str(n)] = median_sample([f.logins(n, DEFAULT_PARALLEL) for _ in range(args.runs)])
            for kind in KINDS:
                samples = [f.kdeploy(kind, n, DEFAULT_PARALLEL, f"{kind}-N{n}-p{DEFAULT_PARALLEL}-r{r}")
                           for r in range(1, args.runs + 1)]
                runs[f"{kind}/{n}/{DEFAULT_PARALLEL}"] = {"kind": kind, "hosts": n, "parallel": DEFAULT_PARALLEL,
                                                          **median_sample(samples), "all": samples}
        for parallel in args.parallel:
            if parallel == DEFAULT_PARALLEL:
                continue
            for kind in KINDS:
                samples = [f.kdeploy(kind, top, parallel, f"{kind}-N{top}-p{parallel}-r{r}")
                           for r in range(1, args.runs + 1)]
                runs[f"{kind}/{top}/{parallel}"] = {"kind": kind, "hosts": top, "parallel": parallel,
                                                    **median_sample(samples), "all": samples}
        if args.conns:
            for lib in ("paramiko", "asyncssh"):
                report["connections"][lib] = {"hosts": top, **median_sample(
                    [f.connections(lib, top) for _ in range(args.runs)])}
    finally:
        t0 = time.monotonic()
        try:
            box.down()
            log(f"sandbox down in {time.monotonic() - t0:.1f}s")
        except Exception as exc:
            report.setdefault("notes", []).append(f"sandbox down failed: {exc}")
            log(f"sandbox down failed: {exc}")
        shutil.rmtree(work, ignore_errors=True)


def boot_only(args: argparse.Namespace, report: dict) -> None:
    box = Sandbox(instance=args.instance, sglang=False)
    for n in args.boot_sizes:
        try:
            report["boot"].append(boot(box, n))
        finally:
            t0 = time.monotonic()
            box.down()
            report["boot"][-1]["down_s"] = round(time.monotonic() - t0, 1)
            log(f"N={n}: down in {report['boot'][-1]['down_s']}s")


# ------------------------------------------------------------------------------------------ summary


def summarise(report: dict) -> None:
    runs = report["runs"]
    slopes = {}
    for kind in KINDS:
        pts = [(r["hosts"], r) for r in runs.values() if r["kind"] == kind and r["parallel"] == DEFAULT_PARALLEL]
        if len(pts) < 2:
            continue
        slopes[kind] = {m: procwatch.slope([(n, r[m]) for n, r in pts])
                        for m in ("wall", "cpu", "rss_mb", "threads", "fds", "sockets")}
        slopes[kind] = {m: round(v, 4) if v is not None else None for m, v in slopes[kind].items()}
    report["slopes_per_host"] = slopes
    targets = []
    for what, kind, size, metric, limit in TARGETS:
        if size is None:
            value = slopes.get(kind, {}).get(metric)
            measured = f"{value:+.4f} s/host" if value is not None else None
        else:
            run = runs.get(f"{kind}/{size}/{DEFAULT_PARALLEL}")
            value = run[metric] if run else None
            measured = f"{value:.2f}" if value is not None else None
            floor = report["logins"].get(str(size))
            if measured and metric == "wall" and floor:
                measured += f" (bare `ssh host true` to the same {size} hosts: {floor['wall']:.2f})"
        targets.append({"target": what, "limit": limit, "measured": measured,
                        "met": None if value is None else value <= limit if metric != "wall" else value < limit})
    top = max((r["hosts"] for r in runs.values()), default=0)
    by_p = sorted({r["parallel"] for r in runs.values() if r["hosts"] == top})
    sizes = sorted({r["hosts"] for r in runs.values()})
    for metric in ("threads", "fds", "sockets"):
        # Below --parallel every host runs at once: the bound is the fleet size there, so only N >= it count.
        by_n = {n: runs[key][metric] for n in sizes
                if n >= DEFAULT_PARALLEL and (key := f"full/{n}/{DEFAULT_PARALLEL}") in runs}
        if len(by_n) < 2:
            continue
        vals = {p: runs[f"full/{top}/{p}"][metric] for p in by_p if f"full/{top}/{p}" in runs}
        measured = "by N: " + ", ".join(f"{n}:{v}" for n, v in by_n.items())
        if len(vals) > 1:
            measured += f"; at N={top} by --parallel: " + ", ".join(f"{p}:{v}" for p, v in vals.items())
        targets.append({"target": f"full push: peak {metric} bounded by --parallel, not by the fleet size",
                        "limit": f"flat over N at --parallel {DEFAULT_PARALLEL} (spread <= 8)", "measured": measured,
                        "met": max(by_n.values()) - min(by_n.values()) <= 8})
    report["targets"] = targets


def print_tables(report: dict) -> str:
    lines = []
    for b in report.get("boot", []):
        lines.append(f"boot {b['hosts']:>3} hosts: {b['boot_s']:6.1f}s, {b['mem_used_mb']} MB "
                     f"({b['mem_per_host_mb']} MB/host idle"
                     + (f", {b['mem_running_per_host_mb']} MB/host with the service" if "mem_running_per_host_mb" in b
                        else "") + (f"; down {b['down_s']}s" if "down_s" in b else "") + ")")
    runs = report["runs"]
    if runs:
        lines.append("")
        lines.append(f"{'kind':<7}{'hosts':>6}{'par':>5}{'wall s':>9}{'CPU s':>8}{'host s':>8}{'RSS MB':>8}"
                     f"{'threads':>8}{'fds':>6}{'socks':>6}  ok")
        for r in sorted(runs.values(), key=lambda r: (r["parallel"] != DEFAULT_PARALLEL, KINDS.index(r["kind"]),
                                                     r["hosts"], r["parallel"])):
            lines.append(f"{r['kind']:<7}{r['hosts']:>6}{r['parallel']:>5}{r['wall']:>9.2f}{r['cpu']:>8.2f}"
                         f"{r.get('host_cpu', float('nan')):>8.2f}{r['rss_mb']:>8.0f}{r['threads']:>8}"
                         f"{r['fds']:>6}{r['sockets']:>6}  "
                         f"{'ok' if r['ok'] else 'FAILED ' + str(r.get('errors') or r.get('error'))}")
    for n, g in report.get("logins", {}).items():
        lines.append(f"logins {int(n):>5}{g['parallel']:>5}{g['wall']:>9.2f}{'':>8}{g['host_cpu']:>8.2f}"
                     "  (OpenSSH `ssh host true` to every host: the SSH floor)")
    for kind, sl in report.get("slopes_per_host", {}).items():
        lines.append(f"slope per added host, {kind:<6}: " + ", ".join(
            f"{m} {v:+.4f}" for m, v in sl.items() if v is not None))
    for lib, c in report.get("connections", {}).items():
        lines.append(f"{c['hosts']} concurrent connections + one command, {lib:<8}: {c['wall']:.2f}s wall, "
                     f"{c['cpu']:.2f}s CPU, {c['rss_mb']:.0f} MB peak RSS, {c['threads']} threads, {c['fds']} fds"
                     + ("" if c["ok"] else f"  FAILED: {c.get('error')}"))
    if report.get("targets"):
        lines.append("")
        lines.append("targets (issue 16):")
        for t in report["targets"]:
            mark = {True: "PASS", False: "MISS", None: "n/a "}[t["met"]]
            lines.append(f"  [{mark}] {t['target']}: {t['measured']} (target {t['limit']})")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(report: dict, stem: Path) -> Path | None:
    runs = [r for r in report["runs"].values() if r["parallel"] == DEFAULT_PARALLEL]
    if not runs:
        return None
    panels = [("wall", "wall (s)"), ("cpu", "controller CPU (s)"), ("rss_mb", "peak RSS (MB)"),
              ("threads", "peak threads"), ("fds", "peak open fds")]
    series = {kind: sorted((r["hosts"], r) for r in runs if r["kind"] == kind) for kind in KINDS}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(series, panels, stem.with_suffix(".svg"))
    top = max(r["hosts"] for r in report["runs"].values())
    by_p = {kind: sorted((r["parallel"], r["wall"]) for r in report["runs"].values()
                         if r["kind"] == kind and r["hosts"] == top) for kind in KINDS}
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (metric, label) in zip(axes.flat, panels, strict=False):
        for kind, pts in series.items():
            if pts:
                ax.plot([n for n, _ in pts], [r[metric] for _, r in pts], marker="o", label=kind)
        ax.set_xlabel("hosts")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    ax = axes.flat[len(panels)]
    for kind, pts in by_p.items():
        if pts:
            ax.plot([p for p, _ in pts], [w for _, w in pts], marker="o", label=kind)
    ax.set_xlabel("--parallel")
    ax.set_title(f"wall (s) at {top} hosts by --parallel")
    ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(f"kdeploy at scale, --parallel {DEFAULT_PARALLEL} ({report['meta']['commit']})")
    fig.tight_layout()
    path = stem.with_suffix(".png")
    fig.savefig(path, dpi=100)
    return path


def _plot_svg(series: dict, panels: list, path: Path) -> Path:
    """A small hand-written SVG (no matplotlib): one panel per metric, one polyline per kind."""
    w, h, pad = 260, 200, 34
    colors = {"full": "#d62728", "noop": "#1f77b4", "verify": "#2ca02c"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h + 20}" '
             'font-family="sans-serif" font-size="10">']
    xs = sorted({n for pts in series.values() for n, _ in pts})
    for i, (metric, label) in enumerate(panels):
        ox = i * w
        ys = [r[metric] for pts in series.values() for _, r in pts] or [1]
        ymax = max(ys) * 1.1 or 1
        def px(n: float, y: float, ox: int = ox, ymax: float = ymax) -> tuple[float, float]:
            x = ox + pad + (n - xs[0]) / max(1, xs[-1] - xs[0]) * (w - 2 * pad)
            return x, h - pad - y / ymax * (h - 2 * pad)
        parts.append(f'<text x="{ox + w / 2}" y="14" text-anchor="middle">{label}</text>')
        parts.append(f'<line x1="{ox + pad}" y1="{h - pad}" x2="{ox + w - pad}" y2="{h - pad}" stroke="black"/>')
        parts.append(f'<line x1="{ox + pad}" y1="{pad}" x2="{ox + pad}" y2="{h - pad}" stroke="black"/>')
        parts.append(f'<text x="{ox + pad - 3}" y="{pad + 4}" text-anchor="end">{ymax:.3g}</text>')
        for n in xs:
            x, _ = px(n, 0)
            parts.append(f'<text x="{x}" y="{h - pad + 12}" text-anchor="middle">{n}</text>')
        for kind, pts in series.items():
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (px(n, r[metric]) for n, r in pts))
            parts.append(f'<polyline fill="none" stroke="{colors[kind]}" stroke-width="2" points="{coords}"/>')
    for j, kind in enumerate(KINDS):
        parts.append(f'<text x="{10 + 60 * j}" y="{h + 14}" fill="{colors[kind]}">{kind}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return path


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_ints, default=[16, 32, 64, 128], help="fleet sizes (comma list)")
    p.add_argument("--parallel", type=_ints, default=[16, 64, 128],
                   help="--parallel values compared at the largest size (comma list)")
    p.add_argument("--runs", type=int, default=1, help="runs per measurement (the median-wall run is reported)")
    p.add_argument("--no-conns", dest="conns", action="store_false",
                   help="skip the concurrent-connections comparison, paramiko vs asyncssh (needs asyncssh)")
    p.add_argument("--boot-sizes", type=_ints, default=None,
                   help="only boot the sandbox at each of these sizes and measure boot time and memory")
    p.add_argument("--linger", action="store_true",
                   help="`loginctl enable-linger root` on every host first (no user manager start per SSH login)")
    p.add_argument("--instance", type=int, default=6, help="sandbox instance (default 6)")
    p.add_argument("--payload", type=Path, default=ROOT / "kernels" / "kdtree")
    p.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    args = p.parse_args(argv)
    if args.conns and subprocess.run([sys.executable, "-c", "import asyncssh"], check=False).returncode:
        log("asyncssh is not installed (pip install asyncssh): no paramiko/asyncssh comparison")
        args.conns = False
    if os.geteuid() != 0:
        print("bench/scale.py needs root (it boots sandbox hosts)", file=sys.stderr)
        return 2
    args.out = args.out.absolute()
    args.logs = args.out.with_suffix("").parent / (args.out.stem + "-logs")
    shutil.rmtree(args.logs, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    report: dict[str, Any] = {
        "meta": {"commit": commit, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "cpus": os.cpu_count(), "mem_total_mb": round(os.sysconf("SC_PHYS_PAGES")
                                                                * os.sysconf("SC_PAGE_SIZE") / 2**20),
                 "kernel": platform.release(), "python": platform.python_version(), "limits": limits(),
                 "sizes": args.sizes, "parallel": args.parallel, "runs": args.runs, "linger": args.linger,
                 "service": "reference server tp=1 (light_service), gate on 1 worker"},
        "boot": [], "runs": {}, "logins": {}, "connections": {}}
    rc = 0
    try:
        if args.boot_sizes:
            boot_only(args, report)
        else:
            bench(args, report)
    except KeyboardInterrupt:
        report["error"] = "interrupted"
        rc = 130
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
        rc = 1
    summarise(report)
    report["table"] = print_tables(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    if report["runs"]:
        path = plot(report, args.out.with_suffix(""))
        log(f"plot: {path}")
    log(f"results: {args.out}; logs: {args.logs}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
