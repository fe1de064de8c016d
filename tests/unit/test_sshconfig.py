"""The inventory merged with an OpenSSH client config: precedence, aliases, jumps, what is refused."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from kdeploy import inventory, remote, sshconfig
from kdeploy.errors import InvalidInput

CONFIG = """\
Host gpu-*
  User deployer
  Port 2222
  IdentityFile ~/.ssh/fleet_a
  IdentityFile /keys/fleet_b
  IdentitiesOnly yes
  IdentityAgent /run/agent.sock
  ProxyJump ops@bastion.example:2200
  ConnectTimeout 4
  ServerAliveInterval 7
  ServerAliveCountMax 5
  UserKnownHostsFile /kh/users /kh/more
  GlobalKnownHostsFile /kh/global
  HostKeyAlias gpu-fleet
Host gpu-1
  HostName 10.1.0.1
Host bastion.example
  User jumper
  IdentityFile /keys/bastion
Host lax
  StrictHostKeyChecking no
Match host 10.9.*
  User matched
Host *
  User fallback
"""


def host(**values: object) -> inventory.HostConfig:
    service = {"name": "svc", "python": "/usr/bin/python3", "sglang": {"model_path": "/m"}}
    return inventory.HostConfig.model_validate({"name": "h", "address": "gpu-1", "service": service, **values})


@pytest.fixture
def config(tmp_path: Path) -> sshconfig.paramiko.SSHConfig:
    path = tmp_path / "config"
    path.write_text(CONFIG)
    return sshconfig.load([path], required=True)


def test_alias_gets_every_setting_from_ssh_config(config: sshconfig.paramiko.SSHConfig) -> None:
    target = sshconfig.resolve(host(), config, base_dir=Path("/inv"))
    hop = target.host
    assert (hop.hostname, hop.user, hop.port) == ("10.1.0.1", "deployer", 2222)
    assert hop.identity_files == (Path("~/.ssh/fleet_a").expanduser(), Path("/keys/fleet_b"))
    assert hop.identities_only and hop.identity_agent == "/run/agent.sock"
    assert hop.user_known_hosts == (Path("/kh/users"), Path("/kh/more"))
    assert hop.global_known_hosts == (Path("/kh/global"),) and hop.host_key_alias == "gpu-fleet"
    assert (hop.connect_timeout, hop.keepalive, hop.keepalive_count) == (4.0, 7, 5)
    (jump,) = target.jumps
    assert (jump.hostname, jump.user, jump.port, jump.identity_files) == (
        "bastion.example", "ops", 2200, (Path("/keys/bastion"),))
    assert not target.notes


def test_explicit_inventory_values_win_over_ssh_config(config: sshconfig.paramiko.SSHConfig) -> None:
    target = sshconfig.resolve(host(user="root", port=22, identity_file="keys/id", known_hosts="kh",
                                    connect_timeout=9, proxy_jump="none"), config, base_dir=Path("/inv"))
    hop = target.host
    assert (hop.user, hop.port, hop.connect_timeout) == ("root", 22, 9.0)
    assert hop.identity_files == (Path("/inv/keys/id"),) and hop.user_known_hosts == (Path("/inv/kh"),)
    assert target.jumps == ()


def test_kdeploy_defaults_when_neither_sets_a_value(tmp_path: Path) -> None:
    empty = sshconfig.load([], required=False)
    target = sshconfig.resolve(host(address="10.2.0.1"), empty, base_dir=tmp_path)
    hop = target.host
    assert (hop.hostname, hop.user, hop.port, hop.connect_timeout) == ("10.2.0.1", "root", 22, 10.0)
    assert hop.identity_agent is None and not hop.identities_only
    assert hop.user_known_hosts[0] == Path("~/.ssh/known_hosts").expanduser()
    assert hop.where == "root@10.2.0.1:22"
    assert sshconfig.resolve(host(address="::1", port=2222), empty, base_dir=tmp_path).host.where == "root@[::1]:2222"


def test_match_host_and_proxy_jump_chain_from_the_inventory(config: sshconfig.paramiko.SSHConfig) -> None:
    target = sshconfig.resolve(host(address="10.9.0.3", proxy_jump="a@j1:2201,[j2]"), config, base_dir=Path("/"))
    assert target.host.user == "matched"
    assert [(j.user, j.hostname, j.port) for j in target.jumps] == [("a", "j1", 2201), ("fallback", "j2", 22)]


def test_strict_host_key_checking_no_is_overridden_and_said(config: sshconfig.paramiko.SSHConfig) -> None:
    (note,) = sshconfig.resolve(host(address="lax"), config, base_dir=Path("/")).notes
    assert "StrictHostKeyChecking no" in note and "verifies host keys anyway" in note


def test_bad_values_are_one_line_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("Host *\n  User x\nMatch exec \"true\"\n  User y\n")
    with pytest.raises(InvalidInput, match=r"config:3: `Match exec` is not supported"):
        sshconfig.load([path], required=True)
    with pytest.raises(InvalidInput, match="not found"):
        sshconfig.load([tmp_path / "missing"], required=True)
    assert sshconfig.load([tmp_path / "missing"], required=False).get_hostnames() == set()
    for spec in ("a@", "h:99999", "h:x"):
        with pytest.raises(InvalidInput, match="proxy_jump"):
            sshconfig.parse_jumps(spec)
    path.write_text("Host *\n  Port many\n")
    with pytest.raises(InvalidInput, match="h: port 'many' is not a number"):
        sshconfig.resolve(host(), sshconfig.load([path], required=True), base_dir=tmp_path)


def test_config_file_precedence() -> None:
    default = [sshconfig.USER_CONFIG.expanduser(), sshconfig.SYSTEM_CONFIG]
    assert sshconfig.config_paths(None, None, {}) == default
    assert sshconfig.config_paths("/inv/cfg", None, {}) == [Path("/inv/cfg")]
    assert sshconfig.config_paths("/inv/cfg", None, {"KDEPLOY_SSH_CONFIG": "/env/cfg"}) == [Path("/env/cfg")]
    assert sshconfig.config_paths("/inv/cfg", "/cli/cfg", {"KDEPLOY_SSH_CONFIG": "/env"}) == [Path("/cli/cfg")]
    assert sshconfig.config_paths(False, None, {}) == []
    assert sshconfig.config_paths("/inv/cfg", "none", {}) == []
    # relative: the inventory's value against the inventory's directory, the others against the current one
    assert sshconfig.config_paths("cfg", None, {}, base_dir=Path("/inv")) == [Path("/inv/cfg")]
    assert sshconfig.config_paths("cfg", "c", {}, base_dir=Path("/inv")) == [Path("c")]
    assert sshconfig.config_paths("cfg", None, {"KDEPLOY_SSH_CONFIG": "e"}, base_dir=Path("/inv")) == [Path("e")]


def test_retries_back_off_with_jitter_within_the_window() -> None:
    pauses: list[float] = []
    calls = iter([remote._Transient("refused")] * 3 + ["ok"])

    def attempt() -> str:
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    result, failures = remote._retrying(attempt, sleep=pauses.append)
    assert result == "ok" and failures == ["refused"] * 3
    assert all(0.75 * b <= p <= 1.25 * b for p, b in zip(pauses, (0.5, 1, 2), strict=True))
    with pytest.raises(remote._Transient, match=r"refused \(\d+ attempts"):
        remote._retrying(lambda: (_ for _ in ()).throw(remote._Transient("refused")), window=0.1,
                         sleep=pauses.append)


def test_the_last_attempt_comes_at_the_end_of_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(remote.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(remote.random, "uniform", lambda low, high: 1.0)  # no jitter: pauses 0.5, 1, 2, 4
    attempts: list[float] = []

    def attempt() -> str:
        attempts.append(clock[0] - 100.0)
        raise remote._Transient("refused")

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    with pytest.raises(remote._Transient, match=r"refused \(5 attempts in 6\.0s\)"):
        remote._retrying(attempt, window=6.0, sleep=sleep)
    assert attempts == pytest.approx([0, 0.5, 1.5, 3.5, 6.0])  # the 4 s pause cut to 2.5 s: one more try


def test_jump_tunnel_never_sends_after_its_close() -> None:
    """A send racing close() must not reach the jump host after the CLOSE (OpenSSH drops the connection)."""
    class Channel:
        def __init__(self) -> None:
            self.events: list[str] = []

        def send(self, data: bytes) -> int:
            self.events.append("send")
            time.sleep(0.002)
            return len(data)

        def close(self) -> None:
            self.events.append("close")

    channel = Channel()
    tunnel = remote._Tunnel(channel)  # type: ignore[arg-type]

    def sender() -> None:
        with contextlib.suppress(OSError):
            while True:
                tunnel.send(b"x")

    thread = threading.Thread(target=sender)
    thread.start()
    time.sleep(0.05)
    tunnel.close()
    thread.join(5)
    assert channel.events.count("close") == 1 and channel.events[-1] == "close"
    with pytest.raises(OSError):
        tunnel.send(b"late")


def test_a_relative_ssh_config_in_the_inventory_is_found_beside_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """As every path in the inventory, whatever the current directory is."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir("/")
    monkeypatch.delenv(sshconfig.ENV_VAR, raising=False)
    (tmp_path / "ssh_config").write_text("Host gpu-a\n  HostName 192.0.2.7\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(f"defaults:\n  ssh_config: ssh_config\n  service:\n    name: svc\n"
                    f"    template: {repo}/templates/sglang.service.j2\n    payload: {repo}/tests/data/testplugin\n"
                    f"    python: /usr/bin/python3\n"
                    f"    sglang: {{model_path: /models/m}}\nhosts:\n  h1: {{address: gpu-a}}\n")
    loaded = inventory.load(path)
    assert sshconfig.target_for(loaded, loaded.hosts["h1"]).host.hostname == "192.0.2.7"
