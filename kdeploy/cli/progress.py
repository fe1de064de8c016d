"""Plain progress for CI logs: one timestamped line per host per phase as it ends, and heartbeats.

A CI log is not a terminal: a live table there is either garbage (ANSI) or nothing until the end, and a
job silent for 10 minutes is killed by some CI systems. So off a TTY (or with ``CI``/``NO_COLOR``) each
phase becomes one greppable line when it ends, and a phase still waiting says so every ``HEARTBEAT_S``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from kdeploy.core.report import HostResult, PhaseWatcher, Report, Result
from kdeploy.core.text import one_line

HEARTBEAT_S = 30.0  # CircleCI kills a step silent for 10 min; GitLab's default job timeout is far longer


def is_terminal(stream: TextIO, env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``stream`` is a terminal as rich's ``Console`` decides it (``TTY_COMPATIBLE``, ``FORCE_COLOR``, else
    ``isatty``), without importing rich: every start asks it (help's style), and most starts need no rich."""
    compatible = env.get("TTY_COMPATIBLE", "")
    if compatible in ("0", "1"):
        return compatible == "1"
    if (force := env.get("FORCE_COLOR")) is not None:
        return force != ""
    try:
        return stream.isatty()
    except ValueError:  # closed (the end of a pytest run)
        return False


def plain_wanted(env: Mapping[str, str], is_tty: bool) -> bool:
    """Plain output (no live view, no ANSI, no box drawing): off a TTY, in CI, or when NO_COLOR is set."""
    ci = env.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return not is_tty or ci or bool(env.get("NO_COLOR"))


def phase_line(clock: str, host: str, phase: str, status: str, seconds: float | None, detail: str) -> str:
    """``12:01:03 ct200 ready ok 1.2s GET /health 200``: a phase's end, a heartbeat or a host's result."""
    words = [clock, host, phase, "FAIL" if status == "fail" else status]
    if seconds is not None:
        words.append(f"{seconds:.1f}s")
    return one_line(" ".join([*words, detail.strip()] if detail.strip() else words))  # one line, whatever it held


def host_name(host: HostResult) -> str:
    """The host, with its server and rank when it is a node of a server that spans hosts, and its role in a
    prefill/decode fleet."""
    about = [x for x in (host.server.describe() if host.server else None, host.role) if x]
    return f"{host.host} ({', '.join(about)})" if about else host.host


def host_line(host: HostResult) -> str:
    """One host of the final summary: result, release, the failed (or last) phase, total seconds, detail."""
    last = host.failed_phase() or (host.phases[-1] if host.phases else None)
    seconds = sum(p.seconds for p in host.phases)
    detail = host.error or (last.detail if last else "")
    words = [host_name(host), str(host.result), f"release={host.release or '-'}", f"phase={last.name if last else '-'}",
             f"{seconds:.1f}s"]
    return one_line(" ".join([*words, detail.strip()] if detail.strip() else words))


def summary_line(report: Report) -> str:
    return ", ".join(f"{k}={v}" for k, v in report.summary().items()) + f"; exit code {report.exit_code}"


class PlainLog(PhaseWatcher):
    """Writes :func:`phase_line` lines to ``out`` as phases end (only failures when ``quiet``), with heartbeats;
    ``starts`` (``-v``): a ``start`` line as each phase begins too, so a log shows what a killed run was doing."""

    def __init__(self, out: TextIO, *, quiet: bool = False, heartbeat: float | None = None, starts: bool = False,
                 clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
        self.out, self.quiet, self.clock, self.starts = out, quiet, clock, starts
        self.heartbeat = HEARTBEAT_S if heartbeat is None else heartbeat
        self.waiting: dict[str, tuple[str, float]] = {}  # host -> (phase, since)
        self.said: dict[str, str] = {}  # host -> the detail of its last failed phase, already on a line
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def event(self, host: str, phase: str, status: str, seconds: float | None, detail: str) -> None:
        with self.lock:
            if status == "start":
                self.waiting[host] = (phase, time.monotonic())
                if self.starts and not self.quiet:
                    self._write(phase_line(self.clock(), host, phase, status, None, ""))
                return
            self.waiting.pop(host, None)
            failed = status == "fail" or (phase == "done" and Result(status).exit_code != 0)
            if status == "fail":
                self.said[host] = detail
            elif phase == "done" and detail and self.said.get(host) == detail:
                detail = ""  # the error is on its failed phase's line: one line per error per host
            if failed or not self.quiet:
                self._write(phase_line(self.clock(), host, phase, status, seconds, detail))

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def _beat(self) -> None:
        while not self.stopped.wait(self.heartbeat):
            now = time.monotonic()
            with self.lock:
                for host, (phase, since) in sorted(self.waiting.items()):
                    self._write(phase_line(self.clock(), host, phase, "waiting", now - since, ""))

    def run(self, fn: Callable[[PhaseWatcher], Report]) -> Report:
        """Run ``fn(self)`` with the heartbeat thread beside it (quiet or not: a silent job looks hung)."""
        beat = threading.Thread(target=self._beat, name="kdeploy-heartbeat", daemon=True)
        beat.start()
        try:
            return fn(self)
        finally:
            self.stopped.set()
            beat.join()
