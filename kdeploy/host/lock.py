"""The per-service deploy lock on a host.

The lock is a ``flock`` held by a shell that lives as long as the controller's SSH channel: Ctrl-C, a crash
or a dropped connection closes the channel and the kernel releases the lock. ``lock.json`` beside it says
who holds it; when it is left behind with no ``flock`` holder (host rebooted, holder killed), it is a stale
lock: reported loudly, never mistaken for a live one.

A blackholed link keeps the channel (and the lock) open on the host until TCP gives up, hours later: so the
controller sends a heartbeat line on the holder's stdin every few seconds (one thread for every lock it
holds), and a watchdog beside the holder ends it after ``lock_timeout`` seconds without one. Every command
the controller runs while holding the lock is fenced (``Remote.fence``): it first checks that ``lock.json``
still names its holder, so a controller that comes back from a partition changes nothing more.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shlex
import socket
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kdeploy.core.errors import LockHeld, PreflightRefused, Unreachable
from kdeploy.core.layout import LOCK, LOCK_BEAT, LOCK_RECORD
from kdeploy.core.step import Step, split_sections
from kdeploy.ssh.remote import FENCE_MARK, FENCE_RC, Process, Remote

READY = "@@ready"
END = "@@end"
HELD_RC = 75
RELEASE_WAIT = 5.0
FORCE_WAIT = 5.0  # seconds `lock release --force` waits for the lock once it ended the holder
FINISH_WAIT = 60.0
BEAT = "@@hb"
BEAT_EVERY = 5.0  # seconds between heartbeats (a third of the shortest lock_timeout when that is less)
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class LockInfo:
    user: str
    controller: str
    pid: int
    since: str
    command: str
    remote_pid: int | None = None

    def describe(self) -> str:
        return f"{self.user}@{self.controller} pid {self.pid} since {self.since} ({self.command})"


def holder_info(command: str) -> LockInfo:
    """Who takes the lock; ``command`` is kdeploy's own (``deploy.recorded_command``), never ``sys.argv``."""
    return LockInfo(
        user=os.environ.get("KDEPLOY_USER") or getpass.getuser(),
        controller=socket.gethostname(),
        pid=os.getpid(),
        since=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=command[:200],
    )


def parse_info(text: str) -> LockInfo | None:
    text = text.strip()
    if not text:
        return None
    try:
        data = json.loads(text)
        return LockInfo(**{k: data.get(k) for k in LockInfo.__dataclass_fields__})
    except (json.JSONDecodeError, TypeError, AttributeError):
        return LockInfo(user="?", controller="?", pid=0, since="?", command=f"unreadable lock.json: {text[:60]}")


def holder_script(service_dir: str, info: LockInfo, *, wait: float = 0, then: str = "",
                  timeout: float = DEFAULT_TIMEOUT) -> str:
    """Take the lock, record who holds it, run ``then`` (the state read), then hold until stdin closes.

    What arrives on stdin is the finish script (history, pruning), run under the lock as the holder's last
    act; only if it arrived whole (ends with ``@@end``): a dropped link must not run half a ``rm``.
    Heartbeat lines (``@@hb``) between touch ``.lock.beat``; a watchdog (its own copy of the lock's fd
    closed) ends the holder once that is ``timeout`` s old, after removing ``lock.json`` so the controller's
    fence fails. It stops at the end of stdin: the finish script may take longer than the timeout.
    The service dir is created 0755 (the service runs in it, maybe as another user); what the holder writes
    there (``.lock``, ``lock.json``, ``history.jsonl``) is for root only: umask 077.
    """
    d = shlex.quote(service_dir)
    # Escape first, then put in the one unescaped $$ (a "$$" inside the command must stay literal).
    record = _dq(json.dumps({**info.__dict__, "remote_pid": "__PID__"})).replace('\\"__PID__\\"', "$$")
    flock = f"flock -w {wait:g} 9" if wait > 0 else "flock -n 9"
    return "\n".join([
        "umask 022",
        f"[ -d {d} ] || mkdir -p {d} || exit 70",
        "umask 077",
        f"exec 9>>{d}/{LOCK} || exit 70",
        f"if ! {flock}; then echo @@held; cat {d}/{LOCK_RECORD} 2>/dev/null; echo; exit {HELD_RC}; fi",
        f"echo @@stale; [ ! -f {d}/{LOCK_RECORD} ] || cat {d}/{LOCK_RECORD} 2>/dev/null; echo",
        f"info=\"{record}\"",
        f"{{ printf '%s\\n' \"$info\" > {d}/.{LOCK_RECORD}.tmp && mv -f {d}/.{LOCK_RECORD}.tmp {d}/{LOCK_RECORD}; }} "
        f"|| {{ rm -f {d}/.{LOCK_RECORD}.tmp; exit 70; }}",  # no record of the holder (a full disk): not taken
        "echo @@holder; echo $$",
        "echo @@then",
        then,
        f"beat={d}/{LOCK_BEAT}; : > \"$beat\"",
        "(exec 9>&- </dev/null >/dev/null 2>&1",
        " while sleep 1; do kill -0 $$ || exit 0",
        f'  [ $(( $(date +%s) - $(stat -c %Y "$beat" || echo 0) )) -lt {int(timeout)} ] && continue',
        f'  [ "$(cat {d}/{LOCK_RECORD})" = "$info" ] && rm -f {d}/{LOCK_RECORD}',
        "  kill -TERM $$; exit 0",
        " done) &",
        "watchdog=$!",
        f"echo {READY}",
        "finish=",
        f'while IFS= read -r line; do if [ "$line" = {BEAT} ]; then : > "$beat"; else finish="${{finish:+$finish',
        '}$line"; fi; done',
        "kill $watchdog 2>/dev/null",
        f"case $finish in *{END}) (eval \"${{finish%{END}}}\") ;; esac",
        f"[ \"$(cat {d}/{LOCK_RECORD} 2>/dev/null)\" = \"$info\" ] && rm -f {d}/{LOCK_RECORD}",
        "exit 0",
    ]) + "\n"


def _dq(text: str) -> str:
    """Escape for a double-quoted shell string: nothing in it expands."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`").replace("$", "\\$")


@dataclass(eq=False)
class HeldLock:
    """A lock this process holds; ``release`` ends the holder by closing its stdin."""

    process: Process
    output: str
    stale: LockInfo | None
    remote_pid: int | None = None  # the holder shell on the host (to end it if its link dies unnoticed)
    timeout: float = DEFAULT_TIMEOUT
    remote: Remote | None = None  # whose commands are fenced while the lock is held
    _sending: threading.Lock = field(default_factory=threading.Lock)
    _released: bool = False

    def beat(self) -> None:
        """One heartbeat; a link that is down just misses it (the holder's watchdog counts on that)."""
        with self._sending:
            if not self._released:
                with contextlib.suppress(Unreachable):
                    self.process.send(f"{BEAT}\n".encode())

    def release(self, finish: str = "") -> bool:
        """Hand the holder ``finish``, close its stdin and wait for it; a dead link must not hang us.

        False when the holder's connection was already gone, so ``finish`` never ran there; the fence then
        stays, so nothing else runs on the host in the lock's name.
        """
        with self._sending:
            self._released = True
        _BEATS.remove(self)
        try:
            if not self.process.alive:
                return False
            if finish:
                self.process.send(f"{finish}\n{END}\n".encode())
            self.process.shutdown_write()
            self.process.wait(FINISH_WAIT if finish else RELEASE_WAIT)
            if self.remote is not None:
                self.remote.fence = None
            return True
        except Unreachable:
            return False
        finally:
            self.process.close()


class _Heartbeats:
    """One thread beats for every lock the process holds (a fleet of hundreds holds hundreds at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: set[HeldLock] = set()
        self.thread: threading.Thread | None = None

    def add(self, held: HeldLock) -> None:
        with self.lock:
            self.held.add(held)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="kdeploy-lock-heartbeat", daemon=True)
                self.thread.start()

    def remove(self, held: HeldLock) -> None:
        with self.lock:
            self.held.discard(held)

    def _run(self) -> None:
        every = BEAT_EVERY
        while True:
            threading.Event().wait(every)
            with self.lock:
                held = list(self.held)
                if not held:
                    self.thread = None
                    return
            every = min(BEAT_EVERY, min(h.timeout for h in held) / 3)
            for h in held:
                h.beat()


_BEATS = _Heartbeats()


def fence_command(service_dir: str, remote_pid: int) -> str:
    """The shell test a held lock puts before every command of its controller: ``lock.json`` still names
    our holder (the watchdog removes it before ending the holder; a later holder writes its own)."""
    mark = shlex.quote(f'"remote_pid": {int(remote_pid)}}}')
    return (f"grep -qF {mark} {shlex.quote(f'{service_dir}/{LOCK_RECORD}')} 2>/dev/null || "
            f"{{ echo {shlex.quote(FENCE_MARK)} >&2; exit {FENCE_RC}; }}")


def acquire(remote: Remote, service_dir: str, *, command: str, wait: float = 0, then: str = "",
            timeout: float = DEFAULT_TIMEOUT) -> HeldLock:
    """Take the lock (waiting up to ``wait`` s) and run ``then`` under it, in one round trip; from then on
    heartbeats keep it and the remote's commands are fenced by it."""
    process = remote.start(holder_script(service_dir, holder_info(command), wait=wait, then=then, timeout=timeout),
                           timeout=max(30.0, wait + 30))
    try:
        text = process.read_until(READY.encode()).decode(errors="replace")
    except Unreachable as exc:
        process.close()
        raise Unreachable(f"{remote.host.name}: connection lost while taking the deploy lock: {exc}") from None
    sections = split_sections(text)
    if "held" in sections or READY not in text:
        rc = process.wait(RELEASE_WAIT)  # exits at once when the lock is held: never wait on a live holder
        err = process.stderr().strip()
        process.close()
        if rc == HELD_RC:
            holder = parse_info(sections.get("held", ""))
            who = holder.describe() if holder else "unknown holder"
            raise LockHeld(f"{remote.host.name}: deploy lock held by {who}")
        why = err or (f"exit status {rc}" if rc is not None else "unexpected output: " + " ".join(text.split())[:120])
        if rc is None:
            raise Unreachable(f"{remote.host.name}: cannot take the deploy lock: {why}")
        # The host answered and refused (a read-only or full filesystem, no permission): nothing was changed.
        raise PreflightRefused(f"{remote.host.name}: cannot take the deploy lock, host unchanged: {why}")
    process.no_timeout()
    pid = sections.get("holder", "").strip()
    held = HeldLock(process, text, parse_info(sections.get("stale", "")), int(pid) if pid.isdigit() else None,
                    timeout, remote)
    if held.remote_pid is not None:
        remote.fence = fence_command(service_dir, held.remote_pid)
        remote.fence_reason = (f"this controller no longer holds the deploy lock: the host ended its holder after "
                               f"{timeout:g}s without a heartbeat (a partitioned or frozen controller; another run "
                               "may hold it now); stopped touching the host")
    _BEATS.add(held)
    return held


def end_holder_command(service_dir: str, pid: int) -> str:
    """End OUR earlier holder whose link died but whose sshd session has not noticed (a blackholed link
    keeps it, and the lock, for hours): only if that pid still holds this service's lock file."""
    lockfile = shlex.quote(f"{service_dir}/{LOCK}")
    return (f"for fd in /proc/{int(pid)}/fd/*; do [ \"$(readlink $fd)\" = {lockfile} ] && "
            f"{{ pkill -TERM -P {int(pid)}; kill -TERM {int(pid)}; sleep 0.2; break; }}; done 2>/dev/null; true")


@dataclass(frozen=True)
class LockStatus:
    held: bool
    info: LockInfo | None

    @property
    def state(self) -> str:
        if self.held:
            return "held"
        return "stale" if self.info else "free"


def status_command(service_dir: str) -> str:
    d = shlex.quote(service_dir)
    return (f"if [ -e {d}/{LOCK} ] && ! flock -n {d}/{LOCK} true; then echo @@held; else echo @@free; fi; "
            f"echo @@info; cat {d}/{LOCK_RECORD} 2>/dev/null; true")


def parse_status(text: str) -> LockStatus:
    sections = split_sections(text)
    return LockStatus(held="held" in sections, info=parse_info(sections.get("info", "")))


def release_command(service_dir: str, status: LockStatus, force: bool, *, wait: float = FORCE_WAIT) -> str:
    """Clear the lock record once the lock is free, and print the lock's status (``status_command``).

    With ``force`` and a held lock, first end the recorded holder, but only if that PID still has the lock
    file open: a holder that is gone may have left its PID to an unrelated process, which is never killed
    (``@@not-holder``). The holder is its SSH session's process group leader, so the group is ended with
    it (``@@killed``); with become it is sudo's child instead, ended with its children (sudo then exits).
    Then the lock is waited for, at most ``wait`` s. The record is removed under the lock, so a deploy that
    takes the lock meanwhile keeps its own.
    """
    d = shlex.quote(service_dir)
    lines = []
    tries = 0
    if force and status.held:
        pid = int(status.info.remote_pid) if status.info and status.info.remote_pid else 0
        lines += [
            f"pid={pid} owns=",
            f'for fd in /proc/$pid/fd/*; do [ "$fd" -ef {d}/{LOCK} ] && owns=1 && break; done',
            'if [ "$pid" -gt 1 ] && [ -n "$owns" ]; then',
            "  echo @@killed; kill -TERM -$pid $pid 2>/dev/null; pkill -TERM -P $pid",
            "else echo @@not-holder; fi",
        ]
        tries = int(wait * 10)
    lines += [
        "n=0",
        f"while [ -e {d}/{LOCK} ] && ! flock -n {d}/{LOCK} rm -f {d}/{LOCK_RECORD}; do",
        f'  [ "$n" -lt {tries} ] || break',
        "  n=$((n+1)); sleep 0.1",
        "done",
        f"[ -e {d}/{LOCK} ] || rm -f {d}/{LOCK_RECORD}",
        'echo @@waited; echo "$n"',
        status_command(service_dir),
    ]
    return "\n".join(lines)


def release_failure(text: str, before: LockInfo | None) -> str | None:
    """Why the lock is still held after ``release_command`` printed ``text``; None when it is free."""
    sections = split_sections(text)
    if "held" not in sections:
        return None
    pid = before.remote_pid if before else None
    if "not-holder" in sections:
        return (f"the recorded holder (pid {pid} on the host) does not hold the lock (it ended, or its PID was "
                "reused): nothing was killed")
    if "killed" in sections:
        waited = int(sections.get("waited", "0").strip() or 0) / 10
        return f"ended the recorded holder (pid {pid} on the host), but the lock was still held {waited:g}s later"
    return "it is held by a live deploy"


def status_step(service_dir: str) -> Step[LockStatus]:
    """Is the lock held, and what does its record say (never waits)."""
    return Step(status_command(service_dir), lambda out: parse_status(out.stdout), 30)


def end_holder_step(service_dir: str, pid: int) -> Step[None]:
    """``end_holder_command`` as a step."""
    return Step(end_holder_command(service_dir, pid), lambda out: None, 30)


def release_step(service_dir: str, status: LockStatus, force: bool) -> Step[tuple[LockStatus, str | None]]:
    """``release_command`` as a step: the lock's status after it, and why it is still held (None: free)."""
    return Step(release_command(service_dir, status, force),
                lambda out: (parse_status(out.stdout), release_failure(out.stdout, status.info)), FORCE_WAIT + 30)
