"""Local files a run reads once (known_hosts, identity files, ssh_config), not once per host: parsed again only
when one of them changed on disk, so a long run still sees an edit (a host key recorded, a key rotated)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def stamp(paths: Sequence[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    """(mtime, size, inode) of each path, None where it is missing: rewriting a file in place or by a rename
    changes at least one of them."""
    out = []
    for path in paths:
        try:
            st = path.stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class FileCache(Generic[T]):
    """What ``load`` made of a set of files, for as long as none of them changes. Thread-safe: hosts connect
    from worker threads, and a file is parsed once, not once per thread that asked at the same time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, ...], tuple[tuple, T]] = {}

    def get(self, paths: Sequence[Path], load: Callable[[], T]) -> T:
        key, now = tuple(str(p) for p in paths), stamp(paths)
        with self._lock:
            cached = self._entries.get(key)
            if cached is None or cached[0] != now:
                cached = self._entries[key] = (now, load())
            return cached[1]
