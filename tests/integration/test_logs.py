"""``kdeploy logs`` against real sandbox hosts: prefixes, --lines, --grep, --since, --run, -f and Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import Deployment

MARKER_RE = r"kdeploy-testplugin\] loaded"
PID = re.compile(r"\[(\d+)\]: ")


def logs(dep: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kdeploy", "logs", *args, "-i", str(dep.path)], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120, check=False)


def pids(out: str, host: str) -> set[str]:
    return {PID.search(line).group(1) for line in out.splitlines() if line.startswith(f"{host} | ")}


@pytest.mark.hosts(2)
def test_logs_of_each_host_and_run(deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "all") == 0
    assert deployment.kdeploy("push", "all", "--force-restart") == 0

    last = logs(deployment, "all", "--lines", "5")
    assert last.returncode == 0, last.stderr
    for host in deployment.hosts:
        mine = [ln for ln in last.stdout.splitlines() if ln.startswith(f"{host} | ")]
        assert 1 <= len(mine) <= 5
    assert all(ln.split(" | ", 1)[0] in deployment.hosts for ln in last.stdout.splitlines())

    current = logs(deployment, "all", "--run", "current", "--grep", MARKER_RE, "--lines", "0")
    previous = logs(deployment, "all", "--run", "previous", "--grep", MARKER_RE, "--lines", "0", "--since",
                    "1 hour ago")
    every = logs(deployment, "all", "--grep", MARKER_RE, "--lines", "0")
    assert current.returncode == previous.returncode == every.returncode == 0, current.stderr + previous.stderr
    for host in deployment.hosts:
        now, before = pids(current.stdout, host), pids(previous.stdout, host)
        assert len(now) >= 8 and len(before) >= 8 and not now & before  # 8 workers a run, different processes
        assert pids(every.stdout, host) >= now | before
    assert all(re.search(MARKER_RE, ln) for ln in current.stdout.splitlines())

    bad = logs(deployment, "h1", "--since", "not a time")
    assert bad.returncode == 2 and bad.stderr.startswith("kdeploy: h1: invalid: "), bad.stderr
    assert "invalid: h1:" not in bad.stderr  # the host is named once


@pytest.mark.hosts(2)
def test_follow_streams_every_host_and_ctrl_c_ends_it(deployment: Deployment) -> None:
    assert deployment.kdeploy("push", "all") == 0
    proc = subprocess.Popen([sys.executable, "-m", "kdeploy", "logs", "all", "-f", "-n", "3", "-i",
                             str(deployment.path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while seen != set(deployment.hosts) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.add(line.split(" | ", 1)[0])
        assert seen == set(deployment.hosts)
        deployment.kdeploy("push", "h1", "--force-restart")  # new lines on h1 arrive while following
        got = ""
        while "Started" not in got and time.monotonic() < deadline:
            got = proc.stdout.readline()
        assert got.startswith("h1 | "), got
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
        rest, err = proc.stdout.read(), proc.stderr.read()  # not communicate(): it skips what readline buffered
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().endswith("kdeploy: interrupted")
    assert [ln for ln in rest.split("\n") if ln and ln.split(" | ", 1)[0] not in deployment.hosts] == []
