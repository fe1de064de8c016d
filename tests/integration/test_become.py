"""Every flow as a user that is not root (``become``), on sandbox hosts booted with ``--become-user deploy``.

sshd refuses root there (``PermitRootLogin no``, although root's key is authorized); ``deploy`` logs in with the
sandbox key and has passwordless sudo. One fleet of two hosts for the module; its tests share one service and run
in order: push, verify, status, plan, history, probe, logs (and -f), set-env, rollback, with the secrets file; the
lock (held, forced away through sudo, freed on EOF); a controller SIGKILLed after the switch (the host's own revert);
router drain/admit through a tunnel from a become host; exec as root, and with --no-become as the user; a sudo
that wants a password, refused at connect with nothing changed; and all of it again through doas, with sudo
refusing everyone.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kdeploy.cli import app as cli
from kdeploy.core.layout import service_dir
from kdeploy.host import lock
from kdeploy.ssh import sshconfig
from kdeploy.ssh.remote import Remote
from kdeploy_lab import router_env
from kdeploy_lab.demo import demo_service, project_dir
from kdeploy_lab.sandbox import Sandbox
from tests.conftest import TEST_MARKER, TEST_PLUGIN, Deployment, fast_drain
from tests.integration import test_provisional as provisional_tests

USER = "deploy"
HOSTS = ["h1", "h2"]
REVERT_AFTER = 12
SUDOERS = "/etc/sudoers.d/kdeploy-sandbox"
SECRETS_FILE = "/etc/kdbecome-secrets.env"
TOKEN = "tok-become-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Two become hosts on the first free sandbox instance, and one service on them."""
    for instance in range(10):
        box = Sandbox(instance=instance, sglang=False)
        box.check_requirements()
        if not box.hosts():
            break
    else:
        pytest.fail("no free sandbox instance: run `kdeploy sandbox down --instance N`")
    box.up(len(HOSTS), become_user=USER)
    try:
        fast_drain(box)
        tmp = tmp_path_factory.mktemp("become")
        payload = tmp / "payload"
        shutil.copytree(TEST_PLUGIN, payload, ignore=shutil.ignore_patterns("__pycache__"))
        port = _free_port()
        service = demo_service(project_dir(), sglang=False, name="kdbecome", payload=str(payload))
        service["sglang"] = {**service["sglang"], "port": port, "host": "0.0.0.0", "extra_args": ["--enable-metrics"]}
        service["gate"] = {"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60,
                           "revert_after": REVERT_AFTER}
        service["env"] = {}
        service["environment_file"] = SECRETS_FILE
        service["secrets"] = {"env": ["KDT_BECOME_TOKEN"]}
        path = tmp / "inventory.yaml"
        box.write_inventory(path, service)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KDT_BECOME_TOKEN", TOKEN)
            yield Deployment(box, path, payload, "kdbecome", HOSTS, port)
    finally:
        box.down()


def _ssh(dep: Deployment, user: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(dep.fleet.ssh_config_path), f"{user}@h1", command],
                          capture_output=True, text=True, timeout=30, check=False)


def _deployed(dep: Deployment) -> None:
    """Every host on a confirmed release (a no-op when an earlier test of the module left it so)."""
    assert dep.kdeploy("push", "all") == 0


def _phase(host: dict, name: str) -> dict:
    return next(p for p in host["phases"] if p["name"] == name)


def test_push_verify_status_logs_set_env_rollback_as_the_user(dep: Deployment, capsys) -> None:
    inv = dep.load()
    assert {(h.user, h.become, h.become_user) for h in inv.hosts.values()} == {(USER, True, "root")}
    refused = _ssh(dep, "root", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    assert _ssh(dep, USER, "id -un").stdout.strip() == USER
    assert {h["system"] for h in dep.fleet.status()} == {"running"}  # sandbox status reads through sudo

    code, doc = dep.json(capsys, "push", "all")
    assert code == 0, doc
    first = {h["host"]: h["release"] for h in doc["hosts"]}
    for host in doc["hosts"]:
        assert host["result"] == "deployed"
        assert _phase(host, "connect")["detail"].startswith(f"{USER}@") and "become root via sudo" in \
            _phase(host, "connect")["detail"]
    # what kdeploy wrote is root's, with the modes it has when root logs in; none of it is writable by others
    d = dep.service_dir
    unit = dep.unit_path
    assert dep.sh("h1", f"stat -c '%U:%G %a' {unit} {d} {d}/history.jsonl {d}/.lock {SECRETS_FILE}").split() == [
        "root:root", "644", "root:root", "755", "root:root", "600", "root:root", "600", "root:root", "600"]
    pid = dep.show("h1", "MainPID")
    assert f"KDT_BECOME_TOKEN={TOKEN}" in dep.sh("h1", f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines()
    assert dep.sh("h1", f"find {d} {unit} {SECRETS_FILE} ! -user root -o ! -type l -perm -o+w").strip() == ""
    assert dep.sh("h1", f"stat -c %a {d}/releases/{first['h1']}/.kdeploy").strip() == "700"
    assert _ssh(dep, USER, f"test -w {d} || test -w {unit} || test -r {SECRETS_FILE} || echo no-access").stdout \
        .strip() == "no-access"

    code, doc = dep.json(capsys, "verify", "all")
    assert code == 0 and {h["result"] for h in doc["hosts"]} == {"healthy"}, doc
    code, doc = dep.json(capsys, "status", "all")
    assert code == 0, doc
    code, doc = dep.json(capsys, "plan", "all")
    assert code == 0 and not any(h["plan"]["restart"] for h in doc["hosts"]), doc
    code, doc = dep.json(capsys, "history", "h1")
    assert code == 0 and doc["hosts"][0]["history"][-1]["release"] == first["h1"], doc
    code, doc = dep.json(capsys, "probe", "h1")  # the probe program ran (as on a root login: no sglang here)
    assert code == 7 and "sglang not installed" in doc["hosts"][0]["probe"]["summary"], doc
    capsys.readouterr()
    assert dep.kdeploy("logs", "h1", "-n", "20") == 0
    lines = capsys.readouterr().out.splitlines()  # the unit's journal: only root (or adm) may read it
    assert lines and all(line.startswith("h1 | ") for line in lines)
    assert any(f" {dep.service}[" in line for line in lines), lines
    _follow_ends_on_the_host_when_stopped(dep)

    code, doc = dep.json(capsys, "set-env", "KDT_BECOME=1")
    assert code == 0, doc
    assert all(h["result"] == "deployed" for h in doc["hosts"]), doc
    assert "KDT_BECOME=1" in dep.sh("h2", f"systemctl show {dep.service} -p Environment --value")

    code, doc = dep.json(capsys, "rollback", "all")
    assert code == 0, doc
    for name in HOSTS:
        assert dep.current(name) == first[name]
        assert "KDT_BECOME" not in dep.sh(name, f"systemctl show {dep.service} -p Environment --value")


def _follow_ends_on_the_host_when_stopped(dep: Deployment) -> None:
    """``logs -f`` streams through sudo, and its journalctl ends on the host once the controller stops."""
    proc = subprocess.Popen([sys.executable, "-m", "kdeploy", "logs", "h1", "-f", "-n", "1", "--inventory",
                             str(dep.path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("h1 | ")
        following = "pgrep -u root -x journalctl || true"
        assert dep.sh("h1", following).strip()
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 15
    while dep.sh("h1", following).strip():
        assert time.monotonic() < deadline, "journalctl -f outlived the controller's channel"
        time.sleep(0.5)


def test_lock_is_held_by_a_root_shell_under_sudo_and_force_released(dep: Deployment, capsys) -> None:
    _deployed(dep)
    inv = dep.load()
    host = inv.hosts["h1"]
    with Remote.connect(host, sshconfig.target_for(inv, host)) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="become holder")
        try:
            pid = held.remote_pid
            assert pid and lock.parse_info(dep.sh("h1", f"cat {dep.service_dir}/lock.json")).remote_pid == pid
            # the reported PID is the holder shell itself, running as root under sudo
            assert dep.sh("h1", f"ps -o user=,comm= -p {pid}; ps -o comm= -p $(ps -o ppid= -p {pid})").split() \
                == ["root", "sh", "sudo"]
            code, doc = dep.json(capsys, "push", "h1", "--force-restart")
            assert code == 6 and "become holder" in doc["hosts"][0]["error"], doc
            code, doc = dep.json(capsys, "lock", "status", "h1")
            assert doc["hosts"][0]["lock"]["state"] == "held"
            code, doc = dep.json(capsys, "lock", "release", "h1", "--force")
            assert code == 0 and doc["hosts"][0]["lock"] == {"state": "free", "holder": None}, doc
            assert dep.sh("h1", f"kill -0 {pid} 2>/dev/null && echo alive || echo gone").strip() == "gone"
            deadline = time.monotonic() + 10
            while not held.process.exit_status_ready():  # sudo ended with it: the channel closed
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            held.process.close()
    # a holder whose channel closes (the controller let go) sees EOF through sudo and frees the lock
    with Remote.connect(host, sshconfig.target_for(inv, host)) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="become holder")
        held.process.close()
        deadline = time.monotonic() + 10
        while (code := dep.json(capsys, "lock", "status", "h1")[1]["hosts"][0]["lock"]["state"]) != "free":
            assert time.monotonic() < deadline, code
            time.sleep(0.2)


def test_controller_killed_after_the_switch_host_reverts_by_itself(dep: Deployment, capsys) -> None:
    _deployed(dep)
    old = dep.current("h1")
    new = provisional_tests._killed_during_the_gate(dep, "h1")
    assert new != old
    record = provisional_tests._wait_reverted(dep, old, new)
    provisional_tests._assert_back_on(dep, old, new, record)
    dep.set_service(env={})


def test_router_drain_and_admit_through_a_become_host(dep: Deployment, tmp_path: Path, capsys) -> None:
    """The router listens on the bridge only; kdeploy reaches its API through h2's connection (``via``)."""
    _deployed(dep)
    gateway = dep.fleet.gateway
    port = _free_port()
    url = f"http://{gateway}:{port}"
    workers = [f"http://{dep.load().hosts[h].address}:{dep.port}" for h in HOSTS]
    argv = router_env.router_argv(router_env.ensure_venv(), gateway, port, workers, health_interval=1,
                                  health_failures=1, prometheus_port=_free_port())
    with router_env.running(argv, url, tmp_path / "router.log"):
        dep.edit(lambda doc: doc["defaults"].update(router={"url": url, "via": "h2", "drain_timeout": 30}))

        def listed() -> set[str]:
            return {w["url"] for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]}

        code, doc = dep.json(capsys, "push", "all", "--force-restart", "--batch", "1")
        assert code == 0, doc
        for host in doc["hosts"]:
            names = [p["name"] for p in host["phases"]]
            assert host["router"] == "in" and names.index("drain") < names.index("restart") < names.index("admit")
        assert listed() == set(workers)
        code, doc = dep.json(capsys, "router", "drain", "h1")
        assert code == 0 and listed() == {workers[1]}, doc
        code, doc = dep.json(capsys, "router", "admit", "h1")
        assert code == 0 and listed() == set(workers), doc
    dep.edit(lambda doc: doc["defaults"].pop("router"))


def test_sudo_that_wants_a_password_is_refused_at_connect_and_nothing_changes(dep: Deployment, capsys) -> None:
    _deployed(dep)
    before = dep.current("h2")
    invocation = dep.show("h2", "InvocationID")
    releases = dep.sh("h2", f"ls {dep.service_dir}/releases").split()
    dep.sh("h2", f"cp {SUDOERS} /root/sudoers.keep && echo '{USER} ALL=(ALL:ALL) ALL' > {SUDOERS}")
    try:
        (dep.payload / "rev.txt").write_text("password")
        code, doc = dep.json(capsys, "push", "all")
        hosts = {h["host"]: h for h in doc["hosts"]}
        assert code == 3 and hosts["h1"]["result"] == "deployed", doc
        assert hosts["h2"]["result"] == "unreachable" and "sudo: a password is required" in hosts["h2"]["error"]
        assert [p["name"] for p in hosts["h2"]["phases"]] == ["connect"]
        assert dep.current("h2") == before
        assert dep.show("h2", "InvocationID") == invocation
        assert dep.sh("h2", f"ls {dep.service_dir}/releases").split() == releases
    finally:
        dep.sh("h2", f"cp /root/sudoers.keep {SUDOERS}")
    code, doc = dep.json(capsys, "push", "h2")
    assert code == 0, doc


def test_exec_runs_as_become_user_unless_no_become(dep: Deployment, capsys) -> None:
    """Under become, exec runs as become_user (root) like every command; --no-become as the SSH user."""
    for extra, who in (([], "root"), (["--no-become"], USER)):
        capsys.readouterr()
        code = cli.main(["exec", "all", "-i", str(dep.path), "--json", *extra, "--", "id", "-un"])
        doc = json.loads(capsys.readouterr().out)
        assert code == 0, doc
        for host in doc["hosts"]:
            assert host["exec"] == {"exit_status": 0, "stdout": f"{who}\n", "stderr": ""}, host
            assert ("become root via sudo" in _phase(host, "connect")["detail"]) == (who == "root"), host


@pytest.mark.skipif(not Path("/usr/bin/doas").exists(), reason="doas is not installed here (make installs opendoas)")
def test_doas_instead_of_sudo(dep: Deployment, capsys) -> None:
    """``become_method: doas`` with sudo refusing everyone: every step still runs, through doas."""
    _deployed(dep)
    for host in HOSTS:
        dep.sh(host, f"mv {SUDOERS} /root/sudoers.keep")
    dep.edit(lambda doc: doc["defaults"].update(become_method="doas"))
    try:
        (dep.payload / "rev.txt").write_text("doas")
        code, doc = dep.json(capsys, "push", "all")
        assert code == 0, doc
        for host in doc["hosts"]:
            assert host["result"] == "deployed" and "become root via doas" in _phase(host, "connect")["detail"]
        code, doc = dep.json(capsys, "verify", "all")
        assert code == 0, doc
        inv = dep.load()
        host = inv.hosts["h1"]
        with Remote.connect(host, sshconfig.target_for(inv, host)) as remote:
            held = lock.acquire(remote, service_dir(host.service), command="doas holder")
            try:
                pid = held.remote_pid
                assert dep.sh("h1", f"ps -o user=,comm= -p {pid}; ps -o comm= -p $(ps -o ppid= -p {pid})").split() \
                    == ["root", "sh", "doas"]
                code, doc = dep.json(capsys, "lock", "release", "h1", "--force")
                assert code == 0 and doc["hosts"][0]["lock"] == {"state": "free", "holder": None}, doc
            finally:
                held.process.close()
        dep.sh("h2", "cp /etc/doas.conf /root/doas.keep && echo 'permit deploy as root' > /etc/doas.conf")
        try:
            code, doc = dep.json(capsys, "push", "h2", "--force-restart")
            assert code == 3 and "doas: a password is required" in doc["hosts"][0]["error"], doc
        finally:
            dep.sh("h2", "cp /root/doas.keep /etc/doas.conf")
    finally:
        dep.edit(lambda doc: doc["defaults"].pop("become_method"))
        for host in HOSTS:
            dep.sh(host, f"mv /root/sudoers.keep {SUDOERS}")
