"""What one remote interaction is, as data: a command, how its output reads, how long it may take.

Modules that know a remote program build its :class:`Step`; ``kdeploy.ssh.remote.Remote.ask`` is the one
executor that runs them (become, tracing and the lock's fence are its business, said once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RunResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def last_error(self) -> str:
        """The last non-empty stderr line: what a one-line error should quote."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exit status {self.rc}"


@dataclass(frozen=True)
class Step(Generic[T]):
    """One remote interaction as data (pyinfra's fact shape): the command, how its output reads, how long it
    may take. ``Remote.ask`` runs every step, so what all of them need (become, tracing, the fence) is said
    once. ``fails``: a non-zero exit ends the phase with ``<fails>: <the command's last error line>``; None:
    the parser reads failures too."""

    command: str
    parse: Callable[[RunResult], T]
    timeout: float = 60.0
    fails: str | None = None


def split_sections(text: str) -> dict[str, str]:
    """Split ``@@name`` marked output into sections."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@@") and " " not in line:
            current = sections.setdefault(line[2:], [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v) for k, v in sections.items()}
