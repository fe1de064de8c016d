"""``kdeploy exec`` against real sandbox hosts: one line per host, a failing host, --json, --timeout, and
Ctrl-C, each checked on the hosts themselves (the stopped command is really gone)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from kdeploy.cli import schema
from tests.conftest import Deployment


def kexec(dep: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kdeploy", "exec", "-i", str(dep.path), *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120, check=False)


def running(dep: Deployment, host: str, command: str) -> int:
    """How many processes on ``host`` have exactly the command line ``command``."""
    out = dep.sh(host, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | "
                       f"grep -cx '{command} ' || true")
    return int(out.strip() or 0)


def wait_until(condition, what: str, limit: float = 30) -> None:
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            pytest.fail(what)
        time.sleep(0.2)


@pytest.mark.hosts(2)
def test_exec_runs_on_every_host_and_stops_what_it_started(deployment: Deployment) -> None:
    hosts = deployment.hosts
    done = kexec(deployment, "all", "--", "nproc")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line.split(": ")[0] for line in lines) == sorted(hosts)  # one line per host
    assert all(line.split(": ")[1].isdigit() for line in lines)

    # A command that fails on one host: exit 8, its stderr and status per host in the JSON.
    deployment.sh(hosts[1], "touch /tmp/kdeploy-exec-no")
    try:
        done = kexec(deployment, "all", "--json", "--", "test", "!", "-e", "/tmp/kdeploy-exec-no", "||",
                     "{", "echo", "refused", ">&2;", "exit", "3;", "}")
    finally:
        deployment.sh(hosts[1], "rm -f /tmp/kdeploy-exec-no")
    assert done.returncode == 8, done.stderr
    doc = json.loads(done.stdout)
    schema.ReportDoc.model_validate(doc)
    by_host = {h["host"]: h for h in doc["hosts"]}
    assert (doc["command"], doc["exit_code"], doc["summary"]) == ("exec", 8, {"hosts": 2, "command_failed": 1,
                                                                             "ok": 1})
    assert by_host[hosts[0]]["exec"] == {"exit_status": 0, "stdout": "", "stderr": ""}
    assert by_host[hosts[1]]["exec"] == {"exit_status": 3, "stdout": "", "stderr": "refused\n"}
    assert (by_host[hosts[1]]["result"], by_host[hosts[1]]["error"]) == ("command_failed", "exit 3: refused")

    # --timeout: the command is stopped on the host, the host ends command_failed.
    done = kexec(deployment, hosts[0], "--timeout", "1", "--json", "--", "echo started; sleep 4711.5; echo never")
    assert done.returncode == 8, done.stderr
    host = json.loads(done.stdout)["hosts"][0]
    assert host["error"] == "timed out after 1s: the command was stopped"
    assert host["exec"] == {"exit_status": None, "stdout": "started\n", "stderr": ""}  # its output until then
    wait_until(lambda: running(deployment, hosts[0], "sleep 4711.5") == 0, "the timed-out command still runs")

    # Ctrl-C stops the command on every host (and what it started in the background): exit 130.
    proc = subprocess.Popen([sys.executable, "-m", "kdeploy", "exec", "all", "-i", str(deployment.path), "--",
                             "echo started; sleep 4712.5 & sleep 4712.5"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: all(running(deployment, h, "sleep 4712.5") == 2 for h in hosts),
                   "the command did not start on every host")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert sorted(out.splitlines()) == sorted(f"{h}: started" for h in hosts)  # the output until Ctrl-C
    for h in hosts:
        wait_until(lambda h=h: running(deployment, h, "sleep 4712.5") == 0, f"{h}: the command outlived Ctrl-C")
