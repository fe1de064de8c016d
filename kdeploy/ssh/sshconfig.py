"""What ``ssh HOST`` would use to reach a host: the inventory merged with the OpenSSH client config.

Precedence for every setting: a value the inventory sets explicitly (at any level) > ``ssh_config`` >
kdeploy's default. Where an OpenSSH client is installed, OpenSSH itself resolves the config (``ssh -G``:
Include, Match, tokens, canonicalisation exactly as ``ssh`` does); without one, paramiko's parser does, with
``Include`` added and every keyword it cannot honour named once on stderr. The result is a :class:`Target`
(the host and its jump hops, each a :class:`Hop`), built by pure functions so ``remote`` only executes it.
"""

from __future__ import annotations

import errno
import getpass
import glob
import hashlib
import io
import os
import pwd
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import paramiko

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.filecache import FileCache, stamp
from kdeploy.core.inventory import HostConfig, Inventory

USER_CONFIG = Path("~/.ssh/config")
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")
ENV_VAR = "KDEPLOY_SSH_CONFIG"
RESOLVER_VAR = "KDEPLOY_SSH_RESOLVER"  # openssh (ssh -G) | builtin (paramiko's parser) | auto (the default)
SSH_G_TIMEOUT = 30.0                  # seconds one `ssh -G` may take (a `Match exec` command runs inside it)
DEFAULT_USER = "root"                 # kdeploy's own default for service hosts
DEFAULT_PORT = 22
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_KEEPALIVE = 10                # seconds between keepalives (ServerAliveInterval): 10 x 3, a dead link in 30 s
DEFAULT_KEEPALIVE_COUNT = 3
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
DEFAULT_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
MAX_JUMP_DEPTH = 8                    # a first jump host's own ProxyJump, and its own...: a loop ends here
_JUMP = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?\Z")
# Keywords the builtin parser honours (or, like Host/Match/Include, evaluates); any other one is named.
HONOURED = frozenset({
    "host", "match", "include", "hostname", "user", "port", "identityfile", "identitiesonly", "identityagent",
    "certificatefile", "proxyjump", "proxycommand", "connecttimeout", "serveraliveinterval",
    "serveralivecountmax", "userknownhostsfile", "globalknownhostsfile", "hostkeyalias", "stricthostkeychecking",
    "canonicalizehostname", "canonicaldomains", "canonicalizemaxdots", "canonicalizefallbacklocal",
})
# `ssh -G` prints every setting, defaults included; these are kdeploy's own defaults where ssh's apply.
_DEFAULTED = ("identityfile", "userknownhostsfile", "globalknownhostsfile", "connecttimeout",
              "serveraliveinterval", "serveralivecountmax", "stricthostkeychecking")

_T = TypeVar("_T")
Options = dict[str, list[str]]         # lowercase keyword -> its values (several for IdentityFile & co.)


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
    proxy_command: str | None = None  # tokens expanded: run as the connection's socket instead of dialling
    certificate_files: tuple[Path, ...] = ()

    @property
    def where(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname  # an IPv6 address, as ssh writes it
        return f"{self.user}@{host}:{self.port}"

    @property
    def key(self) -> tuple:
        """Hops with equal keys can share one connection."""
        return (self.user, self.hostname, self.port, self.identity_files, self.identity_agent, self.proxy_command)


@dataclass(frozen=True)
class Target:
    host: Hop
    jumps: tuple[Hop, ...] = ()       # in dialling order: jumps[0] is dialled directly (or by its ProxyCommand)
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
    return default_paths()


def default_paths() -> list[Path]:
    """What ``ssh`` reads when no file is named: the user's config, then the system's."""
    return [USER_CONFIG.expanduser(), SYSTEM_CONFIG]


def ssh_binary(environ: dict[str, str] | None = None) -> str | None:
    """The ``ssh`` that resolves configs, or None for the builtin parser (``KDEPLOY_SSH_RESOLVER``)."""
    environ = os.environ if environ is None else environ
    choice = environ.get(RESOLVER_VAR, "auto").strip().lower() or "auto"
    if choice not in ("auto", "openssh", "builtin"):
        raise InvalidInput(f"{RESOLVER_VAR}={choice!r}: expected openssh, builtin or auto")
    if choice == "builtin":
        return None
    found = shutil.which("ssh", path=environ.get("PATH"))
    if found is None and choice == "openssh":
        raise InvalidInput(f"{RESOLVER_VAR}=openssh but no `ssh` on PATH (install openssh-client)")
    return found


_SAID: set[str] = set()
_LOCK = threading.Lock()


def _say_once(key: str, text: str) -> None:
    with _LOCK:
        if key in _SAID:
            return
        _SAID.add(key)
    sys.stderr.write(f"kdeploy: note: {text}\n")


def _check_for_openssh(path: Path) -> None:
    """A config named explicitly, before ``ssh -G`` reads it (OpenSSH reads a file whole, without a bound): there,
    a regular file, and within kdeploy's bound. The files it Includes are OpenSSH's to read."""
    st = files.status(path, "ssh_config")
    if st is None:
        raise InvalidInput(f"ssh_config {path}: not found")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"ssh_config {path}: not a regular file")
    if st.st_size > files.MAX_BYTES:
        raise InvalidInput(f"ssh_config {path}: larger than {files.size(files.MAX_BYTES)} (kdeploy's bound)")


def target_for(inventory: Inventory, host: HostConfig, cli_value: str | None = None) -> Target:
    """The host's :class:`Target` under the ssh_config that applies, resolved by ``ssh -G`` where OpenSSH is
    installed (cached per run), else by the builtin parser (once per file version). A setting kdeploy
    overrides (StrictHostKeyChecking no) is said once per process, on stderr."""
    paths = config_paths(host.ssh_config, cli_value, base_dir=inventory.base_dir)
    ssh = ssh_binary()
    if ssh is not None:
        for path in paths if paths != default_paths() else []:
            _check_for_openssh(path)
        lookup = OpenSSH(ssh, paths).lookup
    else:
        required = paths != default_paths()
        config, unhonoured = _CONFIGS.get(paths, lambda: load_builtin(paths, required=required))
        for keyword, where in unhonoured.items():
            _say_once(f"keyword {keyword}", f"ssh_config {where}: {keyword} is not honoured by kdeploy's own "
                                            "parser (no OpenSSH client: install openssh-client to have ssh "
                                            "resolve the config)")
        lookup = builtin_lookup(config)
    target = resolve(host, lookup, base_dir=inventory.base_dir)
    for note in target.notes:
        _say_once(note, note)
    return target


# --- OpenSSH: `ssh -G` ---------------------------------------------------------------------------------

def ssh_g_command(ssh: str, name: str, config: list[Path] | None, *, user: str | None = None,
                  port: int | None = None) -> list[str]:
    """``ssh -G`` for ``name``: ``config`` None reads ssh's own files (~/.ssh/config + /etc/ssh/ssh_config),
    ``[]`` none, ``[path]`` only that file (``ssh -F``). ``user``/``port`` are the inventory's values, given
    as ``ssh -l/-p``: they win over the config, and ``Match user`` and ``%r`` see them."""
    command = [ssh, "-G"]
    if config is not None:
        command += ["-F", str(config[0]) if config else "none"]
    if user is not None:
        command += ["-l", user]
    if port is not None:
        command += ["-p", str(port)]
    return [*command, "--", name]


def parse_ssh_g(text: str) -> Options:
    """``ssh -G``'s output: one ``keyword value`` per line; a keyword given several times keeps each value."""
    options: Options = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            options.setdefault(key.lower(), []).append(value.strip())
    return options


def without_defaults(options: Options, defaults: Options) -> Options:
    """``options`` less the settings equal to OpenSSH's defaults (``ssh -G -F none``'s), where kdeploy has
    defaults of its own (identity files, known_hosts, timeouts)."""
    return {k: v for k, v in options.items() if not (k in _DEFAULTED and defaults.get(k) == v)}


class OpenSSH:
    """Settings as ``ssh -G`` prints them, once per (files, host, inventory values) per run: hosts and
    jump hosts that resolve identically share one ``ssh -G``; different ones run in parallel (each host
    resolves in its own connect thread)."""

    def __init__(self, ssh: str, paths: list[Path]) -> None:
        self.ssh = ssh
        self.paths = paths
        self.config = None if paths == default_paths() else paths

    def lookup(self, name: str, user: str | None = None, port: int | None = None,
               default_user: str | None = None) -> Options:
        """``ssh -G``'s settings for ``name``. ``default_user``: the user when neither the inventory
        (``user``) nor the config sets one, instead of ssh's (the local user)."""
        config, wrapper = self.config, None
        if user is None and default_user is not None and default_user != _local_user():
            config, wrapper = [Path("/dev/stdin")], self.wrapper(default_user)
        command = ssh_g_command(self.ssh, name, config, user=user, port=port)
        return _memo((tuple(command), wrapper, stamp(self.paths)), lambda: expand_options(
            without_defaults(self._run(command, name, wrapper), self._defaults()), name))

    def _run(self, command: list[str], name: str, config_text: str | None = None) -> Options:
        try:
            done = subprocess.run(command, capture_output=True, text=True, input=config_text or "",
                                  timeout=SSH_G_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise InvalidInput(f"ssh_config: `ssh -G {name}` did not finish within {SSH_G_TIMEOUT:g}s "
                               "(a Match exec command that hangs?)") from None
        except OSError as exc:
            raise InvalidInput(f"ssh_config: cannot run {command[0]}: {exc.strerror}") from None
        if done.returncode != 0:
            said = [line.strip() for line in done.stderr.splitlines()
                    if line.strip() and not line.startswith("Pseudo-terminal")]
            if any("recursive configuration includes" in line for line in said):
                loop = find_include_loop(self.config or default_paths())
                if loop:
                    raise InvalidInput(loop)
            reason = said[0] if said else f"exit status {done.returncode}"
            raise InvalidInput(f"ssh_config: `ssh -G {name}` failed: {reason}")
        return parse_ssh_g(done.stdout)

    def _defaults(self) -> Options:
        return _memo(("defaults", self.ssh),
                     lambda: self._run(ssh_g_command(self.ssh, "kdeploy.invalid", []), "(defaults)"))

    def wrapper(self, default_user: str) -> str:
        """A config (given to ``ssh -F /dev/stdin``) that reads the same files as ``ssh`` would, then sets
        ``User default_user`` last: the first value obtained wins, so it applies only where no file sets a
        User."""
        files = self.config if self.config is not None else [_home() / ".ssh" / "config", SYSTEM_CONFIG]
        return "".join(f'Include "{p.absolute()}"\n' for p in files) + f"Host *\n  User {default_user}\n"


_MEMO: dict[tuple, object] = {}
_MEMO_LOCKS: dict[tuple, threading.Lock] = {}
_MEMO_GUARD = threading.Lock()


def _memo(key: tuple, compute: Callable[[], _T]) -> _T:
    """``compute()`` once per ``key`` per run; threads asking for the same key wait for the one computing it,
    different keys compute in parallel."""
    with _MEMO_GUARD:
        lock = _MEMO_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _MEMO:
            _MEMO[key] = compute()
        return _MEMO[key]  # type: ignore[return-value]


def clear_cache() -> None:
    """Forget every ``ssh -G`` answer (a library caller whose Included files changed)."""
    with _MEMO_GUARD:
        _MEMO.clear()


def _local_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def _home() -> Path:
    """OpenSSH's ``~`` and ``%d``: the passwd entry's home, not $HOME."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def expand_tokens(value: str, *, host: str, original: str, user: str, port: int, alias: str | None) -> str:
    """OpenSSH's ``%`` tokens and ``${VAR}`` in IdentityFile/CertificateFile, ``~`` as OpenSSH expands it."""
    local = socket.gethostname()
    tokens = {"%": "%", "d": str(_home()), "h": host, "n": original, "p": str(port), "r": user,
              "u": _local_user(), "i": str(os.getuid()), "l": local, "L": local.split(".")[0],
              "k": alias or original,
              "C": hashlib.sha1(f"{local}{host}{port}{user}".encode()).hexdigest()}

    def token(match: re.Match) -> str:
        letter = match.group(1)
        if letter not in tokens:
            raise InvalidInput(f"ssh_config: unknown token %{letter} in {value!r}")
        return tokens[letter]

    value = re.sub(r"\$\{(\w+)\}", lambda m: os.environ.get(m.group(1), ""), value)
    value = re.sub(r"%(.)", token, value)
    if value == "~" or value.startswith("~/"):
        value = str(_home()) + value[1:]
    return value


def proxy_tokens(command: str, *, host: str, original: str, user: str, port: int) -> str:
    """ProxyCommand's tokens, as OpenSSH expands them when it runs it."""
    tokens = {"%": "%", "h": host, "n": original, "p": str(port), "r": user}
    return re.sub(r"%(.)", lambda m: tokens.get(m.group(1), m.group(0)), command)


def expand_options(options: Options, name: str) -> Options:
    """``ssh -G`` prints IdentityFile, CertificateFile and ProxyCommand as written: expanded here as ssh
    expands them when it uses them (with the final host name, user and port, which ``ssh -G`` prints)."""
    where = {"host": _one(options, "hostname") or name, "original": name, "user": _one(options, "user") or "",
             "port": int(_one(options, "port") or DEFAULT_PORT)}
    out = dict(options)
    for key in ("identityfile", "certificatefile"):
        if key in out:
            out[key] = [v if v.lower() == "none" else expand_tokens(v.strip('"'), **where,
                                                                    alias=_one(options, "hostkeyalias"))
                        for v in out[key]]
    if "proxycommand" in out and out["proxycommand"][0].lower() != "none":
        out["proxycommand"] = [proxy_tokens(out["proxycommand"][0], **where)]
    return out


# --- the builtin parser (no OpenSSH client) --------------------------------------------------------------

_CONFIGS: FileCache[tuple[paramiko.SSHConfig, dict[str, str]]] = FileCache()


def _words(line: str) -> list[str]:
    """A config line's keyword and arguments (``Keyword value``, ``Keyword=value``, quoted arguments)."""
    match = re.match(r"\s*([^\s=#][^\s=]*)\s*=?\s*(.*)\Z", line)
    if match is None:
        return []
    try:
        return [match[1], *shlex.split(match[2])]
    except ValueError:
        return [match[1], *match[2].split()]


@dataclass
class _Read:
    lines: list[str] = field(default_factory=list)
    unhonoured: dict[str, str] = field(default_factory=dict)  # keyword (as written) -> file:line of its first use


def _include_base(top: Path) -> Path:
    """Where a relative Include points, as in OpenSSH: /etc/ssh for the system config, else ~/.ssh."""
    return SYSTEM_CONFIG.parent if top == SYSTEM_CONFIG else _home() / ".ssh"


def _read(path: Path, base: Path, stack: tuple[tuple[Path, int], ...], out: _Read) -> None:
    """``path``'s lines with every Include replaced by the included files' (globs sorted, as OpenSSH), the
    enclosing Host/Match line repeated after them so that the lines after the Include keep their block."""
    if files.status(path, "ssh_config") is None:  # a default file may be absent: load_builtin decides
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    text = files.read_text(path, "ssh_config")
    header = "Host *"
    for number, line in enumerate(text.splitlines(), 1):
        words = _words(line)
        keyword = words[0].lower() if words else ""
        if keyword in ("host", "match"):
            header = line
            if keyword == "match" and "exec" in [w.lower() for w in words[1:]]:
                raise InvalidInput(f"ssh_config {path}:{number}: `Match exec` is not supported by kdeploy's "
                                   "own parser (no OpenSSH client); install openssh-client or use Host or "
                                   "Match host patterns")
        if keyword and keyword not in HONOURED:
            out.unhonoured.setdefault(words[0], f"{path}:{number}")
        if keyword != "include":
            out.lines.append(line)
            continue
        start = len(out.lines)
        for pattern in words[1:]:
            expanded = Path(os.path.expanduser(pattern))
            for found in sorted(glob.glob(str(expanded if expanded.is_absolute() else base / expanded))):
                included = Path(found)
                if not files.is_file(included, "ssh_config"):
                    continue
                chain = [*stack, (path, number)]
                if any(included.resolve() == p.resolve() for p, _ in chain):
                    raise InvalidInput(f"ssh_config {path}:{number}: Include loop: " + " -> ".join(
                        f"{p}:{n}" for p, n in chain[[p.resolve() for p, _ in chain].index(included.resolve()):])
                        + f" -> {included}")
                if len(chain) > 16:
                    raise InvalidInput(f"ssh_config {path}:{number}: more than 16 nested Includes")
                _read(included, base, tuple(chain), out)
        if header != "Host *" and any(_words(x)[:1] and _words(x)[0].lower() in ("host", "match")
                                      for x in out.lines[start:]):  # OpenSSH: only where the enclosing block matches
            out.unhonoured.setdefault("An Include inside a Host/Match block whose file has Host/Match blocks "
                                      "(they apply unconditionally here)", f"{path}:{number}")
        out.lines.append(header)


def find_include_loop(paths: list[Path]) -> str | None:
    """The Include loop among ``paths`` as a one-line file:line message, or None."""
    try:
        for path in paths:
            if files.is_file(path, "ssh_config"):
                _read(path, _include_base(path), (), _Read())
    except InvalidInput as exc:
        return str(exc) if "Include" in str(exc) else None
    except OSError:
        return None
    return None


def load_builtin(paths: list[Path], *, required: bool) -> tuple[paramiko.SSHConfig, dict[str, str]]:
    """Parsed config (Includes read in place) and the keywords it cannot honour with their first file:line;
    a file named explicitly (``required``) must exist, the defaults may be absent."""
    config = paramiko.SSHConfig()
    out = _Read()
    for path in paths:
        try:
            start = len(out.lines)
            _read(path, _include_base(path), (), out)
            config.parse(io.StringIO("\n".join(out.lines[start:]) + "\n"))
        except FileNotFoundError:
            if required:
                raise InvalidInput(f"ssh_config {path}: not found") from None
        except (OSError, paramiko.ConfigParseError, ValueError) as exc:
            raise InvalidInput(f"ssh_config {path}: {exc}") from None
    return config, out.unhonoured


def builtin_lookup(config: paramiko.SSHConfig) -> Callable[..., Options]:
    """A lookup with :meth:`OpenSSH.lookup`'s shape over paramiko's parser."""
    def lookup(name: str, user: str | None = None, port: int | None = None,
               default_user: str | None = None) -> Options:
        try:
            found = dict(config.lookup(name))
        except (paramiko.SSHException, ValueError) as exc:
            raise InvalidInput(f"ssh_config: {name}: {exc}") from None
        result: Options = {k: v if isinstance(v, list) else [v] for k, v in found.items()}
        if user is not None:
            result["user"] = [user]
        elif default_user is not None and "user" not in result:
            result["user"] = [default_user]
        if port is not None:
            result["port"] = [str(port)]
        result.setdefault("hostname", [name])
        return result
    return lookup


# --- settings -> Target ---------------------------------------------------------------------------------

def parse_jumps(spec: str) -> list[tuple[str | None, str, int | None]]:
    """``[user@]host[:port]`` hops, comma-separated; ``none`` is no jump."""
    if spec.strip().lower() == "none":
        return []
    hops = []
    for part in spec.split(","):
        match = _JUMP.match(part.strip().removeprefix("ssh://"))
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


def _one(options: Options, key: str) -> str | None:
    values = options.get(key)
    return values[0] if values else None


def _number(options: Options, key: str, kind: type, where: str) -> float | int | None:
    value = _one(options, key)
    if value is None or value.lower() == "none":
        return None
    try:
        return kind(value)
    except ValueError:
        raise InvalidInput(f"ssh_config: {where}: {key} {value!r} is not a number") from None


def _files(options: Options, key: str) -> tuple[Path, ...]:
    return tuple(Path(v.strip('"')).expanduser() for v in options.get(key, []) if v.lower() != "none")


def _hop(label: str, name: str, options: Options, *, user: str | None, port: int | None,
         identity: tuple[Path, ...], known_hosts: tuple[Path, ...], connect_timeout: float | None,
         default_user: str) -> Hop:
    """One hop: explicit values (None when not given) > ``options`` (ssh_config for ``name``) > defaults."""
    hostname = _one(options, "hostname") or name
    cfg_port = _number(options, "port", int, label)
    hop_port = port or cfg_port or DEFAULT_PORT
    hop_user = user or _one(options, "user") or default_user
    identities = identity or _files(options, "identityfile") or tuple(
        p for p in _paths(list(DEFAULT_IDENTITIES)) if p.exists())
    agent = _one(options, "identityagent")
    if agent is not None and agent.upper() == "SSH_AUTH_SOCK":
        agent = None
    elif agent is not None and agent.lower() != "none":
        agent = str(Path(agent.strip('"')).expanduser())
    timeout = _number(options, "connecttimeout", float, label)
    keepalive = _number(options, "serveraliveinterval", int, label)
    count = _number(options, "serveralivecountmax", int, label)
    proxy = _one(options, "proxycommand")
    return Hop(
        label=label,
        hostname=hostname,
        port=hop_port,
        user=hop_user,
        identity_files=identities,
        identities_only=(_one(options, "identitiesonly") or "no").lower() in ("yes", "true"),
        identity_agent=agent,
        user_known_hosts=known_hosts or _paths(" ".join(options.get("userknownhostsfile", []))) or _paths(
            list(DEFAULT_USER_KNOWN_HOSTS)),
        global_known_hosts=_paths(" ".join(options.get("globalknownhostsfile", DEFAULT_GLOBAL_KNOWN_HOSTS))),
        host_key_alias=_one(options, "hostkeyalias"),
        connect_timeout=connect_timeout or timeout or DEFAULT_CONNECT_TIMEOUT,
        keepalive=DEFAULT_KEEPALIVE if keepalive is None or keepalive <= 0 else keepalive,
        keepalive_count=count or DEFAULT_KEEPALIVE_COUNT,
        proxy_command=None if proxy is None or proxy.lower() == "none" else proxy,
        certificate_files=_files(options, "certificatefile"),
    )


def _jump_chain(spec: str, lookup: Callable[..., Options], *, identity: tuple[Path, ...],
                known: tuple[Path, ...], timeout: float, depth: int = 0) -> list[Hop]:
    """The hops of a ProxyJump spec, as OpenSSH dials them: the first hop by its own ProxyJump or
    ProxyCommand, each later one through the hop before it (``ssh -J``'s own settings win over theirs)."""
    if depth > MAX_JUMP_DEPTH:
        raise InvalidInput(f"ssh_config: ProxyJump {spec!r}: more than {MAX_JUMP_DEPTH} nested jump hosts "
                           "(a loop?)")
    hops: list[Hop] = []
    for index, (user, name, port) in enumerate(parse_jumps(spec)):
        options = lookup(name, user, port)
        if index:
            options = {k: v for k, v in options.items() if k not in ("proxycommand", "proxyjump")}
        elif _one(options, "proxyjump") and _one(options, "proxyjump").lower() != "none":
            hops += _jump_chain(_one(options, "proxyjump"), lookup, identity=identity, known=known,
                                timeout=timeout, depth=depth + 1)
        hops.append(_hop(f"jump host {name}", name, options, user=user, port=port,
                         identity=() if "identityfile" in options else identity, known_hosts=known,
                         connect_timeout=timeout, default_user=getpass.getuser()))
    return hops


def resolve(host: HostConfig, lookup: Callable[..., Options], *, base_dir: Path) -> Target:
    """The host's :class:`Target`: its inventory settings where set explicitly, else the config's (asked
    through ``lookup`` with the inventory's user and port, as ``ssh -l -p``)."""
    explicit = host.model_fields_set
    identity = _paths(host.identity_file, base_dir) if "identity_file" in explicit else ()
    known = _paths(host.known_hosts, base_dir) if "known_hosts" in explicit else ()
    options = lookup(host.address, host.user if "user" in explicit else None,
                     host.port if "port" in explicit else None, DEFAULT_USER)
    if "proxy_jump" in explicit:  # the inventory's jump (or `none`) replaces the config's ProxyJump/ProxyCommand
        options = {k: v for k, v in options.items() if k not in ("proxyjump", "proxycommand")}
        options["proxyjump"] = [host.proxy_jump or "none"]
    notes = []
    strict = (_one(options, "stricthostkeychecking") or "").lower()
    if strict in ("no", "off", "false", "accept-new"):
        notes.append(f"ssh_config sets StrictHostKeyChecking {strict} for {host.address}: kdeploy verifies "
                     "host keys anyway (use --accept-new-host-keys to record new ones)")
    target = _hop(host.name, host.address, options,
                  user=host.user if "user" in explicit else None,
                  port=host.port if "port" in explicit else None,
                  identity=identity, known_hosts=known,
                  connect_timeout=host.connect_timeout if "connect_timeout" in explicit else None,
                  default_user=DEFAULT_USER)
    spec = _one(options, "proxyjump")
    jumps = _jump_chain(spec, lookup, identity=identity, known=known, timeout=target.connect_timeout) \
        if spec and target.proxy_command is None else []
    return Target(target, tuple(jumps), tuple(notes))
