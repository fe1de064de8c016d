"""kdeploy/host/lock.py: the holder script RUN for real with sh (as on a host) and flock in a temp service dir.

Each holder is started in its own process group, so a test can SIGKILL exactly it (the shell and its
`cat`, which inherits the flock'd descriptor) and every holder left running is ended at teardown.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kdeploy.host.lock import (
    END,
    HELD_RC,
    READY,
    LockInfo,
    LockStatus,
    holder_info,
    holder_script,
    parse_info,
    parse_status,
    release_command,
    release_failure,
    split_sections,
    status_command,
)

INFO = LockInfo(user="alice", controller="laptop", pid=4242, since="2025-01-02T03:04:05Z",
                command="kdeploy push kimi")
TRICKY_COMMAND = 'kdeploy push "all" $HOME $$ ${X} `id` $(id) \\ \'q\' "__PID__" %s ü'
SAFETY = 20.0   # seconds: only ever a bound on waiting for output that should come at once


class Holder:
    def __init__(self, script: str) -> None:
        self.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.out = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_until(self, marker: str) -> str:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + SAFETY
        while (marker + "\n").encode() not in self.out:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {marker} from the holder: {self.out!r}"
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                assert chunk, f"holder ended before {marker}: {self.out!r} {self.proc.stderr.read()!r}"
                self.out += chunk
        return self.out.decode()

    def finish(self, stdin: bytes = b"") -> tuple[int, str]:
        """Send ``stdin``, close it (what a closed SSH channel does) and collect the rest."""
        out, _ = self.proc.communicate(stdin, timeout=SAFETY)
        self.out += out
        return self.proc.returncode, self.out.decode()

    def kill(self) -> None:
        """SIGKILL the holder's whole process group: sh and its `cat`."""
        os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=SAFETY)
        deadline = time.monotonic() + SAFETY  # `cat` holds the lock's descriptor until it is gone too
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        raise AssertionError(f"process group {self.pid} outlived SIGKILL")


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(sdir: Path, info: LockInfo = INFO, **kw: object) -> Holder:
        holder = Holder(holder_script(str(sdir), info, **kw))
        started.append(holder)
        return holder

    yield start
    for holder in started:
        if holder.proc.poll() is None:
            holder.kill()
        for stream in (holder.proc.stdin, holder.proc.stdout, holder.proc.stderr):
            if stream and not stream.closed:
                stream.close()


def status(sdir: Path) -> LockStatus:
    out = subprocess.run(["sh", "-c", status_command(str(sdir))], capture_output=True, text=True, timeout=SAFETY,
                         check=True).stdout
    return parse_status(out)


def read_record(sdir: Path) -> dict:
    return json.loads((sdir / "lock.json").read_text())


# --- the script ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"wait": 2.5, "then": "echo @@state; ls -A"}])
def test_holder_script_is_valid_sh(tmp_path, kw):
    script = holder_script(str(tmp_path / "svc dir"), LockInfo(**{**INFO.__dict__, "command": TRICKY_COMMAND}), **kw)
    for shell in ("sh", "bash"):
        proc = subprocess.run([shell, "-n"], input=script, capture_output=True, text=True, timeout=SAFETY, check=False)
        assert (proc.returncode, proc.stderr) == (0, ""), shell
    assert ("flock -w 2.5 9" in script) == bool(kw)
    assert ("flock -n 9" in script) != bool(kw)


def test_holder_script_really_fails_sh_n_when_broken(tmp_path):
    """sh -n can fail: the check above is not vacuous."""
    script = holder_script(str(tmp_path), INFO).replace("; fi", "")
    assert subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True, check=False).returncode != 0


# --- acquire, contend, release ----------------------------------------------------------------------------------


def test_acquire_hold_contend_release(tmp_path, holders):
    sdir = tmp_path / "svc"
    first = holders(sdir, then="echo @@state; echo current=none")
    sections = split_sections(first.read_until(READY))
    assert sections["stale"] == ""                                   # nothing was left behind
    assert sections["state"] == "current=none"                       # `then` ran under the lock
    record = read_record(sdir)
    assert record == {**INFO.__dict__, "remote_pid": first.pid}       # the shell's own pid
    assert parse_info((sdir / "lock.json").read_text()) == LockInfo(**{**INFO.__dict__, "remote_pid": first.pid})
    assert status(sdir) == LockStatus(held=True, info=parse_info(json.dumps(record)))
    assert status(sdir).state == "held"

    other = LockInfo(user="bob", controller="desk", pid=1, since="later", command="kdeploy rollback kimi")
    second = holders(sdir, other)
    rc, out = second.finish()
    assert rc == HELD_RC == 75
    assert READY not in out
    held = parse_info(split_sections(out)["held"])
    assert held == LockInfo(**{**INFO.__dict__, "remote_pid": first.pid})
    assert held.describe() == "alice@laptop pid 4242 since 2025-01-02T03:04:05Z (kdeploy push kimi)"
    assert read_record(sdir)["user"] == "alice"                      # the loser wrote nothing

    rc, _ = first.finish()                                           # stdin closed: the holder lets go
    assert rc == 0
    assert not (sdir / "lock.json").exists()
    assert status(sdir) == LockStatus(held=False, info=None)
    assert status(sdir).state == "free"

    third = holders(sdir, other, wait=5)                             # free now: `flock -w` takes it at once
    assert split_sections(third.read_until(READY))["stale"] == ""
    assert read_record(sdir)["user"] == "bob"
    assert third.finish()[0] == 0


@pytest.mark.parametrize("session_umask", ["000", "022", "077"])
def test_lock_files_are_for_root_only_and_the_service_dir_is_not(tmp_path, session_umask):
    """The service (maybe another user) runs in the service dir; the lock and its record are root's."""
    sdir = tmp_path / "root" / "svc"
    script = f"umask {session_umask}\n" + holder_script(str(sdir), INFO)
    holder = Holder(script)
    try:
        holder.read_until(READY)
        modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
                 for p in (tmp_path / "root", sdir, sdir / ".lock", sdir / "lock.json")}
        assert modes == {"root": 0o755, "root/svc": 0o755, "root/svc/.lock": 0o600, "root/svc/lock.json": 0o600}
        assert holder.finish(f"touch {sdir}/finish-file\n{END}\n".encode())[0] == 0
        assert (sdir / "finish-file").stat().st_mode & 0o777 == 0o600   # what the finish script writes, too
    finally:
        if holder.proc.poll() is None:
            holder.kill()


def test_finish_script_runs_under_the_lock_only_when_it_arrived_whole(tmp_path, holders):
    sdir = tmp_path / "svc"
    probe = f"flock -n {sdir}/.lock true && echo free >> {tmp_path}/seen || echo held >> {tmp_path}/seen"
    whole = holders(sdir)
    whole.read_until(READY)
    rc, _ = whole.finish(f"{probe}\ninfo=clobbered\n{END}\n".encode())
    assert rc == 0 and (tmp_path / "seen").read_text() == "held\n"   # ran, while the lock was still held
    assert not (sdir / "lock.json").exists()                          # and could not clobber the holder's own state

    cut = holders(sdir)
    cut.read_until(READY)
    rc, _ = cut.finish(f"{probe}\n{END[:3]}".encode())               # the link dropped mid-send
    assert rc == 0 and (tmp_path / "seen").read_text() == "held\n"   # nothing of it ran
    assert not (sdir / "lock.json").exists()


def test_killed_holder_leaves_a_stale_lock(tmp_path, holders):
    sdir = tmp_path / "svc"
    victim = holders(sdir)
    victim.read_until(READY)
    victim.kill()                                                    # host rebooted / holder killed -9
    left = read_record(sdir)
    assert left["remote_pid"] == victim.pid
    st = status(sdir)
    assert st.state == "stale" and not st.held
    assert st.info == LockInfo(**{**INFO.__dict__, "remote_pid": victim.pid})

    other = LockInfo(user="bob", controller="desk", pid=2, since="now", command="kdeploy push all")
    taker = holders(sdir, other)
    out = taker.read_until(READY)
    assert parse_info(split_sections(out)["stale"]) == st.info       # reported, then taken over
    assert read_record(sdir) == {**other.__dict__, "remote_pid": taker.pid}
    assert taker.finish()[0] == 0
    assert not (sdir / "lock.json").exists()


def release(sdir: Path, force: bool, wait: float = 2.0) -> tuple[LockStatus, str | None]:
    """Run release_command as ``lock release [--force]`` does: (the status it ends with, why still held)."""
    st = status(sdir)
    out = subprocess.run(["sh", "-c", release_command(str(sdir), st, force, wait=wait)], capture_output=True,
                         text=True, timeout=SAFETY, check=True).stdout
    return parse_status(out), release_failure(out, st.info)


def test_release_command_clears_stale_record(tmp_path, holders):
    sdir = tmp_path / "svc"
    victim = holders(sdir)
    victim.read_until(READY)
    victim.kill()
    st = status(sdir)
    assert st.state == "stale"
    assert "kill" not in release_command(str(sdir), st, force=False)
    assert release(sdir, force=False) == (LockStatus(held=False, info=None), None)


def test_release_command_force_ends_live_holder(tmp_path, holders):
    sdir = tmp_path / "svc"
    live = holders(sdir)
    live.read_until(READY)
    st = status(sdir)
    assert st.state == "held"
    assert "kill" not in release_command(str(sdir), st, force=False)     # never without --force
    assert release(sdir, force=True) == (LockStatus(held=False, info=None), None)
    assert live.proc.wait(timeout=SAFETY) == -signal.SIGTERM
    assert not (sdir / "lock.json").exists()


def test_release_command_never_kills_a_pid_that_does_not_hold_the_lock(tmp_path, holders):
    """lock.json names a PID that was reused by an unrelated process: it is left alone, the lock stays held."""
    sdir = tmp_path / "svc"
    live = holders(sdir)
    live.read_until(READY)
    foreign = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = read_record(sdir)
        (sdir / "lock.json").write_text(json.dumps({**record, "remote_pid": foreign.pid}) + "\n")
        st, why = release(sdir, force=True)
        assert st.held and why == (f"the recorded holder (pid {foreign.pid} on the host) does not hold the lock "
                                   "(it ended, or its PID was reused): nothing was killed")
        assert foreign.poll() is None and live.proc.poll() is None     # neither was touched
        assert read_record(sdir)["remote_pid"] == foreign.pid           # nor the record
    finally:
        foreign.kill()
        foreign.wait()


def test_release_command_reports_a_lock_that_outlives_its_holder(tmp_path, holders):
    """A process the holder started keeps the flock'd descriptor and ignores SIGTERM: still held, said so."""
    sdir = tmp_path / "svc"
    live = holders(sdir, then="(trap '' TERM; exec sleep 60) &")
    live.read_until(READY)
    try:
        started = time.monotonic()
        st, why = release(sdir, force=True, wait=1.0)
        assert 1.0 <= time.monotonic() - started < SAFETY
        assert st.held and why == (f"ended the recorded holder (pid {live.pid} on the host), but the lock was "
                                   "still held 1s later")
        assert live.proc.wait(timeout=SAFETY) == -signal.SIGTERM    # the holder itself did end
    finally:
        os.killpg(live.pid, signal.SIGKILL)                          # the sleep, in the holder's process group


def test_command_with_shell_metacharacters_is_recorded_verbatim(tmp_path, holders):
    sdir = tmp_path / "svc"
    info = LockInfo(**{**INFO.__dict__, "command": TRICKY_COMMAND})
    holder = holders(sdir, info)
    holder.read_until(READY)
    record = read_record(sdir)
    assert record["command"] == TRICKY_COMMAND
    assert record["remote_pid"] == holder.pid
    assert holder.finish()[0] == 0
    assert not (sdir / "lock.json").exists()       # the exit check compared the recorded text exactly


def test_unwritable_service_dir_exits_70(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    proc = subprocess.run(["sh", "-c", holder_script(str(blocker / "svc"), INFO)], input=b"",
                          capture_output=True, timeout=SAFETY, check=False)
    assert proc.returncode == 70


# --- pure helpers --------------------------------------------------------------------------------------------


def test_split_sections():
    text = "junk before\n@@held\n{\"a\": 1}\n\n@@info\nline one\nline @@two\n@@ not a section\n@@empty\n"
    assert split_sections(text) == {"held": '{"a": 1}\n', "info": "line one\nline @@two\n@@ not a section",
                                    "empty": ""}


def test_parse_info():
    assert parse_info("") is None and parse_info(" \n") is None
    full = parse_info(json.dumps({**INFO.__dict__, "remote_pid": 9, "extra": "ignored"}))
    assert full == LockInfo(**{**INFO.__dict__, "remote_pid": 9})
    partial = parse_info('{"user": "u"}')
    assert partial.user == "u" and partial.pid is None
    for junk in ("{truncated", "[1, 2]", '"a string"'):
        info = parse_info(junk)
        assert info.user == "?" and info.command.startswith("unreadable lock.json: ")


def test_parse_status_shapes():
    assert parse_status("@@free\n@@info\n").state == "free"
    assert parse_status("@@held\n@@info\n").state == "held"
    assert parse_status('@@free\n@@info\n{"user": "u"}\n').state == "stale"


def test_holder_info(monkeypatch):
    monkeypatch.setenv("KDEPLOY_USER", "carol")
    monkeypatch.setattr("sys.argv", ["wrapper.py", "--vault-token", "s3cret"])
    info = holder_info("kdeploy verify all")
    assert (info.user, info.command, info.pid, info.remote_pid) == ("carol", "kdeploy verify all", os.getpid(), None)
    assert len(info.since) == 20 and info.since.endswith("Z")
    assert holder_info("x" * 500).command == "x" * 200
