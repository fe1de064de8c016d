"""kdeploy/state.py and kdeploy/provisional.py: the state read's parser on captured real output, and the one
decision push, plan and status make from it."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from kdeploy import provisional
from kdeploy.state import decide, parse_gates, parse_state

CAPTURED = Path(__file__).resolve().parents[2] / "tests/data/captured"
R1, R2, R3 = "20261201T014551Z-897fc894", "20261201T014553Z-9ef8ff74", "20261201T014555Z-a0affe1b"


@pytest.fixture(scope="module")
def pending_state():
    """A host left by a controller that switched to R3 and died before confirming (R2 confirmed)."""
    return parse_state((CAPTURED / "state_pending.txt").read_text())


def test_parses_a_switch_left_unconfirmed(pending_state):
    st = pending_state
    assert st.current == R3 and st.releases == [R1, R2, R3]
    assert st.pending is not None and (st.pending.previous, st.pending.target) == (R2, R3)
    assert st.confirmed == R2  # what a failed deploy returns to: not the unconfirmed current
    assert set(st.gates) == {R1, R2, R3} and st.gates[R2].workers == 8
    assert st.gates[R2].markers == ["[kdeploy-testplugin] loaded"]
    assert [r["result"] for r in st.history] == ["deployed", "deployed"]
    assert st.unit.running and st.unit_text is not None and st.unit_text.startswith("# Managed by kdeploy")


def test_an_unconfirmed_switch_is_never_unchanged(pending_state):
    st = pending_state
    decision = decide(st.manifest, st.unit_text, st)
    assert decision.restart and not decision.stage and not decision.no_op
    assert decision.reasons[0].startswith(f"switch to {R3} not confirmed; the host reverts to {R2}")


def test_decide_reasons_in_order(pending_state):
    st = dataclasses.replace(pending_state, pending=None)
    assert decide(st.manifest, st.unit_text, st).no_op
    changed = {**st.manifest, "new.py": "0" * 64}
    decision = decide(changed, st.unit_text + "# edited\n", st, force_restart=True)
    assert decision.stage and decision.install_unit
    assert decision.reasons == ["payload differs from the inventory (+1 ~0 -0 =4)", "unit differs from the inventory",
                                "--force-restart"]
    stopped = dataclasses.replace(st, unit=dataclasses.replace(st.unit, active="failed", sub="failed",
                                                              need_reload=True))
    decision = decide(st.manifest, st.unit_text, stopped)
    assert not decision.stage and decision.restart and decision.install_unit
    assert decision.reasons == ["unit file changed on disk but not reloaded", "service is failed/failed"]
    fresh = dataclasses.replace(st, current=None, manifest={}, unit_text=None)
    assert decide(st.manifest, st.unit_text, fresh).reasons[0] == "never deployed"


def test_previous_comes_from_history(pending_state):
    st = dataclasses.replace(pending_state, pending=None, current=R1, history=[
        {"result": "deployed", "release": R1}, {"result": "deployed", "release": R2},
        {"result": "deployed", "release": R3}, {"result": "restored", "release": R1}])
    assert st.previous() == R3  # what ran before `rollback --to R1`, though R1 is the oldest by name
    st = dataclasses.replace(st, history=[])
    assert st.previous() is None  # R1 is the oldest by name
    st = dataclasses.replace(st, current=R3)
    assert st.previous() == R2


def test_gate_records_that_do_not_parse_are_skipped():
    assert parse_gates("/x/releases/R/.kdeploy/gate.json:{not json\nnoise\n") == {}


def test_pending_line_round_trips():
    p = provisional.new_pending(None, R3, 60)
    assert provisional.parse_pending(p.line()) == p and p.previous is None and p.line().split()[1] == "-"
    assert provisional.parse_pending("") is None
    assert provisional.parse_pending("a b c notanumber") is None
    again = provisional.new_pending(R2, R2, 30, p.token)
    assert again.token == p.token


@pytest.mark.parametrize(("seconds", "wait"), [(1140, provisional.HOLDER_WAIT), (12, 12), (0, 1)])
def test_a_fired_revert_waits_for_the_lock_at_most_as_long_as_its_deadline_was(seconds, wait):
    p = provisional.Pending("tok", "R2", "R3", int(time.time()) + seconds + 1)
    argv = shlex.split(provisional.arm_script("/srv/kd/x", "x.service", "kdeploy-revert-x", p, "stop").splitlines()[-1])
    assert argv[-1] == str(wait) and argv[-2] == "-"
    assert f"--on-active={max(1, seconds)}" in argv or f"--on-active={max(1, seconds + 1)}" in argv


def test_arm_and_confirm_scripts_quote_and_name_the_unit():
    p = provisional.Pending("tok", "R2", "R3", 2_000_000_000)
    arm = provisional.arm_script("/srv/kd/x@y", "x@y.service", provisional.timer_unit("x@y"), p, "stop")
    assert "--unit=kdeploy-revert-x-at-y" in arm and "/srv/kd/x@y/.revert.sh" in arm
    assert "systemctl stop kdeploy-revert-x-at-y.timer kdeploy-revert-x-at-y.service" in arm
    confirm = provisional.confirm_command("/srv/kd/x", "kdeploy-revert-x", "tok")
    assert "CONFIRMED" in confirm and "LOST" in confirm and "rm -f /srv/kd/x/pending" in confirm


@pytest.mark.parametrize(("transient", "loaded", "stopped"), [
    (True, [], False),                                    # nothing armed: no systemctl at all
    (True, ["kdeploy-revert-x.timer"], True),             # armed
    (True, ["kdeploy-revert-x.service"], True),           # fired, waiting for the lock
    (False, [], True),                                    # no transient dir here: always stop
])
def test_the_revert_is_stopped_only_when_systemd_holds_it(tmp_path, transient, loaded, stopped):
    transient_dir = tmp_path / "transient"
    if transient:
        transient_dir.mkdir()
        for name in loaded:
            (transient_dir / name).write_text("[Unit]\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "systemctl.log"
    (bindir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bindir / "systemctl").chmod(0o755)
    script = provisional.confirm_command(str(tmp_path), "kdeploy-revert-x", "tok")
    script = script.replace(provisional.TRANSIENT_DIR, str(transient_dir))
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
    assert proc.stdout.strip() == "LOST"  # no pending file: the rest of the script still runs
    calls = log.read_text().splitlines() if log.exists() else []
    assert calls == (["stop kdeploy-revert-x.timer kdeploy-revert-x.service",
                      "reset-failed kdeploy-revert-x.timer kdeploy-revert-x.service"] if stopped else [])


def test_what_moved_between_the_stage_pass_and_the_batch(pending_state):
    """HostPush's resume check: a host staged in the first pass, then changed by someone else meanwhile."""
    from kdeploy.deploy import _moved

    staged = "20991231T000000.000Z-abcdef12"
    before = dataclasses.replace(pending_state, releases=[*pending_state.releases, staged])
    assert _moved(before, before, staged) == ""
    assert _moved(before, dataclasses.replace(before, current="other"), staged).startswith("current moved from")
    assert _moved(before, dataclasses.replace(before, pending=None), staged) == "the host's pending switch changed"
    assert _moved(before, dataclasses.replace(before, unit_text="[Unit]\n"), staged).startswith("the installed unit")
    assert _moved(before, pending_state, staged) == f"staged release {staged} was removed"  # pruned meanwhile
    assert _moved(before, pending_state, None) == ""  # a restart alone stages nothing
