"""The inventory merged with an OpenSSH client config: precedence, aliases, jumps, what is refused."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import paramiko
import pytest

from kdeploy.core import inventory
from kdeploy.core.errors import InvalidInput, Unreachable
from kdeploy.ssh import remote, sshconfig

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


def load(paths: list[Path], *, required: bool) -> Callable[..., sshconfig.Options]:
    """The builtin parser's lookup over ``paths``."""
    return sshconfig.builtin_lookup(sshconfig.load_builtin(paths, required=required)[0])


@pytest.fixture
def config(tmp_path: Path) -> Callable[..., sshconfig.Options]:
    path = tmp_path / "config"
    path.write_text(CONFIG)
    return load([path], required=True)


def test_alias_gets_every_setting_from_ssh_config(config: Callable[..., sshconfig.Options]) -> None:
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


def test_explicit_inventory_values_win_over_ssh_config(config: Callable[..., sshconfig.Options]) -> None:
    target = sshconfig.resolve(host(user="root", port=22, identity_file="keys/id", known_hosts="kh",
                                    connect_timeout=9, proxy_jump="none"), config, base_dir=Path("/inv"))
    hop = target.host
    assert (hop.user, hop.port, hop.connect_timeout) == ("root", 22, 9.0)
    assert hop.identity_files == (Path("/inv/keys/id"),) and hop.user_known_hosts == (Path("/inv/kh"),)
    assert target.jumps == ()


def test_kdeploy_defaults_when_neither_sets_a_value(tmp_path: Path) -> None:
    empty = load([], required=False)
    target = sshconfig.resolve(host(address="10.2.0.1"), empty, base_dir=tmp_path)
    hop = target.host
    assert (hop.hostname, hop.user, hop.port, hop.connect_timeout) == ("10.2.0.1", "root", 22, 10.0)
    assert hop.identity_agent is None and not hop.identities_only
    assert hop.user_known_hosts[0] == Path("~/.ssh/known_hosts").expanduser()
    assert hop.where == "root@10.2.0.1:22"
    assert sshconfig.resolve(host(address="::1", port=2222), empty, base_dir=tmp_path).host.where == "root@[::1]:2222"


def test_match_host_and_proxy_jump_chain_from_the_inventory(config: Callable[..., sshconfig.Options]) -> None:
    target = sshconfig.resolve(host(address="10.9.0.3", proxy_jump="a@j1:2201,[j2]"), config, base_dir=Path("/"))
    assert target.host.user == "matched"
    assert [(j.user, j.hostname, j.port) for j in target.jumps] == [("a", "j1", 2201), ("fallback", "j2", 22)]


def test_strict_host_key_checking_no_is_overridden_and_said(config: Callable[..., sshconfig.Options]) -> None:
    (note,) = sshconfig.resolve(host(address="lax"), config, base_dir=Path("/")).notes
    assert "StrictHostKeyChecking no" in note and "verifies host keys anyway" in note


def test_bad_values_are_one_line_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("Host *\n  User x\nMatch exec \"true\"\n  User y\n")
    with pytest.raises(InvalidInput, match=r"config:3: `Match exec` is not supported"):
        load([path], required=True)
    with pytest.raises(InvalidInput, match="not found"):
        load([tmp_path / "missing"], required=True)
    assert load([tmp_path / "missing"], required=False)("h") == {"hostname": ["h"]}
    for spec in ("a@", "h:99999", "h:x"):
        with pytest.raises(InvalidInput, match="proxy_jump"):
            sshconfig.parse_jumps(spec)
    path.write_text("Host *\n  Port many\n")
    with pytest.raises(InvalidInput, match="h: port 'many' is not a number"):
        sshconfig.resolve(host(), load([path], required=True), base_dir=tmp_path)


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


# --- OpenSSH's own resolution (ssh -G) and the builtin parser, against `ssh -G` -------------------------

CORPUS = Path(__file__).resolve().parents[1] / "data" / "ssh_config"
HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)
LOCAL_USER = pwd.getpwuid(os.getuid()).pw_name
needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")


@pytest.fixture
def corpus(tmp_path: Path) -> Iterator[Path]:
    """The corpus with its placeholders filled in; its relative Include's directory under ~/.ssh (where
    OpenSSH reads it from), removed afterwards."""
    rel = HOME / ".ssh" / f"kdeploy-parity-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "corpus"
    shutil.copytree(CORPUS, out)
    shutil.copytree(CORPUS / "rel", rel)
    for path in out.rglob("*"):
        if path.is_file():
            path.write_text(path.read_text().replace("@DIR@", str(out)).replace("@REL@", rel.name)
                            .replace("@LOCALUSER@", LOCAL_USER))
    (out / "flag").touch()
    sshconfig.clear_cache()
    try:
        yield out
    finally:
        shutil.rmtree(rel)
        sshconfig.clear_cache()


def ssh_g(config: Path | None, name: str, *args: str) -> sshconfig.Options:
    command = ["ssh", "-G", *(["-F", str(config)] if config else []), *args, name]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True)
    return sshconfig.parse_ssh_g(done.stdout)


def tokens(value: str, g: sshconfig.Options) -> str:
    """The test's own reading of ssh_config(5) TOKENS, for those the corpus uses."""
    for token, text in (("%h", g["hostname"][0]), ("%r", g["user"][0]), ("%p", g["port"][0]),
                        ("%d", str(HOME)), ("%u", LOCAL_USER)):
        value = value.replace(token, text)
    return str(HOME) + value[1:] if value.startswith("~/") else value


def by_openssh(config: Path | None, name: str, user: str | None) -> dict:
    """What `ssh -G` itself says: user, port, hostname, identities, proxy (its jumps each asked of ssh -G)."""
    g = ssh_g(config, name, *(["-l", user] if user else []))
    jumps = []
    for juser, jname, jport in sshconfig.parse_jumps(g["proxyjump"][0]) if "proxyjump" in g else []:
        j = ssh_g(config, jname, *(["-l", juser] if juser else []), *(["-p", str(jport)] if jport else []))
        jumps.append((j["user"][0], j["hostname"][0], int(j["port"][0])))
    return {"user": g["user"][0], "port": int(g["port"][0]), "hostname": g["hostname"][0],
            "identities": tuple(Path(tokens(v, g)) for v in g["identityfile"]),
            "proxy_command": tokens(g["proxycommand"][0], g) if "proxycommand" in g else None, "jumps": jumps}


def by_kdeploy(config: Path | None, name: str, user: str | None, resolver: str,
               monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, resolver)
    loaded = inventory_with(config, name, user)
    target = sshconfig.target_for(loaded, loaded.hosts["h"])
    hop = target.host
    return {"user": hop.user, "port": hop.port, "hostname": hop.hostname, "identities": hop.identity_files,
            "proxy_command": hop.proxy_command, "jumps": [(j.user, j.hostname, j.port) for j in target.jumps]}


def inventory_with(config: Path | None, address: str, user: str | None = None) -> inventory.Inventory:
    repo = Path(__file__).resolve().parents[2]
    path = Path(tempfile.mkdtemp()) / "inventory.yaml"
    extra = f", user: {user}" if user else ""
    path.write_text(f"defaults:\n  ssh_config: {config if config else 'true'}\n  service:\n    name: svc\n"
                    f"    template: {repo}/templates/sglang.service.j2\n    payload: {repo}/tests/data/testplugin\n"
                    f"    python: /usr/bin/python3\n    sglang: {{model_path: /models/m}}\n"
                    f"hosts:\n  h: {{address: '{address}'{extra}}}\n")
    return inventory.load(path)


PARITY = [  # (config, host, inventory user, the builtin parser supports it)
    ("main.conf", "web-1", None, True),          # Host pattern with `!`, tokens in IdentityFile, several of them
    ("main.conf", "web-admin", None, True),      # ... the negated name gets its own block
    ("main.conf", "db-1", None, True),           # HostName from an Include glob, then `Match host` on it
    ("main.conf", "db-1", "ops", False),         # `Match user` sees the inventory's user (ssh -l)
    ("main.conf", "db-2", None, True),
    ("main.conf", "alias-x", None, True),        # %h in HostName
    ("main.conf", "behind-1", None, True),       # a ProxyJump chain, each hop resolved itself
    ("main.conf", "piped", None, True),          # ProxyCommand with tokens
    ("main.conf", "deep-1", None, True),         # a jump host reached by its own ProxyCommand
    ("main.conf", "gpu-3", None, True),          # a relative Include (from ~/.ssh), %d and %u
    ("main.conf", "local-1", None, True),        # Match localuser
    ("main.conf", "10.9.0.7", None, True),       # Match host on an address
    ("main.conf", "other", None, True),
    ("exec.conf", "exec-1", None, False),        # Match exec, run by OpenSSH
]


@needs_ssh
@pytest.mark.parametrize(("config", "name", "user", "builtin"), PARITY)
def test_parity_with_ssh_G(corpus: Path, monkeypatch: pytest.MonkeyPatch, config: str, name: str,
                           user: str | None, builtin: bool) -> None:
    expected = by_openssh(corpus / config, name, user)
    assert by_kdeploy(corpus / config, name, user, "openssh", monkeypatch) == expected
    if builtin:
        sshconfig._SAID.clear()
        assert by_kdeploy(corpus / config, name, user, "builtin", monkeypatch) == expected


@needs_ssh
def test_parity_spot_checks(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus does what it says (so parity is not two equal mistakes)."""
    main = corpus / "main.conf"
    web = by_kdeploy(main, "web-1", None, "openssh", monkeypatch)
    assert web["user"] == "web" and web["identities"] == (
        HOME / ".ssh/web_web-1_web", Path("/keys/shared"), HOME / ".ssh/id_fleet")
    assert by_kdeploy(main, "web-admin", None, "openssh", monkeypatch)["port"] == 2200
    assert by_kdeploy(main, "db-1", None, "openssh", monkeypatch)["user"] == "matched"
    assert by_kdeploy(main, "db-1", "ops", "openssh", monkeypatch)["port"] == 5022
    assert by_kdeploy(main, "gpu-3", None, "builtin", monkeypatch)["port"] == 2222
    assert by_kdeploy(main, "piped", None, "builtin", monkeypatch)["proxy_command"] == \
        "ssh -W 10.7.0.5:22 -l fallback gateway.example"
    assert by_kdeploy(main, "behind-1", None, "openssh", monkeypatch)["jumps"] == [
        ("jumper", "bastion.example", 2222), ("fallback", "inner.example", 22)]
    loaded = inventory_with(main, "deep-1")
    (edge,) = sshconfig.target_for(loaded, loaded.hosts["h"]).jumps
    assert edge.proxy_command == "nc -X connect -x proxy.example:3128 edge.example 22"
    assert by_kdeploy(corpus / "exec.conf", "exec-1", None, "openssh", monkeypatch)["port"] == 7000
    (corpus / "flag").unlink()
    sshconfig.clear_cache()
    assert by_kdeploy(corpus / "exec.conf", "exec-1", None, "openssh", monkeypatch)["port"] == 22


@needs_ssh
@pytest.mark.parametrize("resolver", ["openssh", "builtin"])
def test_no_user_anywhere_is_root_for_the_host_and_the_local_user_for_jumps(
        corpus: Path, monkeypatch: pytest.MonkeyPatch, resolver: str) -> None:
    found = by_kdeploy(corpus / "plain.conf", "plain-1", None, resolver, monkeypatch)
    assert (found["user"], found["hostname"]) == ("root", "192.0.2.10")
    assert found["jumps"] == [(getpass.getuser(), "hop.example", 22)]


@needs_ssh
def test_the_default_user_applies_only_where_no_config_sets_one(corpus: Path) -> None:
    """ssh -G's user is the local one when no file sets it: kdeploy's default (root) is given to ssh as a
    last `User` line instead, so `Match user` and %r see exactly what ssh would, and a config's User wins."""
    ssh = shutil.which("ssh")
    assert ssh is not None
    resolver = sshconfig.OpenSSH(ssh, [corpus / "plain.conf"])
    assert resolver.lookup("plain-1", default_user="svc-deployer")["user"] == ["svc-deployer"]
    resolver = sshconfig.OpenSSH(ssh, [corpus / "main.conf"])
    assert resolver.lookup("web-1", default_user="svc-deployer")["user"] == ["web"]
    assert resolver.lookup("web-1", "ops", default_user="svc-deployer")["user"] == ["ops"]
    # with ssh's own files (~/.ssh/config + /etc/ssh/ssh_config), everything but the user is as `ssh -G` says
    plain = sshconfig.without_defaults(ssh_g(None, "gpu-default.example"), resolver._defaults())
    wrapped = sshconfig.OpenSSH(ssh, sshconfig.default_paths()).lookup("gpu-default.example",
                                                                       default_user="svc-deployer")
    assert wrapped["user"] == (plain["user"] if plain["user"] != [LOCAL_USER] else ["svc-deployer"])
    assert {k: v for k, v in wrapped.items() if k != "user"} == {k: v for k, v in plain.items() if k != "user"}


@needs_ssh
def test_the_distributions_default_files_as_ssh_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ssh_config named: ~/.ssh/config + /etc/ssh/ssh_config (Debian's: Include ssh_config.d/*.conf)."""
    monkeypatch.delenv(sshconfig.ENV_VAR, raising=False)
    expected = by_openssh(None, "gpu-default.example", None)
    for resolver in ("openssh", "builtin"):
        found = by_kdeploy(None, "gpu-default.example", None, resolver, monkeypatch)
        assert {k: found[k] for k in ("hostname", "port", "proxy_command", "jumps")} == \
            {k: expected[k] for k in ("hostname", "port", "proxy_command", "jumps")}


@needs_ssh
def test_ssh_G_runs_once_per_distinct_host_per_run(corpus: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A logging `ssh` first on PATH: 8 lookups of 2 names (4 threads at once) run ssh -G 2 times, plus
    once for OpenSSH's defaults."""
    log = tmp_path / "calls"
    wrapper = tmp_path / "bin" / "ssh"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {shutil.which('ssh')} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}:{os.environ['PATH']}")
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, "openssh")
    loaded = [inventory_with(corpus / "main.conf", name) for name in ("web-1", "web-2") * 4]
    with ThreadPoolExecutor(4) as pool:
        users = list(pool.map(lambda inv: sshconfig.target_for(inv, inv.hosts["h"]).host.user, loaded))
    assert users == ["web"] * 8
    assert len(log.read_text().splitlines()) == 3


@needs_ssh
def test_bad_config_under_ssh_G_is_invalid_input_with_what_ssh_said(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, "openssh")
    config = tmp_path / "config"
    config.write_text("Host *\n  User x\n  NoSuchKeyword 1\n")
    with pytest.raises(InvalidInput, match=r"`ssh -G h1` failed: .*config: line 3: Bad configuration option: "
                                           r"nosuchkeyword"):
        sshconfig.target_for(*one_host(inventory_with(config, "h1")))
    with pytest.raises(InvalidInput, match="not found"):
        sshconfig.target_for(*one_host(inventory_with(tmp_path / "missing", "h1")))


@pytest.mark.parametrize("resolver", [pytest.param("openssh", marks=needs_ssh), "builtin"])
def test_an_include_loop_is_one_line_with_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         resolver: str) -> None:
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, resolver)
    (tmp_path / "a.conf").write_text(f"Host *\n  Port 22\nInclude {tmp_path}/b.conf\n")
    (tmp_path / "b.conf").write_text(f"# b\nInclude {tmp_path}/a.conf\n")
    with pytest.raises(InvalidInput) as raised:
        sshconfig.target_for(*one_host(inventory_with(tmp_path / "a.conf", "h1")))
    assert str(raised.value) == (f"ssh_config {tmp_path}/b.conf:2: Include loop: {tmp_path}/a.conf:3 -> "
                                 f"{tmp_path}/b.conf:2 -> {tmp_path}/a.conf")


def test_builtin_parser_reads_includes_and_names_each_keyword_it_cannot_honour_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, "builtin")
    sshconfig._SAID.clear()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.conf").write_text("Host gpu-1\n  Port 9\n  ControlMaster auto\n")
    (tmp_path / "d" / "2.conf").write_text("Host gpu-*\n  User ops\n  ForwardAgent yes\n")
    config = tmp_path / "config"
    config.write_text(f"Host gpu-*\n  Include {tmp_path}/d/*.conf\n  ControlMaster no\n  HostName 10.0.0.1\n"
                      "Host *\n  SendEnv LANG\n")
    for name in ("gpu-1", "gpu-1", "gpu-2"):
        hop = sshconfig.target_for(*one_host(inventory_with(config, name))).host
    assert (hop.user, hop.port) == ("ops", 22)
    hop = sshconfig.target_for(*one_host(inventory_with(config, "gpu-1"))).host
    assert (hop.user, hop.port, hop.hostname) == ("ops", 9, "10.0.0.1")  # after the Include, still gpu-*'s block
    err = capsys.readouterr().err
    assert err.count("ControlMaster") == 1 and f"ssh_config {tmp_path}/d/1.conf:3: ControlMaster" in err
    assert err.count("ForwardAgent") == 1 and err.count("SendEnv") == 1
    assert "HostName" not in err
    # its files have Host blocks of their own, which OpenSSH would apply only where gpu-* matched: said once
    assert err.count(f"ssh_config {config}:2: An Include inside a Host/Match block") == 1


def test_builtin_relative_includes_are_read_from_ssh_dir_or_etc_ssh(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[tuple[Path, Path]] = []
    monkeypatch.setattr(sshconfig, "_read", lambda path, base, stack, out: read.append((path, base)))
    sshconfig.load_builtin([tmp_path / "user", sshconfig.SYSTEM_CONFIG], required=False)
    assert read == [(tmp_path / "user", HOME / ".ssh"), (sshconfig.SYSTEM_CONFIG, Path("/etc/ssh"))]


def one_host(loaded: inventory.Inventory) -> tuple[inventory.Inventory, inventory.HostConfig]:
    return loaded, loaded.hosts["h"]


def test_resolver_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sshconfig.ssh_binary({sshconfig.RESOLVER_VAR: "builtin", "PATH": "/usr/bin"}) is None
    assert sshconfig.ssh_binary({"PATH": "/nonexistent"}) is None
    with pytest.raises(InvalidInput, match="no `ssh` on PATH"):
        sshconfig.ssh_binary({sshconfig.RESOLVER_VAR: "openssh", "PATH": "/nonexistent"})
    with pytest.raises(InvalidInput, match="expected openssh, builtin or auto"):
        sshconfig.ssh_binary({sshconfig.RESOLVER_VAR: "paramiko"})


def test_ssh_G_command_and_output() -> None:
    assert sshconfig.ssh_g_command("ssh", "h", None) == ["ssh", "-G", "--", "h"]
    assert sshconfig.ssh_g_command("ssh", "h", [], user="u", port=2) == [
        "ssh", "-G", "-F", "none", "-l", "u", "-p", "2", "--", "h"]
    assert sshconfig.ssh_g_command("ssh", "h", [Path("/c")]) == ["ssh", "-G", "-F", "/c", "--", "h"]
    parsed = sshconfig.parse_ssh_g("user a\nidentityfile ~/x\nidentityfile /y\nproxycommand ssh -W %h:%p b\n")
    assert parsed == {"user": ["a"], "identityfile": ["~/x", "/y"], "proxycommand": ["ssh -W %h:%p b"]}
    assert sshconfig.without_defaults({"identityfile": ["~/a"], "port": ["22"]},
                                      {"identityfile": ["~/a"], "port": ["22"]}) == {"port": ["22"]}


def test_proxy_command_that_exits_is_one_line_unreachable_not_retried(tmp_path: Path) -> None:
    """A real ProxyCommand process that ends before the SSH handshake: exit 3, its last stderr line."""
    count = tmp_path / "count"
    script = tmp_path / "proxy"
    script.write_text(f"#!/bin/sh\necho run >> {count}\necho \"no route to $1 port $2\" >&2\nexit 7\n")
    script.chmod(0o755)
    hop = sshconfig._hop("h1", "h1", {"proxycommand": [f"{script} h1 22"]}, user=None, port=None, identity=(),
                         known_hosts=(tmp_path / "kh",), connect_timeout=5, default_user="root")
    with pytest.raises(Unreachable) as raised:
        remote.Remote.connect(host(address="h1"), sshconfig.Target(hop))
    assert str(raised.value) == (f"h: h1 (root@h1:22): ProxyCommand '{script} h1 22' exited with status 7: "
                                 "no route to h1 port 22")
    assert count.read_text() == "run\n"


def test_user_certificates_are_offered_before_their_key(tmp_path: Path) -> None:
    """CertificateFile and KEY-cert.pub (made by the real ssh-keygen) pair with the key they certify only."""
    for name in ("ca", "id_a", "id_b"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    for name in ("id_a", "id_b"):
        subprocess.run(["ssh-keygen", "-q", "-s", str(tmp_path / "ca"), "-I", name, "-n", "root",
                        str(tmp_path / f"{name}.pub")], check=True, capture_output=True)
    moved = tmp_path / "certs" / "a.cert"
    moved.parent.mkdir()
    (tmp_path / "id_a-cert.pub").rename(moved)  # only CertificateFile names it now
    hop = sshconfig._hop("h", "h", {"identityfile": [str(tmp_path / "id_a")],
                                    "certificatefile": [str(moved), str(tmp_path / "id_b-cert.pub")]},
                         user=None, port=None, identity=(), known_hosts=(), connect_timeout=None, default_user="root")
    keys, skipped = remote._identities(hop, None)
    assert not skipped and len(keys) == 2
    assert keys[0].public_blob is not None and keys[0].public_blob.key_type.endswith("-cert-v01@openssh.com")
    assert keys[0].public_blob.key_blob == paramiko.PublicBlob.from_file(str(moved)).key_blob
    assert keys[1].public_blob is None and keys[1].asbytes() == keys[0].asbytes()


@pytest.mark.parametrize("resolver", [pytest.param("openssh", marks=needs_ssh), "builtin"])
def test_kdeploy_defaults_follow_HOME_where_no_file_sets_a_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 resolver: str) -> None:
    """A CI job with its own HOME writes ~/.ssh/id_ed25519 and known_hosts there: OpenSSH's defaults (from the
    passwd home) are not taken for set values, kdeploy's own defaults (from $HOME) apply."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, resolver)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_ed25519").touch()
    config = tmp_path / "empty"
    config.touch()
    hop = sshconfig.target_for(*one_host(inventory_with(config, "10.0.0.9"))).host
    assert hop.identity_files == (tmp_path / ".ssh" / "id_ed25519",)
    assert hop.user_known_hosts[0] == tmp_path / ".ssh" / "known_hosts"
    assert (hop.connect_timeout, hop.keepalive, hop.keepalive_count) == (10.0, 10, 3)


@needs_ssh
@pytest.mark.parametrize("config", ["Host *\n  Bogus 1\n", "Include {dir}/config\n"])
def test_a_config_ssh_refuses_is_exit_2_one_line_per_host_before_any_connection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], config: str) -> None:
    from kdeploy.cli import app as cli
    monkeypatch.setenv(sshconfig.RESOLVER_VAR, "openssh")
    path = tmp_path / "config"
    path.write_text(config.format(dir=tmp_path))
    loaded = inventory_with(path, "192.0.2.1")  # TEST-NET: a connection attempt would time out, not exit 2
    capsys.readouterr()
    assert cli.main(["history", "all", "-i", str(loaded.path), "--json"]) == 2
    (host_doc,) = json.loads(capsys.readouterr().out)["hosts"]
    assert host_doc["result"] == "invalid" and "\n" not in host_doc["error"]
    assert ("line 2: Bad configuration option: bogus" in host_doc["error"]
            or f"{path}:1: Include loop: {path}:1 -> {path}" in host_doc["error"]), host_doc["error"]
