"""One SSH connection per host, reused for every step: commands, streamed uploads and HTTP.

Host keys are always verified against known_hosts. An unknown key is refused unless the caller trusts
on first use (then it is recorded); a changed key is always refused. Every failure to reach a host
becomes :class:`Unreachable` with a one-line reason, so the CLI can exit 3 without a traceback.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import httpcore
import httpx
import paramiko

from kdeploy.errors import Unreachable
from kdeploy.inventory import HostConfig

KEEPALIVE_SECONDS = 15
DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
_KNOWN_HOSTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class RunResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def last_error(self) -> str:
        """The last non-empty stderr line: what a one-line error should quote."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exit status {self.rc}"


def fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} SHA256:{key.fingerprint.removeprefix('SHA256:')}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown keys: refuse, or record them when trust-on-first-use was asked for."""

    def __init__(self, host: HostConfig, path: Path, accept_new: bool) -> None:
        self.host = host
        self.path = path
        self.accept_new = accept_new
        self.recorded: str | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise Unreachable(
                f"{self.host.name}: host key unknown ({fingerprint(key)} not in {self.path}); "
                "verify it and rerun with --accept-new-host-keys to trust it")
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _KNOWN_HOSTS_LOCK:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(line)
        self.recorded = fingerprint(key)


class Remote:
    """A live connection to one host. Not thread-safe for concurrent runs on the same object."""

    def __init__(self, host: HostConfig, client: paramiko.SSHClient, new_host_key: str | None = None) -> None:
        self.host = host
        self.client = client
        self.new_host_key = new_host_key

    @classmethod
    def connect(cls, host: HostConfig, *, known_hosts: Path | None = None, identity_file: Path | None = None,
                accept_new_host_keys: bool = False, timeout: float | None = None) -> Remote:
        path = (known_hosts or DEFAULT_KNOWN_HOSTS).expanduser()
        client = paramiko.SSHClient()
        if path.exists():
            try:
                client.load_host_keys(str(path))
            except (OSError, paramiko.SSHException) as exc:
                raise Unreachable(f"{host.name}: cannot read known_hosts {path}: {exc}") from None
        policy = _HostKeyPolicy(host, path, accept_new_host_keys)
        client.set_missing_host_key_policy(policy)
        timeout = timeout or host.connect_timeout
        where = f"{host.name} ({host.user}@{host.address}:{host.port})"
        try:
            client.connect(
                host.address, port=host.port, username=host.user, sock=_socket(host.address, host.port, timeout),
                key_filename=str(identity_file) if identity_file else None,
                allow_agent=True, look_for_keys=identity_file is None,
                timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise Unreachable(
                f"{where}: HOST KEY CHANGED: known_hosts {path} has {fingerprint(exc.expected_key)}, "
                f"host offers {fingerprint(exc.key)}; refusing (possible man-in-the-middle; if the host "
                "was reinstalled, remove its old line from known_hosts)") from None
        except Unreachable:
            client.close()
            raise
        except paramiko.AuthenticationException as exc:
            client.close()
            raise Unreachable(f"{where}: SSH authentication failed: {exc}") from None
        except TimeoutError:
            client.close()
            raise Unreachable(f"{where}: unreachable: connection timed out after {timeout:g}s") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise Unreachable(f"{where}: unreachable: {reason}") from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(KEEPALIVE_SECONDS)
        return cls(host, client, policy.recorded)

    @property
    def transport(self) -> paramiko.Transport:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable(f"{self.host.name}: connection lost")
        return transport

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> RunResult:
        """Run one shell command; ``stdin`` is streamed and closed. One round trip."""
        try:
            channel = self.transport.open_session(timeout=timeout)
            channel.settimeout(timeout)
            channel.exec_command(command)
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
            stdout, stderr = _drain(channel)
            rc = channel.recv_exit_status()
            channel.close()
        except TimeoutError:
            raise Unreachable(f"{self.host.name}: remote command timed out after {timeout:g}s") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host.name}: connection lost: {exc or type(exc).__name__}") from None
        if rc == -1:
            raise Unreachable(f"{self.host.name}: connection lost while running a command")
        return RunResult(rc, stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    def start(self, command: str, timeout: float | None = 30.0) -> paramiko.Channel:
        """Start a command that keeps running (e.g. the lock holder); the caller reads and closes it."""
        try:
            channel = self.transport.open_session(timeout=timeout)
            channel.settimeout(timeout)
            channel.exec_command(command)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise Unreachable(f"{self.host.name}: connection lost: {exc or type(exc).__name__}") from None
        return channel

    def http(self, port: int, *, timeout: float = 10.0) -> httpx.Client:
        """An httpx client whose connections are direct-tcpip channels to 127.0.0.1:port on the host."""
        return httpx.Client(transport=_ChannelTransport(self, port), base_url=f"http://127.0.0.1:{port}",
                            timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _socket(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection that notices a dead link (silently dropped packets) within about 30 s."""
    sock = socket.create_connection((address, port), timeout=timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 30000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


def _drain(channel: paramiko.Channel) -> tuple[bytes, bytes]:
    """All of stdout, then all of stderr (paramiko buffers stderr while stdout is read)."""
    out, err = bytearray(), bytearray()
    while chunk := channel.recv(65536):
        out += chunk
    while chunk := channel.recv_stderr(65536):
        err += chunk
    return bytes(out), bytes(err)


class _ChannelStream(httpcore.NetworkStream):
    def __init__(self, channel: paramiko.Channel) -> None:
        self.channel = channel

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self.channel.settimeout(timeout)
        try:
            return self.channel.recv(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.channel.settimeout(timeout)
        try:
            self.channel.sendall(buffer)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    def close(self) -> None:
        self.channel.close()

    def get_extra_info(self, info: str) -> object:
        return None


class _ChannelBackend(httpcore.NetworkBackend):
    def __init__(self, remote: Remote, port: int) -> None:
        self.remote = remote
        self.port = port

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: object = None) -> httpcore.NetworkStream:
        try:
            channel = self.remote.transport.open_channel(
                "direct-tcpip", ("127.0.0.1", self.port), ("127.0.0.1", 0), timeout=timeout)
        except paramiko.ChannelException as exc:
            raise httpcore.ConnectError(f"127.0.0.1:{self.port} on {self.remote.host.name}: {exc.text}") from exc
        except (OSError, paramiko.SSHException, EOFError, Unreachable) as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _ChannelStream(channel)


class _ChannelTransport(httpx.BaseTransport):
    """httpx over SSH: no service port has to be reachable from the network."""

    def __init__(self, remote: Remote, port: int) -> None:
        self.pool = httpcore.ConnectionPool(network_backend=_ChannelBackend(remote, port), max_connections=4)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = self.pool.handle_request(httpcore.Request(
                method=request.method,
                url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                                 port=request.url.port, target=request.url.raw_path),
                headers=request.headers.raw,
                content=request.stream,
                extensions=request.extensions,
            ))
            try:
                content = response.read()
            finally:
                response.close()  # hands the channel back to the pool
        except httpcore.TimeoutException as exc:
            raise httpx.TimeoutException(str(exc), request=request) from exc
        except httpcore.ConnectError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except httpcore.NetworkError as exc:
            raise httpx.NetworkError(str(exc), request=request) from exc
        except httpcore.ProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        return httpx.Response(status_code=response.status, headers=response.headers, content=content,
                              extensions=response.extensions)

    def close(self) -> None:
        self.pool.close()
