"""Reaching hosts the way `ssh HOST` does, on real sshd: ssh_config aliases, jump hosts (the hosts behind
them unreachable directly), hashed known_hosts, host certificates, ssh-agent, retries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdeploy.ssh import remote, sshconfig
from tests.conftest import Deployment

pytestmark = pytest.mark.hosts(4)


def addr(dep: Deployment, host: str) -> str:
    return dep.fleet._get(host).address


def only(dep: Deployment, host: str) -> None:
    """The inventory keeps one host."""
    dep.edit(lambda doc: [doc["hosts"].pop(h) for h in list(doc["hosts"]) if h != host])
    dep.edit(lambda doc: doc.update(groups={"test": {"hosts": [host]}}))


def connect_only(dep: Deployment, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    """A command that only connects and reads: (exit code, the host's JSON)."""
    code, doc = dep.json(capsys, "history", "test", *extra)
    return code, doc["hosts"][0]


def connect_detail(host: dict) -> str:
    return next(p["detail"] for p in host["phases"] if p["name"] == "connect")


def reaches_directly(address: str) -> bool:
    try:
        socket.create_connection((address, 22), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def hidden(deployment: Deployment) -> Iterator[list[str]]:
    """h2..h4 answer only the other hosts; h1 is their bastion. Always made reachable again."""
    names = ["h2", "h3", "h4"]
    remote.close_jumps()
    try:
        for name in names:
            deployment.fleet.hide(name)
        yield names
    finally:
        remote.close_jumps()
        for name in names:
            deployment.fleet.unhide(name)


def test_ssh_config_alias_gives_hostname_user_port_identity_and_key_alias(
        deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = deployment.load()
    key, known = doc.hosts["h1"].identity_file, doc.hosts["h1"].known_hosts
    fleet = deployment.fleet
    fleet.exec("h1", ["sh", "-c", "printf 'Port 22\\nPort 2222\\n' > /etc/ssh/sshd_config.d/30-port.conf && "
                                  "systemctl reload ssh"])
    try:
        config = tmp_path / "ssh_config"
        config.write_text(f"Host web-a\n  HostName {addr(deployment, 'h1')}\n  Port 2222\n  HostKeyAlias h1\n"
                          f"Host *\n  User root\n  IdentityFile /nonexistent/key\n  IdentityFile {key}\n"
                          f"  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n  StrictHostKeyChecking no\n")
        only(deployment, "h1")
        def use_config(doc: dict) -> None:
            for k in ("user", "port", "identity_file", "known_hosts"):
                doc["defaults"].pop(k)
            doc["defaults"]["ssh_config"] = str(config)
            doc["hosts"]["h1"]["address"] = "web-a"
        deployment.edit(use_config)
        code, host = connect_only(deployment, capsys)
        assert code == 0, host
        assert connect_detail(host) == f"root@{addr(deployment, 'h1')}:2222"
        # explicit inventory values win over the config
        deployment.edit(lambda doc: doc["hosts"]["h1"].update(port=22))
        code, host = connect_only(deployment, capsys)
        assert code == 0 and connect_detail(host).endswith(":22")
        # --ssh-config and KDEPLOY_SSH_CONFIG override the inventory's
        code, host = connect_only(deployment, capsys, "--ssh-config", str(tmp_path / "missing"))
        assert code == 2
    finally:
        fleet.exec("h1", ["sh", "-c", "rm -f /etc/ssh/sshd_config.d/30-port.conf; systemctl reload ssh"])


def test_one_bastion_connection_carries_every_host_behind_it(
        deployment: Deployment, hidden: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert not any(reaches_directly(addr(deployment, h)) for h in hidden)
    bastion = addr(deployment, "h1")
    deployment.edit(lambda doc: doc["hosts"].pop("h1"))
    deployment.edit(lambda doc: doc.update(groups={"test": {"hosts": hidden}}))
    deployment.edit(lambda doc: doc["defaults"].update(proxy_jump=f"root@{bastion}"))
    code, doc = deployment.json(capsys, "push", "test", "--parallel", "3")
    assert code == 0, [h["error"] for h in doc["hosts"]]
    assert all(f"via root@{bastion}:22" in connect_detail(h) for h in doc["hosts"])
    gateway = deployment.fleet.gateway
    sessions = deployment.sh("h1", f"ss -Htn state established '( sport = :22 )' dst {gateway} | wc -l")
    assert int(sessions) == 1  # our one connection to the bastion, still open for later hosts
    # no data after a channel's close: OpenSSH would have dropped the bastion connection for every host
    assert "nonexistent channel" not in deployment.sh("h1", "journalctl -u ssh --no-pager -q")


def test_two_jump_hops(deployment: Deployment, hidden: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    only(deployment, "h4")
    deployment.edit(lambda doc: doc["hosts"]["h4"].update(
        proxy_jump=f"root@{addr(deployment, 'h1')},{addr(deployment, 'h2')}:22"))
    code, host = connect_only(deployment, capsys)
    assert code == 0, host
    assert connect_detail(host).endswith(f"via root@{addr(deployment, 'h2')}:22 via root@{addr(deployment, 'h1')}:22")


def test_a_dead_bastion_is_unreachable_naming_it(deployment: Deployment, hidden: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    only(deployment, "h2")
    deployment.edit(lambda doc: doc["defaults"].update(proxy_jump=f"root@{addr(deployment, 'h1')}:2"))
    code, host = connect_only(deployment, capsys)
    assert code == 3 and host["result"] == "unreachable"
    assert f"jump host {addr(deployment, 'h1')} (root@{addr(deployment, 'h1')}:2): unreachable" in host["error"]
    assert "refused" in host["error"].lower()


def test_hosts_reached_only_through_a_proxy_command_and_only_through_an_included_file(
        deployment: Deployment, hidden: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """h2 and h3 answer only h1. Every setting of theirs is in a file the config Includes (by a glob): h2 is
    reached through `ProxyCommand ssh -W %h:%p bastion` (a real OpenSSH client process), h3 through
    `ProxyJump bastion`. Both are pushed and verified; then a ProxyCommand that exits is one line, exit 3."""
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, "openssh")
    sshconfig.clear_cache()
    doc = deployment.load()
    key, known = doc.hosts["h1"].identity_file, doc.hosts["h1"].known_hosts
    config, included = tmp_path / "ssh_config", tmp_path / "ssh_config.d"
    included.mkdir()
    config.write_text(f"Include {included}/*.conf\nHost *\n  User root\n  IdentityFile {key}\n"
                      f"  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n  BatchMode yes\n")

    def fleet_conf(proxy_port: str) -> None:
        (included / "10-fleet.conf").write_text(
            f"Host bastion\n  HostName {addr(deployment, 'h1')}\n"
            f"Host gpu-proxied\n  HostName {addr(deployment, 'h2')}\n"
            f"  ProxyCommand ssh -F {config} -W %h:{proxy_port} bastion\n"
            f"Host gpu-included\n  HostName {addr(deployment, 'h3')}\n  ProxyJump bastion\n")
        sshconfig.clear_cache()

    fleet_conf("%p")

    def use_config(doc: dict) -> None:
        for k in ("user", "port", "identity_file", "known_hosts"):
            doc["defaults"].pop(k)
        doc["defaults"]["ssh_config"] = str(config)
        for name in ("h1", "h4"):
            doc["hosts"].pop(name)
        doc["hosts"]["h2"]["address"] = "gpu-proxied"
        doc["hosts"]["h3"]["address"] = "gpu-included"
        doc["groups"] = {"test": {"hosts": ["h2", "h3"]}}
    deployment.edit(use_config)
    code, pushed = deployment.json(capsys, "push", "test")
    assert code == 0, [h["error"] for h in pushed["hosts"]]
    details = {h["host"]: connect_detail(h) for h in pushed["hosts"]}
    assert details["h2"] == (f"root@{addr(deployment, 'h2')}:22 via ProxyCommand "
                             f"'ssh -F {config} -W {addr(deployment, 'h2')}:22 bastion'")
    assert details["h3"] == f"root@{addr(deployment, 'h3')}:22 via root@{addr(deployment, 'h1')}:22"
    code, verified = deployment.json(capsys, "verify", "test")
    assert code == 0, [h.get("error") for h in verified["hosts"]]
    # without the Included file the aliases lead nowhere: that file alone reached them
    (included / "10-fleet.conf").rename(included / "10-fleet.off")
    sshconfig.clear_cache()
    code, _ = deployment.json(capsys, "history", "test")
    assert code == 3
    # a ProxyCommand that exits (ssh -W to a closed port): one line naming it and what it said, exit 3
    fleet_conf("2")
    code, doc_ = deployment.json(capsys, "history", "test")
    error = next(h["error"] for h in doc_["hosts"] if h["host"] == "h2")
    assert code == 3 and "\n" not in error, error
    assert f"ProxyCommand 'ssh -F {config} -W {addr(deployment, 'h2')}:2 bastion' exited with status 255" in error
    assert error.endswith("Connection refused; stdio forwarding failed"), error


def test_hashed_known_hosts_are_read_and_new_keys_written_hashed(
        deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    only(deployment, "h1")
    known = tmp_path / "known_hosts"
    known.write_text(Path(deployment.load().hosts["h1"].known_hosts).read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(known)], check=True, capture_output=True)
    deployment.edit(lambda doc: doc["defaults"].update(known_hosts=str(known)))
    assert connect_only(deployment, capsys)[0] == 0
    # a hashed file without h1: the key is recorded hashed
    address = addr(deployment, "h1")
    subprocess.run(["ssh-keygen", "-q", "-R", address, "-f", str(known)], check=True, capture_output=True)
    subprocess.run(["ssh-keygen", "-q", "-R", "h1", "-f", str(known)], check=True, capture_output=True)
    assert connect_only(deployment, capsys)[0] == 3
    code, host = connect_only(deployment, capsys, "--accept-new-host-keys")
    assert code == 0 and "new host key recorded" in connect_detail(host)
    assert address not in known.read_text()
    found = subprocess.run(["ssh-keygen", "-F", address, "-f", str(known)], capture_output=True, text=True)
    assert found.returncode == 0, found


@pytest.fixture
def ca(deployment: Deployment, tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Two CAs (one trusted by known_hosts); h1's certificate is removed afterwards."""
    keys = {}
    for name in ("ca", "other_ca"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
        keys[name] = tmp_path / name
    only(deployment, "h1")
    known = tmp_path / "ca_known_hosts"
    known.write_text(f"@cert-authority * {(tmp_path / 'ca.pub').read_text()}")
    keys["known"] = known
    deployment.edit(lambda doc: doc["defaults"].update(known_hosts=str(known)))
    try:
        yield keys
    finally:
        deployment.fleet.uncertify("h1")


@pytest.mark.parametrize(("signer", "principals", "validity", "revoke", "reason"), [
    ("ca", None, "-5m:+1h", False, None),
    ("ca", None, "20200101:20200102", False, "expired at 2020-01-02"),
    ("ca", ["h9", "10.0.0.9"], "-5m:+1h", False, "is not valid for"),
    ("other_ca", None, "-5m:+1h", False, "which no @cert-authority line trusts"),
    ("ca", None, "-5m:+1h", True, "is marked @revoked"),
])
def test_host_certificates(deployment: Deployment, ca: dict[str, Path], capsys: pytest.CaptureFixture[str],
                           signer: str, principals: list[str] | None, validity: str, revoke: bool,
                           reason: str | None) -> None:
    fleet = deployment.fleet
    fleet.certify("h1", ca[signer], principals=principals, validity=validity)
    if revoke:
        host_pub = fleet.exec("h1", ["cat", "/etc/ssh/ssh_host_ed25519_key.pub"]).stdout
        ca["known"].write_text(ca["known"].read_text() + f"@revoked * {host_pub}")
    code, host = connect_only(deployment, capsys, "--accept-new-host-keys")
    if reason is None:
        assert code == 0, host
    else:
        assert code == 3 and host["result"] == "unreachable", host
        assert "host key refused" in host["error"] and reason in host["error"], host["error"]
        assert "\n" not in host["error"]


def test_a_user_certificate_named_by_certificate_file_logs_in(
        deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sshd trusts a user CA (TrustedUserCAKeys), not the key: the key's certificate, named by CertificateFile
    in ssh_config (not beside the key), gets in; without the config, authentication fails (exit 3)."""
    for name in ("user_ca", "id_cert"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-s", str(tmp_path / "user_ca"), "-I", "kdeploy-test", "-n", "root",
                    "-V", "-5m:+1h", str(tmp_path / "id_cert.pub")], check=True, capture_output=True)
    cert = tmp_path / "certs" / "fleet-cert.pub"
    cert.parent.mkdir()
    (tmp_path / "id_cert-cert.pub").rename(cert)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host *\n  CertificateFile {cert}\n")
    fleet = deployment.fleet
    fleet.exec("h1", ["sh", "-c", "cat > /etc/ssh/kdeploy_user_ca.pub && printf 'TrustedUserCAKeys "
                                  "/etc/ssh/kdeploy_user_ca.pub\\n' > /etc/ssh/sshd_config.d/40-user-ca.conf && "
                                  "systemctl reload ssh"], input=(tmp_path / "user_ca.pub").read_text())
    try:
        only(deployment, "h1")
        deployment.edit(lambda doc: doc["defaults"].update(identity_file=str(tmp_path / "id_cert"),
                                                           ssh_config=str(config)))
        code, host = connect_only(deployment, capsys)
        assert code == 0, host
        code, host = connect_only(deployment, capsys, "--ssh-config", "none")
        assert code == 3 and "SSH authentication failed" in host["error"], host
    finally:
        fleet.exec("h1", ["sh", "-c", "rm -f /etc/ssh/sshd_config.d/40-user-ca.conf /etc/ssh/kdeploy_user_ca.pub; "
                                      "systemctl reload ssh"])


@pytest.fixture
def passphrase_key(deployment: Deployment, tmp_path: Path) -> Iterator[Path]:
    """A passphrase-protected key h1 accepts (removed from its authorized_keys afterwards)."""
    key = tmp_path / "id_locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret pass", "-C", "locked", "-f", str(key)],
                   check=True)
    pub = key.with_name("id_locked.pub").read_text()
    deployment.fleet.exec("h1", ["sh", "-c", "cat >> /etc/ssh/authorized_keys/root"], input=pub)
    only(deployment, "h1")
    deployment.edit(lambda doc: doc["defaults"].update(identity_file=str(key)))
    try:
        yield key
    finally:
        deployment.fleet.exec("h1", ["sed", "-i", "/ locked$/d", "/etc/ssh/authorized_keys/root"])


def test_passphrase_key_through_a_real_ssh_agent(deployment: Deployment, passphrase_key: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if sock.exists():
                break
            time.sleep(0.1)
        askpass = tmp_path / "askpass"
        askpass.write_text("#!/bin/sh\necho 's3cret pass'\n")
        askpass.chmod(0o700)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock), "SSH_ASKPASS": str(askpass),
               "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}
        subprocess.run(["ssh-add", str(passphrase_key)], env=env, check=True, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=10)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        code, host = connect_only(deployment, capsys)
        assert code == 0, host
        # IdentityAgent in ssh_config instead of the environment
        monkeypatch.delenv("SSH_AUTH_SOCK")
        config = tmp_path / "ssh_config"
        config.write_text(f"Host *\n  IdentityAgent {sock}\n")
        code, host = connect_only(deployment, capsys, "--ssh-config", str(config))
        assert code == 0, host
    finally:
        agent.terminate()
        agent.wait(10)


def test_passphrase_key_without_agent_is_one_line_exit_3_without_prompting(
        deployment: Deployment, passphrase_key: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    proc = subprocess.run([str(Path(sys.executable).with_name("kdeploy")), "lock", "status", "test",
                           "-i", str(deployment.path), "--ssh-config", "none", "--json"],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    error = json.loads(proc.stdout)["hosts"][0]["error"]
    assert f"{passphrase_key} is passphrase-protected and no ssh-agent holds it" in error
    assert "\n" not in error and "Traceback" not in proc.stderr


def test_a_host_refusing_connections_for_3s_is_reached_through_retries(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    only(deployment, "h1")
    fleet = deployment.fleet
    fleet.exec("h1", ["systemctl", "stop", "ssh.socket", "ssh.service"], check=False)
    restart = threading.Timer(3.0, lambda: fleet.exec("h1", ["systemctl", "start", "ssh.service"]))
    restart.start()
    try:
        started = time.monotonic()
        code, host = connect_only(deployment, capsys)
        assert code == 0, host
        assert time.monotonic() - started >= 2.5
        assert "failed attempts: Connection refused" in connect_detail(host)
    finally:
        restart.join()
        fleet.exec("h1", ["systemctl", "start", "ssh.service"], check=False)


def test_sandbox_with_bastion_and_host_certs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sandbox up --bastion --host-certs`: an inventory of ssh_config aliases behind a jump host, with
    certified host keys, that kdeploy and OpenSSH both reach; the hosts are not reachable directly."""
    from kdeploy.cli import app as cli
    from kdeploy_lab import demo
    from kdeploy_lab.sandbox import Sandbox

    box = next((b for b in (Sandbox(instance=i, sglang=False) for i in range(6, -1, -1)) if not b.hosts()), None)
    if box is None:
        pytest.skip("no free sandbox instance")
    try:
        box.up(2, bastion=True, host_certs=True)
        assert box.bastion() is not None and box.bastion().name == "h3"
        assert "@cert-authority *" in box.known_hosts_path.read_text()
        assert not any(reaches_directly(h.address) for h in box.hosts()[:2])
        path = tmp_path / "inventory.yaml"
        box.write_inventory(path, demo.demo_service(sglang=False))
        text = path.read_text()
        assert "ssh_config:" in text and "address: h1" in text and "h3" not in text
        remote.close_jumps()
        capsys.readouterr()
        assert cli.main(["history", "all", "-i", str(path), "--json"]) == 0
        for host in ("h1", "h2"):
            proc = subprocess.run(["ssh", "-F", str(box.ssh_config_path), host, "hostname"],
                                  capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
            assert proc.stdout.strip() == host, proc.stderr
    finally:
        remote.close_jumps()
        box.down()
