"""kdeploy/core/state.py and kdeploy/core/provisional.py: the state read's parser on captured real output, and the one
decision push, plan and status make from it."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from kdeploy.core import provisional
from kdeploy.core.release import META, Payload, TarStream, release_id, release_meta, scan_payload, stage_script
from kdeploy.core.state import (
    Decision,
    HostState,
    ReleaseFiles,
    decide,
    files_script,
    parse_files,
    parse_gates,
    parse_state,
)
from kdeploy.core.step import split_sections
from tests.unit.test_release import T0, UNIT, V1, make_tree, remote_identity, run_script, snapshot, stage

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
    from kdeploy.flows.push import changed_since_staging as moved

    staged = "20991231T000000.000Z-abcdef12"
    before = dataclasses.replace(pending_state, releases=[*pending_state.releases, staged])
    assert moved(before, before, staged) == ""
    assert moved(before, dataclasses.replace(before, current="other"), staged).startswith("current moved from")
    assert moved(before, dataclasses.replace(before, pending=None), staged) == "the host's pending switch changed"
    assert moved(before, dataclasses.replace(before, unit_text="[Unit]\n"), staged).startswith("the installed unit")
    assert moved(before, pending_state, staged) == f"staged release {staged} was removed"  # pruned meanwhile
    assert moved(before, pending_state, None) == ""  # a restart alone stages nothing


# --- hand-made changes in the current release: read for real with sh, decided on, repaired by staging ----------


UNIT_TEXT = "[Unit]\nDescription=v1\n"  # what test_release's stage() records


def deployed(tmp_path: Path, base: HostState) -> tuple[Path, Payload, HostState]:
    """A service dir whose current release holds V1, the payload it came from, and ``base`` (captured) as the
    host's state, its release files not read yet."""
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", V1)
    first = stage(sdir, payload_root)
    assert first.proc.returncode == 0, first.proc.stderr.decode()
    (sdir / "current").symlink_to(f"releases/{first.release}")
    state = dataclasses.replace(base, pending=None, current=first.release, manifest=remote_identity(sdir) or {},
                                unit_text=UNIT_TEXT)
    return sdir, scan_payload(payload_root), state


def read_files(sdir: Path, state: HostState) -> HostState:
    """``state`` with the release files as ``files_script`` finds them on disk."""
    proc = run_script(files_script(shlex.quote(str(sdir))))
    assert proc.returncode == 0, proc.stderr.decode()
    return dataclasses.replace(state, files=parse_files(split_sections(proc.stdout.decode()), state.manifest))


def restage(sdir: Path, payload: Payload, state: HostState, decision: Decision) -> Path:
    """Stage what ``decision`` asks for, as push does; the new release's directory."""
    rid = release_id(payload.manifest, UNIT_TEXT, T0 + timedelta(minutes=1))
    meta = release_meta(payload.manifest, payload.modes, UNIT_TEXT, UNIT)
    proc = run_script(stage_script(str(sdir), rid, state.has_release, decision.delta),
                      b"".join(TarStream(payload, decision.delta.upload, meta)))
    assert proc.returncode == 0, proc.stderr.decode()
    return sdir / "releases" / rid


def test_a_release_as_staged_is_intact(tmp_path, pending_state):
    sdir, payload, state = deployed(tmp_path, pending_state)
    (sdir / "current/pkg/__pycache__").mkdir()  # what Python writes at run time is no hand edit
    (sdir / "current/pkg/__pycache__/x.pyc").write_bytes(b"bytecode")
    state = read_files(sdir, state)
    assert state.files == ReleaseFiles() and state.on_disk == state.manifest and state.has_release
    assert decide(payload.identity, UNIT_TEXT, state).no_op
    assert dataclasses.replace(state, files=None).on_disk == state.manifest  # not read: the manifest alone


def test_hand_edits_in_the_current_release_are_a_change_and_staging_repairs_them(tmp_path, pending_state):
    sdir, payload, state = deployed(tmp_path, pending_state)
    current = sdir / "current"
    old = snapshot(current.resolve())
    with (current / "pkg/changed.py").open("a") as fh:
        fh.write("# hotfix\n")
    (current / "pkg/sub/same.py").chmod(0o755)
    (current / "pkg/removed.py").unlink()
    (current / "pkg/extra.txt").write_text("stray\n")
    state = read_files(sdir, state)
    assert state.files == ReleaseFiles(edited=["pkg/changed.py", "pkg/sub/same.py"], missing=["pkg/removed.py"],
                                       extra=["pkg/extra.txt"])
    decision = decide(payload.identity, UNIT_TEXT, state)
    assert decision.stage and decision.restart and not decision.install_unit
    assert decision.reasons == ["release files edited on the host: pkg/changed.py, pkg/sub/same.py",
                                "release files missing on the host: pkg/removed.py",
                                "extra files in the release: pkg/extra.txt"]
    delta = decision.delta  # the damaged files travel again; the stray one is left out
    assert (delta.added, delta.changed, delta.removed) == (
        ["pkg/removed.py"], ["pkg/changed.py", "pkg/sub/same.py"], ["pkg/extra.txt"])

    rel = restage(sdir, payload, state, decision)
    repaired = snapshot(rel)
    assert {p: data for p, (data, _) in repaired.items() if not p.startswith(META)} == {
        p: (v.encode() if isinstance(v, str) else v) for p, v in V1.items()}
    assert repaired["pkg/changed.py"][1] != old["pkg/changed.py"][1]  # a new file, not a link to the edited one
    assert repaired["pkg/__init__.py"][1] == old["pkg/__init__.py"][1]  # the rest still shared
    assert (rel / "pkg/sub/same.py").stat().st_mode & 0o777 == 0o644
    (sdir / "current").unlink()
    (sdir / "current").symlink_to(f"releases/{rel.name}")
    fixed = read_files(sdir, dataclasses.replace(state, current=rel.name, manifest=remote_identity(sdir) or {}))
    assert fixed.files == ReleaseFiles() and decide(payload.identity, UNIT_TEXT, fixed).no_op


def test_a_deleted_current_release_is_staged_again_in_full(tmp_path, pending_state):
    sdir, payload, state = deployed(tmp_path, pending_state)
    shutil.rmtree(sdir / "releases" / state.current)
    state = read_files(sdir, dataclasses.replace(state, manifest={}))  # the manifest went with it
    assert state.files == ReleaseFiles(present=False) and not state.has_release and state.on_disk == {}
    decision = decide(payload.identity, UNIT_TEXT, state)
    assert decision.reasons == [f"current release directory releases/{state.current} is gone from the host"]
    assert decision.delta.added == sorted(payload.files) and decision.stage
    rel = restage(sdir, payload, state, decision)  # no `cp -al` from a directory that is not there
    assert (rel / "pkg/changed.py").read_text() == "old\n"


def test_a_host_never_deployed_has_no_release_files_to_repair(tmp_path, pending_state):
    fresh = dataclasses.replace(pending_state, current=None, manifest={}, unit_text=None, pending=None)
    fresh = read_files(tmp_path / "svc", fresh)
    assert fresh.files == ReleaseFiles(present=False) and not fresh.has_release
    assert decide({"a.py": "x 0644"}, UNIT_TEXT, fresh).reasons == [
        "never deployed", "payload differs from the inventory (+1 ~0 -0 =0)", "unit differs from the inventory"]
