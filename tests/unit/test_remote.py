"""Pure logic of kdeploy.remote that needs no host: how a command whose input failed is given up."""

import threading
import time

from kdeploy import remote


class TricklingChannel:
    """Stands in for a paramiko channel whose command prints a line every few ms and never exits."""

    def __init__(self) -> None:
        self.status_event = threading.Event()
        self.closed = False
        self.input_ended = False
        self.timeout: float | None = None

    def shutdown_write(self) -> None:
        self.input_ended = True

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def recv(self, size: int) -> bytes:
        assert self.timeout is not None
        if self.timeout < 0.005:
            time.sleep(self.timeout)
            raise TimeoutError()
        time.sleep(0.005)
        return b"still cleaning up\n"

    def close(self) -> None:
        self.closed = True


class ExitingChannel(TricklingChannel):
    """A command that prints once, then exits."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = [b"removed staging\n"]

    def recv(self, size: int) -> bytes:
        if self.lines:
            return self.lines.pop()
        self.status_event.set()
        return b""


def test_a_command_that_keeps_printing_is_given_up_after_the_wait_in_all() -> None:
    channel = TricklingChannel()
    started = time.monotonic()
    remote._cut_short(channel, 0.3)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed
    assert time.monotonic() - started < 3.0


def test_a_command_that_exits_is_not_waited_for_longer() -> None:
    channel = ExitingChannel()
    started = time.monotonic()
    remote._cut_short(channel, 30.0)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed and channel.status_event.is_set()
    assert time.monotonic() - started < 3.0
