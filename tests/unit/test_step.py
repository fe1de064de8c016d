"""Remote steps read their command's output without a host: each parser is pure."""

from __future__ import annotations

from kdeploy.core import provisional, release, systemd
from kdeploy.core.release import Delta
from kdeploy.core.step import RunResult
from kdeploy.host import lock


def test_a_confirm_says_why_the_switch_was_not_kept() -> None:
    step = provisional.confirm_step("/srv/k/s", "kdeploy-revert-s", "tok")
    assert step.parse(RunResult(0, "CONFIRMED\n", "")) is None
    assert step.parse(RunResult(0, "LOST\n", "")) == "LOST"
    assert step.parse(RunResult(1, "", "sh: cannot open\n")) == "sh: cannot open"


def test_a_stage_reads_staged_or_the_failure() -> None:
    step = release.stage_step("/srv/k/s", "r1", True, Delta())
    assert step.timeout == 600 and step.fails is None
    assert step.parse(RunResult(0, "STAGED\n", "")) is None
    failure = step.parse(RunResult(1, "", "tar: x: No space left on device\nkdeploy-free: 40\n"
                                          "kdeploy-free: tmpfs tmpfs 1048576 1048564 12 100% /srv/k\n"
                                          "kdeploy-free: tmpfs 1000 13 987 2% /srv/k\n"))
    assert failure is not None and failure.disk_full and failure.room is not None and failure.room.free_bytes == 12


def test_an_activation_fails_with_its_target_named() -> None:
    step = release.activate_step("/srv/k/s", "r2", "s.service", False)
    assert step.fails == "switching to r2 failed"
    assert step.parse(RunResult(0, f"{systemd.OLD_RUN}abc123\nACTIVATED\n", "")) == "abc123"


def test_a_lock_release_reads_the_status_after_it() -> None:
    held = lock.parse_status("@@held\n@@info\n")
    status, why = lock.release_step("/srv/k/s", held, True).parse(RunResult(0, "@@free\n@@info\n", ""))
    assert status.state == "free" and why is None
