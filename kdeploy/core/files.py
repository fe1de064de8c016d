"""The one way kdeploy reads what a user names: inventory files, the service file, group_vars/host_vars, unit
templates, secrets files, ssh_config, ``--limit @FILE``, a payload's manifest, and an inventory program's output.

Every read is bounded in size and in time and every parsed document in depth, so that no input can fill the
controller's memory (``-i /dev/zero``), hang a command (a FIFO nobody writes to) or overflow Python's stack (a
document nested 20000 deep); each failure is one line naming the path, exit 2 (docs/inventory.md, Limits).
"""

from __future__ import annotations

import os
import select
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from kdeploy.core.errors import InvalidInput

T = TypeVar("T")
MiB = 1 << 20
MAX_BYTES = 64 * MiB  # a file or program output kdeploy parses: inventories, service files, templates, ...
LIST_BYTES = 1 * MiB  # a --limit @FILE: patterns, one a line
WAIT = 60.0  # seconds a FIFO or device may take to give its content to its end (a regular file is there at once)
MAX_DEPTH = 64  # nesting levels of a parsed document: an inventory needs about 8; Python's stack allows ~300
MAX_VALUES = 1 << 22  # values of a parsed document, aliases expanded: a fleet of thousands of hosts is far below
_TAIL = 64 * 1024  # bytes of a program's stderr kept (its last line is what an error quotes)


class TooLarge(Exception):
    """A stream went past its byte limit."""


def drain(limits: dict[int, int], deadline: float) -> dict[int, bytes]:
    """Each file descriptor of ``limits`` read to its end, polled without blocking, by ``deadline``
    (``time.monotonic()``; else :class:`TimeoutError`). A limit above 0 is the most bytes it may give (more is
    :class:`TooLarge`); 0 keeps only its last 64 KiB (a program's stderr)."""
    poller = select.poll()
    data = {fd: bytearray() for fd in limits}
    live = set(limits)
    for fd in limits:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    while live:
        for fd in list(live):  # read before polling: a FIFO with no writer is at its end at once
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                live.discard(fd)
                poller.unregister(fd)
                continue
            data[fd] += chunk
            if limits[fd] and len(data[fd]) > limits[fd]:
                raise TooLarge
            if not limits[fd]:
                del data[fd][:-_TAIL]
        left = deadline - time.monotonic()
        if live and left <= 0:
            raise TimeoutError
        if live:
            poller.poll(left * 1000)
    return {fd: bytes(chunks) for fd, chunks in data.items()}


def size(limit: int) -> str:
    return f"{limit // MiB} MiB" if limit >= MiB else f"{limit} bytes"


def read_bytes(path: Path, what: str, *, limit: int = MAX_BYTES, missing: str | None = None) -> bytes:
    """``path``'s content, at most ``limit`` bytes, within :data:`WAIT` seconds. ``missing``: the reason given
    when it does not exist ("not found" by default)."""
    try:
        # O_NONBLOCK: opening a FIFO waits for no writer; drain() polls it instead, within the time bound
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInput(f"{path}: {missing or f'{what} not found'}") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise InvalidInput(f"{path}: cannot read {what}: it is a directory")
        return drain({fd: limit}, time.monotonic() + WAIT)[fd]
    except TooLarge:
        raise InvalidInput(f"{path}: {what} is larger than {size(limit)} (kdeploy's bound)") from None
    except TimeoutError:  # an OSError too: before it
        raise InvalidInput(f"{path}: {what} did not end within {WAIT:g} s (a FIFO or device that does not "
                           "close?)") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_text(path: Path, what: str, *, limit: int = MAX_BYTES, missing: str | None = None,
              exact: bool = False) -> str:
    """``path`` as UTF-8 text (:func:`read_bytes`' bounds), with universal newlines unless ``exact`` (the file's
    own ``\\r\\n`` kept, for an edit that writes it back)."""
    data = read_bytes(path, what, limit=limit, missing=missing)
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InvalidInput(f"{path}:{line}: {what} is not UTF-8 text ({exc.reason})") from None
    return text if exact else text.replace("\r\n", "\n").replace("\r", "\n")


def status(path: Path, what: str) -> os.stat_result | None:
    """``path``'s stat (symlinks followed), None where nothing is there; a path that cannot be looked at (a
    directory on the way without search permission) is an error, not a missing file."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read {what}: {exc.strerror}") from None


def is_dir(path: Path, what: str) -> bool:
    st = status(path, what)
    return st is not None and stat.S_ISDIR(st.st_mode)


def is_file(path: Path, what: str) -> bool:
    st = status(path, what)
    return st is not None and stat.S_ISREG(st.st_mode)


def listdir(path: Path, what: str) -> list[str]:
    """The names in a directory, sorted."""
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read {what}: {exc.strerror}") from None


def parsed(load: Callable[[], T], where: str) -> T:
    """What ``load`` parsed, refused where it nests deeper than :data:`MAX_DEPTH` or holds more than
    :data:`MAX_VALUES` values with every YAML alias counted where it is used (``where``: the file, or the program,
    it came from). Checked here, once, so that nothing after the parse (merging, validation, the JSON report)
    can overflow the stack or expand ten aliases of ten aliases (...) into billions of values."""
    try:
        data = load()
    except RecursionError:
        raise InvalidInput(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    _measure(data, where)
    return data


def _inner(node: Any) -> list | None:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return list(node) if isinstance(node, list | tuple) else None


def _measure(data: Any, where: str) -> None:
    """:func:`parsed`'s bounds, in one walk without recursion that measures a container shared by aliases once
    (its height and size, by identity) however often it is used."""
    def refuse(node: Any, what: str) -> NoReturn:
        lc = getattr(node, "lc", None)  # a round-trip YAML node knows its line
        line = f":{lc.line + 1}" if lc is not None and lc.line is not None else ""
        raise InvalidInput(f"{where}{line}: {what}")

    measured: dict[int, tuple[int, int]] = {}  # id -> (containers on its longest path down, values in it)
    total = 0  # values so far, a shared container counted each time it is used
    path: list[list[Any]] = []  # from the root: [container, its children left, its height so far, total before it]
    deep, many = f"nested deeper than {MAX_DEPTH} levels", f"more than {MAX_VALUES} values (YAML aliases counted " \
        "each time they are used)"

    def enter(node: Any) -> None:
        nonlocal total
        inner = _inner(node)
        if inner is None:
            total += 1
        elif id(node) in measured:  # an alias of a container measured already (never the root)
            height, size = measured[id(node)]
            total += size
            if len(path) + height > MAX_DEPTH:
                refuse(node, deep)
            path[-1][2] = max(path[-1][2], height + 1)
        else:
            if len(path) >= MAX_DEPTH:
                refuse(node, deep)
            path.append([node, iter(inner), 1, total])
            total += 1
        if total > MAX_VALUES:
            refuse(data, many)

    enter(data)
    while path:
        frame = path[-1]
        child = next(frame[1], path)  # ``path`` itself: no child left
        if child is not path:
            enter(child)
            continue
        path.pop()
        measured[id(frame[0])] = (frame[2], total - frame[3])
        if path:
            path[-1][2] = max(path[-1][2], frame[2] + 1)
