"""systemctl and journalctl: command builders and parsers of their real output."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from kdeploy import onhost
from kdeploy.core.step import Step

SHOW_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "InvocationID", "ExecMainPID",
                   "ExecMainStatus", "ActiveEnterTimestamp", "LoadState", "UnitFileState", "NeedDaemonReload")
UNIT_DIR = "/etc/systemd/system"
_RANK = re.compile(r"\bTP(\d+)\]|\brank[= ](\d+)\b")


@dataclass(frozen=True)
class UnitState:
    active: str
    sub: str
    result: str
    n_restarts: int
    invocation: str
    main_pid: int
    main_status: int
    active_since: str
    load: str
    file_state: str
    need_reload: bool = False

    @property
    def running(self) -> bool:
        return self.active == "active" and self.sub == "running"

    @property
    def summary(self) -> str:
        text = f"{self.active}/{self.sub}"
        if self.result not in ("", "success"):
            text += f" result={self.result}"
        if self.n_restarts:
            text += f" restarts={self.n_restarts}"
        return text


def show_command(unit: str) -> str:
    return f"systemctl show {shlex.quote(unit)} -p {','.join(SHOW_PROPERTIES)} --no-pager"


_FOLLOW = onhost.shell("follow.sh")  # runs on the host: kdeploy/onhost/follow.sh


OLD_RUN = "@@old "


def stop_command(unit: str) -> str:
    """Print the run being replaced (``@@old <invocation>``), then ask it to stop without waiting.

    The activation reloads systemd while the old run is still stopping (a service's stop takes seconds:
    its drain and CUDA teardown), then restarts it (:func:`restart_command`). The run id is read
    before the stop, so a run systemd started by itself meanwhile (Restart=on-failure) is not taken for
    ours. A unit not loaded yet (first deploy) has nothing to stop.
    """
    u = shlex.quote(unit)
    return (f'echo "{OLD_RUN}$(systemctl show -p InvocationID --value {u})"; '
            f"systemctl stop --no-block {u} 2>/dev/null || true")


def restart_command(unit: str) -> str:
    """Replaces the stop job still running: systemd's restart job waits until the old run is gone, then
    starts the unit once, on the unit file as reloaded. A start job queued behind the stop instead is retried
    at each of the unit's state changes while it stops, and each retry counts against StartLimitBurst: a
    stop through several states (a main process that exits, then its leftovers killed) failed the unit
    with start-limit-hit."""
    return f"systemctl restart --no-block {shlex.quote(unit)}"


def gone_command(unit: str, old: str, timeout: float, poll: float) -> str:
    """Wait ON THE HOST until run ``old`` is gone (the unit inactive or failed, or another run), at most
    ``timeout`` seconds; prints ``@@gone`` and the wait's exit status (124: still there)."""
    u = shlex.quote(unit)
    still = (f'[ "$(systemctl show -p InvocationID --value {u})" = {shlex.quote(old)} ] && '
             f'case "$(systemctl show -p ActiveState --value {u})" in inactive|failed) false;; *) true;; esac')
    loop = f"while {still}; do sleep {poll:g}; done"
    return f"timeout {int(timeout)} sh -c {shlex.quote(loop)}; rc=$?; echo @@gone; echo $rc"


def gone_step(unit: str, old: str, timeout: float, poll: float) -> Step[bool]:
    """``gone_command`` as a step: True once the old run is gone."""
    return Step(gone_command(unit, old, timeout, poll), lambda out: out.stdout.split()[-2:] == ["@@gone", "0"],
                timeout + 30, fails="waiting for the old run to stop failed")


def start_step(unit: str) -> Step[None]:
    """Start the unit unless it runs (a run systemd restarted by itself on the new release is kept)."""
    return Step(f"systemctl start --no-block {shlex.quote(unit)}", lambda out: None, 30,
                fails=f"starting {unit} failed")


def parse_old_run(text: str) -> str:
    """The invocation :func:`stop_command` printed ("" when the unit had never run)."""
    for line in text.splitlines():
        if line.startswith(OLD_RUN):
            return line[len(OLD_RUN):].strip()
    return ""


def follow_command(unit: str, old: str, timeout: float, poll: float) -> str:
    """Follow the unit ON THE HOST until a run other than ``old`` has started: one round trip.

    Prints ``@@stopping`` once if the old run was seen deactivating, ``@@followed`` with the wait's exit
    status (124: timed out), then the unit's state.
    """
    u = shlex.quote(unit)
    return "\n".join([
        f"timeout {int(timeout)} sh -c {shlex.quote(_FOLLOW)} follow {shlex.quote(old)} {u} {poll:g}",
        "rc=$?; echo @@followed; echo $rc",
        f"echo @@show; {show_command(unit)}",
    ])


@dataclass(frozen=True)
class Restarted:
    state: UnitState
    stopping: bool  # the old run was seen deactivating
    followed: bool  # a new run started before the timeout


def parse_restart(text: str) -> Restarted:
    head, sep, show = text.partition("@@show\n")
    lines = head.splitlines()
    return Restarted(parse_show(show), "@@stopping" in lines, bool(sep) and lines[-2:] == ["@@followed", "0"])


def parse_show(text: str) -> UnitState:
    """Parse ``systemctl show -p ...`` (it prints in its own order, not the order asked)."""
    props: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key] = value

    def num(key: str) -> int:
        try:
            return int(props.get(key, "0") or 0)
        except ValueError:
            return 0

    return UnitState(
        active=props.get("ActiveState", "unknown"), sub=props.get("SubState", "unknown"),
        result=props.get("Result", ""), n_restarts=num("NRestarts"), invocation=props.get("InvocationID", ""),
        main_pid=num("ExecMainPID"), main_status=num("ExecMainStatus"),
        active_since=props.get("ActiveEnterTimestamp", ""), load=props.get("LoadState", ""),
        file_state=props.get("UnitFileState", ""), need_reload=props.get("NeedDaemonReload") == "yes",
    )


def journal_command(invocation: str, *, grep: Iterable[str] = (), lines: int | None = None,
                    first: int | None = None) -> str:
    """Journal records of ONE invocation as JSON, optionally only those containing a fixed string.

    The grep runs on journalctl's JSON, so it looks for each string as that JSON writes it: ``"`` and ``\\``
    escaped, non-ASCII text as plain UTF-8 (never ``\\u`` escapes). ``lines``: the last N records; ``first``:
    only the first N (what a start-up logs), so a run that has served for weeks is not read whole.
    """
    cmd = (f"journalctl --no-pager -o json --output-fields=MESSAGE,_PID "
           f"{shlex.quote('_SYSTEMD_INVOCATION_ID=' + invocation)}")
    if lines is not None:
        cmd += f" -n {int(lines)}"
    if first is not None:
        cmd += f" | head -n {int(first)}"
    patterns = [json.dumps(p, ensure_ascii=False)[1:-1] for p in grep]
    if patterns:
        cmd += " | grep -F " + " ".join(f"-e {shlex.quote(p)}" for p in patterns) + " || true"
    return cmd


@dataclass(frozen=True)
class JournalLine:
    pid: int
    message: str

    @property
    def rank(self) -> int | None:
        match = _RANK.search(self.message)
        return int(match.group(1) or match.group(2)) if match else None


def parse_journal(text: str) -> list[JournalLine]:
    out = []
    for raw in text.splitlines():
        if not raw.startswith("{"):
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            continue
        message = record.get("MESSAGE", "")
        if isinstance(message, list):  # journald sends non-UTF-8 messages as byte arrays
            message = bytes(message).decode(errors="replace")
        try:
            pid = int(record.get("_PID", 0))
        except (TypeError, ValueError):
            pid = 0
        out.append(JournalLine(pid, str(message)))
    return out


def parse_environment(value: str) -> dict[str, str]:
    """Parse ``systemctl show -p Environment --value``: space-separated, C-escaped, quoted assignments."""
    env: dict[str, str] = {}
    for word in _split_words(value):
        name, sep, val = word.partition("=")
        if sep:
            env[name] = val
    return env


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "s": " "}


def _split_words(text: str) -> list[str]:
    words: list[str] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        word: list[str] = []
        quote: str | None = None
        while i < n and (quote or not text[i].isspace()):
            ch = text[i]
            if ch == "\\" and i + 1 < n:
                nxt = text[i + 1]
                if nxt == "x" and i + 3 < n:
                    word.append(chr(int(text[i + 2:i + 4], 16)))
                    i += 4
                    continue
                word.append(_ESCAPES.get(nxt, nxt))
                i += 2
                continue
            if quote and ch == quote:
                quote = None
            elif not quote and ch in "\"'":
                quote = ch
            else:
                word.append(ch)
            i += 1
        words.append("".join(word))
    return words


def follow_step(unit: str, old: str, timeout: float, poll: float) -> Step[Restarted]:
    """``follow_command`` as a step; the host's own wait bounds it, the link gets 30 s more."""
    return Step(follow_command(unit, old, timeout, poll), lambda out: parse_restart(out.stdout), timeout + 30,
                fails="following the restart failed")


def show_step(unit: str) -> Step[UnitState]:
    return Step(show_command(unit), lambda out: parse_show(out.stdout), 30)


def journal_step(invocation: str, *, grep: Iterable[str] = (), lines: int | None = None,
                 first: int | None = None) -> Step[list[JournalLine]]:
    """``journal_command`` as a step: the run's lines."""
    return Step(journal_command(invocation, grep=grep, lines=lines, first=first),
                lambda out: parse_journal(out.stdout), 30)


def disable_and_stop_step(unit: str, *, then: str = "true") -> Step[None]:
    """Disable the unit and stop it without waiting, then run ``then`` (a first deploy that failed)."""
    u = shlex.quote(unit)
    return Step(f"systemctl disable --quiet {u}; systemctl stop --no-block {u}; {then}", lambda out: None, 60)
