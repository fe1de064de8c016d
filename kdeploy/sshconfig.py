"""What ``ssh HOST`` would use to reach a host: the inventory merged with the OpenSSH client config.

Precedence for every setting: a value the inventory sets explicitly (at any level) > ``ssh_config`` >
kdeploy's default. The result is a :class:`Target` (the host and its jump hops, each a :class:`Hop`), built
by pure functions so ``remote`` only executes it.
"""

from __future__ import annotations

import getpass
import io
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from kdeploy.errors import InvalidInput
from kdeploy.filecache import FileCache
from kdeploy.inventory import HostConfig, Inventory

USER_CONFIG = Path("~/.ssh/config")
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")
ENV_VAR = "KDEPLOY_SSH_CONFIG"
DEFAULT_USER = "root"                 # kdeploy's own default for service hosts
DEFAULT_PORT = 22
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_KEEPALIVE = 10                # seconds between keepalives (ServerAliveInterval): 10 x 3, a dead link in 30 s
DEFAULT_KEEPALIVE_COUNT = 3
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
DEFAULT_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
_JUMP = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?\Z")


@dataclass(frozen=True)
class Hop:
    """One SSH connection: to a jump host or to the service host itself."""

    label: str                        # how messages name it: the inventory host name or the jump spec
    hostname: str                     # what is dialled (or asked of the previous hop)
    port: int
    user: str
    identity_files: tuple[Path, ...]
    identities_only: bool
    identity_agent: str | None        # agent socket; None: $SSH_AUTH_SOCK; "none": no agent
    user_known_hosts: tuple[Path, ...]  # the first is where --accept-new-host-keys records a key
    global_known_hosts: tuple[Path, ...]
    host_key_alias: str | None
    connect_timeout: float
    keepalive: int
    keepalive_count: int

    @property
    def where(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname  # an IPv6 address, as ssh writes it
        return f"{self.user}@{host}:{self.port}"

    @property
    def key(self) -> tuple:
        """Hops with equal keys can share one connection."""
        return (self.user, self.hostname, self.port, self.identity_files, self.identity_agent)


@dataclass(frozen=True)
class Target:
    host: Hop
    jumps: tuple[Hop, ...] = ()       # in dialling order: jumps[0] is dialled directly
    notes: tuple[str, ...] = field(default=())  # config settings kdeploy overrides, said once


def config_paths(inventory_value: str | bool | None, cli_value: str | None,
                 environ: dict[str, str] | None = None, base_dir: Path = Path()) -> list[Path]:
    """Which ssh_config files apply: --ssh-config > KDEPLOY_SSH_CONFIG > inventory > ~/.ssh/config +
    /etc/ssh/ssh_config. ``false``/``none`` in any of them means no config at all. A relative path is the
    command line's (the current directory) from the option or the variable, the inventory's from the
    inventory, as every path in it (``base_dir``)."""
    environ = os.environ if environ is None else environ
    for value, base in ((cli_value, Path()), (environ.get(ENV_VAR), Path()), (inventory_value, base_dir)):
        if value is None or value == "":
            continue
        if value is False or str(value).lower() in ("false", "none"):
            return []
        if value is True:
            break
        return [base / Path(str(value)).expanduser()]
    return [USER_CONFIG.expanduser(), SYSTEM_CONFIG]


_CONFIGS: FileCache[paramiko.SSHConfig] = FileCache()
_SAID: set[str] = set()
_LOCK = threading.Lock()


def target_for(inventory: Inventory, host: HostConfig, cli_value: str | None = None) -> Target:
    """The host's :class:`Target` under the ssh_config that applies (parsed once per file version); a
    setting kdeploy overrides (StrictHostKeyChecking no) is said once per process, on stderr."""
    paths = config_paths(host.ssh_config, cli_value, base_dir=inventory.base_dir)
    required = paths != [USER_CONFIG.expanduser(), SYSTEM_CONFIG]
    config = _CONFIGS.get(paths, lambda: load(paths, required=required))
    target = resolve(host, config, base_dir=inventory.base_dir)
    for note in target.notes:
        with _LOCK:
            if note in _SAID:
                continue
            _SAID.add(note)
        sys.stderr.write(f"kdeploy: note: {note}\n")
    return target


def load(paths: list[Path], *, required: bool) -> paramiko.SSHConfig:
    """Parsed config; a file named explicitly (``required``) must exist, the defaults may be absent."""
    config = paramiko.SSHConfig()
    for path in paths:
        try:
            text = path.read_text()
            _refuse_match_exec(text, path)
            config.parse(io.StringIO(text))
        except FileNotFoundError:
            if required:
                raise InvalidInput(f"ssh_config {path}: not found") from None
        except (OSError, paramiko.ConfigParseError, ValueError) as exc:
            raise InvalidInput(f"ssh_config {path}: {exc}") from None
    return config


def _refuse_match_exec(text: str, path: Path) -> None:
    """``Match exec`` runs a command per lookup (and needs invoke in paramiko): refused, by line."""
    for number, line in enumerate(text.splitlines(), 1):
        words = line.replace("=", " ").lower().split()
        if words[:1] == ["match"] and "exec" in words:
            raise InvalidInput(f"ssh_config {path}:{number}: `Match exec` is not supported by kdeploy; "
                               "use Host or Match host patterns")


def lookup(config: paramiko.SSHConfig, name: str) -> dict:
    """The options ``ssh NAME`` would get."""
    try:
        return dict(config.lookup(name))
    except (paramiko.SSHException, ValueError) as exc:
        raise InvalidInput(f"ssh_config: {name}: {exc}") from None


def parse_jumps(spec: str) -> list[tuple[str | None, str, int | None]]:
    """``[user@]host[:port]`` hops, comma-separated; ``none`` is no jump."""
    if spec.strip().lower() == "none":
        return []
    hops = []
    for part in spec.split(","):
        match = _JUMP.match(part.strip())
        if not match:
            raise InvalidInput(f"proxy_jump {spec!r}: {part.strip()!r} is not [user@]host[:port]")
        port = int(match["port"]) if match["port"] else None
        if port is not None and not 0 < port < 65536:
            raise InvalidInput(f"proxy_jump {spec!r}: port {port} out of range")
        hops.append((match["user"], match["host"].strip("[]"), port))
    return hops


def _paths(value: str | list[str] | None, base: Path | None = None) -> tuple[Path, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else value.split()
    return tuple(Path(v).expanduser() if base is None or Path(v).expanduser().is_absolute()
                 else base / Path(v) for v in items if v.lower() != "none")


def _number(options: dict, key: str, kind: type, where: str) -> float | int | None:
    if key not in options:
        return None
    try:
        value = kind(options[key])
    except ValueError:
        raise InvalidInput(f"ssh_config: {where}: {key} {options[key]!r} is not a number") from None
    return value


def _hop(label: str, name: str, options: dict, *, user: str | None, port: int | None, identity: tuple[Path, ...],
         known_hosts: tuple[Path, ...], connect_timeout: float | None, default_user: str) -> Hop:
    """One hop: explicit values (None when not given) > ``options`` (ssh_config for ``name``) > defaults."""
    identities = identity or _paths(options.get("identityfile")) or tuple(
        p for p in _paths(list(DEFAULT_IDENTITIES)) if p.exists())
    agent = options.get("identityagent")
    if agent is not None and agent.upper() == "SSH_AUTH_SOCK":
        agent = None
    elif agent is not None and agent.lower() != "none":
        agent = str(Path(agent.strip('"')).expanduser())
    cfg_port = _number(options, "port", int, label)
    timeout = _number(options, "connecttimeout", float, label)
    keepalive = _number(options, "serveraliveinterval", int, label)
    count = _number(options, "serveralivecountmax", int, label)
    return Hop(
        label=label,
        hostname=options.get("hostname", name),
        port=port or cfg_port or DEFAULT_PORT,
        user=user or options.get("user") or default_user,
        identity_files=identities,
        identities_only=options.get("identitiesonly", "no").lower() == "yes",
        identity_agent=agent,
        user_known_hosts=known_hosts or _paths(options.get("userknownhostsfile")) or _paths(
            list(DEFAULT_USER_KNOWN_HOSTS)),
        global_known_hosts=_paths(options.get("globalknownhostsfile", " ".join(DEFAULT_GLOBAL_KNOWN_HOSTS))),
        host_key_alias=options.get("hostkeyalias"),
        connect_timeout=connect_timeout or timeout or DEFAULT_CONNECT_TIMEOUT,
        keepalive=DEFAULT_KEEPALIVE if keepalive is None or keepalive <= 0 else keepalive,
        keepalive_count=count or DEFAULT_KEEPALIVE_COUNT,
    )


def resolve(host: HostConfig, config: paramiko.SSHConfig, *, base_dir: Path) -> Target:
    """The host's :class:`Target`: its inventory settings where set explicitly, else ``config``'s."""
    explicit = host.model_fields_set
    options = lookup(config, host.address)
    notes = []
    if options.get("stricthostkeychecking", "").lower() in ("no", "off", "accept-new"):
        notes.append(f"ssh_config sets StrictHostKeyChecking {options['stricthostkeychecking']} for "
                     f"{host.address}: kdeploy verifies host keys anyway (use --accept-new-host-keys to "
                     "record new ones)")
    identity = _paths(host.identity_file, base_dir) if "identity_file" in explicit else ()
    known = _paths(host.known_hosts, base_dir) if "known_hosts" in explicit else ()
    target = _hop(host.name, host.address, options,
                  user=host.user if "user" in explicit else None,
                  port=host.port if "port" in explicit else None,
                  identity=identity, known_hosts=known,
                  connect_timeout=host.connect_timeout if "connect_timeout" in explicit else None,
                  default_user=DEFAULT_USER)
    spec = host.proxy_jump if "proxy_jump" in explicit else options.get("proxyjump")
    jumps = []
    for user, name, port in parse_jumps(spec) if spec else []:
        jump_options = lookup(config, name)
        jumps.append(_hop(f"jump host {name}", name, jump_options, user=user, port=port,
                          identity=() if "identityfile" in jump_options else identity, known_hosts=known,
                          connect_timeout=target.connect_timeout, default_user=getpass.getuser()))
    return Target(target, tuple(jumps), tuple(notes))
