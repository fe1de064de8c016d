"""Fleet rollouts on 8 sandbox hosts: batches, canary, max-fail, a failing host, an unreachable one."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import pytest

from kdeploy.flows import fleet
from kdeploy.flows.options import Options
from tests.conftest import Deployment

ALL = [f"h{i}" for i in range(1, 9)]


def _bump(dep: Deployment, value: str) -> None:
    (dep.payload / "rev.txt").write_text(value)


def _bad(dep: Deployment, *hosts: str) -> None:
    def change(doc: dict) -> None:
        for host in hosts:
            doc["hosts"][host]["service"] = {"env": {"REFSERVER_WRONG_ANSWER": "1"}}
    dep.edit(change)


def _windows(dep: Deployment, host: str, since: float) -> tuple[float, float]:
    """From the host's journal: when systemd began stopping the old run and when the new one was ready."""
    out = dep.sh(host, f"journalctl -u {dep.service} -o json --output-fields=MESSAGE --since=@{int(since)}")
    stop = ready = None
    for line in out.splitlines():
        rec = json.loads(line)
        t = int(rec["__REALTIME_TIMESTAMP"]) / 1e6
        msg = rec.get("MESSAGE", "")
        if isinstance(msg, str) and msg.startswith("Stopping") and stop is None:
            stop = t
        if isinstance(msg, str) and "fired up and ready to roll" in msg and stop is not None:
            ready = t
    assert stop is not None and ready is not None, out[-2000:]
    return stop, ready


@pytest.mark.hosts(8)
def test_batches_of_two_never_restart_more_than_two_at_once(deployment: Deployment,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    start = float(deployment.sh("h1", "date +%s.%N"))
    _bump(deployment, "2")
    code, doc = deployment.json(capsys, "push", "test", "--batch", "2")
    assert code == 0 and doc["summary"] == {"hosts": 8, "deployed": 8}
    windows = [_windows(deployment, h, start - 1) for h in ALL]
    events = sorted([(a, 1) for a, _ in windows] + [(b, -1) for _, b in windows])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    print(f"peak concurrent restarts: {peak}")
    assert peak <= 2
    assert peak == 2  # and batching did run two at once


@pytest.mark.hosts(8)
def test_one_bad_host_is_rolled_back_and_the_rest_deploy(deployment: Deployment,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    _bad(deployment, "h5")
    _bump(deployment, "2")
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 4
    results = {h["host"]: h["result"] for h in doc["hosts"]}
    assert results.pop("h5") == "rolled_back"
    assert set(results.values()) == {"deployed"}
    assert doc["summary"] == {"hosts": 8, "deployed": 7, "rolled_back": 1}


@pytest.mark.hosts(8)
def test_max_fail_stops_the_rollout_and_leaves_the_rest_unchanged(deployment: Deployment,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    _bad(deployment, "h1", "h2")
    _bump(deployment, "2")
    before = {h: deployment.state(h) for h in ALL[2:]}
    code, doc = deployment.json(capsys, "push", "test", "--batch", "1", "--max-fail", "1")
    assert code == 4
    results = {h["host"]: h["result"] for h in doc["hosts"]}
    assert results["h1"] == results["h2"] == "rolled_back"
    assert {results[h] for h in ALL[2:]} == {"skipped"}
    assert all("max-fail" in h["error"] for h in doc["hosts"][2:])
    for host in ALL[2:]:
        assert deployment.state(host) == before[host]  # no restart, no new release left behind


@pytest.mark.hosts(8)
def test_canary_failure_touches_no_other_host(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    _bad(deployment, "h1")
    _bump(deployment, "2")
    before = {h: deployment.state(h) for h in ALL[1:]}
    code, doc = deployment.json(capsys, "push", "test", "--canary", "1")
    assert code == 4
    results = {h["host"]: h["result"] for h in doc["hosts"]}
    assert results["h1"] == "rolled_back"
    assert {results[h] for h in ALL[1:]} == {"skipped"}
    for host in ALL[1:]:
        assert deployment.state(host) == before[host]


@pytest.mark.hosts(8)
def test_an_unreachable_host_does_not_stop_the_others(deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    _bump(deployment, "2")
    deployment.fleet.cut("h4")
    try:
        report = fleet.push(deployment.load(), "test", Options(verify=False))
    finally:
        deployment.fleet.heal("h4")
    results = {h.host: h.result for h in report.hosts}
    assert results.pop("h4") == "unreachable"
    assert set(results.values()) == {"deployed"}
    assert report.exit_code == 3
    assert "unreachable" in report.hosts[3].error


@pytest.mark.hosts(8)
def test_a_host_cut_off_mid_rollout_ends_unreachable_on_its_old_release(deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    _bump(deployment, "2")
    before = deployment.state("h4")

    def cut_h4_once_staged(host: str, phase: str, status: str) -> None:
        if (host, phase, status) == ("h4", "stage", "ok"):
            deployment.fleet.cut("h4")

    try:
        report = fleet.push(deployment.load(), "test", Options(verify=False), listener=cut_h4_once_staged)
    finally:
        deployment.fleet.heal("h4")
    results = {h.host: h.result for h in report.hosts}
    assert results.pop("h4") == "unreachable", report.hosts[3].error
    assert set(results.values()) == {"deployed"}
    assert report.exit_code == 3
    current, _, invocation = deployment.state("h4")
    assert (current, invocation) == (before[0], before[2])  # never switched: still the old release and run


@pytest.mark.hosts(2)
def test_ctrl_c_mid_rollout_finishes_the_running_batch_and_leaves_the_rest_unchanged(
        deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    deployment.set_service(env={"REFSERVER_SLOW_START": "3"})  # h1's gate is still waiting when Ctrl-C comes
    _bump(deployment, "2")
    h1_before = deployment.show("h1", "InvocationID")
    h2_before = deployment.state("h2")
    # --parallel 1: h2 lets go of its connection and lock after staging, so removing its staged release
    # takes a connection of its own
    run = deployment.interrupt("push", "test", "--batch", "1", "--parallel", "1",
                               when=lambda: deployment.show("h1", "InvocationID") != h1_before, what="h1's restart")
    results = run.hosts
    assert run.code == run.doc["exit_code"] == 130, run.err
    assert results["h1"]["result"] == "deployed"          # the batch that was restarting finished, gated
    assert results["h2"]["result"] == "interrupted" and "interrupted" in results["h2"]["error"]
    assert deployment.state("h2") == h2_before           # no restart, its staged release removed
    assert deployment.sh("h2", f"ls {deployment.service_dir}/lock.json 2>&1", check=False).endswith(
        "No such file or directory\n")                      # and its lock let go


def _ssh_sockets() -> int:
    """This process's TCP connections to an sshd (port 22), established: /proc/self/fd against /proc/net/tcp."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[2].endswith(":0016") and fields[3] == "01" and fields[9] in inodes:
                    found += 1
    return found


@pytest.mark.hosts(8)
def test_parallel_four_on_twelve_hosts_never_holds_more_than_four_connections(deployment: Deployment) -> None:
    """Issue 16: connections are bounded by --parallel, not by the fleet: a host that is done or not yet
    started holds none. Twelve hosts: the eight sandbox hosts, and four of them a second time with a service
    of their own (own unit, port and directory), each its own connection."""
    extra = {f"{h}x": h for h in ALL[:4]}

    def twelve(doc: dict) -> None:
        for name, base in extra.items():
            doc["hosts"][name] = {**doc["hosts"][base], "service": {
                "name": f"{deployment.service}x", "sglang": {"port": deployment.port + 1000}}}
        doc["groups"]["test"]["hosts"] = [*ALL, *extra]

    deployment.edit(twelve)
    peak, samples, done = 0, 0, threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        while not done.is_set():
            peak, samples = max(peak, _ssh_sockets()), samples + 1
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        report = fleet.push(deployment.load(), "test", Options(verify=False), parallel=4)
        assert report.exit_code == 0, [(h.host, h.result, h.error) for h in report.hosts]
        assert len(report.hosts) == 12 and {h.result for h in report.hosts} == {"deployed"}
        resumed = [p.detail for h in report.hosts for p in h.phases if p.name == "resume"]
        assert resumed == ["lock taken again; nothing moved since staging"] * 12  # let go after staging
        assert _ssh_sockets() == 0  # nothing held once the push returned
    finally:
        done.set()
        sampler.join()
        for base in extra.values():
            deployment.sh(base, f"systemctl disable --now {deployment.service}x 2>/dev/null; "
                                f"rm -rf /etc/systemd/system/{deployment.service}x.service "
                                f"/srv/kdeploy/{deployment.service}x; systemctl daemon-reload", check=False)
    assert samples > 50 and 2 <= peak <= 4 + 1, (peak, samples)
