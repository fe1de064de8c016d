"""How kdeploy.remote reads a command's output and gives up on one whose input failed, on stand-in channels
(a real channel over a sandbox host: tests/integration/test_safety.py)."""

import os
import threading
import time
from collections.abc import Iterator

import pytest

from kdeploy import remote


class StandInChannel:
    """The part of a paramiko channel that ``_drain`` and ``_cut_short`` use. ``stdout``/``stderr``: what the
    command prints, one piece per read; ``endless``: it keeps printing and never exits."""

    def __init__(self, stdout: list[bytes], stderr: list[bytes], endless: bool = False) -> None:
        self.stdout, self.stderr, self.endless = stdout, stderr, endless
        self.status_event = threading.Event()
        self.closed = self.input_ended = False
        self.read_fd, self.write_fd = os.pipe()
        os.write(self.write_fd, b"x")  # output is always ready here

    @property
    def eof_received(self) -> bool:
        return not (self.endless or self.stdout or self.stderr)

    def fileno(self) -> int:
        return self.read_fd

    def gettimeout(self) -> float:
        return 5.0

    def shutdown_write(self) -> None:
        self.input_ended = True

    def recv_ready(self) -> bool:
        return self.endless or bool(self.stdout)

    def recv_stderr_ready(self) -> bool:
        return bool(self.stderr)

    def recv(self, size: int) -> bytes:
        if self.endless:
            time.sleep(0.005)
            return b"still cleaning up\n"
        return self.stdout.pop(0)

    def recv_stderr(self, size: int) -> bytes:
        return self.stderr.pop(0)

    def close(self) -> None:
        self.closed = True
        os.close(self.read_fd)
        os.close(self.write_fd)


@pytest.fixture
def channels() -> Iterator[list[StandInChannel]]:
    made: list[StandInChannel] = []
    yield made
    for channel in made:
        if not channel.closed:
            channel.close()


def test_both_streams_are_read_whatever_the_order_they_come_in(channels: list[StandInChannel]) -> None:
    channel = StandInChannel([b"a", b"b"], [b"1", b"2", b"3"])
    channels.append(channel)
    assert remote._drain(channel) == (b"ab", b"123")  # type: ignore[arg-type]


def test_a_command_that_keeps_printing_is_given_up_after_the_wait_in_all(channels: list[StandInChannel]) -> None:
    channel = StandInChannel([], [], endless=True)
    started = time.monotonic()
    remote._cut_short(channel, 0.3)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed
    assert time.monotonic() - started < 3.0


def test_a_command_that_exits_is_not_waited_for_longer(channels: list[StandInChannel]) -> None:
    channel = StandInChannel([b"removed staging\n"], [])
    channel.status_event.set()
    started = time.monotonic()
    remote._cut_short(channel, 30.0)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed and not channel.stdout
    assert time.monotonic() - started < 3.0
