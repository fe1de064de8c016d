"""A kdeploy run in a process of its own, as a user's or a CI job's: a signal reaches it as it would theirs, and the
phase lines of its plain log (``-v``: each phase's ``start`` too, docs/cli.md) are timed as they arrive, so a fault
can be placed in a phase and the moment it hit can be named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# kdeploy's plain log (docs/ci.md): `HH:MM:SS host[ (server head, role)] phase start` as a phase begins (-v; a
# phase may be two words: `rollback activate`), `HH:MM:SS host[ (...)] done RESULT ...` as the host ends
_PHASE = r"^\d\d:\d\d:\d\d (\S+)(?: \([^)]*\))? ([a-z][a-z_-]*(?: [a-z][a-z_-]*)?) "  # time, host, phase
_START = re.compile(_PHASE + r"start$")
_END = re.compile(_PHASE + r"(?:ok|FAIL) \d")


@dataclass
class Controller:
    """A kdeploy run in a process of its own (a signal reaches it as it would a user's); its stderr's phase
    lines are timed as they arrive."""

    argv: list[str]
    proc: subprocess.Popen[str]
    started: float
    starts: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # host -> (seconds, phase) starts
    ends: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # host -> (seconds, phase) ends
    stderr: list[str] = field(default_factory=list)
    ended: float | None = None
    out: str = ""
    readers: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, inventory: Path, argv: list[str]) -> Controller:
        env = {**os.environ, "CI": "1", "COLUMNS": "200"}
        proc = subprocess.Popen([sys.executable, "-m", "kdeploy", *argv, "-v", "--json", "--inventory",
                                 str(inventory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        run = cls(argv, proc, time.monotonic())
        run.readers = [threading.Thread(target=run._read_err, daemon=True),
                       threading.Thread(target=run._read_out, daemon=True)]
        for reader in run.readers:
            reader.start()
        return run

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            now = time.monotonic() - self.started
            self.stderr.append(line.rstrip("\n"))
            if m := _START.match(line.rstrip("\n")):
                self.starts.setdefault(m.group(1), []).append((now, m.group(2)))
            elif m := _END.match(line):
                self.ends.setdefault(m.group(1), []).append((now, m.group(2)))

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        self.out = self.proc.stdout.read()

    def wait(self, timeout: float) -> int | None:
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            code = None
        if self.ended is None:
            self.ended = time.monotonic() - self.started
        for reader in self.readers:  # its whole output read before anyone looks at it
            reader.join(10)
        return code

    def ended_for(self, host: str) -> float | None:
        """When the run was over for ``host``: its last phase ended and no other began, or the process is gone
        (None: neither). Its ``done`` line is no end: a host's result is known at its confirm, before its
        router's admit. Read once the run ended."""
        starts, ends = self.starts.get(host, []), self.ends.get(host, [])
        if starts and ends and len(ends) >= len(starts) and ends[-1][0] >= starts[-1][0]:
            return ends[-1][0] if self.ended is None else min(ends[-1][0], self.ended)
        return self.ended

    def failed_phase(self, hosts: tuple[str, ...]) -> str | None:
        """The first phase that failed on any of ``hosts``, from the JSON report."""
        try:
            found = [p["name"] for h in json.loads(self.out)["hosts"] if h["host"] in hosts for p in h["phases"]
                     if not p["ok"]]
        except (ValueError, KeyError, TypeError):
            return None
        return found[0] if found else None

    def crashed(self) -> bool:
        """An internal error (a bug): a host's traceback in the JSON, or kdeploy's one line for one. Exit 1 alone
        is not one: a host that deployed but that its router did not take back ends ``failed`` (exit 1) too."""
        try:
            hosts = json.loads(self.out)["hosts"]
        except (ValueError, KeyError, TypeError):
            hosts = []
        return any(isinstance(h, dict) and h.get("traceback") for h in hosts) or any(
            line.startswith("kdeploy: internal error") for line in self.stderr)

    def results(self) -> dict[str, str]:
        try:
            return {h["host"]: h["result"] for h in json.loads(self.out)["hosts"]}
        except (ValueError, KeyError, TypeError):
            return {}
