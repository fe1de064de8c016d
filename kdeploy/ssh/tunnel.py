"""HTTP to the service's port on a host, carried over the host's SSH connection (direct-tcpip channels).

No service port has to be reachable from the controller's network. It lives apart from ``remote`` so
that commands which never speak HTTP (a no-op push, status, history) do not pay for importing httpx.
"""

from __future__ import annotations

import ipaddress

import httpcore
import httpx
import paramiko

from kdeploy.core.errors import Unreachable
from kdeploy.ssh.remote import Remote


def dial_address(bind: str) -> str:
    """Where, on the host, to reach a server bound to ``bind`` (``sglang.host``: an IP or ``localhost``).

    A wildcard listens on the loopback too, so it is reached there; a specific address only on itself, so it
    is dialled as it is (sshd connects on the host, the traffic never leaves it); ``localhost`` is resolved
    by sshd on the host, as the server resolved it.
    """
    if bind == "localhost":
        return bind
    ip = ipaddress.ip_address(bind)
    if ip.is_unspecified:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return str(ip)


class ServiceHttp:
    """Requests to the service on the host, which listens on ``bind``:``port``; transport errors come back as
    values, never raised. The URL's host is nominal: every request goes to ``dial_address(bind)``."""

    def __init__(self, remote: Remote, bind: str, port: int, *, timeout: float = 10.0) -> None:
        self.client = httpx.Client(transport=_ChannelTransport(remote, dial_address(bind), port),
                                   base_url=f"http://127.0.0.1:{port}", timeout=timeout)

    def status(self, path: str) -> int | str:
        """The status code of GET ``path``, or the name of the error that stopped it."""
        try:
            return self.client.get(path).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def post_json(self, path: str, body: dict, *, timeout: float) -> tuple[int | None, str]:
        """(status, body text); (None, reason) when no response came."""
        try:
            response = self.client.post(path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return response.status_code, response.text

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ServiceHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def channel_client(remote: Remote, address: str, port: int, *, base_url: str, headers: dict[str, str],
                   timeout: float = 10.0) -> httpx.Client:
    """An httpx client whose every connection is a channel to ``address``:``port`` dialled by the host."""
    return httpx.Client(transport=_ChannelTransport(remote, address, port), base_url=base_url, headers=headers,
                        timeout=timeout)


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
    def __init__(self, remote: Remote, address: str, port: int) -> None:
        self.remote = remote
        self.address = address
        self.port = port

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: object = None) -> httpcore.NetworkStream:
        try:
            channel = self.remote.transport.open_channel(
                "direct-tcpip", (self.address, self.port), ("127.0.0.1", 0), timeout=timeout)
        except paramiko.ChannelException as exc:
            raise httpcore.ConnectError(f"{self.address} port {self.port} on {self.remote.host.name}: "
                                        f"{exc.text}") from exc
        except (OSError, paramiko.SSHException, EOFError, Unreachable) as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _ChannelStream(channel)


class _ChannelTransport(httpx.BaseTransport):
    def __init__(self, remote: Remote, address: str, port: int) -> None:
        self.pool = httpcore.ConnectionPool(network_backend=_ChannelBackend(remote, address, port), max_connections=4)

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
