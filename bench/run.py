#!/usr/bin/env python3
"""kdeploy benchmarks (issue 7): kdeploy against Ansible and the hand workflow, on sandbox fleets.

For each fleet size N (default 1, 4, 8, 16) this boots N sandbox hosts (systemd-nspawn, real systemd +
sshd + journald) and measures, on those same hosts, wall time and controller CPU of:

  kdeploy-full   ``kdeploy push all --json``: new payload + changed unit + restart + the whole gate
  kdeploy-noop   the same push again: nothing changed (asserted: every host ``unchanged``, no upload,
                 no restart phase, InvocationIDs unchanged)
  kdeploy-verify ``kdeploy verify all --workers 8 --json``
  ansible        ``ansible-playbook bench/ansible/deploy.yml`` (forks=N, pipelining, host key checking on)
  hand           ``bench/hand.sh``: the field-notes workflow, host after host, 30 s poll (slow: only some N)

plus, on one fleet, the gate latency: readiness (REFSERVER_SLOW_START=5: journal time of the "ready" line
-> the listener's ("ready", "ok")) and failure (REFSERVER_EXIT_AT_START=3 over a good release: journal
time of "Main process exited" -> the listener's first failed phase).

Controller CPU = user+sys of the tool's whole process tree: each tool is a child process reaped with
os.wait4 (its rusage includes every descendant it waited for). Ansible's ControlPersist ssh masters
outlive ansible-playbook: this process is a child subreaper, so they are re-parented here, stopped after
each run (so every run starts cold, like the kdeploy CLI does) and their CPU is added to Ansible's.
Host CPU = CPU used inside all sandbox hosts during the run (the sandbox's cgroup), for context: on this
machine the hosts share the same cores as the controller.

Results: a table per N on stdout, bench/results/latest.json, bench/results/deploy-time.png.
Uses sandbox instance 5 (``--instance``); always torn down, also on Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from kdeploy.core import inventory  # noqa: E402
from kdeploy.core.render import render_unit  # noqa: E402
from kdeploy.flows import fleet  # noqa: E402
from kdeploy_lab import floor  # noqa: E402
from kdeploy_lab.demo import PLUGIN_LOADED, demo_service, project_dir  # noqa: E402
from kdeploy_lab.procwatch import slope  # noqa: E402
from kdeploy_lab.sandbox import HOST_VENV, Sandbox  # noqa: E402

SERVICE = "sglang-demo"           # kdeploy's service (the demo service, reference server + kdtree payload)
ANS_SERVICE, ANS_PORT, ANS_ROOT = "sglang-ans", 30001, "/srv/kdeploy-ans"
HAND_SERVICE, HAND_PORT, HAND_ROOT = "sglang-hand", 30002, "/srv/kdeploy-hand"
MODEL = "kimi-k2.6"
MARKER = PLUGIN_LOADED            # what the demo gate counts per worker
WORKERS = 8
READY_LINE = "The server is fired up and ready to roll!"
TOOLS = ("kdeploy-full", "kdeploy-noop", "kdeploy-verify", "ansible", "hand")
LABELS = {
    "kdeploy-full": "kdeploy push (full)",
    "kdeploy-noop": "kdeploy push (no-op)",
    "kdeploy-verify": "kdeploy verify --workers 8",
    "ansible": "ansible-playbook",
    "hand": "hand workflow (30 s poll)",
}
PR_SET_CHILD_SUBREAPER = 36


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ measuring


@dataclass
class Sample:
    wall: float
    cpu: float            # controller: user + sys of the tool's process tree
    user: float
    sys: float
    host_cpu: float       # inside all sandbox hosts during the run
    load: float           # 1-min load average when the run started (other work on the machine)
    rc: int
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        out = {"wall": round(self.wall, 3), "cpu": round(self.cpu, 3), "user": round(self.user, 3),
               "sys": round(self.sys, 3), "host_cpu": round(self.host_cpu, 3), "load": round(self.load, 2),
               "rc": self.rc}
        out.update(self.extra)
        return out


def _children_named(names: set[str]) -> list[int]:
    """Our direct children (also orphans re-parented to us) whose comm is in ``names``."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and comm in names:
            found.append(int(entry))
    return found


def _reap_orphans(names: set[str]) -> tuple[float, float, int]:
    """Stop re-parented leftovers of a tool run (Ansible's ControlPersist ssh masters) and collect their
    CPU. Only processes that are our children and carry one of ``names``; ended by pid."""
    user = system = 0.0
    pids = _children_named(names)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in pids:
        try:
            _, _, ru = os.wait4(pid, 0)
        except ChildProcessError:
            continue
        user += ru.ru_utime
        system += ru.ru_stime
    return user, system, len(pids)


def measure(argv: list[str], *, box: Sandbox, env: dict | None = None, cwd: Path | None = None,
            log_to: Path | None = None, orphans: set[str] | None = None,
            timeout: float = 1800) -> tuple[Sample, str, str]:
    """Run one tool as a child process; wall time, and its process tree's CPU from os.wait4."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        load = os.getloadavg()[0]
        h0 = box.cpu_seconds()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                                start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        h1 = box.cpu_seconds()
        user, system = ru.ru_utime, ru.ru_stime
        extra: dict = {}
        if orphans:
            ou, osys, count = _reap_orphans(orphans)
            user, system = user + ou, system + osys
            extra["reaped_ssh_masters"] = count
            extra["ssh_masters_cpu"] = round(ou + osys, 3)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if log_to is not None:
        log_to.parent.mkdir(parents=True, exist_ok=True)
        log_to.write_text(f"$ {shlex.join(argv)}\n# rc={proc.returncode} wall={wall:.2f}s\n"
                          f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    sample = Sample(wall, user + system, user, system, h1 - h0, load, proc.returncode, extra)
    return sample, stdout, stderr


def stats(values: list[float]) -> dict:
    vals = [v for v in values if v == v]  # drop NaN
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3),
            "max": round(max(vals), 3), "n": len(vals)}


# ------------------------------------------------------------------------------------------ the fleet


class BenchError(Exception):
    pass


def make_sandbox(instance: int) -> Sandbox:
    """The sandbox WITHOUT the real-SGLang venv: the bench runs the reference server from the small host
    venv (workers ready in ~1 s), so that the tools' own cost is measured, not torch imports."""
    if "sglang" in inspect.signature(Sandbox).parameters:
        return Sandbox(instance=instance, sglang=False)
    return Sandbox(instance=instance)


def bench_service(payload: Path, **overrides: Any) -> dict:
    """demo_service() pinned to what the bench measures: the reference server from the host venv, tp=8,
    gate on 8 workers each logging the kdtree "plugin loaded" marker, 0.25 s gate poll."""
    kw: dict[str, Any] = {}
    if "sglang" in inspect.signature(demo_service).parameters:
        kw["sglang"] = False
    svc = demo_service(project_dir(), payload=str(payload), **kw)
    svc["python"] = f"{HOST_VENV}/bin/python"
    svc["gate"] = {**svc.get("gate", {}), "workers": WORKERS, "poll_interval": 0.25, "markers": [MARKER]}
    svc.update(overrides)
    return svc


class Fleet:
    """One booted sandbox fleet of N hosts plus the files every tool's run needs."""

    def __init__(self, box: Sandbox, n: int, work: Path, payload_src: Path, keep_logs: Path) -> None:
        self.box, self.n, self.work = box, n, work
        self.names = [h.name for h in box.hosts()]
        self.logs = keep_logs
        self.payload = work / "payload"
        shutil.copytree(payload_src, self.payload)
        self.inv = work / "inventory.yaml"

    # --- helpers on the hosts (untimed) ------------------------------------------------------------

    def ssh(self, host: str, command: str, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(["ssh", "-F", str(self.box.ssh_config_path), host, command],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if check and proc.returncode != 0:
            raise BenchError(f"{host}: `{command}` failed: {proc.stderr.strip()[-300:]}")
        return proc.stdout

    def on_all(self, fn) -> list:
        with ThreadPoolExecutor(max_workers=min(16, len(self.names))) as pool:
            return list(pool.map(fn, self.names))

    def invocations(self, service: str) -> dict[str, str]:
        outs = self.on_all(lambda h: self.ssh(h, f"systemctl show -p InvocationID --value {service}").strip())
        return dict(zip(self.names, outs, strict=True))

    def stop(self, service: str) -> None:
        self.on_all(lambda h: self.ssh(h, f"systemctl stop {service}", check=False))

    def stamp(self, text: str) -> None:
        """A new payload: one file of it changes each run (the tools ship only what changed)."""
        (self.payload / "bench_stamp.txt").write_text(text + "\n")

    def service(self, run: str, name: str = SERVICE, port: int | None = None, root: str | None = None,
                **env: str) -> dict:
        svc = bench_service(self.payload, name=name)
        svc["env"] = {**svc["env"], "BENCH_RUN": run, **env}
        if port is not None:
            svc["sglang"] = {**svc["sglang"], "port": port}
        if root is not None:
            svc["remote_root"] = root
        return svc

    def write_inventory(self, path: Path, run: str, **kw: Any) -> Path:
        self.box.write_inventory(path, self.service(run, **kw))
        return path

    def kdeploy(self, *args: str, tag: str) -> tuple[Sample, dict]:
        argv = [str(BIN / "kdeploy"), *args, "--inventory", str(self.inv), "--json"]
        sample, out, err = measure(argv, box=self.box, log_to=self.logs / f"N{self.n}-{tag}.log")
        try:
            doc = json.loads(out)
        except json.JSONDecodeError:
            raise BenchError(f"kdeploy {' '.join(args)} (exit {sample.rc}) printed no JSON; stderr: "
                             f"{err.strip()[-500:]}") from None
        return sample, doc


def _results(doc: dict) -> dict[str, str]:
    return {h["host"]: h["result"] for h in doc["hosts"]}


def _bytes_sent(doc: dict) -> int:
    total = 0
    for h in doc["hosts"]:
        for p in h["phases"]:
            m = re.search(r"(\d+) bytes sent", p.get("detail", ""))
            if p["name"] == "stage" and m:
                total += int(m.group(1))
    return total


def _phase_times(doc: dict) -> dict[str, float]:
    """Median seconds per phase over the hosts (where the tool's time goes)."""
    by: dict[str, list[float]] = {}
    for h in doc["hosts"]:
        for p in h["phases"]:
            by.setdefault(p["name"], []).append(p["seconds"])
    return {k: round(statistics.median(v), 3) for k, v in by.items()}


# ------------------------------------------------------------------------------------------ the tools


def bench_kdeploy(f: Fleet, runs: int, out: dict) -> None:
    # untimed: the first install, so every timed push replaces a running release (the usual deploy)
    f.stamp("warm")
    f.write_inventory(f.inv, "0")
    sample, doc = f.kdeploy("push", "all", tag="kdeploy-warm")
    if not doc["ok"]:
        raise BenchError(f"first (untimed) kdeploy push failed: {_results(doc)}; "
                         f"{[h.get('error') for h in doc['hosts']][:2]} -- is the payload {f.payload} broken?")

    samples = []
    for r in range(1, runs + 1):
        f.stamp(f"full-{r}")
        f.write_inventory(f.inv, str(r))
        since = time.time()
        sample, doc = f.kdeploy("push", "all", tag=f"kdeploy-full-{r}")
        results = _results(doc)
        sample.extra.update(ok=doc["ok"] and all(v == "deployed" for v in results.values()),
                            results=sorted(set(results.values())), bytes_sent=_bytes_sent(doc),
                            phases=_phase_times(doc), **restart_floor(f, since, sample.wall))
        if not sample.extra["ok"]:
            sample.extra["errors"] = sorted({str(h.get("error")) for h in doc["hosts"] if not h["ok"]})[:3]
        ratio = sample.extra.get("floor_ratio")
        log(f"  N={f.n} kdeploy push full #{r}: {sample.wall:.2f}s wall, {sample.cpu:.2f}s CPU, "
            f"{sorted(set(results.values()))}, floor {sample.extra.get('floor_s')}s"
            + (f" -> {ratio:.2f}x the floor ({sample.extra['before_stop_s']:.2f}s to the stop requests, "
               f"{sample.extra['after_ready_s']:.2f}s after the last ready line)" if ratio else ""))
        samples.append(sample)
    out["kdeploy-full"] = samples

    before = f.invocations(SERVICE)
    samples = []
    for r in range(1, runs + 1):
        sample, doc = f.kdeploy("push", "all", tag=f"kdeploy-noop-{r}")
        results = _results(doc)
        restarts = sum(1 for h in doc["hosts"] for p in h["phases"] if p["name"] in ("activate", "restart"))
        uploads = sum(1 for h in doc["hosts"] for p in h["phases"]
                      if p["name"] == "stage" and "no upload" not in p["detail"])
        after = f.invocations(SERVICE)
        sample.extra.update(
            ok=doc["ok"] and all(v == "unchanged" for v in results.values()) and restarts == 0 and uploads == 0
            and after == before,
            results=sorted(set(results.values())), bytes_sent=_bytes_sent(doc), restart_phases=restarts,
            upload_phases=uploads, invocations_unchanged=after == before, phases=_phase_times(doc))
        log(f"  N={f.n} kdeploy push no-op #{r}: {sample.wall:.2f}s wall, {sample.cpu:.2f}s CPU, "
            f"{sorted(set(results.values()))}, invocations unchanged: {after == before}")
        samples.append(sample)
    out["kdeploy-noop"] = samples

    samples = []
    for r in range(1, runs + 1):
        sample, doc = f.kdeploy("verify", "all", "--workers", str(WORKERS), tag=f"kdeploy-verify-{r}")
        results = _results(doc)
        sample.extra.update(ok=doc["ok"] and all(v == "healthy" for v in results.values()),
                            results=sorted(set(results.values())), phases=_phase_times(doc))
        log(f"  N={f.n} kdeploy verify #{r}: {sample.wall:.2f}s wall, {sample.cpu:.2f}s CPU")
        samples.append(sample)
    out["kdeploy-verify"] = samples


def restart_floor(f: Fleet, since: float, wall: float) -> dict:
    """The floor of the push that just ran, from the hosts' journals (kdeploy_lab.floor): per host from
    systemd's "Stopping" entry to the ready line; the slowest host; and the push's wall over it. Beside it,
    where the rest of the wall went: from the push's start to the hosts' stop requests (median host), and
    from the last ready line to the push's end."""
    texts = f.on_all(lambda h: f.ssh(h, f"journalctl -u {SERVICE} -o json "
                                        f"--output-fields=MESSAGE,SYSLOG_IDENTIFIER --since=@{int(since) - 1}",
                                     check=False))
    windows = {h: floor.restart_window(t, since) for h, t in zip(f.names, texts, strict=True)}
    found = floor.fleet_floor(windows)
    if found is None:
        return {"floor_error": f"no complete restart in the journal of {[h for h, w in windows.items() if not w]}"}
    seconds, host = found
    stops = [w[0] for w in windows.values() if w]
    return {"floor_s": round(seconds, 3), "floor_host": host, "floor_ratio": round(wall / seconds, 3),
            "before_stop_s": round(statistics.median(stops) - since, 3),
            "after_ready_s": round(since + wall - max(w[1] for w in windows.values() if w), 3)}


def bench_gate_latency(f: Fleet, runs: int) -> dict:
    """Readiness and failure noticed by the gate, against the journal's own timestamps."""
    def push_with(run: str, **env: str) -> tuple[Any, list[tuple[float, str, str, str]], float]:
        f.write_inventory(f.inv, run, **env)
        events: list[tuple[float, str, str, str]] = []
        lock = threading.Lock()

        def listener(host: str, phase: str, status: str) -> None:
            now = time.time()
            with lock:
                events.append((now, host, phase, status))

        started = time.time()
        report = fleet.push(inventory.load(f.inv), "all", listener=listener)
        return report, events, started

    def journal(host: str, args: str) -> list[dict]:
        text = f.ssh(host, f"journalctl --no-pager -o json --output-fields=MESSAGE {args}")
        recs = []
        for line in text.splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return recs

    import logging

    logging.getLogger("paramiko").setLevel(logging.CRITICAL)   # refused probes of a dead port are expected
    failure: list[float] = []
    failure_runs = []
    for r in range(1, runs + 1):
        f.stamp(f"fail-{r}")
        report, events, started = push_with(f"fail-{r}", REFSERVER_EXIT_AT_START="3")
        per_host = {}
        for host in f.names:
            seen = next((t for t, h, p, s in sorted(events) if h == host and s == "fail" and p != "done"), None)
            phase = next((p for t, h, p, s in sorted(events) if h == host and s == "fail" and p != "done"), None)
            exits = [int(rec["__REALTIME_TIMESTAMP"]) / 1e6
                     for rec in journal(host, f"-u {SERVICE}.service --since @{int(started) - 1}")
                     if "Main process exited" in str(rec.get("MESSAGE")) and "status=3" in str(rec.get("MESSAGE"))]
            exits = [t for t in exits if t >= started - 0.5]
            if seen is None or not exits:
                per_host[host] = {"error": "no failed phase seen" if seen is None else "no exit in the journal"}
                continue
            latency = seen - exits[0]
            failure.append(latency)
            per_host[host] = {"latency": round(latency, 3), "phase": phase}
        results = sorted({h.result for h in report.hosts})
        failure_runs.append({"run": r, "results": results, "hosts": per_host})
        log(f"  gate failure run {r}: results {results}, latencies "
            f"{[v.get('latency') for v in per_host.values()]}")

    ready: list[float] = []
    ready_runs = []
    for r in range(1, runs + 1):
        f.stamp(f"slow-{r}")
        report, events, started = push_with(f"slow-{r}", REFSERVER_SLOW_START="5")
        inv = f.invocations(SERVICE)
        per_host = {}
        for host in f.names:
            seen = next((t for t, h, p, s in events if h == host and p == "ready" and s == "ok"), None)
            lines = [int(rec["__REALTIME_TIMESTAMP"]) / 1e6
                     for rec in journal(host, shlex.quote(f"_SYSTEMD_INVOCATION_ID={inv[host]}"))
                     if READY_LINE in str(rec.get("MESSAGE"))]
            if seen is None or not lines:
                per_host[host] = {"error": "ready phase did not pass" if seen is None else "no ready line"}
                continue
            latency = seen - lines[0]
            ready.append(latency)
            per_host[host] = {"latency": round(latency, 3)}
        results = sorted({h.result for h in report.hosts})
        ready_runs.append({"run": r, "results": results, "hosts": per_host})
        log(f"  gate readiness run {r}: results {results}, latencies "
            f"{[v.get('latency') for v in per_host.values()]}")
    return {
        "hosts": f.n, "poll_interval": 0.25,
        "ready": {**stats(ready), "per_run_worst": [max((v["latency"] for v in run["hosts"].values()
                                                          if "latency" in v), default=None) for run in ready_runs],
                  "runs": ready_runs},
        "failure": {**stats(failure), "per_run_worst": [max((v["latency"] for v in run["hosts"].values()
                                                              if "latency" in v), default=None)
                                                         for run in failure_runs],
                    "runs": failure_runs},
    }


def install_direct(f: Fleet, service: str, port: int, dest: str, units: dict[str, str]) -> None:
    """Untimed first install of a tool's service (payload, unit, started, healthy), so that every timed
    run is a redeploy of a running service, as for kdeploy. One tar over ssh per host."""
    tarball = subprocess.run(["tar", "-C", str(f.payload), "-cf", "-", "."], capture_output=True,
                             check=True).stdout

    def one(host: str) -> None:
        cfg = ["ssh", "-F", str(f.box.ssh_config_path), host]
        subprocess.run([*cfg, f"mkdir -p {dest} && tar -x -C {dest}"], input=tarball, check=True,
                       capture_output=True, timeout=120)
        subprocess.run([*cfg, f"cat > /etc/systemd/system/{service}.service && systemctl daemon-reload && "
                              f"systemctl enable --now --quiet {service}"],
                       input=units[host].encode(), check=True, capture_output=True, timeout=120)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            code = subprocess.run([*cfg, f"curl -s -o /dev/null -w %{{http_code}} http://127.0.0.1:{port}/health"],
                                  capture_output=True, text=True, check=False, timeout=60).stdout.strip()
            if code == "200":
                return
            time.sleep(1)
        raise BenchError(f"{host}: {service} not healthy 180 s after its first install")
    f.on_all(one)


def bench_ansible(f: Fleet, runs: int, out: dict) -> None:
    adir = f.work / "ansible"
    units = adir / "units"
    units.mkdir(parents=True)
    ans_inv = adir / "kdeploy-inventory.yaml"   # only to render the same unit kdeploy would install

    def render(run: str) -> None:
        f.write_inventory(ans_inv, run, name=ANS_SERVICE, port=ANS_PORT, root=ANS_ROOT)
        loaded = inventory.load(ans_inv)
        for name, host in loaded.hosts.items():
            (units / f"{name}.service").write_text(render_unit(loaded, host))

    hosts = f.box.hosts()
    lines = ["[sandbox]", *(f"{h.name} ansible_host={h.address}" for h in hosts), "", "[sandbox:vars]",
             "ansible_user=root", f"ansible_ssh_private_key_file={f.box.key_path}",
             f"ansible_ssh_common_args='-F {f.box.ssh_config_path}'",
             "ansible_python_interpreter=/usr/bin/python3",
             f"svc={ANS_SERVICE}", f"port={ANS_PORT}", f"model={MODEL}", f"payload_dir={f.payload}",
             f"release_dir={ANS_ROOT}/{ANS_SERVICE}/current", f"units_dir={units}",
             f"marker='{MARKER}'", f"workers={WORKERS}"]
    (adir / "inventory.ini").write_text("\n".join(lines) + "\n")
    (adir / "ansible.cfg").write_text(
        "[defaults]\n"
        f"forks = {f.n}\n"
        "host_key_checking = True\n"
        "retry_files_enabled = False\n"
        "[ssh_connection]\n"
        "pipelining = True\n")

    def play(tag: str) -> tuple[Sample, str]:
        cp = Path(tempfile.mkdtemp(prefix="kdb-cp-"))   # short: ssh ControlPath sockets live here
        env = {**os.environ, "ANSIBLE_CONFIG": str(adir / "ansible.cfg"), "ANSIBLE_HOME": str(adir / "home"),
               "ANSIBLE_LOCAL_TEMP": str(adir / "tmp"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp),
               "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
        try:
            argv = [str(BIN / "ansible-playbook"), "-i", str(adir / "inventory.ini"),
                    str(BENCH / "ansible" / "deploy.yml")]
            sample, stdout, stderr = measure(
                argv, box=f.box, env=env, cwd=adir, log_to=f.logs / f"N{f.n}-{tag}.log", orphans={"ssh"})
        finally:
            shutil.rmtree(cp, ignore_errors=True)
        return sample, stdout + stderr

    f.stamp("ans-0")
    render("ans-0")
    install_direct(f, ANS_SERVICE, ANS_PORT, f"{ANS_ROOT}/{ANS_SERVICE}/current",
                   {h: (units / f"{h}.service").read_text() for h in f.names})
    samples = []
    for r in range(1, runs + 1):
        f.stamp(f"ans-{r}")
        render(f"ans-{r}")
        sample, text = play(f"ansible-{r}")
        recap = re.findall(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", text, re.M)
        sample.extra.update(ok=sample.rc == 0 and len(recap) == f.n and all(x[4] == "0" for x in recap),
                            recap={x[0]: {"ok": int(x[1]), "changed": int(x[2]), "failed": int(x[4])} for x in recap})
        log(f"  N={f.n} ansible-playbook #{r}: {sample.wall:.2f}s wall, {sample.cpu:.2f}s CPU "
            f"(ssh masters {sample.extra.get('ssh_masters_cpu')}s), exit {sample.rc}")
        samples.append(sample)
    out["ansible"] = samples


def bench_hand(f: Fleet, runs: int, out: dict) -> None:
    hdir = f.work / "hand"
    hdir.mkdir()
    inv = hdir / "kdeploy-inventory.yaml"
    f.write_inventory(inv, "hand-0", name=HAND_SERVICE, port=HAND_PORT, root=HAND_ROOT)
    loaded = inventory.load(inv)
    dest = f"{HAND_ROOT}/{HAND_SERVICE}/current"

    f.stamp("hand-0")
    install_direct(f, HAND_SERVICE, HAND_PORT, dest,   # untimed: the unit exists before hand.sh edits it
                   {h: render_unit(loaded, loaded.hosts[h]) for h in f.names})

    def hand(run: str, tag: str, poll: str | None = None) -> Sample:
        env = {**os.environ}
        if poll:
            env["HAND_POLL"] = poll
        argv = [str(BENCH / "hand.sh"), str(f.box.ssh_config_path), HAND_SERVICE, str(HAND_PORT), MODEL,
                str(f.payload), dest, run, *f.names]
        sample, _, _ = measure(argv, box=f.box, env=env, log_to=f.logs / f"N{f.n}-{tag}.log")
        return sample

    samples = []
    for r in range(1, runs + 1):
        f.stamp(f"hand-{r}")
        sample = hand(f"hand-{r}", f"hand-{r}")
        sample.extra["ok"] = sample.rc == 0
        log(f"  N={f.n} hand workflow #{r}: {sample.wall:.2f}s wall, {sample.cpu:.2f}s CPU, exit {sample.rc}")
        samples.append(sample)
    out["hand"] = samples


# ------------------------------------------------------------------------------------------ profiling


PROFILE_SNIPPET = r"""
import json, sys, threading, time
from collections import Counter
from pathlib import Path
from kdeploy.flows import fleet  # noqa: E402
from kdeploy.core import inventory  # noqa: E402
from kdeploy.ssh import remote, tunnel  # noqa: E402
from kdeploy.host import lock  # noqa: E402

calls = []
mutex = threading.Lock()

def wrap(cls, name, kind):
    orig = getattr(cls, name)
    def inner(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **kw)
        finally:
            dt = time.perf_counter() - t0
            what = str(a[0] if a else kw.get("command", "")).strip()
            with mutex:
                calls.append((self.host.name, kind, what.splitlines()[0][:70] if what else "", round(dt, 4)))
    setattr(cls, name, inner)

wrap(remote.Remote, "run", "run")
wrap(remote.Remote, "start", "start")
orig_release = lock.HeldLock.release
def release(self, finish=""):
    transport = self.channel.get_transport()
    name = transport.getpeername()[0] if transport else "?"
    t0 = time.perf_counter()
    try:
        return orig_release(self, finish)
    finally:
        host = next((h.name for h in inv.hosts.values() if h.address == name), name)
        with mutex:
            calls.append((host, "unlock", "finish script to the lock holder, close its stdin, wait for its exit",
                          round(time.perf_counter() - t0, 4)))
lock.HeldLock.release = release
orig_connect = remote.Remote.connect.__func__
def connect(cls, host, *a, **kw):
    t0 = time.perf_counter()
    try:
        return orig_connect(cls, host, *a, **kw)
    finally:
        with mutex:
            calls.append((host.name, "connect", f"{host.user}@{host.address}", round(time.perf_counter() - t0, 4)))
remote.Remote.connect = classmethod(connect)
orig_tcp = tunnel._ChannelBackend.connect_tcp
def connect_tcp(self, *a, **kw):
    t0 = time.perf_counter()
    try:
        return orig_tcp(self, *a, **kw)
    finally:
        with mutex:
            calls.append((self.remote.host.name, "http", f"direct-tcpip channel to 127.0.0.1:{self.port}",
                          round(time.perf_counter() - t0, 4)))
tunnel._ChannelBackend.connect_tcp = connect_tcp

inv = None
t0 = time.perf_counter()
inv = inventory.load(Path(sys.argv[1]))
t_load = time.perf_counter() - t0
report = fleet.push(inv, "all")
total = time.perf_counter() - t0
print(json.dumps({"load_inventory": round(t_load, 4), "push_total": round(total, 4),
                  "results": sorted({h.result for h in report.hosts}),
                  "phases": {h.host: [(p.name, p.seconds) for p in h.phases] for h in report.hosts[:1]},
                  "calls": calls}))
"""


def _library_push(f: Fleet) -> dict:
    """One push through the library API with every SSH round trip of every host recorded and timed."""
    proc = subprocess.run([sys.executable, "-c", PROFILE_SNIPPET, str(f.inv)], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": proc.stderr[-500:]}
    per_host: dict[str, list] = {}
    for host, kind, what, dt in doc["calls"]:
        per_host.setdefault(host, []).append({"kind": kind, "what": what, "s": dt})
    counts = [len(v) for v in per_host.values()]
    return {"total_s": doc["push_total"], "load_inventory_s": doc["load_inventory"], "results": doc["results"],
            "per_host": per_host, "round_trips_per_host": stats(counts)}


def _kind(call: dict) -> str:
    what = call["what"]
    if call["kind"] == "start":
        return "main-process exit watcher (1 idle channel)" if what.startswith("p=$PPID") else \
            "lock + state read (1 channel)"
    if call["kind"] != "run":
        return {"connect": "SSH connect (TCP, key exchange, auth)",
                "unlock": "history + prune + lock release (on the lock's channel)",
                "http": "HTTP request channel (gate)"}[call["kind"]]
    if what.startswith("systemctl show"):
        return "unit state read (systemctl show)"
    if what.startswith("old=$(systemctl show"):
        return "restart, followed on the host"
    if what.startswith("echo '@@kdeploy"):
        return "preflight checks"
    if what.startswith("journalctl"):
        return "journal read (markers)"
    if what.startswith("set -eu") or what.startswith("umask"):
        return "stage/activate script"
    if what.startswith("printf") or "history" in what:
        return "history append + prune"
    return "other command: " + what[:40]


def round_trip_summary(lib: dict) -> dict:
    """Per-host round trips of a library push, grouped by what they are for (median host)."""
    if "per_host" not in lib:
        return lib
    groups: dict[str, list[tuple[int, float]]] = {}
    for calls in lib["per_host"].values():
        by: dict[str, list[float]] = {}
        for c in calls:
            by.setdefault(_kind(c), []).append(c["s"])
        for k, v in by.items():
            groups.setdefault(k, []).append((len(v), sum(v)))
    return {k: {"count_median": statistics.median(c for c, _ in v), "seconds_median": round(
        statistics.median(t for _, t in v), 3)} for k, v in sorted(groups.items(), key=lambda kv: -max(
            c for c, _ in kv[1]))}


def profile_noop(f: Fleet) -> dict:
    """Why a no-op push takes what it takes: interpreter + imports, then per-host round trips."""
    prof = {}
    # 1. import cost of the CLI process (python -X importtime) in a no-op push, top modules by cumulative time
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kdeploy", "push", "all", "--inventory",
                           str(f.inv), "--json"], capture_output=True, text=True, check=False)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), len(m.group(3)), m.group(4)))
    top = max((r for r in rows if r[2] == "kdeploy.cli.app"), default=None)
    prof["import_kdeploy_cli_s"] = round(top[0] / 1e6, 3) if top else None
    heavy = sorted((r for r in rows if "." not in r[2] and r[2] != "kdeploy"), reverse=True)[:12]
    prof["imports_top"] = [{"module": name, "cumulative_s": round(us / 1e6, 3)} for us, _, name in heavy]
    # 2. bare interpreter start for reference
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    prof["python_startup_s"] = round(time.perf_counter() - t0, 3)
    # 3. the whole CLI under pyinstrument (main thread: startup, imports, fan-out, waiting)
    pyi = BIN / "pyinstrument"
    if pyi.exists():
        txt = RESULTS / f"profile-noop-N{f.n}.txt"
        subprocess.run([str(pyi), "-r", "text", "-o", str(txt), "-m", "kdeploy", "push", "all",
                        "--inventory", str(f.inv), "--json"], capture_output=True, check=False)
        prof["pyinstrument_report"] = str(txt.relative_to(ROOT)) if txt.exists() else None
    # 4. round trips per host, timed, with the library API (same code path as the CLI, no imports counted)
    lib = _library_push(f)
    if "per_host" not in lib:
        prof["round_trips_error"] = lib.get("error")
        return prof
    one = lib["per_host"].get("h1") or next(iter(lib["per_host"].values()), [])
    prof["library_push_total_s"] = lib["total_s"]
    prof["library_load_inventory_s"] = lib["load_inventory_s"]
    prof["round_trips_per_host"] = len(one)
    prof["round_trips_one_host"] = one
    prof["results"] = lib["results"]
    return prof


CATEGORIES = (   # first match wins; py-spy samples only threads that run (not idle ones) ~ CPU time
    ("interpreter start + imports", ("_find_and_load",)),
    ("SSH connect (key exchange, auth)", ("auth_handler.py", "kex_", "_parse_kex", "Transport.connect",
                                          "SSHClient.connect", "start_client")),
    ("SSH transport thread (packets, ciphers)", ("paramiko/transport.py", "paramiko/packet.py")),
    ("gate: HTTP over SSH channels", ("kdeploy/host/gate.py", "httpx", "httpcore")),
    ("payload hash, tar, render", ("kdeploy/core/release.py", "kdeploy/core/render.py", "jinja2")),
    ("inventory (YAML, pydantic)", ("kdeploy/core/inventory.py", "ruamel", "pydantic")),
    ("CLI output (rich, typer, JSON)", ("rich/", "typer/", "json/")),
    ("kdeploy per-host steps (other)", ("kdeploy/",)),
)


def profile_full(f: Fleet, measured_cpu: float | None) -> dict:
    """CPU of a full push by category, all threads: py-spy at 200 Hz, only samples holding the GIL (on this
    oversubscribed machine py-spy's idle detection counts runnable-but-waiting threads as busy; GIL
    samples add up to about the measured CPU). Shares are scaled to the median CPU of the timed runs."""
    spy = BIN / "py-spy"
    if not spy.exists():
        return {"error": "py-spy not installed"}
    f.stamp("pyspy")
    f.write_inventory(f.inv, "pyspy")
    raw = RESULTS / f"profile-full-N{f.n}.raw"
    rate = 200
    proc = subprocess.run([str(spy), "record", "-r", str(rate), "--gil", "-t", "-f", "raw", "-o", str(raw), "--",
                           sys.executable, "-m", "kdeploy", "push", "all", "--inventory", str(f.inv), "--json"],
                          capture_output=True, text=True, check=False)
    if not raw.exists():
        return {"error": f"py-spy failed: {proc.stderr.strip()[-300:]}"}
    cats: dict[str, int] = {}
    funcs: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        if all(fr.startswith("thread (") for fr in frames):
            cat = "interpreter, no Python frame (start/exit, C code)"
        else:
            cat = next((name for name, keys in CATEGORIES if any(k in stack for k in keys)), "other")
        cats[cat] = cats.get(cat, 0) + n
        inner = next((fr for fr in reversed(frames) if "kdeploy/" in fr), None)
        if inner:
            funcs[inner] = funcs.get(inner, 0) + n
    scale = (measured_cpu or total / rate) / max(total, 1)
    out = {
        "hosts": f.n, "rate_hz": rate, "gil_samples": total, "sampled_s": round(total / rate, 2),
        "scaled_to_cpu_s": measured_cpu,
        "by_category_share": {k: round(v / max(total, 1), 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "by_category_s": {k: round(v * scale, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "innermost_kdeploy_frames_s": {k: round(v * scale, 3)
                                       for k, v in sorted(funcs.items(), key=lambda kv: -kv[1])[:12]},
        "raw": str(raw.relative_to(ROOT)),
    }
    # the same push again through the instrumented library: which round trips each host makes
    f.stamp("roundtrips")
    f.write_inventory(f.inv, "roundtrips")
    lib = _library_push(f)
    out["round_trips_per_host"] = lib.get("round_trips_per_host")
    out["round_trips_by_purpose"] = round_trip_summary(lib)
    out["library_push_total_s"] = lib.get("total_s")
    return out


# ------------------------------------------------------------------------------------------ one N


def bench_size(n: int, args: argparse.Namespace, payload_src: Path, report: dict, work_root: Path) -> None:
    box = make_sandbox(args.instance)
    entry: dict[str, Any] = {"hosts": n, "tools": {}, "notes": []}
    report["sizes"][str(n)] = entry
    samples: dict[str, list[Sample]] = {}
    t_start = time.monotonic()
    try:
        if box.hosts() or box.leftovers():
            log(f"sandbox instance {args.instance} has leftovers: tearing them down first")
            box.down()
        t0 = time.monotonic()
        box.up(n)
        entry["boot_s"] = round(time.monotonic() - t0, 2)
        log(f"N={n}: {n} hosts up in {entry['boot_s']}s (instance {args.instance})")
        work = work_root / f"N{n}"
        work.mkdir(parents=True)
        f = Fleet(box, n, work, payload_src, work_root / "logs")

        bench_kdeploy(f, args.runs, samples)
        if n == args.gate_hosts:
            log(f"N={n}: gate latency ({args.runs} runs each)")
            report["gate_latency"] = bench_gate_latency(f, args.runs)
        if n == args.profile_hosts and not args.no_profile:
            log(f"N={n}: profiling the no-op push")
            f.write_inventory(f.inv, "profile")
            f.stamp("profile")
            f.kdeploy("push", "all", tag="profile-setup")   # a fresh good release, then no-op pushes
            report["profile"] = {"hosts": n, **profile_noop(f)}
            log(f"N={n}: profiling a full push (py-spy)")
            report["profile_full"] = profile_full(f, statistics.median(s.cpu for s in samples["kdeploy-full"]))
        f.stop(SERVICE)   # the idle service of one tool does not share the CPU with the next tool

        if not args.skip_ansible:
            bench_ansible(f, args.runs, samples)
            f.stop(ANS_SERVICE)
        hand_runs = args.hand.get(n, 0)
        if hand_runs and not args.skip_hand:
            bench_hand(f, hand_runs, samples)
            f.stop(HAND_SERVICE)
        elif not args.skip_hand:
            entry["notes"].append("hand workflow not run at this N (30 s per host, serial): extrapolated")
    except BenchError as exc:
        entry["error"] = str(exc)
        log(f"N={n}: FAILED: {exc}")
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc()
        log(f"N={n}: FAILED: {traceback.format_exc()}")
    finally:
        t0 = time.monotonic()
        try:
            box.down()
        except Exception as exc:
            log(f"sandbox down failed: {exc}")
            entry.setdefault("notes", []).append(f"sandbox down failed: {exc}")
        log(f"N={n}: torn down in {time.monotonic() - t0:.1f}s; N={n} took {time.monotonic() - t_start:.0f}s")
        entry["duration_s"] = round(time.monotonic() - t_start, 1)
        for tool, ss in samples.items():
            entry["tools"][tool] = {
                "runs": len(ss),
                "ok": all(s.extra.get("ok", s.rc == 0) for s in ss),
                "wall": stats([s.wall for s in ss]),
                "cpu": stats([s.cpu for s in ss]),
                "host_cpu": stats([s.host_cpu for s in ss]),
                "samples": [s.as_json() for s in ss],
            }
            for key, name in (("floor_s", "floor"), ("floor_ratio", "floor_ratio"),
                              ("before_stop_s", "before_stop"), ("after_ready_s", "after_ready")):
                if any(key in s.extra for s in ss):
                    entry["tools"][tool][name] = stats([s.extra[key] for s in ss if key in s.extra])


# ------------------------------------------------------------------------------------------ summary


def summarise(report: dict) -> None:
    sizes = sorted(int(n) for n in report["sizes"])
    slopes = {}
    for tool in TOOLS:
        pts_w = [(n, report["sizes"][str(n)]["tools"][tool]["wall"]["median"]) for n in sizes
                 if tool in report["sizes"][str(n)]["tools"] and report["sizes"][str(n)]["tools"][tool]["wall"]["n"]]
        pts_c = [(n, report["sizes"][str(n)]["tools"][tool]["cpu"]["median"]) for n in sizes
                 if tool in report["sizes"][str(n)]["tools"] and report["sizes"][str(n)]["tools"][tool]["cpu"]["n"]]
        pts_h = [(n, report["sizes"][str(n)]["tools"][tool]["host_cpu"]["median"]) for n in sizes
                 if tool in report["sizes"][str(n)]["tools"]
                 and report["sizes"][str(n)]["tools"][tool]["host_cpu"]["n"]]
        sw, sc, sh = slope(pts_w), slope(pts_c), slope(pts_h)
        if sw is None and sc is None:
            continue
        slopes[tool] = {"wall_s_per_host": round(sw, 4) if sw is not None else None,
                        "cpu_s_per_host": round(sc, 4) if sc is not None else None,
                        "host_cpu_s_per_host": round(sh, 4) if sh is not None else None,
                        "sizes": [n for n, _ in pts_w]}
    report["slopes"] = slopes

    # the hand workflow is serial: where it was not run, extrapolate from its own line
    hand = slopes.get("hand")
    if hand and hand["wall_s_per_host"] is not None:
        pts = [(n, report["sizes"][str(n)]["tools"]["hand"]) for n in sizes
               if "hand" in report["sizes"][str(n)]["tools"]]
        n0, t0 = pts[0][0], pts[0][1]
        for n in sizes:
            if "hand" not in report["sizes"][str(n)]["tools"]:
                report["sizes"][str(n)]["hand_extrapolated"] = {
                    "wall": round(t0["wall"]["median"] + hand["wall_s_per_host"] * (n - n0), 1),
                    "cpu": round(t0["cpu"]["median"] + (hand["cpu_s_per_host"] or 0) * (n - n0), 2)}

    for n in sizes:
        entry = report["sizes"][str(n)]
        tools = entry["tools"]
        base = tools.get("kdeploy-full")
        ratios = {}
        if base and base["wall"]["median"]:
            for alt in ("ansible", "hand"):
                if alt in tools and tools[alt]["wall"]["median"] is not None:
                    ratios[alt] = {"wall": round(tools[alt]["wall"]["median"] / base["wall"]["median"], 2),
                                   "cpu": round(tools[alt]["cpu"]["median"] / base["cpu"]["median"], 2)}
                elif alt == "hand" and "hand_extrapolated" in entry:
                    ex = entry["hand_extrapolated"]
                    ratios["hand (extrapolated)"] = {"wall": round(ex["wall"] / base["wall"]["median"], 2),
                                                     "cpu": round(ex["cpu"] / base["cpu"]["median"], 2)}
        entry["ratios_vs_kdeploy_full"] = ratios
    report["targets"] = evaluate_targets(report)


def _tool(report: dict, n: int, tool: str) -> dict | None:
    return report["sizes"].get(str(n), {}).get("tools", {}).get(tool)


def evaluate_targets(report: dict) -> list[dict]:
    targets = []

    def add(name: str, target: str, measured: str, met: bool | None) -> None:
        targets.append({"target": name, "goal": target, "measured": measured, "met": met})

    n8 = 8 if "8" in report["sizes"] else max((int(n) for n in report["sizes"]), default=None)
    full, ans = _tool(report, n8, "kdeploy-full"), _tool(report, n8, "ansible")
    if full and ans and full["wall"]["median"] and ans["wall"]["median"]:
        r = ans["wall"]["median"] / full["wall"]["median"]
        add(f"full push, {n8} hosts: wall vs Ansible", ">= 10x faster",
            f"{full['wall']['median']:.2f}s vs {ans['wall']['median']:.2f}s = {r:.1f}x", r >= 10)
        r = ans["cpu"]["median"] / full["cpu"]["median"]
        add(f"full push, {n8} hosts: controller CPU vs Ansible", ">= 10x less",
            f"{full['cpu']['median']:.2f}s vs {ans['cpu']['median']:.2f}s = {r:.1f}x", r >= 10)
    if full and full.get("floor_ratio", {}).get("median"):
        fr, fl = full["floor_ratio"], full["floor"]
        add(f"full push, {n8} hosts: wall over the floor (slowest host's Stopping -> ready, its journal)",
            "<= 1.15x", f"{fr['median']:.2f}x (runs {fr['min']:.2f}-{fr['max']:.2f}x; push "
            f"{full['wall']['median']:.2f}s, floor {fl['median']:.2f}s"
            + (f"; {full['before_stop']['median']:.2f}s to the stop requests, {full['after_ready']['median']:.2f}s "
               "after the last ready line" if "before_stop" in full else "") + ")", fr["median"] <= 1.15)
    noop = _tool(report, n8, "kdeploy-noop")
    if noop:
        zero = all(s.get("bytes_sent", 0) == 0 and s.get("restart_phases", 0) == 0 and s.get("invocations_unchanged")
                   for s in noop["samples"])
        add(f"no-op push, {n8} hosts: wall", "< 1 s",
            f"{noop['wall']['median']:.2f}s (min {noop['wall']['min']:.2f}, max {noop['wall']['max']:.2f})",
            noop["wall"]["median"] < 1)
        add(f"no-op push, {n8} hosts: payload bytes and restarts", "0 bytes, 0 restarts",
            "0 bytes, 0 restarts, InvocationIDs unchanged" if zero else "NOT zero: see samples", zero)
    gate = report.get("gate_latency")
    if gate:
        rd, fl = gate["ready"], gate["failure"]
        if rd["n"]:
            add(f"readiness noticed ({gate['hosts']} hosts)", "within 1 s",
                f"median {rd['median']:.2f}s, max {rd['max']:.2f}s ({rd['n']} host-runs)", rd["max"] <= 1)
        if fl["n"]:
            add(f"failed unit reported ({gate['hosts']} hosts)", "within 2 s",
                f"median {fl['median']:.2f}s, max {fl['max']:.2f}s ({fl['n']} host-runs)", fl["max"] <= 2)
    sl = report.get("slopes", {}).get("kdeploy-full")
    if sl:
        w, c = sl["wall_s_per_host"], sl["cpu_s_per_host"]
        hs = sl.get("host_cpu_s_per_host")
        cores = report["meta"]["machine"]["cpus"] or 1
        why = (f"; the sandbox hosts' own CPU grows {hs:+.2f} s/host, i.e. {hs / cores:+.2f} s/host of wall on "
               f"the {cores} cores they share with the controller" if hs is not None else "")
        add("full push: wall per added host (N <= --parallel 16)", "close to 0 (<= 0.1 s/host)",
            f"{w:+.3f} s/host over N={sl['sizes']}{why}", w is not None and w <= 0.1)
        add("full push: controller CPU per added host", "< 0.1 s/host", f"{c:+.3f} s/host", c is not None and c < 0.1)
    return targets


def fmt(st: dict | None, digits: int = 2) -> str:
    if not st or st.get("median") is None:
        return "-"
    return f"{st['median']:.{digits}f} [{st['min']:.{digits}f}-{st['max']:.{digits}f}]"


def print_tables(report: dict) -> str:
    lines = []
    for n in sorted(int(k) for k in report["sizes"]):
        entry = report["sizes"][str(n)]
        lines.append("")
        lines.append(f"N = {n} host{'s' if n > 1 else ''}   (median [min-max] of the runs; CPU = controller "
                     f"user+sys of the tool's process tree; host CPU = inside all sandbox hosts; busy = "
                     f"(CPU + host CPU) / (cores x wall))")
        if entry.get("error"):
            lines.append(f"  ERROR: {entry['error']}")
        head = (f"  {'tool':<28} {'runs':>4} {'wall s':>22} {'CPU s':>22} {'host CPU s':>11} {'busy':>5} "
                f"{'x wall':>7} {'x CPU':>7}")
        lines.append(head)
        lines.append("  " + "-" * (len(head) - 2))
        base = entry["tools"].get("kdeploy-full")
        for tool in TOOLS:
            t = entry["tools"].get(tool)
            if t is None:
                if tool == "hand" and "hand_extrapolated" in entry and base and base["wall"]["median"]:
                    ex = entry["hand_extrapolated"]
                    rw = ex["wall"] / base["wall"]["median"] if base else float("nan")
                    rc = ex["cpu"] / base["cpu"]["median"] if base else float("nan")
                    wall = f"~{ex['wall']:.1f} (extrap.)"
                    lines.append(f"  {LABELS[tool] + ' *':<28} {'0':>4} {wall:>22} {'~' + format(ex['cpu'], '.2f'):>22}"
                                 f" {'-':>11} {'-':>5} {rw:>6.1f}x {rc:>6.1f}x")
                continue
            ratio_w = ratio_c = ""
            if base and base["wall"]["median"] and t["wall"]["median"] and tool in ("ansible", "hand"):
                ratio_w = f"{t['wall']['median'] / base['wall']['median']:.1f}x"
                ratio_c = f"{t['cpu']['median'] / base['cpu']['median']:.1f}x"
            flag = "" if t["ok"] else "  (FAILED runs)"
            hc = t["host_cpu"]["median"]
            cores = report["meta"]["machine"]["cpus"] or 1
            busy = (f"{(t['cpu']['median'] + hc) / (cores * t['wall']['median']):.0%}"
                    if hc is not None and t["wall"]["median"] else "-")
            lines.append(f"  {LABELS[tool]:<28} {t['runs']:>4} {fmt(t['wall']):>22} {fmt(t['cpu']):>22} "
                         f"{(f'{hc:.1f}' if hc is not None else '-'):>11} {busy:>5} {ratio_w:>7} {ratio_c:>7}{flag}")
        if base and base.get("floor_ratio", {}).get("median"):
            lines.append(f"  {'floor (perfect tool)':<28} {base['floor']['n']:>4} {fmt(base['floor']):>22}   "
                         f"slowest host, systemd's \"Stopping\" -> ready line; kdeploy full push = "
                         f"{fmt(base['floor_ratio'])}x the floor")
        for note in entry.get("notes", []):
            lines.append(f"  * {note}")
    lines.append("")
    lines.append("Per added host (least-squares slope of the medians over N):")
    for tool, sl in report.get("slopes", {}).items():
        w, c, h = sl["wall_s_per_host"], sl["cpu_s_per_host"], sl.get("host_cpu_s_per_host")
        hs = f"{h:+8.3f}" if h is not None else "       -"
        lines.append(f"  {LABELS[tool]:<28} wall {w:+8.3f} s/host   CPU {c:+8.3f} s/host   host CPU {hs} s/host"
                     f"   (N = {sl['sizes']})")
    gate = report.get("gate_latency")
    if gate:
        lines.append("")
        lines.append(f"Gate latency on {gate['hosts']} hosts (poll interval {gate['poll_interval']} s), "
                     "median [min-max] over host-runs:")
        lines.append(f"  readiness: journal 'ready to roll' -> ready phase passed   {fmt(gate['ready'], 3)} s "
                     f"(n={gate['ready']['n']})")
        lines.append(f"  failure:   journal 'Main process exited' -> failed phase    {fmt(gate['failure'], 3)} s "
                     f"(n={gate['failure']['n']})")
    if report.get("targets"):
        lines.append("")
        lines.append("Targets:")
        for t in report["targets"]:
            mark = "MET   " if t["met"] else "MISSED"
            lines.append(f"  [{mark}] {t['target']}: goal {t['goal']}; measured {t['measured']}")
    prof = report.get("profile")
    if prof:
        lines.append("")
        lines.append(f"No-op push profile ({prof['hosts']} hosts): python start {prof.get('python_startup_s')}s, "
                     f"`import kdeploy.cli.app` {prof.get('import_kdeploy_cli_s')}s, library push "
                     f"{prof.get('library_push_total_s')}s with {prof.get('round_trips_per_host')} SSH round "
                     f"trips per host:")
        for call in prof.get("round_trips_one_host", []):
            lines.append(f"    {call['kind']:<8} {call['s']:>7.3f}s  {call['what']}")
        lines.append("  slowest imports (cumulative s): " + ", ".join(
            f"{m['module']} {m['cumulative_s']}" for m in prof.get("imports_top", [])[:8]))
    pf = report.get("profile_full")
    if pf and "by_category_s" in pf:
        lines.append("")
        lines.append(f"Full push CPU profile ({pf['hosts']} hosts, py-spy --gil, all threads), scaled to the "
                     f"median {pf['scaled_to_cpu_s']:.2f}s CPU of the timed runs:")
        for k, v in pf["by_category_s"].items():
            lines.append(f"    {v:>7.3f}s  {pf['by_category_share'][k]:>5.0%}  {k}")
        rt = pf.get("round_trips_by_purpose") or {}
        if rt and "error" not in rt:
            lines.append(f"  SSH round trips per host of a full push (median host; total "
                         f"{pf['round_trips_per_host']['median']}):")
            for k, v in rt.items():
                lines.append(f"    {v['count_median']:>5g} x  {v['seconds_median']:>7.3f}s  {k}")
    full = next((report["sizes"][k]["tools"].get("kdeploy-full") for k in ("8", *report["sizes"])
                 if k in report["sizes"] and report["sizes"][k]["tools"].get("kdeploy-full")), None)
    if full:
        ph = full["samples"][len(full["samples"]) // 2].get("phases", {})
        lines.append("")
        lines.append("Full push, median seconds per phase over the hosts (one run): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    text = "\n".join(lines)
    print(text)
    return text


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2))
    sizes = sorted(int(n) for n in report["sizes"])
    styles = {"kdeploy-full": ("tab:blue", "o"), "kdeploy-noop": ("tab:cyan", "s"),
              "kdeploy-verify": ("tab:green", "^"), "ansible": ("tab:red", "D"), "hand": ("tab:gray", "v")}
    for tool in TOOLS:
        pts = [(n, report["sizes"][str(n)]["tools"][tool]["wall"]) for n in sizes
               if tool in report["sizes"][str(n)]["tools"] and report["sizes"][str(n)]["tools"][tool]["wall"]["n"]]
        if not pts:
            continue
        colour, marker = styles[tool]
        xs = [n for n, _ in pts]
        ys = [w["median"] for _, w in pts]
        err = [[w["median"] - w["min"] for _, w in pts], [w["max"] - w["median"] for _, w in pts]]
        ax.errorbar(xs, ys, yerr=err, color=colour, marker=marker, capsize=3, label=LABELS[tool])
        if tool == "hand":
            ext = [(n, report["sizes"][str(n)]["hand_extrapolated"]["wall"]) for n in sizes
                   if "hand_extrapolated" in report["sizes"][str(n)]]
            if ext:
                ax.plot([xs[-1], *[n for n, _ in ext]], [ys[-1], *[w for _, w in ext]], color=colour, ls="--",
                        label="hand workflow (extrapolated)")
    ax.set_xlabel("hosts (N)")
    ax.set_ylabel("wall time, s (log scale; median, bars = min/max)")
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Deploy wall time vs fleet size (sandbox hosts, 2-core machine)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def parse_hand(spec: str) -> dict[int, int]:
    out = {}
    for part in filter(None, spec.split(",")):
        n, _, runs = part.partition(":")
        out[int(n)] = int(runs or 1)
    return out


def snapshot_payload(src: Path, dest: Path) -> Path:
    """Copy the payload once: other people edit kernels/ while the bench runs."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,8,16", help="fleet sizes (comma list)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per tool and N (>= 3 for the report)")
    p.add_argument("--hand", default="1:3,4:1",
                   help="N:runs of the hand workflow (30 s per host, serial); other N are extrapolated")
    p.add_argument("--gate-hosts", type=int, default=8, help="fleet size the gate latency is measured on")
    p.add_argument("--profile-hosts", type=int, default=8, help="fleet size the no-op push is profiled on")
    p.add_argument("--instance", type=int, default=5, choices=(5, 6), help="sandbox instance (5 or 6)")
    p.add_argument("--skip-ansible", action="store_true")
    p.add_argument("--skip-hand", action="store_true")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--payload", type=Path, default=ROOT / "kernels" / "kdtree")
    p.add_argument("--out", type=Path, default=RESULTS / "latest.json",
                   help="the JSON report; the plot and the text report are written beside it")
    args = p.parse_args(argv)
    args.hand = parse_hand(args.hand)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.gate_hosts not in sizes:
        args.gate_hosts = max((n for n in sizes if n <= 8), default=sizes[0])
    if args.profile_hosts not in sizes:
        args.profile_hosts = args.gate_hosts
    if os.geteuid() != 0:
        print("bench: needs root (sandbox hosts)", file=sys.stderr)
        return 2
    for tool in ("kdeploy",) if args.skip_ansible else ("ansible-playbook", "kdeploy"):
        if not (BIN / tool).exists():
            print(f"bench: {BIN / tool} missing: {BIN}/pip install -r bench/requirements.txt", file=sys.stderr)
            return 2

    # pip compiles an installed package's bytecode; an editable source tree has it only if something wrote
    # it, and PYTHONDONTWRITEBYTECODE=1 environments never do. Measure kdeploy as users run it.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "kdeploy")], check=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # Ansible's ssh masters come back to us to be counted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so that `finally` tears the sandbox down

    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    t0 = time.monotonic()
    work_root = Path(tempfile.mkdtemp(prefix="kdeploy-bench-"))
    ansible_version = subprocess.run([str(BIN / "ansible-playbook"), "--version"], capture_output=True, text=True,
                                     check=False).stdout.splitlines()[:1] if not args.skip_ansible else []
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kdeploy"], capture_output=True,
                           text=True, check=False).stdout.strip()
    report: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "git": git + ("+dirty kdeploy/" if dirty else ""),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "kernel": platform.release(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
            "ansible": ansible_version[0] if ansible_version else None,
            "sizes": sizes, "runs": args.runs, "hand_runs": {str(k): v for k, v in args.hand.items()},
            "instance": args.instance, "service": SERVICE, "gate_workers": WORKERS, "marker": MARKER,
            "notes": [
                "Each tool redeploys a running service: an untimed first install precedes the timed runs.",
                "A full run ships a changed payload file and a changed unit (env BENCH_RUN) and restarts.",
                "Ansible runs start cold: its ControlPersist ssh masters are stopped after each run and "
                "their CPU is added to Ansible's.",
                "The hand workflow polls every 30 s as in the field notes; it runs only at N in "
                f"{sorted(args.hand)} ({args.hand} runs); other N are extrapolated from its slope.",
                "Hosts and controller share this machine's cores; other jobs may run too (see load).",
            ],
        },
        "sizes": {},
    }
    try:
        payload_src = snapshot_payload(args.payload, work_root / "payload-snapshot")
        for n in sizes:
            bench_size(n, args, payload_src, report, work_root)
    except KeyboardInterrupt:
        report["meta"]["interrupted"] = True
        log("interrupted")
    finally:   # belt and braces: nothing of ours may stay up
        with_box = make_sandbox(args.instance)
        if with_box.hosts() or with_box.leftovers():
            try:
                with_box.down()
            except Exception as exc:
                log(f"final sandbox down failed: {exc}")
        logs = work_root / "logs"
        if logs.exists():
            dest = RESULTS / "logs"
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(logs, dest)
        shutil.rmtree(work_root, ignore_errors=True)

    report["meta"]["duration_s"] = round(time.monotonic() - t0, 1)
    report["meta"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summarise(report)
    text = print_tables(report)
    png = args.out.with_name("deploy-time.png")
    print(f"\nmake bench took {report['meta']['duration_s'] / 60:.1f} min; results: {args.out}, {png}, "
          f"per-run logs in {RESULTS / 'logs'}/")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    args.out.with_suffix(".txt").write_text(text + "\n")
    try:
        plot(report, png)
    except Exception as exc:
        log(f"plot failed: {exc}")
    failed = [n for n, e in report["sizes"].items() if e.get("error")]
    return 1 if failed or report["meta"].get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
