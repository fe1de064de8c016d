"""The local sandbox (lab/kdeploy_lab/sandbox.py): real systemd-nspawn hosts with systemd, sshd and journald.

Uses sandbox instances 8 and 9 only (the session fleet uses 0/1). Every fixture tears its sandbox
down, whatever happens in the test, and the tests check that nothing is left on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kdeploy_lab.demo import light_service
from kdeploy_lab.sandbox import HOST_VENV, RENDEZVOUS_PORT, Sandbox, SandboxError, SandboxHost

REPO = Path(__file__).resolve().parents[2]
INOTIFY = Path("/proc/sys/fs/inotify/max_user_instances")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")


def ssh(sb: Sandbox, host: SandboxHost, command: str, connect_timeout: int = 5,
        timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """The real OpenSSH client, pinned host keys, no agent, no user config."""
    argv = ["ssh", "-F", "none", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={sb.known_hosts_path}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={connect_timeout}", "-o", "LogLevel=ERROR",
            "-i", str(sb.key_path), f"root@{host.address}", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def assert_nothing_left(sb: Sandbox, inotify_before: str) -> None:
    i = sb.instance
    assert sb.leftovers() == []
    assert sb.hosts() == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not re.search(rf"^kd{i}-h", netns, re.MULTILINE), netns
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not re.search(rf"^\d+: (kdbr{i}|kd{i}-h\d+)[@:]", links, re.MULTILINE), links
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            assert not re.search(rf"\bkd{i}-h\d+\b".encode(), cmdline), (entry, cmdline)
    assert not list(Path("/sys/fs/cgroup").glob(f"*/kdeploy-sandbox-{i}"))
    assert not sb.state_dir.exists()
    assert sb.key_path.exists() and (sb.venv_path / "bin" / "python").exists()   # the cache stays
    assert INOTIFY.read_text() == inotify_before


def make_sandbox(instance: int) -> Iterator[Sandbox]:
    sb = Sandbox(instance=instance)
    sb.down()                       # whatever an interrupted earlier run left
    try:
        yield sb
    finally:
        sb.down()


@pytest.fixture
def sb8() -> Iterator[Sandbox]:
    yield from make_sandbox(8)


@pytest.fixture
def sb9() -> Iterator[Sandbox]:
    yield from make_sandbox(9)


# --- unit level: no hosts --------------------------------------------------------------------------


def test_check_requirements_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which",
                        lambda name, *a, **k: None if name == "systemd-nspawn" else real_which(name, *a, **k))
    with pytest.raises(SandboxError) as err:
        Sandbox(instance=8).check_requirements()
    assert str(err.value) == ("kdeploy sandbox needs systemd-nspawn and sshd: "
                              "apt-get install systemd-container openssh-server")
    assert err.value.exit_code == 2


def test_check_requirements_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match=r"^kdeploy sandbox needs root$"):
        Sandbox(instance=8).check_requirements()


def test_bad_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match=r"instance must be 0\.\.9"):
        Sandbox(tmp_path, instance=10)
    sb = Sandbox(tmp_path, instance=8)
    monkeypatch.setattr(sb, "check_requirements", lambda: None)
    for n in (0, 201):
        with pytest.raises(SandboxError, match=r"must be 1\.\.200"):
            sb.up(n)
    for name in ("root", "Deploy", "-u", "a b", "x" * 33):
        with pytest.raises(SandboxError, match=r"--become-user must be a user name other than root"):
            sb.up(1, become_user=name)
    with pytest.raises(SandboxError, match="not up"):
        sb.write_inventory(tmp_path / "inventory.yaml", {"name": "x"})
    assert sb.hosts() == []
    assert [SandboxHost("h3", 3, "10.213.8.13", "kd8-h3")] == [sb._host(3)]


# --- real hosts --------------------------------------------------------------------------------------


@needs_root
def test_up_ssh_journald_inventory_then_down(sb8: Sandbox, tmp_path: Path) -> None:
    inotify_before = INOTIFY.read_text()
    t0 = time.monotonic()
    hosts = sb8.up(2)
    up_seconds = time.monotonic() - t0
    assert [(h.name, h.index, h.address, h.machine) for h in hosts] == [
        ("h1", 1, "10.213.8.11", "kd8-h1"), ("h2", 2, "10.213.8.12", "kd8-h2")]
    assert sb8.hosts() == hosts
    assert up_seconds < 30, up_seconds
    assert int(INOTIFY.read_text()) >= 8192

    # known_hosts pins name AND address of every host
    lines = sb8.known_hosts_path.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["h1,10.213.8.11", "h2,10.213.8.12"]
    assert all(line.split()[1] == "ssh-ed25519" for line in lines)

    for host in hosts:
        proc = ssh(sb8, host, "systemctl is-system-running; hostname; "
                              "journalctl -n1 --no-pager -q >/dev/null && echo journal-ok")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["running", host.name, "journal-ok"], proc.stdout

    # journald really records what a unit prints
    marker = f"kdeploy-sandbox-test-{os.getpid()}"
    assert ssh(sb8, hosts[0], f"systemd-run --wait -q --unit=kdtest echo {marker}").returncode == 0
    for _ in range(50):
        out = ssh(sb8, hosts[0], "journalctl -u kdtest -o cat --no-pager").stdout
        if marker in out:
            break
        time.sleep(0.1)
    assert marker in out

    # the venv is visible read-only at HOST_VENV, with the reference server importable
    proc = ssh(sb8, hosts[1], f"{HOST_VENV}/bin/python -c 'import sys; print(sys.prefix)'; "
                              f"touch {HOST_VENV}/x 2>/dev/null || echo read-only")
    assert proc.stdout.split() == [HOST_VENV, "read-only"], (proc.stdout, proc.stderr)
    if (REPO / "lab" / "kdeploy_lab" / "refserver.py").exists():
        proc = ssh(sb8, hosts[1], f"{HOST_VENV}/bin/python -c 'import kdeploy_refserver'")
        assert proc.returncode == 0, proc.stderr

    status = sb8.status()
    assert [(s["name"], s["running"], s["link"], s["system"]) for s in status] == [
        ("h1", True, "UP", "running"), ("h2", True, "UP", "running")]
    assert all(isinstance(s["nspawn_pid"], int) for s in status)

    inventory = tmp_path / "sub" / "inventory.yaml"
    service = {"name": "sglang-test", "python": f"{HOST_VENV}/bin/python", "module": "kdeploy_refserver",
               "sglang": {"model_path": "/srv/models/tiny", "tp": 2}}
    sb8.write_inventory(inventory, service)
    text = inventory.read_text()
    assert text.startswith("# Written by `kdeploy sandbox up`")
    doc = YAML(typ="safe").load(text)
    assert doc["defaults"] == {"user": "root", "port": 22, "identity_file": str(sb8.key_path),
                               "known_hosts": str(sb8.known_hosts_path), "service": service}
    assert doc["groups"] == {"sandbox": {"hosts": ["h1", "h2"]}}
    assert doc["hosts"] == {"h1": {"address": "10.213.8.11"}, "h2": {"address": "10.213.8.12"}}
    assert "hosts: [h1, h2]" in text
    from kdeploy.core.inventory import load
    loaded = load(inventory)
    assert loaded.resolve("sandbox") == ["h1", "h2"]
    assert loaded.hosts["h2"].address == "10.213.8.12"
    assert loaded.hosts["h1"].known_hosts == str(sb8.known_hosts_path)

    t0 = time.monotonic()
    sb8.down()
    assert time.monotonic() - t0 < 15
    assert_nothing_left(sb8, inotify_before)
    sb8.down()                                  # idempotent
    assert_nothing_left(sb8, inotify_before)


@needs_root
def test_recovers_from_crashed_controller(sb8: Sandbox) -> None:
    inotify_before = INOTIFY.read_text()
    # a controller that brings a host up and then dies by SIGKILL: the host keeps running
    code = ("import os, signal\nfrom kdeploy_lab.sandbox import Sandbox\n"
            "Sandbox(instance=8).up(1)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr

    fresh = Sandbox(instance=8)
    assert [h.name for h in fresh.hosts()] == ["h1"]
    assert fresh.status()[0]["running"] is True
    with pytest.raises(SandboxError, match=r"^sandbox already up \(1 hosts\): kdeploy sandbox down first$"):
        fresh.up(1)

    # now its nspawn dies too (the container is orphaned) and the state dir is lost
    pid = fresh.status()[0]["nspawn_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while fresh.status()[0]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(fresh.state_dir)
    left = Sandbox(instance=8).leftovers()
    assert any(item.startswith("netns kd8-h1") for item in left), left
    assert any(item.startswith("process ") for item in left), left   # the orphaned container

    again = Sandbox(instance=8)
    (host,) = again.up(1)
    proc = ssh(again, host, "systemctl is-system-running")
    assert proc.stdout.strip() == "running", (proc.stdout, proc.stderr)
    again.down()
    assert_nothing_left(again, inotify_before)


@needs_root
def test_failed_up_names_the_host_and_cleans_up(sb8: Sandbox) -> None:
    inotify_before = INOTIFY.read_text()
    with pytest.raises(SandboxError) as err:
        sb8.up(2, timeout=0.05)          # no host boots that fast
    message = str(err.value)
    assert re.match(r"^h[12] did not come up within 0\.05s \(.*\); console: \S", message), message
    assert "\n" not in message
    assert_nothing_left(sb8, inotify_before)


@needs_root
def test_fault_injection_and_exec(sb9: Sandbox) -> None:
    h1, h2 = sb9.up(2)

    assert sb9.exec("h1", ["hostname"]).stdout.strip() == "h1"
    assert sb9.exec("h2", ["sh", "-c", "cat > /srv/note; cat /srv/note"], input="kept").stdout == "kept"
    assert sb9.exec("h1", ["sh", "-c", "exit 3"], check=False).returncode == 3
    with pytest.raises(SandboxError, match=r"^h1: `false` exited 1"):
        sb9.exec("h1", ["false"])
    with pytest.raises(SandboxError, match="no host 'h7'"):
        sb9.cut("h7")

    # cut: connects fail fast ("No route to host") while the other host is fine
    sb9.cut("h1")
    t0 = time.monotonic()
    proc = ssh(sb9, h1, "true", connect_timeout=5)
    assert proc.returncode == 255 and time.monotonic() - t0 < 8, proc.stderr
    assert ssh(sb9, h2, "true").returncode == 0
    assert sb9.status()[0]["link"] == "DOWN"
    sb9.heal("h1")
    assert ssh(sb9, h1, "true").returncode == 0
    assert sb9.status()[0]["link"] == "UP"

    # blackhole: the link stays up but nothing arrives, so connects time out
    sb9.blackhole("h1")
    proc = ssh(sb9, h1, "true", connect_timeout=2)
    assert proc.returncode == 255 and "timed out" in proc.stderr, proc.stderr
    sb9.heal("h1")
    assert ssh(sb9, h1, "true").returncode == 0

    # kill = power loss; start boots it again with /srv kept
    sb9.kill("h2")
    assert sb9.status()[1]["running"] is False
    with pytest.raises(SandboxError, match="h2 is not running"):
        sb9.exec("h2", ["true"])
    sb9.start("h2")
    proc = ssh(sb9, h2, "cat /srv/note; echo; systemctl is-system-running")
    assert proc.stdout.split() == ["kept", "running"], (proc.stdout, proc.stderr)


def _status(url: str) -> int | None:
    """The HTTP status of GET url, None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.2)


@needs_root
def test_a_server_of_two_nodes_forms_its_group_across_hosts(sb8: Sandbox, tmp_path: Path) -> None:
    """``--nodes-per-server 2``: the inventory makes h1+h2 one server, and its two nodes, started by hand as the
    unit renderer will start them (kdeploy push cannot yet), meet over the bridge at the head's rendezvous port."""
    h1, h2 = sb8.up(2)
    inventory = tmp_path / "inventory.yaml"
    sb8.write_inventory(inventory, light_service(), nodes_per_server=2)
    text = inventory.read_text()
    doc = YAML(typ="safe").load(text)
    assert doc["servers"] == {"s1": {"nodes": ["h1", "h2"], "rendezvous_port": 29500}}
    assert "nodes: [h1, h2]" in text
    assert doc["defaults"]["service"]["sglang"]["tp"] == 2 and doc["defaults"]["service"]["gate"]["workers"] == 2

    dist = f"{h1.address}:{RENDEZVOUS_PORT}"
    tp = str(doc["defaults"]["service"]["sglang"]["tp"])

    def start(host: SandboxHost, rank: int) -> None:
        # --host 0.0.0.0: this machine reads the nodes' health over the bridge (the rendezvous binds every
        # address whatever --host says)
        sb8.exec(host.name, ["systemd-run", "--unit=kdmn", "--setenv=REFSERVER_SHUTDOWN_POLL=0.2",
                             f"{HOST_VENV}/bin/python", "-m", "kdeploy_refserver", "--model-path", "/models/m",
                             "--tp-size", tp, "--host", "0.0.0.0", "--port", "30000", "--nnodes", "2",
                             "--node-rank", str(rank), "--dist-init-addr", dist, "--dist-timeout", "60"])

    def log(host: SandboxHost) -> str:
        return sb8.exec(host.name, ["journalctl", "-u", "kdmn", "-o", "cat", "--no-pager"]).stdout

    start(h1, 0)
    _until(lambda: "Rendezvous listening on port 29500" in log(h1), "the head's rendezvous listener")
    assert _status(f"http://{h1.address}:30000/health") == 503  # no follower yet
    # plain TCP from the follower's host to the head's sandbox address (not loopback, not via this machine)
    probe = (f"import socket; s = socket.create_connection(('{h1.address}', {RENDEZVOUS_PORT}), timeout=5); "
             "print(s.getsockname()[0]); s.close()")
    assert sb8.exec("h2", [f"{HOST_VENV}/bin/python", "-c", probe]).stdout.strip() == h2.address
    _until(lambda: f"Rendezvous connection from {h2.address}:" in log(h1), "the head seeing the probe")

    start(h2, 1)
    _until(lambda: _status(f"http://{h1.address}:30000/health") == 200, "the head's health 200")
    head = log(h1)
    assert f"Node 1 joined from {h2.address}:" in head and "All 2 nodes joined: the process group is formed" in head
    assert "Node 1 is ready: scheduler(s) TP1..TP1" in head, head
    assert f"Joined the process group at {dist} as node_rank 1" in log(h2)
    assert _status(f"http://{h2.address}:30000/health") == 200  # the follower's dummy health server

    # stopping the head stops the follower on the other host (the head's shutdown crosses the bridge too)
    sb8.exec("h1", ["systemctl", "stop", "kdmn"])
    _until(lambda: "Shutdown received from the head (node_rank 0)" in log(h2), "the follower's shutdown")
    _until(lambda: sb8.exec("h2", ["systemctl", "is-active", "kdmn"], check=False).stdout.strip() == "inactive",
           "the follower's clean exit (a failed one stays `failed`)", timeout=15)
