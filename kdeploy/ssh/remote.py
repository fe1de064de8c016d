"""The SSH layer: one connection per host (through shared jump-host connections), reused for every step.

Host keys are always verified against known_hosts as OpenSSH reads it (``kdeploy.ssh.knownhosts``: hashed
names, ``@revoked``, ``@cert-authority`` host certificates). An unknown key is refused unless the caller
trusts on first use (then it is recorded, hashed when the file is); a changed, revoked or badly certified
key is always refused. Every failure to reach a host becomes :class:`Unreachable` with a one-line reason
naming the hop, so the CLI can exit 3 without a traceback. paramiko is used here and in ``tunnel`` only:
long-running commands (the lock holder, the exit watcher) are handed out as :class:`Process`.

Privilege escalation (``become``) lives here too, in :func:`posix`, the one place every command passes: with
it each command runs as ``become_user`` through ``sudo -n`` (or ``doas -n``), and :meth:`Remote.connect`
checks once, before any command, that it lets us in without a password.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import logging
import os
import random
import select
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import paramiko

from kdeploy.core.errors import RemoteTimeout, Unreachable
from kdeploy.core.filecache import FileCache
from kdeploy.core.inventory import HostConfig
from kdeploy.core.report import Cancelled, PhaseFailed
from kdeploy.core.step import RunResult, Step
from kdeploy.ssh import knownhosts
from kdeploy.ssh.sshconfig import Hop, Target

# paramiko logs what it raises to us (e.g. "Secsh channel 4 open FAILED" for a port that is not up yet, which the
# gate polls): without a handler of its own, Python prints those on stderr for every program that uses kdeploy.
# An application that configures logging still gets them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

STDERR_POLL = 0.1  # seconds between looks at a command's stderr while its stdout is awaited
INPUT_FAILED_WAIT = 30.0  # seconds a command whose input was cut short gets to clean up and exit
SEND_CHUNK = 256 * 1024  # an upload notices Ctrl-C within one chunk (~20 ms at paramiko's ~15 MB/s)
# AES-GCM first: its tag is checked inside `cryptography`, while paramiko's default (aes128-ctr +
# hmac-sha2-256) verifies every received packet's MAC in Python. Hosts without GCM get the rest, in
# paramiko's order.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
# A host that refuses or drops connections (rebooting) is retried with exponential backoff and jitter, for
# at most RETRY_WINDOW seconds since the first attempt; authentication and host-key failures never are.
RETRY_WINDOW = 6.0
RETRY_FIRST_DELAY = 0.5
BECOME_OK = "@@become-ok"  # what the connect check prints once sudo let it in
# become_method -> what runs the shell as {user}: never a prompt (-n), the command's stdin and stdout untouched
BECOME = {"sudo": "sudo -n -u {user} --", "doas": "doas -n -u {user}"}
_TRANSIENT = {errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET}
_KNOWN_HOSTS_LOCK = threading.Lock()
# A command refused by its fence (``Remote.fence``): the deploy lock this controller took is no longer its own.
FENCE_RC = 76
FENCE_MARK = "kdeploy-fence: the deploy lock is no longer ours"
_T = TypeVar("_T")
# `kdeploy -v`: one INFO record per SSH step (its command's first line, seconds, exit status); DEBUG (-vv) has the
# whole command. Never a command's input: secrets travel there.
TRACE = logging.getLogger("kdeploy.ssh")


def fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} SHA256:{key.fingerprint.removeprefix('SHA256:')}"


class _Transient(Exception):
    """A connect failure worth retrying (refused, timed out, no route): the host may be rebooting."""


class _Transport(paramiko.Transport):
    """Offers host key algorithms in the order known_hosts asks for (certificates first when a CA is
    trusted), as OpenSSH does; paramiko's own order would make a certified host show its plain key."""

    host_key_order: tuple[str, ...] = ()

    @property
    def preferred_keys(self) -> tuple[str, ...]:
        return self.host_key_order or super().preferred_keys

    def default_keys(self) -> tuple[str, ...]:
        return super().preferred_keys


def _new_transport(sock: socket.socket | _Tunnel | _ProxyCommand) -> _Transport:
    transport = _Transport(sock)
    options = transport.get_security_options()
    options.ciphers = PREFERRED_CIPHERS + tuple(c for c in options.ciphers if c not in PREFERRED_CIPHERS)
    return transport


def _socket(address: str, port: int, timeout: float, user_timeout: float) -> socket.socket:
    """A TCP connection that notices a dead link (silently dropped packets) within ``user_timeout``.

    TCP_NODELAY: every step is a small request waiting for a small answer; with Nagle's algorithm and the
    host's delayed ACKs each round trip stalled about 40 ms (measured: 49 ms per command, 4.4 ms without).
    """
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except TimeoutError:
        raise _Transient(f"connection timed out after {timeout:g}s") from None
    except OSError as exc:
        if exc.errno in _TRANSIENT:
            raise _Transient(exc.strerror or str(exc)) from None
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(user_timeout * 1000))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


class _ProxyCommand:
    """A ProxyCommand used as the connection's socket: run as OpenSSH runs it (``$SHELL -c 'exec CMD'``), what
    is sent goes to its stdin, what it prints is what the host sent. Its stderr goes to a file whose last
    lines say why it ended. It runs in its own session (a Ctrl-C at the terminal reaches kdeploy, which
    closes connections in order) and ends when the connection is closed, or when kdeploy exits (EOF)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 (open as long as the command runs: close())
        self.timeout: float | None = None
        self.closed = False
        self.ended = False  # it closed its stdout or stdin by itself
        self.terminated = False  # kdeploy ended it
        self.last_said = ""
        try:
            self.process = subprocess.Popen([os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                            bufsize=0, start_new_session=True)
        except OSError as exc:
            self.errors.close()
            raise Unreachable(f"ProxyCommand {command!r} could not start: {exc.strerror}") from None

    def send(self, data: bytes) -> int:
        if self.closed:
            raise OSError(errno.EPIPE, "ProxyCommand closed")
        try:
            return os.write(self.process.stdin.fileno(), data)  # type: ignore[union-attr]
        except BrokenPipeError:  # it closed its stdin: it is ending by itself
            self.ended = True
            raise

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes; b"" once the command closed its stdout (paramiko's own ProxyCommand waits
        out its timeout there again and again instead of seeing the end)."""
        stdout = self.process.stdout
        try:
            ready, _, _ = select.select([stdout], [], [], self.timeout)
            data = os.read(stdout.fileno(), size) if ready else None  # type: ignore[union-attr]
        except (ValueError, OSError):  # closed meanwhile (by close(), from another thread): the end
            return b""
        if data is None:
            raise TimeoutError
        if not data:
            self.ended = True
        return data

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def gettimeout(self) -> float | None:
        return self.timeout

    @property
    def _closed(self) -> bool:  # paramiko's Transport reads it like socket._closed
        return self.closed

    def failure(self) -> str | None:
        """Why the command ended by itself (one line), or None when it did not (it runs, or kdeploy ended it)."""
        if self.terminated:
            return None
        try:
            status = self.process.wait(2 if self.ended else 0.2)
        except subprocess.TimeoutExpired:
            return None
        said = self._said()
        return f"ProxyCommand {self.command!r} exited with status {status}" + (f": {said}" if said else "")

    def _said(self) -> str:
        """The last two lines it wrote to stderr (ssh -W: why, then "stdio forwarding failed")."""
        if self.errors.closed:
            return self.last_said
        self.errors.seek(0)
        lines = [line.strip() for line in self.errors.read()[-4096:].decode(errors="replace").splitlines()]
        return "; ".join([line for line in lines if line][-2:])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        if self.ended:  # it closed its stdout or stdin: let it exit by itself, with its own status
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(2)
        if self.process.poll() is None:
            self.terminated = True
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.last_said = self._said()
        self.errors.close()


def _opener(hop: Hop) -> Callable[[], socket.socket | _ProxyCommand]:
    """How the first hop is reached: its ProxyCommand, else a TCP connection."""
    if hop.proxy_command is not None:
        command = hop.proxy_command
        return lambda: _ProxyCommand(command)
    return lambda: _socket(hop.hostname, hop.port, hop.connect_timeout, _user_timeout(hop))


def _retrying(attempt: Callable[[], _T], *, window: float = RETRY_WINDOW,
              sleep: Callable[[float], None] = time.sleep) -> tuple[_T, list[str]]:
    """``attempt()`` until it does not raise :class:`_Transient` or the window is spent; the result and
    the reasons of the failed attempts (the connect phase shows them). A backoff pause that would run past
    the window is cut short so the last attempt comes at the window's end: a host back a little later than
    the previous attempt is still reached."""
    started = time.monotonic()
    failures: list[str] = []
    delay = RETRY_FIRST_DELAY
    last = False
    while True:
        try:
            return attempt(), failures
        except _Transient as exc:
            failures.append(str(exc))
            elapsed = time.monotonic() - started
            if last or elapsed >= window:
                raise _Transient(f"{exc} ({len(failures)} attempts in {elapsed:.1f}s)") from None
            pause = delay * random.uniform(0.75, 1.25)
            if elapsed + pause >= window:
                pause, last = window - elapsed, True
            sleep(pause)
            delay *= 2


def _check_host_key(transport: _Transport, hop: Hop, entries: list[knownhosts.Entry], name: str,
                    accept_new: bool) -> str | None:
    """Raise Unreachable unless known_hosts vouches for the key the host proved it holds; the fingerprint
    of a key recorded on first use, else None."""
    key = transport.get_remote_server_key()
    cert = key.public_blob.key_blob if transport.host_key_type.endswith(knownhosts.hostcert.CERT_SUFFIX) else None
    offered = knownhosts.Offered(key.get_name(), key.asbytes(), cert)
    verdict = knownhosts.decide(entries, [name], offered, int(time.time()))
    files = ", ".join(str(p) for p in hop.user_known_hosts + hop.global_known_hosts)
    if verdict.ok:
        return None
    if verdict.status == "changed":
        raise Unreachable(
            f"HOST KEY CHANGED: {verdict.reason}, host offers {fingerprint(key)}; refusing (possible "
            "man-in-the-middle; if the host was reinstalled, remove its old line from known_hosts)")
    if verdict.status != "unknown":
        raise Unreachable(f"host key refused: {verdict.reason}")
    if not accept_new:
        raise Unreachable(f"host key unknown ({fingerprint(key)} not in {files}); verify it and rerun with "
                          "--accept-new-host-keys to trust it")
    path = hop.user_known_hosts[0]
    with _KNOWN_HOSTS_LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text(errors="replace") if path.exists() else ""
        with path.open("a") as fh:
            fh.write(knownhosts.entry_line(name, key.get_name(), key.asbytes(), knownhosts.is_hashed(text)))
    return fingerprint(key)


class _Agent(paramiko.agent.AgentSSH):
    """The keys of the agent at ``path`` (IdentityAgent), or of $SSH_AUTH_SOCK."""

    def __init__(self, path: str | None) -> None:
        super().__init__()
        if path is None:
            agent = paramiko.Agent()
            self._conn, self._keys = agent._conn, agent.get_keys()
            return
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            self._connect(sock)
        except OSError:
            sock.close()


def _identities(hop: Hop, agent: _Agent | None) -> tuple[list[paramiko.PKey], list[str]]:
    """Keys to offer, in OpenSSH's order (agent first, then files; with IdentitiesOnly only the agent's
    copies of the files' keys), and why a file was skipped (passphrase-protected, not in the agent)."""
    agent_keys = list(agent.get_keys()) if agent else []
    in_agent = {k.asbytes() for k in agent_keys}
    files: list[paramiko.PKey] = []
    skipped: list[str] = []
    wanted: set[bytes] = set()
    for path in hop.identity_files:
        public = _public_blob(path)
        if public is not None:
            wanted.add(public)
            if public in in_agent:
                continue
        try:
            key = _private_key(path)
            files += [*_certified(key, path, hop), key]
        except (paramiko.PasswordRequiredException, TypeError) as exc:  # never prompt: a deploy is unattended
            # (cryptography raises TypeError for an OpenSSH-format key that needs a passphrase)
            if isinstance(exc, TypeError) and "password" not in str(exc):
                raise
            skipped.append(f"{path} is passphrase-protected and no ssh-agent holds it (ssh-add it)")
        except FileNotFoundError:
            skipped.append(f"{path} not found")
        except (OSError, paramiko.SSHException, ValueError) as exc:
            skipped.append(f"{path} unreadable: {exc}")
    if hop.identities_only:
        agent_keys = [k for k in agent_keys if k.asbytes() in wanted]
    return agent_keys + files, skipped


_KEYS: FileCache[paramiko.PKey] = FileCache()


def _certified(key: paramiko.PKey, path: Path, hop: Hop) -> list[paramiko.PKey]:
    """``key`` with each user certificate issued for it (``CertificateFile``s, ``PATH-cert.pub``), offered
    before the plain key as OpenSSH does; a certificate for another key is passed over."""
    out = []
    for cert in dict.fromkeys((*hop.certificate_files, Path(f"{path}-cert.pub"))):
        try:
            blob = paramiko.PublicBlob.from_file(str(cert))
            if knownhosts.hostcert.parse(blob.key_blob).public_key != key.asbytes():
                continue
        except (OSError, ValueError, paramiko.SSHException):
            continue
        certified = copy.copy(key)  # the cached key stays plain
        certified.public_blob = blob
        out.append(certified)
    return out


def _private_key(path: Path) -> paramiko.PKey:
    """An identity file, read once per run (again only when it changed), not once per connection."""
    return _KEYS.get([path], lambda: paramiko.PKey.from_path(path))


def _public_blob(path: Path) -> bytes | None:
    try:
        return paramiko.PublicBlob.from_file(f"{path}.pub").key_blob
    except (OSError, ValueError, paramiko.SSHException):
        return None


def _authenticate(transport: paramiko.Transport, hop: Hop) -> None:
    agent = _Agent(hop.identity_agent) if hop.identity_agent != "none" else None
    try:
        keys, skipped = _identities(hop, agent)
        for key in keys:
            try:
                transport.auth_publickey(hop.user, key)
                return
            except paramiko.BadAuthenticationType as exc:
                raise Unreachable("SSH authentication failed: the host allows only "
                                  f"{', '.join(exc.allowed_types)}") from None
            except paramiko.AuthenticationException:
                continue
    finally:
        if agent is not None:
            agent._close()
    tried = f"{len(keys)} key(s) tried" if keys else "no usable key"
    raise Unreachable(f"SSH authentication failed for {hop.user} ({tried}"
                      f"{'; ' + '; '.join(skipped) if skipped else ''})")


def _handshake(hop: Hop, open_sock: Callable[[], socket.socket | _Tunnel | _ProxyCommand],
               accept_new: bool) -> tuple[paramiko.Transport, str | None, list[str]]:
    """Connect (retrying transient failures), verify the host key, authenticate: (transport, newly recorded
    key, failed attempts). Unreachable names the hop."""
    name = hop.host_key_alias or knownhosts.lookup_name(hop.hostname, hop.port)
    try:
        entries = knownhosts.table([*hop.user_known_hosts, *hop.global_known_hosts]).matching([name])
    except OSError as exc:
        raise Unreachable(f"{hop.label}: {exc}") from None

    def attempt() -> tuple[paramiko.Transport, str | None]:
        sock = open_sock()
        transport = _new_transport(sock)
        transport.host_key_order = knownhosts.preferred_key_types(entries, name, transport.default_keys())
        try:
            try:
                transport.start_client(timeout=hop.connect_timeout)
            except (EOFError, ConnectionResetError, paramiko.SSHException) as exc:
                ended = sock.failure() if isinstance(sock, _ProxyCommand) else None
                if ended is not None:  # not retried: the command decided, and it may do anything
                    raise Unreachable(ended) from None
                if isinstance(exc, paramiko.SSHException):
                    raise
                raise _Transient(f"connection closed during the SSH handshake ({str(exc) or type(exc).__name__})") \
                    from None
            recorded = _check_host_key(transport, hop, entries, name, accept_new)
            _authenticate(transport, hop)
        except BaseException:
            transport.close()
            raise
        transport.set_keepalive(hop.keepalive)
        return transport, recorded

    try:
        (transport, recorded), failures = _retrying(attempt)
    except _Transient as exc:
        raise Unreachable(f"{hop.label} ({hop.where}): unreachable: {exc}") from None
    except Unreachable as exc:
        raise Unreachable(f"{hop.label} ({hop.where}): {exc}") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise Unreachable(f"{hop.label} ({hop.where}): unreachable: {reason}") from None
    return transport, recorded, failures


class _JumpPool:
    """One connection per jump chain, shared by every host behind it (direct-tcpip channels over it):
    64 hosts behind a bastion cost one handshake with it. Connections live until :func:`close_jumps`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: dict[tuple, tuple[threading.Lock, list[paramiko.Transport]]] = {}

    def transport(self, chain: tuple[Hop, ...], accept_new: bool) -> paramiko.Transport:
        key = tuple(h.key for h in chain)
        with self.lock:
            lock, held = self.slots.setdefault(key, (threading.Lock(), []))
        with lock:  # hosts behind the same bastion wait for its one handshake
            if held and held[0].is_active():
                return held[0]
            hop = chain[-1]
            opener = _opener(hop) if len(chain) == 1 else _channel_opener(self.transport(chain[:-1], accept_new),
                                                                          hop)
            transport, _, _ = _handshake(hop, opener, accept_new)
            held[:] = [transport]
            return transport

    def close(self) -> None:
        with self.lock:
            slots, self.slots = self.slots, {}
        for _, held in slots.values():
            for transport in held:
                transport.close()


_JUMPS = _JumpPool()


def close_jumps() -> None:
    """Close the shared jump-host connections (the process's last hosts are done)."""
    _JUMPS.close()


def _user_timeout(hop: Hop) -> float:
    return max(30.0, float(hop.keepalive * hop.keepalive_count))


class _Tunnel:
    """A direct-tcpip channel used as the socket of the next hop's connection.

    paramiko's Channel builds a data packet under its lock but sends it after releasing it, so a send racing
    close() can put data on the wire after the channel's CLOSE; OpenSSH then drops the whole jump-host
    connection ("data packet referred to nonexistent channel"), and every host behind it with it. Here a
    send and the close never overlap, and nothing is sent after the close."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.closed = False

    def send(self, data: bytes) -> int:
        with self.lock:
            if self.closed:
                raise OSError(errno.EPIPE, "jump channel closed")
            return self.channel.send(data)

    def recv(self, size: int) -> bytes:
        return self.channel.recv(size)

    def settimeout(self, timeout: float | None) -> None:
        self.channel.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.channel.gettimeout()

    def getpeername(self) -> tuple[str, int]:
        return self.channel.getpeername()

    @property
    def _closed(self) -> bool:  # paramiko's Transport reads it like socket._closed
        return self.closed

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.channel.close()


def _channel_opener(via: paramiko.Transport, hop: Hop) -> Callable[[], _Tunnel]:
    """A TCP connection to ``hop`` made by the previous hop (``ssh -J``'s direct-tcpip channel)."""
    def open_channel() -> _Tunnel:
        try:
            return _Tunnel(via.open_channel("direct-tcpip", (hop.hostname, hop.port), ("127.0.0.1", 0),
                                            timeout=hop.connect_timeout))
        except paramiko.ChannelException as exc:  # refused or unresolvable, seen from the jump host
            raise _Transient(f"the jump host cannot connect: {exc.text}") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"connection to the jump host lost: {str(exc) or type(exc).__name__}") from None
    return open_channel


class Process:
    """A command that keeps running on the host (the lock holder, the exit watcher): its stdin, output
    up to a marker, and its end. Errors of the link come back as :class:`Unreachable`."""

    def __init__(self, host: str, channel: paramiko.Channel) -> None:
        self.host = host
        self.channel = channel

    @property
    def alive(self) -> bool:
        """The connection carrying it is up and it was not closed."""
        transport = self.channel.get_transport()
        return transport is not None and transport.is_active() and not self.channel.closed

    def send(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host}: connection lost: {str(exc) or type(exc).__name__}") from None

    def shutdown_write(self) -> None:
        """Close its stdin (it sees EOF)."""
        try:
            self.channel.shutdown_write()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host}: connection lost: {str(exc) or type(exc).__name__}") from None

    def read_until(self, marker: bytes) -> bytes:
        """stdout until a line ``marker`` arrived, or until it ended; what arrived."""
        buf = bytearray()
        try:
            while marker + b"\n" not in buf:
                chunk = self.channel.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host}: connection lost: {str(exc) or type(exc).__name__}") from None
        return bytes(buf)

    def read_some(self, timeout: float) -> bytes | None:
        """What stdout has now (waiting up to ``timeout``): b"" once it ended, None when nothing came."""
        self.channel.settimeout(timeout)
        try:
            return self.channel.recv(65536)
        except TimeoutError:
            return None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host}: connection lost: {str(exc) or type(exc).__name__}") from None

    def exit_status_ready(self) -> bool:
        return self.channel.exit_status_ready()

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status, or None when it did not end within ``timeout`` (or the link died)."""
        if not self.channel.status_event.wait(timeout):
            return None
        status = self.channel.exit_status
        return None if status == -1 else status

    def stderr(self) -> str:
        """What it wrote to stderr so far (up to 4 KiB)."""
        return self.channel.recv_stderr(4096).decode(errors="replace") if self.channel.recv_stderr_ready() else ""

    def no_timeout(self) -> None:
        """From now on reads wait as long as it runs (it holds a lock for the whole deploy)."""
        self.channel.settimeout(None)

    def close(self) -> None:
        """Close it; on a link that is already gone there is nothing left to close."""
        with contextlib.suppress(OSError, paramiko.SSHException, EOFError):
            self.channel.close()


def _traced(step: Callable[..., _T]) -> Callable[..., _T]:
    """Log each call of the executor ``step`` on :data:`TRACE`: what it ran, how long it took, how it ended."""

    @functools.wraps(step)
    def traced(self: Remote, command: str, *args: object, **kwargs: object) -> _T:
        started = time.monotonic()
        try:
            out = step(self, command, *args, **kwargs)
        except BaseException as exc:
            _trace(self.host.name, command, started, f"{type(exc).__name__}: {exc}")
            raise
        _trace(self.host.name, command, started, f"exit {out.rc}" if isinstance(out, RunResult) else "started")
        return out

    return traced


def _trace(host: str, command: str, started: float, outcome: str) -> None:
    if not TRACE.isEnabledFor(logging.INFO):
        return
    lines = command.strip().splitlines() or [""]
    shown = command.strip() if TRACE.isEnabledFor(logging.DEBUG) else (
        lines[0][:100] + ("..." if len(lines[0]) > 100 else "") + (f" (+{len(lines) - 1} lines)" if len(lines) > 1
                                                                   else ""))
    TRACE.info("%s: %s -> %s in %.2fs", host, shown, outcome, time.monotonic() - started)


class Remote:
    """A live connection to one host. Not thread-safe for concurrent runs on the same object."""

    def __init__(self, host: HostConfig, transport: paramiko.Transport, target: Target,
                 new_host_key: str | None = None, retries: tuple[str, ...] = ()) -> None:
        self.host = host
        self._transport = transport
        self.target = target
        self.new_host_key = new_host_key
        self.retries = retries  # why earlier connect attempts failed (a rebooting host)
        self._become_user = host.become_user if host.become else None
        # While this controller holds the host's deploy lock: a shell test every command runs first, failing
        # with FENCE_RC once the host has ended the holder (``kdeploy.host.lock``), so nothing more is changed.
        self.fence: str | None = None
        self.fence_reason = ""

    @classmethod
    def connect(cls, host: HostConfig, target: Target, *, accept_new_host_keys: bool = False) -> Remote:
        """Through ``target``'s jump hops (shared connections), to the host; every hop's key verified."""
        hop = target.host
        try:
            if target.jumps:
                via = _JUMPS.transport(target.jumps, accept_new_host_keys)
                opener = _channel_opener(via, hop)
            else:
                opener = _opener(hop)
            transport, recorded, failures = _handshake(hop, opener, accept_new_host_keys)
        except Unreachable as exc:
            said = str(exc)
            raise Unreachable(said if said.startswith((f"{host.name} ", f"{host.name}:")) else f"{host.name}: {said}") \
                from None
        remote = cls(host, transport, target, recorded, tuple(failures))
        if host.become:
            try:
                remote._check_become()
            except BaseException:
                remote.close()
                raise
        return remote

    def _check_become(self) -> None:
        """One round trip before any other command: does sudo let us in without a password?"""
        wait = self.target.host.connect_timeout + 20
        try:
            result = self.run(f"echo {BECOME_OK}", timeout=wait)
        except RemoteTimeout:
            raise Unreachable(f"{self.host.name}: {self.host.become_method} did not answer within {wait:g}s "
                              "(become); nothing was changed") from None
        failure = become_failure(result, self.target.host.user, self.host.become_user, self.host.become_method)
        if failure:
            raise Unreachable(f"{self.host.name}: {failure}")

    def describe(self) -> str:
        """The connect phase's detail: where, through which hops, after which retries, new keys."""
        hop = self.target.host
        text = hop.where + "".join(f" via {j.where}" for j in reversed(self.target.jumps))
        first = self.target.jumps[0] if self.target.jumps else hop
        if first.proxy_command is not None:
            text += f" via ProxyCommand {first.proxy_command!r}"
        if self.retries:
            text += f" (after {len(self.retries)} failed attempts: {self.retries[-1]})"
        if self.new_host_key:
            text += f" (new host key recorded: {self.new_host_key})"
        if self.host.become:
            text += f" (become {self.host.become_user} via {self.host.become_method})"
        return text

    @property
    def transport(self) -> paramiko.Transport:
        if not self._transport.is_active():
            raise Unreachable(f"{self.host.name}: connection lost")
        return self._transport

    @_traced
    def run(self, command: str, *, stdin: bytes | Iterable[bytes] | None = None, timeout: float | None = 120.0,
            cancel: threading.Event | None = None, stop: Callable[[], bool] | None = None) -> RunResult:
        """Run one shell command; ``stdin`` (bytes, or chunks produced as they are sent) is streamed and
        closed. One round trip.

        ``stop`` is asked while the output is awaited (every ``STDERR_POLL`` s): once it says True the channel
        is closed and :class:`Stopped` is raised, with the output so far. That does not end the command: sshd
        signals no command whose channel closes (without a pty), nor, for root logins, on SSH's ``signal``
        request; the caller ends it (``kdeploy exec`` does with a second command).

        ``cancel`` is checked between chunks of ``stdin``: when it is set the channel is closed (the command
        sees its input end early and cleans up) and :class:`Cancelled` is raised within a chunk's time. A
        chunk source that fails (OSError) ends the command's input and raises :class:`InputFailed` once the
        command has exited (it cleans up first: a caller that reports the host unchanged must find it so).
        """
        try:
            channel = self.transport.open_session(timeout=timeout)
            channel.settimeout(timeout)
            script = command if self.fence is None else f"{self.fence}\n{command}"
            channel.exec_command(posix(script, self._become_user, self.host.become_method))
            try:
                for chunk in _chunks(stdin):
                    if cancel is not None and cancel.is_set():
                        channel.close()
                        raise Cancelled("interrupted while uploading: nothing was switched")
                    channel.sendall(chunk)
            except InputFailed:
                _cut_short(channel, INPUT_FAILED_WAIT)
                raise
            channel.shutdown_write()
            stdout, stderr = _drain(channel, stop=stop)
            rc = channel.recv_exit_status()
            channel.close()
        except _Stopped as stopped:
            with contextlib.suppress(OSError, paramiko.SSHException, EOFError):
                channel.close()
            raise Stopped(f"{self.host.name}: stopped while the command ran", stopped.stdout.decode(errors="replace"),
                          stopped.stderr.decode(errors="replace")) from None
        except TimeoutError:
            if not self._transport.is_active():
                raise Unreachable(f"{self.host.name}: connection lost (no answer for {timeout:g}s)") from None
            raise RemoteTimeout(f"{self.host.name}: remote command did not finish within {timeout:g}s") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host.name}: connection lost: {str(exc) or type(exc).__name__}") from None
        if rc == -1:
            raise Unreachable(f"{self.host.name}: connection lost while running a command")
        if rc == FENCE_RC and FENCE_MARK.encode() in stderr:
            raise Unreachable(f"{self.host.name}: {self.fence_reason}")
        if rc != 0 and self.fence is not None and command != ":":
            self.run(":", timeout=timeout)  # a failure may be another run's doing: is the lock still ours?
        return RunResult(rc, stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    def ask(self, step: Step[_T], *, stdin: bytes | Iterable[bytes] | None = None,
            cancel: threading.Event | None = None) -> _T:
        """Run one :class:`Step` and read its output (``stdin``, ``cancel``: as :meth:`run`)."""
        out = self.run(step.command, stdin=stdin, timeout=step.timeout, cancel=cancel)
        if step.fails is not None and not out.ok:
            raise PhaseFailed(f"{step.fails}: {out.last_error()}")
        return step.parse(out)

    @_traced
    def start(self, command: str, timeout: float | None = 30.0) -> Process:
        """Start a command that keeps running (e.g. the lock holder); the caller reads and closes it."""
        try:
            channel = self.transport.open_session(timeout=timeout)
            channel.settimeout(timeout)
            channel.exec_command(posix(command, self._become_user, self.host.become_method))
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host.name}: connection lost: {str(exc) or type(exc).__name__}") from None
        return Process(self.host.name, channel)

    def close(self) -> None:
        """Close the host's connection (the jump hosts' stay for other hosts); closing a connection whose
        jump host link is already gone has nothing left to tell it."""
        with contextlib.suppress(OSError, paramiko.SSHException, EOFError):
            self._transport.close()

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stopped(Cancelled):
    """``Remote.run``'s ``stop`` ended the wait for a command (which may still run): what it printed so far."""

    def __init__(self, message: str, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


class InputFailed(Exception):
    """Reading what ``Remote.run`` streams to a command's stdin failed (a local file vanished or shrank)."""


def posix(command: str, become_user: str | None = None, method: str = "sudo") -> str:
    """What sshd hands the login shell: ``command`` run by ``/bin/sh`` whatever that shell is (zsh, say,
    fails on a glob that matches nothing, where kdeploy's POSIX scripts expect it kept as it is). The login
    shell still sets the environment up first; ``exec`` keeps the PID, which the lock holder reports.

    With ``become_user`` the shell runs as that user through ``sudo -n`` or ``doas -n`` (``method``; never a
    prompt: one that wants a password fails at once). Both hand the command the channel's stdin and stdout as
    they are, so uploads stream into a root process and a holder still sees EOF when the channel closes; the
    script's ``$$`` is the shell under sudo, which is what a forced lock release ends."""
    shell = "/bin/sh -c " + shlex.quote(command)
    if become_user is None:
        return "exec " + shell
    return f"exec {BECOME[method].format(user=shlex.quote(become_user))} {shell}"


# Shell lines that set $c to the PID of the sshd process that serves this command's connection (it ends when the
# connection does): the parent of the command's shell, or with become the parent of sudo (doas), which lives as
# long as the shell it runs.
CONNECTION_PID = ('c=$PPID; case "$(cat /proc/$c/comm 2>/dev/null)" in sudo|doas) c=$(cut -d" " -f4 /proc/$c/stat) ;; '
                  'esac')


def become_failure(result: RunResult, user: str, become_user: str, method: str = "sudo") -> str | None:
    """Why the connect check (``echo BECOME_OK`` through :func:`posix`) did not get in; None when it did."""
    if result.rc == 0 and BECOME_OK in result.stdout.split():
        return None
    err = result.stderr
    rule = (f"`{user} ALL=({become_user}) NOPASSWD: ALL` in /etc/sudoers.d" if method == "sudo" else
            f"`permit nopass {user} as {become_user}` in /etc/doas.conf")
    if "password is required" in err or "Authentication required" in err:
        return (f"{method}: a password is required (become: {user} needs passwordless {method} to {become_user}, "
                f"e.g. {rule}; kdeploy never types a password); nothing was changed")
    refusals = ("not allowed to execute", "not in the sudoers") if method == "sudo" else \
        ("doas: Operation not permitted",)
    if any(s in err for s in refusals):
        return (f"{method} refused: {user} may not run /bin/sh as {become_user} ({result.last_error()}); nothing "
                "was changed")
    if result.rc == 127 and method in err:
        return f"become: {method} is not installed on the host ({result.last_error()})"
    return f"become via {method} failed: {result.last_error()}"


def _chunks(stdin: bytes | Iterable[bytes] | None) -> Iterator[bytes]:
    """``stdin`` in pieces of at most ``SEND_CHUNK`` bytes; a failing source raises :class:`InputFailed`."""
    if stdin is None:
        return
    pieces = iter([stdin]) if isinstance(stdin, bytes) else iter(stdin)
    while True:
        try:
            piece = next(pieces, None)
        except OSError as exc:
            raise InputFailed(str(exc)) from None
        if piece is None:
            return
        for start in range(0, len(piece), SEND_CHUNK):
            yield piece[start:start + SEND_CHUNK]


def _cut_short(channel: paramiko.Channel, wait: float) -> None:
    """End the command's input early and give it up to ``wait`` s in all to exit (its cleanup), reading
    its output meanwhile so that it cannot block on a full window, then close."""
    deadline = time.monotonic() + wait
    with contextlib.suppress(OSError, paramiko.SSHException, EOFError):
        channel.shutdown_write()
        _drain(channel, deadline)
        channel.status_event.wait(max(0.0, deadline - time.monotonic()))
    channel.close()


class _Stopped(Exception):
    """``Remote.run``'s ``stop`` said True while the command ran; ``stdout``, ``stderr``: read so far."""

    def __init__(self, stdout: bytes, stderr: bytes) -> None:
        super().__init__("stopped")
        self.stdout, self.stderr = stdout, stderr


def _drain(channel: paramiko.Channel, deadline: float | None = None,
           stop: Callable[[], bool] | None = None) -> tuple[bytes, bytes]:
    """All of stdout and all of stderr. Unread stderr holds the channel's window, so a command that wrote more
    than that to it would stall before its stdout ends: stderr is taken whenever it has something, and
    at least every ``STDERR_POLL`` s while stdout is awaited (no pipe or thread per command for it).
    ``TimeoutError`` after the channel's timeout without output, or once past ``deadline``; ``_Stopped`` once
    ``stop`` says so."""
    out, err = bytearray(), bytearray()
    timeout = channel.gettimeout()
    heard = time.monotonic()
    while True:
        if stop is not None and stop():
            raise _Stopped(bytes(out), bytes(err))
        limit = deadline if deadline is not None else None if timeout is None else heard + timeout
        left = None if limit is None else limit - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        if channel.recv_stderr_ready():
            err += channel.recv_stderr(65536)
            heard = time.monotonic()
            continue
        channel.settimeout(STDERR_POLL if left is None else min(STDERR_POLL, left))
        try:
            chunk = channel.recv(65536)
        except TimeoutError:
            continue
        if not chunk:  # stdout and stderr end together (one EOF): the rest of stderr is already here
            while chunk := channel.recv_stderr(65536):
                err += chunk
            return bytes(out), bytes(err)
        out += chunk
        heard = time.monotonic()
