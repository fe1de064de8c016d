"""What a command did, per host and phase: the one shape behind the tables and ``--json``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol

from kdeploy import __version__
from kdeploy.core.errors import ExitCode, KdeployError, most_severe

SCHEMA_VERSION = 1  # of the --json document (kdeploy/cli/schema.py): changes only when a field goes or changes meaning


class Result(StrEnum):
    """How a host ended, and the exit code that stands for it (the one mapping of the two)."""

    exit_code: ExitCode

    def __new__(cls, value: str, code: ExitCode) -> Result:
        member = str.__new__(cls, value)
        member._value_ = value
        member.exit_code = code
        return member

    DEPLOYED = "deployed", ExitCode.OK
    UNCHANGED = "unchanged", ExitCode.OK
    HEALTHY = "healthy", ExitCode.OK
    PLANNED = "planned", ExitCode.OK
    RESTORED = "restored", ExitCode.OK
    OK = "ok", ExitCode.OK
    SKIPPED = "skipped", ExitCode.OK
    ROLLED_BACK = "rolled_back", ExitCode.ROLLED_BACK
    UNHEALTHY = "unhealthy", ExitCode.ROLLED_BACK
    ROLLBACK_FAILED = "rollback_failed", ExitCode.ROLLBACK_FAILED
    UNREACHABLE = "unreachable", ExitCode.UNREACHABLE
    LOCKED = "locked", ExitCode.LOCKED
    PREFLIGHT_REFUSED = "preflight_refused", ExitCode.PREFLIGHT
    INCOMPATIBLE = "incompatible", ExitCode.PREFLIGHT
    COMMAND_FAILED = "command_failed", ExitCode.COMMAND_FAILED
    FAILED = "failed", ExitCode.INTERNAL
    INVALID = "invalid", ExitCode.INVALID
    INTERRUPTED = "interrupted", ExitCode.INTERRUPTED

    @classmethod
    def of(cls, exc: BaseException) -> Result:
        """The result a host ends with when ``exc`` stopped it: the one its exit code stands for."""
        if isinstance(exc, Cancelled):
            return cls.INTERRUPTED
        code = exc.exit_code if isinstance(exc, KdeployError) else ExitCode.INTERNAL
        return _BY_CODE.get(code, cls.FAILED)


@dataclass
class Phase:
    name: str
    ok: bool
    seconds: float
    detail: str
    data: dict | None = None  # a phase's numbers for the JSON report (parity); left out when None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "data" or v is not None}


class PhaseFailed(Exception):
    """A phase decided the host cannot go on; ``detail`` is its one-line reason."""

    def __init__(self, detail: str, log: list[str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.log = log or []


class Cancelled(Exception):
    """Ctrl-C: stop before the next change; what already changed is finished or reverted."""


# An exception's exit code -> the result it ends a host with (its first result of that code).
_BY_CODE = {code: next(r for r in Result if r.exit_code == code)
            for code in (ExitCode.UNREACHABLE, ExitCode.LOCKED, ExitCode.PREFLIGHT, ExitCode.INVALID)}


class Details(Protocol):
    """A command's typed findings on one host; ``--json`` puts ``to_json()`` under the host's ``key``."""

    key: ClassVar[str]

    def to_json(self) -> object: ...


Listener = Callable[[str, str, str], None]  # (host, phase, status) status: start|ok|fail|<result> (phase "done")


class PhaseWatcher:
    """A listener that is also told each phase's seconds and detail as it ends (the CI log's line per phase).

    A plain :data:`Listener` keeps its three arguments; a subclass gets :meth:`event` instead.
    """

    def __call__(self, host: str, phase: str, status: str) -> None:
        self.event(host, phase, status, None, "")

    def event(self, host: str, phase: str, status: str, seconds: float | None, detail: str) -> None:
        """``seconds`` is None at a phase's start and at ``done``; ``detail`` is the phase's, or the host's error."""
        raise NotImplementedError


@dataclass(frozen=True)
class ServerRef:
    """The server a host is a node of, for a server that spans hosts (docs/topologies.md)."""

    name: str
    node_rank: int
    nodes: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.name} {'head' if self.node_rank == 0 else f'node {self.node_rank}'}"


@dataclass
class HostResult:
    host: str
    ok: bool = True
    result: Result = Result.OK
    release: str | None = None
    phases: list[Phase] = field(default_factory=list)
    exit_code: int = 0
    error: str | None = None
    log: list[str] = field(default_factory=list)
    attempted: str | None = None  # the release the command staged or switched to
    restored: Result | None = None  # set-env/set: how putting the old config back ended on this host
    traceback: str | None = None  # an internal error's, for --debug and the JSON
    details: Details | None = None  # the command's own findings (plan, status, history, lock, probe)
    router: str | None = None  # membership in the SGLang router as this command left it: "in" or "out"
    server: ServerRef | None = None  # the server it is a node of, when that spans hosts
    role: str | None = None  # "prefill" or "decode": its server's half of a prefill/decode pair
    recorded: Result | None = field(default=None, repr=False, compare=False)  # its history line's, by the confirm
    gated: str | None = field(default=None, repr=False, compare=False)  # kept by a confirm after its gate
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
        self._emit(name, "start", None, "")
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
            self._emit(name, "ok" if entry.ok else "fail", entry.seconds, entry.detail)

    def _emit(self, phase: str, status: str, seconds: float | None, detail: str) -> None:
        if isinstance(self.listener, PhaseWatcher):
            self.listener.event(self.host, phase, status, seconds, detail)
        elif self.listener:
            self.listener(self.host, phase, status)

    def finish(self, result: Result | str, error: str | None = None) -> HostResult:
        self.done = True
        self.result = Result(result)
        self.exit_code = int(self.result.exit_code)
        self.ok = self.exit_code == 0
        self.error = error
        self._emit("done", self.result, None, error or "")
        return self

    def fail(self, exc: BaseException) -> None:
        """End the host with the result ``exc`` stands for, unless a result was already decided."""
        if not self.done:
            self.finish(Result.of(exc), getattr(exc, "detail", None) or str(exc))

    def failed_phase(self) -> Phase | None:
        return next((p for p in self.phases if not p.ok), None)

    def as_json(self) -> dict:
        out = {"host": self.host, "ok": self.ok, "result": self.result, "release": self.release,
               "phases": [p.to_json() for p in self.phases], "exit_code": self.exit_code, "error": self.error}
        if self.log:
            out["log"] = self.log
        for key in ("attempted", "restored", "traceback", "router", "role"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.server is not None:
            out["server"] = {"name": self.server.name, "node_rank": self.server.node_rank,
                             "nodes": list(self.server.nodes)}
        if self.details is not None:
            out[self.details.key] = self.details.to_json()
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
        counts = Counter(str(h.result) for h in self.hosts)  # plain strings: printed as the docs show them
        return {"hosts": len(self.hosts), **dict(sorted(counts.items()))}

    def as_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "kdeploy_version": __version__,
                "command": self.command, "ok": self.ok, "exit_code": self.exit_code,
                "hosts": [h.as_json() for h in self.hosts], "summary": self.summary(), **self.extra}
