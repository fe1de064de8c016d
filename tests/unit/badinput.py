"""The bad-input corpus: what a user can type or a file can hold, and how kdeploy must answer it.

Each :class:`Case` is a command line with the files, environment and user it runs with. Its contract is one of:

- ``invalid``: exit 2, nothing on stdout (``--json`` or not), exactly one line on stderr, ``kdeploy: ...``, with no
  control character in it, never ``internal error`` — and it ends within its timeout;
- ``ok``: the documented success (exit 0), stdout holding ``stdout`` where given, no control character on stderr;
- ``report``: a per-host report of bad input (``check``'s findings, a host's own SSH config): exit 2, a line per
  finding, host and summary, in which no planted name starts a line of its own.

Whatever the contract, no line on stderr holds a control character or starts with a line the input planted.

The runner forks the test process for each case (kdeploy is already imported, so a case costs milliseconds, not a
process start), runs ``kdeploy.__main__.main`` there as the console script does, with an address-space limit
(an unbounded read fails instead of filling the machine) and a deadline (a hang is killed and reported).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Imported before the forks, so that a case costs its own work only (a lazy CLI imports these on demand).
PRELOAD = ("kdeploy.__main__", "kdeploy.cli.app", "kdeploy.core.inventory", "kdeploy.core.ansible",
           "kdeploy.core.render", "kdeploy.flows.check", "kdeploy.flows.fleet", "kdeploy.ssh.sshconfig")
# What the corpus's names and values plant after a newline, to see whether it starts a line of its own.
PLANTED = ("kdeploy: FORGED", "kdeploy: FAKE", "FORGED", "FAKE", "inv.yaml:1: FAKE")
MEMORY_LIMIT = 3 << 30  # bytes of address space a case may map: torch-free kdeploy needs well under 1 GiB

# A file's content: text, bytes, or a function of the case directory that writes the file itself (a FIFO, a
# directory, a mode) and returns nothing.
Content = str | bytes | Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    files: dict[str, Content] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    expect: str = "invalid"  # or "ok", "report"
    stdout: str | None = None  # with "ok": a string stdout must contain
    mentions: tuple[str, ...] = ()  # strings the one line must contain (the option, the file, the key ...)
    timeout: float = 15.0
    unprivileged: bool = False  # without root's capabilities: a mode-000 file is unreadable, as for any user

    def args(self, folder: Path) -> list[str]:
        return [a.replace("{d}", str(folder)) for a in self.argv]


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float

    def problems(self, case: Case, folder: Path) -> list[str]:
        """What breaks the case's contract: an empty list when it held."""
        if self.code is None:
            return [f"still running after {case.timeout:.0f} s: killed"]
        lines = self.stderr.splitlines(keepends=True)
        found = []
        if case.expect == "report":
            if self.code != 2:
                found.append(f"exit {self.code}, expected 2")
        elif case.expect == "ok":
            if self.code != 0:
                found.append(f"exit {self.code}, expected 0")
            if case.stdout is not None and case.stdout not in self.stdout:
                found.append(f"stdout lacks {case.stdout!r}")
        else:
            if self.code != 2:
                found.append(f"exit {self.code}, expected 2")
            if self.stdout:
                found.append(f"stdout not empty: {self.stdout[:120]!r}")
            if len(lines) != 1:
                found.append(f"{len(lines)} lines on stderr, expected 1")
            elif not lines[0].startswith("kdeploy: ") or not lines[0].endswith("\n"):
                found.append("the line is not 'kdeploy: ...\\n'")
            if "internal error" in self.stderr or "Traceback" in self.stderr:
                found.append("an internal error")
            for text in case.mentions:
                text = text.replace("{d}", str(folder))
                if text not in self.stderr:
                    found.append(f"the line does not name {text!r}")
        if any(_control(line.removesuffix("\n")) for line in lines):
            found.append("a control character on stderr")
        if any(line.startswith(PLANTED) for line in lines):
            found.append("a line planted by the input")
        return [*found, f"stderr: {self.stderr[:400]!r}"] if found else []


def _control(text: str) -> bool:
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in text)


def materialize(case: Case, folder: Path) -> None:
    """Writes the case's files (``{d}`` in a name or text is the case's folder)."""
    folder.mkdir(parents=True)
    for name, content in case.files.items():
        path = folder / name.replace("{d}", str(folder))
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path)
            continue
        if isinstance(content, str):
            path.write_text(content.replace("{d}", str(folder)))
        else:
            path.write_bytes(content)
        if path.read_bytes().startswith(b"#!"):
            path.chmod(0o755)
        else:
            path.chmod(0o644)


def _child(case: Case, folder: Path) -> None:
    """Runs in the forked child: never returns."""
    code = 99
    try:
        out = os.open(folder / ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        err = os.open(folder / ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.setsid()  # its own process group: the deadline kills a case's children (inventory scripts) too
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        os.chdir(folder)
        for key in [k for k in os.environ if k.startswith("KDEPLOY_") or k in ("CI", "NO_COLOR")]:
            del os.environ[key]
        os.environ.update({"HOME": str(folder), "CI": "true"})
        os.environ.update({k: v.replace("{d}", str(folder)) for k, v in case.env.items()})
        if case.unprivileged:
            drop_capabilities()
        sys.argv = ["kdeploy", *case.args(folder)]
        from kdeploy.__main__ import main

        main()  # os._exit()s with the command's code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the harness's own failure: exit 99 with its trace
        traceback.print_exc()
    finally:
        os._exit(code)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """This process keeps its uid but loses every capability (capset(2)): root then reads a file only as its
    owner may, so a mode-000 file or directory is refused as it is for any user. Dropping the uid instead would
    also lose the interpreter, which may live under root's home."""
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3: two words
    if ctypes.CDLL(None, use_errno=True).capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def run_all(cases: Iterable[Case], root: Path, parallel: int) -> dict[str, Outcome]:
    """Runs every case, ``parallel`` at a time, each in a fork of this process; returns their outcomes by id."""
    for module in PRELOAD:
        importlib.import_module(module)
    root.mkdir(parents=True, exist_ok=True)
    pending = list(cases)
    running: dict[int, tuple[Case, Path, float]] = {}
    done: dict[str, Outcome] = {}
    while pending or running:
        while pending and len(running) < parallel:
            case = pending.pop(0)
            folder = root / case.id
            materialize(case, folder)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case, folder)
            running[pid] = (case, folder, time.monotonic())
        time.sleep(0.005)
        for pid, (case, folder, started) in list(running.items()):
            finished, status = os.waitpid(pid, os.WNOHANG)
            late = time.monotonic() - started > case.timeout
            if not finished and not late:
                continue
            if not finished:
                _kill(pid)
                os.waitpid(pid, 0)
            del running[pid]
            code = os.waitstatus_to_exitcode(status) if finished else None
            done[case.id] = Outcome(code, _read(folder / ".stdout"), _read(folder / ".stderr"),
                                    time.monotonic() - started)
    return done


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        with contextlib.suppress(ProcessLookupError):
            target()


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "backslashreplace")
    except FileNotFoundError:
        return ""


def as_json(value: object) -> str:
    return json.dumps(value)
