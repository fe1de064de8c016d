"""What a command did, per host and phase: the one shape behind the tables and ``--json``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from kdeploy.errors import ExitCode, KdeployError, most_severe

# result -> exit code
RESULT_CODES = {
    "deployed": ExitCode.OK, "unchanged": ExitCode.OK, "healthy": ExitCode.OK, "planned": ExitCode.OK,
    "restored": ExitCode.OK, "ok": ExitCode.OK,
    "rolled_back": ExitCode.ROLLED_BACK, "unhealthy": ExitCode.ROLLED_BACK,
    "rollback_failed": ExitCode.ROLLBACK_FAILED, "unreachable": ExitCode.UNREACHABLE,
    "locked": ExitCode.LOCKED, "preflight_refused": ExitCode.PREFLIGHT, "skipped": ExitCode.OK,
    "failed": ExitCode.INTERNAL, "invalid": ExitCode.INVALID,
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

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Time a phase; a PhaseFailed or KdeployError inside marks it failed and propagates."""
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
        except KdeployError as exc:
            entry.ok, entry.detail = False, str(exc)
            raise
        finally:
            entry.seconds = round(time.monotonic() - start, 3)
            self._emit(name, "ok" if entry.ok else "fail")

    def _emit(self, phase: str, status: str) -> None:
        if self.listener:
            self.listener(self.host, phase, status)

    def finish(self, result: str, error: str | None = None) -> HostResult:
        self.result = result
        self.exit_code = int(RESULT_CODES[result])
        self.ok = self.exit_code == 0
        self.error = error
        self._emit("done", result)
        return self

    def failed_phase(self) -> str | None:
        return next((p.name for p in self.phases if not p.ok), None)

    def as_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("listener", "data", "log", "exit_code")}
        out["exit_code"] = self.exit_code
        if self.log:
            out["log"] = self.log
        out.update(self.data)
        return out


@dataclass
class Report:
    command: str
    hosts: list[HostResult]

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
                "hosts": [h.as_json() for h in self.hosts], "summary": self.summary()}
