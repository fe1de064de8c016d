"""Remote steps read their command's output without a host: each parser is pure."""

from __future__ import annotations

import pytest

from kdeploy.core import provisional, release, systemd
from kdeploy.core.release import Delta
from kdeploy.core.report import PhaseFailed
from kdeploy.core.step import RunResult
from kdeploy.host import lock


def test_a_confirm_says_why_the_switch_was_not_kept() -> None:
    step = provisional.confirm_step("/srv/k/s", "kdeploy-revert-s", "tok")
    assert step.parse(RunResult(0, "CONFIRMED\n", "")) == (None, False)
    assert step.parse(RunResult(0, "LOST\n", "")) == ("LOST", False)
    assert step.parse(RunResult(1, "", "sh: cannot open\n")) == ("sh: cannot open", False)
    # with the history line: written only once kept, in the same command; RECORDED once it was
    step = provisional.confirm_step("/srv/k/s", "kdeploy-revert-s", "tok", then="echo line >> history.jsonl")
    kept = step.command.split("then rm -f", 1)[1]
    assert "echo line >> history.jsonl" in kept and kept.index("history.jsonl") < kept.index("else echo LOST")
    assert step.parse(RunResult(0, "RECORDED\nCONFIRMED\n", "")) == (None, True)
    assert step.parse(RunResult(0, "CONFIRMED\n", "sh: history.jsonl: No space left on device\n")) == (None, False)


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
    assert step.parse(RunResult(0, f"{systemd.OLD_RUN}abc123\nACTIVATED\n", "")) == "abc123"
    with pytest.raises(PhaseFailed, match=r"^switching to r2 failed: mv: boom$") as failed:
        step.parse(RunResult(1, "", "mv: boom\n"))
    assert not isinstance(failed.value, release.SwitchRefused)
    # failed before the switch (the revert could not be armed: a full disk): nothing changed on the host
    with pytest.raises(release.SwitchRefused, match=r"refused on the host, nothing changed: .*No space left"):
        step.parse(RunResult(release.NOT_SWITCHED_RC, "", "sh: 1: printf: No space left on device\n"))


def test_an_activation_exits_not_switched_only_before_current_moves() -> None:
    """Under `set -e`, an EXIT trap turns a failure before the armed revert into NOT_SWITCHED_RC; it is gone before
    the environment, the unit or `current` change."""
    lines = release.activate_script("/srv/k/s", "r2", "s.service", True, arm="printf x > /srv/k/s/pending").splitlines()
    trap, untrap = lines.index(f"trap 'exit {release.NOT_SWITCHED_RC}' EXIT"), lines.index("trap - EXIT")
    arm = next(i for i, line in enumerate(lines) if "pending" in line)
    moved = next(i for i, line in enumerate(lines) if line.startswith("mv -T") and "current" in line)
    unit = next(i for i, line in enumerate(lines) if line.startswith("cp "))
    assert trap < arm < untrap < unit < moved


def test_an_arming_ahead_moves_nothing_and_refuses_as_an_activation_does() -> None:
    """A server's nodes are armed before any moves: the arming alone is the activation's refusable start."""
    step = release.arm_step("/srv/k/s", "r2", "printf x > /srv/k/s/pending")
    lines = step.command.splitlines()
    assert lines[-1] == "trap - EXIT" and lines[1] == f"trap 'exit {release.NOT_SWITCHED_RC}' EXIT"
    assert not any("current" in line or "systemctl" in line for line in lines), lines
    assert step.parse(RunResult(0, "", "")) is None
    with pytest.raises(release.SwitchRefused, match=r"^switching to r2 was refused on the host, nothing changed"):
        step.parse(RunResult(release.NOT_SWITCHED_RC, "", "sh: 1: printf: No space left on device\n"))


def test_a_lock_release_reads_the_status_after_it() -> None:
    held = lock.parse_status("@@held\n@@info\n")
    status, why = lock.release_step("/srv/k/s", held, True).parse(RunResult(0, "@@free\n@@info\n", ""))
    assert status.state == "free" and why is None
