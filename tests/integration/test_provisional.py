"""Provisional activation on sandbox hosts: a switch the controller never confirms is undone by the host.

The controller is killed (SIGKILL) during the gate, cut off by a blackholed link after the switch, or
stops right after switching without restarting: each time the host goes back to its last confirmed
release by itself at the deadline (``gate.revert_after``), restarts it, and says so in its history; a
later run sees the unconfirmed switch as a change, never as ``unchanged``.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kdeploy.core import provisional, state
from kdeploy.core.errors import Unreachable
from kdeploy.core.report import HostResult
from kdeploy.flows import fleet, push, session, switch
from kdeploy.flows.options import Options
from tests.conftest import Deployment

REVERT_AFTER = 12


def _wait_reverted(dep: Deployment, old: str, new: str, host: str = "h1", within: float = 150) -> dict:
    """Until the host's history says it reverted by itself; returns that record."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        records = [r for r in dep.history(host) if r.get("result") == "reverted"]
        if records:
            return records[-1]
        time.sleep(1)
    raise AssertionError(f"{host} never reverted: current {dep.current(host)}, history {dep.history(host)[-3:]}")


def _assert_back_on(dep: Deployment, old: str, new: str, record: dict, host: str = "h1") -> None:
    assert record["release"] == old and record["attempted"] == new, record
    assert "by itself" in record["error"]
    assert dep.current(host) == old
    assert dep.sh(host, f"cmp {dep.unit_path} {dep.service_dir}/releases/{old}/.kdeploy/unit.service && echo same") \
        .strip() == "same"
    deadline = time.monotonic() + 30
    while dep.show(host, "ActiveState") != "active" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert dep.show(host, "ActiveState") == "active"
    assert dep.sh(host, f"ls {dep.service_dir}/pending 2>&1", check=False).endswith("No such file or directory\n")
    timer = provisional.timer_unit(dep.service)
    assert dep.sh(host, f"systemctl list-units --all --no-legend '{timer}.timer'").strip() == ""


def _deployed(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> str:
    code, doc = dep.json(capsys, "push", "test")
    assert code == 0, doc
    return doc["hosts"][0]["release"]


def _gate(revert_after: float = REVERT_AFTER) -> dict:
    return {"workers": 8, "poll_interval": 0.25, "markers": ["[kdeploy-testplugin] loaded"], "timeout": 60,
            "revert_after": revert_after}


def _killed_during_the_gate(dep: Deployment, target: str = "test") -> str:
    """A push of ``target`` SIGKILLed once h1 restarted on the new release (a slow start keeps its gate
    waiting): that release, switched and never confirmed."""
    dep.set_service(env={"REFSERVER_SLOW_START": "30"})
    before = dep.show("h1", "InvocationID")
    dep.interrupt("push", target, when=lambda: dep.show("h1", "InvocationID") != before, what="h1's restart",
                  wait=60, sig=signal.SIGKILL)
    return dep.current()


@pytest.fixture
def quick(deployment: Deployment) -> Deployment:
    deployment.set_service(gate=_gate())
    return deployment


def test_controller_killed_during_the_gate_host_reverts_by_itself(quick: Deployment,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    old = _deployed(quick, capsys)
    new = _killed_during_the_gate(quick)
    assert new != old

    # Before the deadline the next run sees the truth: an unconfirmed switch is a change, not "unchanged".
    code, doc = quick.json(capsys, "plan", "test")
    plan = doc["hosts"][0]["plan"]
    assert code == 0 and plan["restart"], plan
    assert any("not confirmed" in r for r in plan["reasons"]), plan["reasons"]

    record = _wait_reverted(quick, old, new)
    _assert_back_on(quick, old, new, record)
    code, doc = quick.json(capsys, "history", "test")
    assert doc["hosts"][0]["history"][-1]["result"] == "reverted"


def test_a_revert_that_cannot_move_current_keeps_its_pending_and_tries_again(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Found reading revert.sh: a swap that failed (here the service's filesystem out of inodes at the deadline:
    no room for ``current``'s new link) still restarted the service and removed ``pending``, leaving the host on
    a release nobody confirmed with nothing to say so. The revert now tries again, ``pending`` kept, and goes
    back once there is room."""
    small = f"/srv/kdeploy-inodes-{deployment.service}"
    deployment.fleet.exec("h1", ["sh", "-c", f"mkdir -p {small} && "
                                             f"mount -t tmpfs -o size=256m,nr_inodes=4000 tmpfs {small}"])
    try:
        deployment.set_service(remote_root=small, gate=_gate())
        old = _deployed(deployment, capsys)
        new = _killed_during_the_gate(deployment)
        filler = f"{small}/.filler"
        deployment.sh("h1", f"mkdir {filler} && cd {filler} && seq 4000 | xargs touch 2>/dev/null; "
                            f"! touch {small}/.one-more 2>/dev/null")  # every inode taken
        revert = f"{provisional.timer_unit(deployment.service)}.service"
        deadline = time.monotonic() + REVERT_AFTER + 90
        while f"putting {old} back failed (try 2 of" not in deployment.sh(
                "h1", f"journalctl -q -o cat -u {revert}", check=False):
            assert time.monotonic() < deadline, deployment.sh("h1", f"journalctl -q -u {revert}", check=False)
            time.sleep(1)
        assert deployment.current() == new  # not moved, and not called reverted
        assert deployment.sh("h1", f"cat {deployment.service_dir}/pending").split()[2] == new
        assert not [r for r in deployment.history() if r.get("result") == "reverted"]
        deployment.sh("h1", f"rm -rf {filler}")
        record = _wait_reverted(deployment, old, new, within=30)
        _assert_back_on(deployment, old, new, record)
    finally:
        deployment.fleet.exec("h1", ["sh", "-c", f"systemctl stop {deployment.service}; umount {small}; "
                                                 f"rmdir {small}"], check=False)


def test_host_reset_before_the_confirm_boots_on_its_last_confirmed_release(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """A power cycle loses the transient revert timer: the boot guard puts the old release back before the
    service starts, long before the (here far) deadline."""
    deployment.set_service(gate=_gate(revert_after=900))
    old = _deployed(deployment, capsys)
    guard = provisional.guard_unit(f"{deployment.service}.service")
    assert deployment.sh("h1", f"systemctl is-enabled {guard}").strip() == "enabled"
    new = _killed_during_the_gate(deployment)
    assert new != old
    deployment.fleet.reboot("h1")

    record = _wait_reverted(deployment, old, new, within=60)
    assert "rebooted before the switch" in record["error"], record
    _assert_back_on(deployment, old, new, record)
    assert "REFSERVER_SLOW_START" not in deployment.show("h1", "Environment")
    assert deployment.kdeploy("verify", "test") == 0


@pytest.mark.hosts(2)
def test_host_blackholed_after_the_switch_is_back_on_its_old_release_after_heal(
        quick: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = quick.json(capsys, "push", "test")
    assert code == 0, doc
    old = {h["host"]: h["release"] for h in doc["hosts"]}
    (quick.payload / "rev.txt").write_text("2")

    def blackhole_h2_once_switched(host: str, phase: str, status: str) -> None:
        if (host, phase, status) == ("h2", "activate", "ok"):
            quick.fleet.blackhole("h2")

    try:
        report = fleet.push(quick.load(), "test", Options(), listener=blackhole_h2_once_switched)
        results = {h.host: h for h in report.hosts}
        assert results["h1"].result == "deployed"
        h2 = results["h2"]
        assert h2.result == "unreachable", (h2.error, h2.phases)
        assert "by itself" in (h2.error or ""), h2.error
        new = h2.attempted
    finally:
        quick.fleet.heal("h2")
    record = _wait_reverted(quick, old["h2"], new, "h2")
    _assert_back_on(quick, old["h2"], new, record, "h2")
    code, doc = quick.json(capsys, "verify", "test")
    assert code == 0, doc


def test_switched_but_never_gated_is_a_change_and_reverts(quick: Deployment,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """What a controller killed right after the switch leaves: current moved, the new release restarting,
    never gated nor confirmed."""
    old = _deployed(quick, capsys)
    invocation = quick.show("h1", "InvocationID")
    (quick.payload / "rev.txt").write_text("2")
    inv = quick.load()
    host = inv.hosts["h1"]
    local = fleet.prepare(inv, ["h1"])["h1"]
    result = HostResult("h1")
    step = push.HostPush(inv, host, local, Options(), result, threading.Event())
    step.prepare()
    assert step.at.staged and not result.done and step.remote is None, result  # staged, holding nothing
    pending = provisional.new_pending(step.state.confirmed, step.at.staged, REVERT_AFTER)
    staged = step.at
    with session.connect(inv, host, result, Options().reach) as remote:  # the controller then dies: no gate/confirm
        node = switch.Node(remote, host, result, pending, local.spec, local.spec)
        replaced = switch.switch(node, staged.staged, staged.decision.install_unit, pending)
    new = step.at.staged
    assert quick.current() == new and replaced == invocation
    deadline = time.monotonic() + 30
    while (switched := quick.show("h1", "InvocationID")) == invocation:  # the restart queued behind the stop
        assert time.monotonic() < deadline, "the activation queued no start"
        time.sleep(0.1)

    seen = state.parse_state(quick.sh("h1", state.state_script(host)))
    decision = state.decide(local.payload.identity, local.unit_text, seen)
    assert seen.pending and seen.pending.target == new and seen.confirmed == old
    assert decision.restart and not decision.no_op, decision

    record = _wait_reverted(quick, old, new)
    _assert_back_on(quick, old, new, record)
    assert quick.show("h1", "InvocationID") not in (invocation, switched)  # restarted on the old release


def test_a_switch_whose_pending_record_cannot_be_written_changes_nothing(quick: Deployment,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the fault campaign (a disk filled at the switch): the activation wrote `pending` as
    `printf > tmp && mv`, and `set -e` ignores a failure left of `&&`, so the switch went ahead with no way back
    and its confirm found nothing pending. Then, with that fixed, the failed activation was taken for a failed
    switch: its rollback failed the same way (exit 5, and the host left out of its router). Here `.pending.tmp`
    is a directory: the same write fails, and the host refuses the switch with nothing changed."""
    old = _deployed(quick, capsys)
    invocation = quick.show("h1", "InvocationID")
    quick.sh("h1", f"mkdir {quick.service_dir}/.pending.tmp")
    (quick.payload / "rev.txt").write_text("2")
    code, doc = quick.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 7 and host["result"] == "preflight_refused", host  # nothing switched: no rollback to fail
    assert "refused on the host, nothing changed" in host["error"] and "Is a directory" in host["error"], host
    assert host["release"] == old
    assert quick.current() == old and quick.show("h1", "InvocationID") == invocation
    assert quick.sh("h1", f"ls {quick.service_dir}/pending 2>&1", check=False).endswith("No such file or directory\n")
    quick.sh("h1", f"rmdir {quick.service_dir}/.pending.tmp")
    assert quick.kdeploy("push", "test") == 0
    assert quick.history()[-1]["gated"] == quick.current() != old


def _staged_and_locked(dep: Deployment) -> tuple[push.HostPush, HostResult]:
    """A push of a changed payload to h1 driven through its states by hand: staged, at its turn, locked."""
    (dep.payload / "rev.txt").write_text("2")
    inv = dep.load()
    result = HostResult("h1")
    step = push.HostPush(inv, inv.hosts["h1"], fleet.prepare(inv, ["h1"])["h1"], Options(), result,
                         threading.Event())
    step.prepare()
    assert step.resume()
    return step, result


def test_a_controller_gone_right_after_the_confirm_leaves_the_line_that_says_gated(
        quick: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the fault campaign (a host reset during the router's admit, right after its confirm): the history
    line was written only at the command's end, so the host ran a release its history never said had passed its
    gate. The confirm now writes it, in the same command. Here the push is driven through its states and the
    controller stops right after the switch is confirmed: no end of command."""
    old = _deployed(quick, capsys)
    lines = len(quick.history())
    step, result = _staged_and_locked(quick)
    outcome = switch.switch_and_gate([step.node()], verify=True)
    assert isinstance(outcome, switch.Confirmed) and result.result == "deployed"
    assert step.remote is not None
    step.remote.close()  # the controller is gone: its lock holder ends with the link, nothing more is written
    new = quick.current()
    assert new != old
    assert quick.history()[lines:] == [quick.history()[-1]]
    last = quick.history()[-1]
    assert (last["release"], last["result"], last["gated"], last["attempted"]) == (new, "deployed", new, new), last
    # a command that ends normally writes its line once
    (quick.payload / "rev.txt").write_text("3")
    lines = len(quick.history())
    assert quick.kdeploy("push", "test") == 0
    assert len(quick.history()) == lines + 1 and quick.history()[-1]["gated"] == quick.current()


def test_a_link_lost_on_the_way_back_is_a_lost_link_not_a_failed_rollback(quick: Deployment,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the fault campaign (a host reset during its gate, behind a router): the gate failed, the way back
    could not reach the host, and the push ended `rollback_failed` (a person needed) and left the host out of its
    router, while the host went back by itself at boot. `go_back` now lets a lost link through: the push
    reconnects, or leaves the host to its own revert. Here the controller's SSH session is ended from the host
    between the switch and the way back."""
    old = _deployed(quick, capsys)
    step, result = _staged_and_locked(quick)
    node = step.node()
    switch.switch(node, node.pending.target, True, node.pending)
    quick.sh("h1", "pkill -KILL -f '^sshd: root' || true")  # every session of the controller's, not the daemon
    with pytest.raises(Unreachable):
        switch.go_back([node], "gate failed")
    assert not result.done, result  # not rollback_failed: undecided, for the caller's reconnect
    step.reconnect_and_go_back(Unreachable("h1: connection lost"))
    assert result.result in ("rolled_back", "unreachable"), result
    record = _wait_reverted(quick, old, node.pending.target) if result.result == "unreachable" else None
    assert quick.current() == old, record


def test_gate_failure_rolls_back_with_the_old_release_config(quick: Deployment,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The new config moves the port and the worker count; the rollback is gated as the old release was."""
    old = _deployed(quick, capsys)
    service = quick.load().hosts["h1"].service
    quick.set_service(env={"REFSERVER_WRONG_ANSWER": "1"},
                      sglang={**service.sglang.model_dump(exclude_none=True), "port": quick.port + 500, "tp": 4},
                      gate={**_gate(), "workers": 4})
    code, doc = quick.json(capsys, "push", "test", "--workers", "4")
    host = doc["hosts"][0]
    assert code == 4 and host["result"] == "rolled_back", host
    names = [p["name"] for p in host["phases"]]
    assert names[names.index("rollback"):] == [
        "rollback", "rollback activate", "rollback restart", "rollback unit", "rollback ready", "rollback completion",
        "rollback parity", "rollback workers", "rollback confirm"], names
    workers = next(p for p in host["phases"] if p["name"] == "rollback workers")
    assert workers["ok"] and workers["detail"].startswith("1 markers x 8 workers"), workers
    assert host["release"] == old == quick.current()
    assert quick.sh("h1", f"ls {quick.service_dir}/pending 2>&1", check=False).endswith("No such file or directory\n")


def test_link_lost_after_the_switch_reconnects_relocks_and_rolls_back(quick: Deployment,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The controller's link dies during the gate (blackholed long enough for TCP to give up), then heals
    before the host's deadline: kdeploy reconnects, ends its own orphaned lock holder, takes the lock and
    rolls back; the host ends on its old release, healthy."""
    old = _deployed(quick, capsys)
    quick.set_service(env={"REFSERVER_SLOW_START": "60"}, gate=_gate(revert_after=90))
    marks: dict[str, float] = {}

    def blackhole_once_restarted_heal_at_the_reconnect(host: str, phase: str, status: str) -> None:
        if (phase, status) == ("restart", "ok") and "cut" not in marks:
            quick.fleet.blackhole("h1")
            marks["cut"] = time.monotonic()
        elif (phase, status) == ("connect", "start") and "cut" in marks and "healed" not in marks:
            quick.fleet.heal("h1")  # the controller declared the link dead and reconnects
            marks["healed"] = time.monotonic()

    try:
        report = fleet.push(quick.load(), "test", Options(), listener=blackhole_once_restarted_heal_at_the_reconnect)
    finally:
        quick.fleet.heal("h1")
    # dead by the 30 s TCP user timeout (keepalive 10 s x 3), not by anything sooner
    assert marks["healed"] - marks["cut"] >= 25, marks
    host = report.hosts[0]
    assert host.result == "rolled_back", (host.error, [(p.name, p.detail) for p in host.phases])
    assert host.release == old == quick.current()
    assert any(p.name == "relock" and p.ok for p in host.phases), host.phases
    assert any(p.name == "rollback" and p.ok for p in host.phases), host.phases
    deadline = time.monotonic() + 30
    while quick.show("h1", "ActiveState") != "active" and time.monotonic() < deadline:
        time.sleep(0.25)
    assert quick.show("h1", "ActiveState") == "active"
    assert quick.sh("h1", f"ls {quick.service_dir}/pending 2>&1", check=False).endswith("No such file or directory\n")
    assert not quick.sh("h1", f"cat {quick.service_dir}/lock.json 2>/dev/null", check=False).strip()


def test_pruning_keeps_the_release_that_ran_before_the_push(quick: Deployment,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    quick.set_service(keep_releases=2)
    first = _deployed(quick, capsys)
    (quick.payload / "rev.txt").write_text("2")
    _deployed(quick, capsys)
    assert quick.kdeploy("rollback", "test", "--to", first) == 0
    (quick.payload / "rev.txt").write_text("3")
    third = _deployed(quick, capsys)
    releases = quick.sh("h1", f"ls {quick.service_dir}/releases").split()
    assert first in releases and third in releases, releases  # first ran just before: a rollback's target
    code, doc = quick.json(capsys, "rollback", "test")
    assert code == 0 and doc["hosts"][0]["release"] == first, doc
