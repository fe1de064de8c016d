"""Watch a running process from outside through /proc: its peak memory, threads, open files and sockets.

The scale bench (bench/scale.py) runs ``kdeploy`` as a child and samples it with :class:`ProcWatch`; a
resource bound (connections held <= --parallel + a constant) can be checked the same way. The parsers are
pure, so they are unit-tested without a process.
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcSample:
    rss_kb: int        # VmRSS
    hwm_kb: int        # VmHWM: the kernel's own peak RSS of the process
    threads: int
    fds: int
    sockets: int       # fds that are sockets (SSH connections, HTTP probes, ...)


def parse_status(text: str) -> tuple[int, int, int]:
    """(VmRSS kB, VmHWM kB, Threads) of a /proc/PID/status text; 0 for a field that is missing."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.split()
    def num(key: str) -> int:
        value = fields.get(key)
        return int(value[0]) if value and value[0].isdigit() else 0
    return num("VmRSS"), num("VmHWM"), num("Threads")


def count_fds(targets: list[str]) -> tuple[int, int]:
    """(open fds, of which sockets) from the readlink targets of /proc/PID/fd/*."""
    return len(targets), sum(1 for t in targets if t.startswith("socket:"))


def sample(pid: int) -> ProcSample | None:
    """One look at a live process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            rss, hwm, threads = parse_status(fh.read())
        fd_dir = f"/proc/{pid}/fd"
        targets = []
        for name in os.listdir(fd_dir):
            try:
                targets.append(os.readlink(f"{fd_dir}/{name}"))
            except OSError:
                continue          # closed between listdir and readlink
    except (OSError, ValueError):
        return None
    fds, sockets = count_fds(targets)
    return ProcSample(rss, hwm, threads, fds, sockets)


@dataclass
class Peaks:
    rss_kb: int = 0
    threads: int = 0
    fds: int = 0
    sockets: int = 0
    samples: int = 0

    def add(self, s: ProcSample) -> None:
        self.rss_kb = max(self.rss_kb, s.rss_kb, s.hwm_kb)
        self.threads = max(self.threads, s.threads)
        self.fds = max(self.fds, s.fds)
        self.sockets = max(self.sockets, s.sockets)
        self.samples += 1


class ProcWatch:
    """Sample a process every ``interval`` seconds in a thread until it exits or :meth:`stop` is called."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peaks = Peaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"procwatch-{pid}", daemon=True)

    def __enter__(self) -> ProcWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            s = sample(self.pid)
            if s is None:
                return
            if s.threads:        # a zombie has no threads and no fds left: nothing to learn from it
                self.peaks.add(s)
            self._stop.wait(self.interval)

    def stop(self) -> Peaks:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peaks


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x (None with fewer than two distinct x)."""
    if len(points) < 2:
        return None
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
