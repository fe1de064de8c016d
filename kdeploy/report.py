"""What a command did, per host and phase: the one shape behind the tables and ``--json``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from kdeploy.errors import ExitCode, KdeployError, LockHeld, PreflightRefused, Unreachable, most_severe

# result -> exit code
RESULT_CODES = {
    "deployed": ExitCode.OK, "unchanged": ExitCode.OK, "healthy": ExitCode.OK, "planned": ExitCode.OK,
    "restored": ExitCode.OK, "ok": ExitCode.OK,
    "rolled_back": ExitCode.ROLLED_BACK, "unhealthy": ExitCode.ROLLED_BACK,
    "rollback_failed": ExitCode.ROLLBACK_FAILED, "unreachable": ExitCode.UNREACHABLE,
    "locked": ExitCode.LOCKED, "preflight_refused": ExitCode.PREFLIGHT, "incompatible": ExitCode.PREFLIGHT,
    "skipped": ExitCode.OK,
    "failed": ExitCode.INTERNAL, "invalid": ExitCode.INVALID, "interrupted": ExitCode.INTERRUPTED,
}


@dataclass
class Phase:
    name: str
    ok: bool
    seconds: float
    detail: str


class PhaseFailed(Exception):
    """A phase decided the host cannot go on; ``detail`` is its one-line reason."""

    def __init__(self, detail: str, log: list[str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.log = log or []


class Cancelled(Exception):
    """Ctrl-C: stop before the next change; what already changed is finished or reverted."""


def classify(exc: BaseException) -> str:
    """The result a host ends with when ``exc`` stopped it."""
    if isinstance(exc, Unreachable):
        return "unreachable"
    if isinstance(exc, LockHeld):
        return "locked"
    if isinstance(exc, PreflightRefused):
        return "preflight_refused"
    if isinstance(exc, Cancelled):
        return "interrupted"
    if isinstance(exc, KdeployError) and exc.exit_code == ExitCode.INVALID:
        return "invalid"
    return "failed"


Listener = Callable[[str, str, str], None]  # (host, phase, status) status: start|ok|fail|info


@dataclass
class HostResult:
    host: str
    ok: bool = True
    result: str = "ok"
    release: str | None = None
    phases: list[Phase] = field(default_factory=list)
    exit_code: int = 0
    error: str | None = None
    log: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    listener: Listener | None = field(default=None, repr=False, compare=False)
    done: bool = field(default=False, repr=False, compare=False)
    prefix: str = field(default="", repr=False, compare=False)

    @contextmanager
    def prefixed(self, prefix: str) -> Iterator[None]:
        """Phases of a step inside another (a rollback's restart and gate) are reported as ``<prefix><name>``."""
        before, self.prefix = self.prefix, prefix
        try:
            yield
        finally:
            self.prefix = before

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Time a phase; a PhaseFailed or KdeployError inside marks it failed and propagates."""
        name = self.prefix + name
        entry = Phase(name, True, 0.0, "")
        self.phases.append(entry)
        self._emit(name, "start")
        start = time.monotonic()
        try:
            yield entry
        except PhaseFailed as exc:
            entry.ok, entry.detail = False, exc.detail
            self.log.extend(exc.log)
            raise
        except BaseException as exc:  # KdeployError, Cancelled, or a bug: the phase did not pass
            entry.ok, entry.detail = False, str(exc) or type(exc).__name__
            raise
        finally:
            entry.seconds = round(time.monotonic() - start, 3)
            self._emit(name, "ok" if entry.ok else "fail")

    def _emit(self, phase: str, status: str) -> None:
        if self.listener:
            self.listener(self.host, phase, status)

    def finish(self, result: str, error: str | None = None) -> HostResult:
        self.done = True
        self.result = result
        self.exit_code = int(RESULT_CODES[result])
        self.ok = self.exit_code == 0
        self.error = error
        self._emit("done", result)
        return self

    def fail(self, exc: BaseException) -> None:
        """End the host with the result ``exc`` stands for, unless a result was already decided."""
        if not self.done:
            self.finish(classify(exc), getattr(exc, "detail", None) or str(exc))

    def failed_phase(self) -> Phase | None:
        return next((p for p in self.phases if not p.ok), None)

    def as_json(self) -> dict:
        out = {"host": self.host, "ok": self.ok, "result": self.result, "release": self.release,
               "phases": [asdict(p) for p in self.phases], "exit_code": self.exit_code, "error": self.error}
        if self.log:
            out["log"] = self.log
        out.update(self.data)
        return out


@dataclass
class Report:
    command: str
    hosts: list[HostResult]
    extra: dict = field(default_factory=dict)  # command-level facts, e.g. the inventory edit of set-env

    @property
    def exit_code(self) -> int:
        return int(most_severe([h.exit_code for h in self.hosts]))

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def summary(self) -> dict:
        counts = Counter(h.result for h in self.hosts)
        return {"hosts": len(self.hosts), **dict(sorted(counts.items()))}

    def as_json(self) -> dict:
        return {"command": self.command, "ok": self.ok, "exit_code": self.exit_code,
                "hosts": [h.as_json() for h in self.hosts], "summary": self.summary(), **self.extra}
