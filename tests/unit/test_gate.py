"""kdeploy/host/gate.py: the pure verdicts the health gate polls (unit state, golden completion, worker markers)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kdeploy.core.systemd import JournalLine, UnitState, parse_journal, parse_show
from kdeploy.host.gate import (
    RANK_LINE,
    MarkerVerdict,
    UnitVerdict,
    completion_verdict,
    config_verdict,
    exit_watch_command,
    marker_verdict,
    unit_verdict,
)

DEFRAG, VERIFY_OVERRIDE = "[kdtree] defrag Tier-0", "[kdtree] installed verify override"
CAPTURED = Path(__file__).resolve().parents[2] / "tests/data/captured"
INV = "f4ad513725a94ca5b4eca53a48276903"
RUNNING = UnitState(active="active", sub="running", result="success", n_restarts=0, invocation=INV, main_pid=4321,
                    main_status=0, active_since="Sun 2026-11-29 09:47:11 UTC", load="loaded", file_state="enabled")
MARKERS = [DEFRAG, VERIFY_OVERRIDE]


def st(**kw: object) -> UnitState:
    return dataclasses.replace(RUNNING, **kw)


def captured_state(name: str) -> UnitState:
    return parse_show((CAPTURED / name).read_text())


# --- unit_verdict ----------------------------------------------------------------------------------------------


def test_running_is_done_and_ok():
    assert unit_verdict(RUNNING, INV, 0) == UnitVerdict(True, False, "active/running pid 4321")
    assert unit_verdict(RUNNING, None, None) == UnitVerdict(True, False, "active/running pid 4321")
    real = captured_state("show_running.txt")
    verdict = unit_verdict(real, real.invocation, real.n_restarts)
    assert (verdict.done, verdict.failed) == (True, False)
    assert verdict.detail == f"active/running pid {real.main_pid}"


def test_failed_unit():
    real = captured_state("show_failed.txt")
    assert unit_verdict(real, real.invocation, 0) == UnitVerdict(
        True, True, "failed/failed result=exit-code (main process status 3)")
    limit = captured_state("show_restart_limit.txt")
    verdict = unit_verdict(limit, None, 0)
    assert verdict.done and verdict.failed and "restarts=3" in verdict.detail


def test_inactive_dead_fails():
    verdict = unit_verdict(st(active="inactive", sub="dead", main_pid=0), INV, 0)
    assert (verdict.done, verdict.failed) == (True, True)
    assert verdict.detail.startswith("inactive/dead")


def test_not_installed():
    assert unit_verdict(captured_state("show_not_found.txt"), None, None) == UnitVerdict(True, True,
                                                                                           "unit not installed")


def test_auto_restart_is_a_crash_loop():
    real = captured_state("show_auto_restart.txt")
    verdict = unit_verdict(real, real.invocation, real.n_restarts)   # even before NRestarts moves
    assert (verdict.done, verdict.failed) == (True, True)
    assert verdict.detail.startswith("crash loop: activating/auto-restart result=exit-code")


def test_rising_restart_count_is_a_crash_loop():
    verdict = unit_verdict(st(n_restarts=2), INV, 1)
    assert (verdict.done, verdict.failed) == (True, True)
    assert "crash loop" in verdict.detail and "restarts=2" in verdict.detail
    # the same count as when the gate began is fine; unknown baseline: not judged
    assert not unit_verdict(st(n_restarts=2), INV, 2).failed
    assert not unit_verdict(st(n_restarts=2), INV, None).failed


def test_new_invocation_is_a_crash_loop():
    verdict = unit_verdict(st(invocation="0" * 32), INV, 0)
    assert verdict == UnitVerdict(True, True, "crash loop: the service restarted by itself (new invocation)")
    assert not unit_verdict(st(invocation=""), INV, 0).failed        # not known yet: no verdict on it


@pytest.mark.parametrize(("active", "sub"), [("activating", "start"), ("activating", "start-pre"),
                                             ("deactivating", "stop-sigterm"), ("reloading", "reload")])
def test_transitional_states_wait(active, sub):
    assert unit_verdict(st(active=active, sub=sub), INV, 0) == UnitVerdict(False, False, f"{active}/{sub}")


# --- completion_verdict ---------------------------------------------------------------------------------------


def test_completion_match():
    assert completion_verdict([" Paris. It is", " Paris. It is"], r"\bParis\b") is None
    assert completion_verdict([" Paris"], r"\bParis\b") is None


def test_completion_mismatch():
    reason = completion_verdict([" Lyon.", " Lyon."], r"\bParis\b")
    assert reason == "answer ' Lyon.' does not match /\\bParis\\b/"
    assert completion_verdict(["Parisian"], r"\bParis\b") is not None


def test_completion_nondeterministic():
    assert completion_verdict([" Paris.", " Paris!"], r"\bParis\b") == (
        "temperature 0 is not deterministic: ' Paris.' then ' Paris!'")
    # a wrong first answer is reported as wrong, whatever the second says
    assert "does not match" in completion_verdict([" Lyon", " Paris"], r"\bParis\b")


# --- marker_verdict --------------------------------------------------------------------------------------------


def worker_lines(ranks: range | list[int], markers: list[str] = MARKERS, base_pid: int = 100) -> list[JournalLine]:
    """What N SGLang TP workers log: a rank line (`[time TPn] Load weight end.`), then each marker."""
    lines = []
    for rank in ranks:
        pid = base_pid + rank
        lines.append(JournalLine(pid, f"[2025-01-01 00:00:00 TP{rank}] {RANK_LINE} type=X, dtype=bf16"))
        lines += [JournalLine(pid, f"{m} pid={pid}") for m in markers]
    return lines


def test_markers_all_workers():
    assert marker_verdict(worker_lines(range(8)), MARKERS, 8) == MarkerVerdict(True, True, "2 markers x 8 workers")


def test_marker_missing_on_one_rank_names_rank_and_pid():
    lines = [line for line in worker_lines(range(8)) if not (line.pid == 105 and DEFRAG in line.message)]
    verdict = marker_verdict(lines, MARKERS, 8)
    assert verdict == MarkerVerdict(False, False, f"{DEFRAG!r} in 7/8 workers, missing TP5 (pid 105)")


def test_markers_missing_on_several_ranks():
    lines = [line for line in worker_lines(range(8)) if line.pid not in (102, 106) or RANK_LINE in line.message]
    verdict = marker_verdict(lines, MARKERS, 8)
    assert not verdict.ok and not verdict.final
    assert verdict.detail == "; ".join(f"{m!r} in 6/8 workers, missing TP2,6 (pid 102,106)" for m in MARKERS)


def test_marker_without_rank_lines_still_counts():
    lines = [line for line in worker_lines(range(8)) if RANK_LINE not in line.message and line.pid != 103]
    assert marker_verdict(lines, MARKERS, 8).detail.startswith(f"{DEFRAG!r} in 7/8 workers;")
    assert marker_verdict([], MARKERS, 8) == MarkerVerdict(
        False, False, f"{DEFRAG!r} in 0/8 workers; {VERIFY_OVERRIDE!r} in 0/8 workers")


def test_too_many_workers_is_final():
    lines = [*worker_lines(range(8)), JournalLine(999, f"{DEFRAG} pid=999")]
    verdict = marker_verdict(lines, MARKERS, 8)
    assert (verdict.ok, verdict.final) == (False, True)
    assert verdict.detail == f"{DEFRAG!r} in 9/8 workers"


def test_repeated_lines_of_one_pid_count_once():
    lines = worker_lines(range(8))
    doubled = lines + [line for line in lines if line.pid == 100]       # pid 100 logs everything twice
    assert marker_verdict(doubled, MARKERS, 8).ok
    # seven processes cannot make eight workers by repeating themselves
    seven = [line for line in lines if line.pid != 107]
    assert not marker_verdict(seven + seven, MARKERS, 8).ok


def test_markers_on_real_journal():
    """The captured journal of four 'workers' (child shells of a real unit, each its own _PID)."""
    lines = [line for line in parse_journal((CAPTURED / "journal_running_grep.jsonl").read_text())
             if "pid=" in line.message]
    assert marker_verdict(lines, MARKERS, 4) == MarkerVerdict(True, True, "2 markers x 4 workers")
    tp2 = next(line.pid for line in lines if line.rank == 2)
    without = [line for line in lines if not (line.pid == tp2 and VERIFY_OVERRIDE in line.message)]
    assert marker_verdict(without, MARKERS, 4) == MarkerVerdict(
        False, False, f"{VERIFY_OVERRIDE!r} in 3/4 workers, missing TP2 (pid {tp2})")
    assert marker_verdict(lines, MARKERS, 3).final                       # 4 seen where 3 expected


# --- exit_watch_command (run by a real sh; the process it watches is a local one) --------------------------------


def _gone(pid: int) -> bool:
    """Exited: a zombie, or reaped (its /proc entry gone, also between the open and the read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def test_exit_watch_ends_when_the_process_exits():
    target = subprocess.Popen(["sleep", "60"])
    watch = subprocess.Popen(["sh", "-c", exit_watch_command(target.pid, 60)])
    try:
        time.sleep(0.5)
        assert watch.poll() is None                  # still watching a live process
        target.kill()
        target.wait()
        watch.wait(timeout=5)                        # ...and ends once it is gone
    finally:
        target.kill()
        watch.kill()


def test_exit_watch_ends_after_its_time():
    watch = subprocess.Popen(["sh", "-c", exit_watch_command(os.getpid(), 0.3)])
    try:
        watch.wait(timeout=10)
    finally:
        watch.kill()


def test_exit_watch_ends_with_the_session_that_started_it():
    """Its parent stands for the sshd session: when the connection goes, the watcher goes too."""
    session = subprocess.Popen(["sh", "-c", f"sh -c '{exit_watch_command(os.getpid(), 60)}' & echo $!; wait"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        watcher = int(session.stdout.readline())
        time.sleep(0.3)
        _assert_ends_with_its_session(watcher, session)
    finally:
        os.killpg(session.pid, signal.SIGKILL)


def _assert_ends_with_its_session(watcher: int, session: subprocess.Popen) -> None:
    assert not _gone(watcher)
    session.send_signal(signal.SIGKILL)
    session.wait()
    deadline = time.monotonic() + 5
    while not _gone(watcher):
        assert time.monotonic() < deadline, "the watcher outlived its session"
        time.sleep(0.05)


@pytest.mark.parametrize("become", ["sudo", "doas"])
def test_exit_watch_under_become_ends_with_the_session_above_it(tmp_path, become):
    """With become the watcher's parent is sudo (doas), which lives as long as the watcher: it watches that
    one's parent (the sshd session) instead. A shell named ``sudo`` (``doas``) stands for it here."""
    shutil.copy("/bin/sh", tmp_path / become)
    (tmp_path / "watch").write_text(exit_watch_command(os.getpid(), 60))
    session = subprocess.Popen(["sh", "-c", f"{tmp_path}/{become} -c 'sh {tmp_path}/watch; true' & echo $!; wait"],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        sudo = int(session.stdout.readline())
        time.sleep(0.3)
        watcher = int(subprocess.run(["pgrep", "-P", str(sudo)], capture_output=True, text=True).stdout.split()[0])
        _assert_ends_with_its_session(watcher, session)
    finally:
        os.killpg(session.pid, signal.SIGKILL)


# --- config_verdict ------------------------------------------------------------------------------------------

CONFIG = "[kdtree] config"
WANT = {"verify": "on", "defrag": "1", "nsplit": "64"}


def config_lines(release: str, ranks: range, **overrides: str) -> list[JournalLine]:
    values = {**WANT, **overrides}
    return [JournalLine(1000 + r, f"{CONFIG} verify={values['verify']} defrag={values['defrag']} "
                                  f"nsplit={values['nsplit']} release={release} (rank={r} pid={1000 + r})")
            for r in ranks]


def test_config_verdict_passes_when_every_worker_runs_the_intended_config():
    assert config_verdict(config_lines("R2", range(8)), CONFIG, WANT, "R2") is None
    assert config_verdict(config_lines("R2", range(8)), CONFIG, WANT, None) is None  # release not checked


def test_config_verdict_names_workers_on_another_release_or_flags():
    lines = config_lines("R2", range(3)) + config_lines("R1", range(3, 4)) + config_lines("R2", range(4, 8),
                                                                                          defrag="0")
    reason = config_verdict(lines, CONFIG, WANT, "R2")
    assert reason == ("workers run another config: TP3 pid 1003: release=R1 (want R2); "
                      "TP4 pid 1004: defrag=0 (want 1); TP5 pid 1005: defrag=0 (want 1) (+2 more)")


def test_config_verdict_ignores_other_lines():
    lines = [JournalLine(5, "[kdtree] plugin loaded via plugin (rank=0 pid=5)"), JournalLine(6, RANK_LINE)]
    assert config_verdict(lines, CONFIG, WANT, "R2") is None
