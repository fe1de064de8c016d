"""kdeploy/ssh/tunnel.py: HTTP to the service goes through a direct-tcpip channel to the address the server binds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kdeploy.ssh.tunnel import ServiceHttp, dial_address


@pytest.mark.parametrize(("bind", "dialed"), [
    ("127.0.0.1", "127.0.0.1"),
    ("0.0.0.0", "127.0.0.1"),     # a wildcard is reached on its loopback
    ("::", "::1"),
    ("0:0::0", "::1"),
    ("::1", "::1"),
    ("10.1.2.3", "10.1.2.3"),     # a specific address of the host: only there does the server listen
    ("fd00::7", "fd00::7"),
    ("localhost", "localhost"),   # sshd on the host resolves it, as the server did
])
def test_dial_address(bind, dialed):
    assert dial_address(bind) == dialed


class FakeChannel:
    """Answers one HTTP request with 200."""

    def __init__(self) -> None:
        self.reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        self.closed = False

    def settimeout(self, timeout: float | None) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        pass

    def recv(self, size: int) -> bytes:
        data, self.reply = self.reply[:size], self.reply[size:]
        return data

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("bind", "dialed"), [("0.0.0.0", "127.0.0.1"), ("10.213.0.11", "10.213.0.11")])
def test_requests_are_tunnelled_to_the_bound_address(bind, dialed):
    opened = []

    def open_channel(kind, dest, src, timeout=None):
        opened.append((kind, dest))
        return FakeChannel()

    remote = SimpleNamespace(transport=SimpleNamespace(open_channel=open_channel), host=SimpleNamespace(name="h1"))
    with ServiceHttp(remote, bind, 31000) as http:
        assert http.status("/health") == 200
    assert opened == [("direct-tcpip", (dialed, 31000))]
