"""The fault campaign's pure parts (docs/chaos.md): draws replay from (seed, iteration), moments come from the
head's phase starts, and the invariant checks catch what they must."""

from __future__ import annotations

import json

from kdeploy_lab.chaos import invariants as inv
from kdeploy_lab.chaos import plan, report
from kdeploy_lab.chaos.controller import _END, _START

SERVERS = {"h1": ("h1",), "h2": ("h2",), "h3": ("h3",), "s4": ("h4", "h5")}


def test_an_iteration_is_drawn_from_its_seed_and_index_alone():
    assert plan.draw(7, 12, SERVERS) == plan.draw(7, 12, SERVERS)
    assert plan.draw(7, 12, SERVERS) != plan.draw(8, 12, SERVERS)
    draws = [plan.draw(1, i, SERVERS) for i in range(600)]
    assert {d.command for d in draws} == set(plan.COMMANDS)
    assert {d.fault for d in draws} == set(plan.FAULTS)
    for d in draws:
        assert d.fault not in plan.RELEASE_FAULTS or d.command in plan.NEW_RELEASE, d
        assert d.aim not in plan.SWITCHING or d.command in (*plan.NEW_RELEASE, "rollback"), d  # noop never switches
        assert d.host in d.nodes and d.nodes == SERVERS[d.server]
        assert 0 <= d.at < 1 and 1 <= d.hold <= 12
    assert json.loads(json.dumps(draws[0].as_json()))["nodes"] == list(draws[0].nodes)


def test_each_cycle_deals_every_firing_fault_at_every_aim():
    """Independent draws left cells of the fault x moment table empty by chance; each cycle of the deck hits them
    all, in an order of its own, and iteration i still needs only (seed, i)."""
    n = len(plan.DECK)
    for cycle in (0, 1):
        dealt = [(d.fault, d.aim) for d in (plan.draw(3, cycle * n + i, SERVERS) for i in range(n))]
        assert sorted(dealt) == sorted(plan.DECK)
        assert {(f, a) for f in plan.FIRING for a in ("anywhere", *plan.AIMED)} <= set(dealt)
    first, second = ([(d.fault, d.aim) for d in (plan.draw(3, c * n + i, SERVERS) for i in range(n))] for c in (0, 1))
    assert first != second


def test_an_aimed_fault_waits_for_its_moment_on_the_head():
    from kdeploy_lab.chaos.campaign import Campaign

    starts = [(0.1, "connect"), (0.2, "preflight"), (2.0, "drain"), (2.4, "restart"), (3.0, "workers"),
              (4.0, "confirm"), (4.03, "admit")]
    assert plan.anchor(starts, "confirm") == 4.0 and plan.anchor(starts, "gate") == 3.0
    assert plan.anchor(starts, "before-lock") == 0.0  # the run's start
    assert plan.anchor(starts[:5], "confirm") is None  # not yet: keep waiting
    campaign = Campaign(None, None)  # type: ignore[arg-type]  # its aims read only what it measured
    it = plan.Iteration(1, 0, "push", "reset", "h1", ("h1",), "h1", "confirm", 0.5, 1.0, 0)
    assert campaign.aim(it) == ("confirm", 0.0)  # nothing measured yet: at the moment's start
    campaign.windows[("push", "h1")] = plan.windows(starts, 4.5)
    assert campaign.aim(it) == ("confirm", 0.015)  # half of the confirm's 30 ms
    campaign.durations["push"] = [8.0]
    assert campaign.aim(plan.Iteration(1, 0, "push", "reset", "h1", ("h1",), "h1", "anywhere", 0.5, 1.0, 0)) \
        == (None, 4.0)


def test_the_moment_is_the_phase_the_head_had_started_last():
    starts = [(0.1, "connect"), (0.2, "preflight"), (0.5, "stage"), (2.0, "drain"), (2.4, "restart"),
              (3.0, "workers"), (4.0, "confirm"), (4.1, "admit")]
    assert plan.moment(starts, 0.05, None) == "before-lock"
    assert plan.moment(starts, 1.0, None) == "staging"
    assert plan.moment(starts, 2.1, None) == "switch"
    assert plan.moment(starts, 2.5, None) == "restart"
    assert plan.moment(starts, 3.5, None) == "gate"
    assert plan.moment(starts, 4.05, None) == "confirm"
    assert plan.moment(starts, 4.2, None) == "router-readmit"
    assert plan.moment(starts, 4.2, 4.15) == "after"
    assert plan.moment([(0.1, "newphase")], 1.0, None) == "newphase"  # unknown: named, not guessed
    assert plan.moment([*starts[:3], (1.9, "arm")], 1.95, None) == "switch"  # a server's nodes arm first
    way_back = [*starts[:6], (3.8, "rollback"), (3.9, "rollback activate"), (4.5, "rollback workers")]
    assert plan.moment(way_back, 4.0, None) == plan.moment(way_back, 4.6, None) == "rollback"
    assert plan.anchor(way_back, "confirm") is None  # a gate that failed never reaches its confirm


def test_phase_lines_are_read_with_or_without_the_server_suffix():
    m = _START.match("07:46:33 h4 (s4 head) stage start")
    assert m and m.group(1, 2) == ("h4", "stage")
    m = _START.match("07:46:33 h1 rollback activate start")
    assert m and m.group(1, 2) == ("h1", "rollback activate")
    assert not _START.match("07:46:33 h5 preflight ok 0.1s lock taken; start")
    assert not _START.match("07:46:33 h5 stage ok 0.0s nothing changed")
    m = _END.match("07:46:34 h5 (s4 node 1) rollback confirm ok 0.0s kept")
    assert m and m.group(1, 2) == ("h5", "rollback confirm")
    assert not _END.match("07:46:34 h5 done deployed")


def _out(**over: str) -> str:
    fields = {"current": "releases/R2", "current_mtime": "1000.0", "pending": "", "staging": "", "lock": "free",
              "state": "active", "reload": "no", "started": "1001.5", "timers": "", "unit_same": "yes",
              "env": 'Environment="A=1"', **over}
    history = [{"release": "R1", "result": "deployed", "payload_hash": "p1"},
               {"release": "R2", "result": "deployed", "payload_hash": "p2"}]
    return "".join(f"{k}={v}\n" for k, v in fields.items()) + "history_begin\n" + "".join(
        json.dumps(r) + "\n" for r in history)


def test_a_settled_healthy_host_has_no_violation():
    facts = inv.parse_host("h1", _out())
    assert facts.current == "R2" and inv.settled(facts)
    assert inv.host_violations(facts) == []


def test_each_host_invariant_is_caught():
    def found(**over: str) -> list[str]:
        return inv.host_violations(inv.parse_host("h1", _out(**over)))

    assert "started before `current` moved" in found(started="990.0")[0]
    assert "never passed a gate" in found(current="releases/R3")[0]
    assert "not release R2's" in found(unit_same="")[0]
    assert "daemon-reload" in found(reload="yes")[0]
    assert "lock is held" in found(lock="held")[0]
    assert "still pending" in found(pending="yes")[0]
    assert "timers still armed" in found(timers="kdeploy-revert-x.timer")[0]
    assert "service failed" in found(state="failed")[0]
    assert inv.host_violations(inv.parse_host("h1", "current=\nhistory_begin\n")) == ["h1: no current release"]
    assert not inv.settled(inv.parse_host("h1", _out(state="activating")))


def test_a_server_whose_nodes_run_different_releases_is_caught():
    head = inv.parse_host("h4", _out())
    same = inv.parse_host("h5", _out(current="releases/R2"))
    older = inv.parse_host("h5", _out(current="releases/R1"))
    other_env = inv.parse_host("h5", _out(env='Environment="A=2"'))
    assert inv.server_violations("s4", [head, same]) == []
    assert "different releases" in inv.server_violations("s4", [head, older])[0]
    assert inv.server_violations("s4", [head, other_env])
    assert inv.server_violations("h1", [head]) == []


def test_router_and_staging_checks():
    assert inv.router_violations({"a", "b"}, {"a", "b"}) == []
    assert inv.router_violations({"a"}, {"a", "b"}) == ["router: serving but not listed: b"]
    assert inv.router_violations({"a", "c"}, {"a"}) == ["router: listed but not serving: c"]
    left = inv.parse_host("h1", _out(staging=".staging-R3"))
    assert inv.staging_violations([left]) == ["h1: staging left behind: .staging-R3"]


def test_the_report_counts_every_fault_at_every_moment(tmp_path):
    outcomes = [{"iteration": i, "command": "push", "fault": f, "moment": m, "violations": v, "requests": 10,
                 "lost": 1 if f == "reset" else 0, "lost_apart": 1 if f == "reset" else 0, "refused": 0}
                for i, (f, m, v) in enumerate([("reset", "gate", []), ("reset", "gate", ["x"]),
                                               ("sigkill", "switch", [])])]
    doc = report.document(3, outcomes, planned=3, seconds=1.0, budget=None, machine="m", fleet={}, estimates={})
    assert doc["table"] == {"reset": {"gate": {"iterations": 2, "violations": 1}},
                            "sigkill": {"switch": {"iterations": 1, "violations": 0}}}
    assert [v["iteration"] for v in doc["violations"]] == [1]
    assert doc["traffic"] == {"requests": 30, "refused": 0, "lost_apart": 2, "lost_other": 0}
    case = report.save_case(tmp_path, 3, outcomes[1], {"h1": "journal"})
    assert json.loads(case.read_text())["iteration"] == 1
    assert (case.parent / "journals" / "h1.log").read_text() == "journal"


def test_each_moment_s_window_runs_from_its_first_phase_to_the_next_moment():
    starts = [(0.1, "connect"), (0.2, "preflight"), (0.5, "stage"), (2.0, "drain"), (2.1, "stop"), (2.4, "restart"),
              (3.0, "workers"), (3.2, "ready"), (4.0, "confirm"), (4.03, "admit")]
    w = plan.windows(starts, 4.5)
    assert w["before-lock"] == (0.1, 0.2) and w["staging"] == (0.2, 2.0) and w["switch"] == (2.0, 2.4)
    assert w["gate"] == (3.0, 4.0) and w["confirm"] == (4.0, 4.03) and w["router-readmit"] == (4.03, 4.5)


def test_a_release_fault_hits_where_kdeploy_caught_it():
    from kdeploy_lab.chaos.campaign import release_moment

    assert release_moment("crash-loop", "unit") == "restart"
    assert release_moment("perturbed-output", "completion") == "gate"
    assert release_moment("crash-at-start", "rollback ready") == "gate"
    assert release_moment("ignore-sigterm", None) == "restart"  # passes its gate; hits at the next stop
    assert release_moment("perturbed-output", None) == "gate"


def test_exit_1_alone_is_not_an_internal_error():
    """A host its router did not take back ends `failed`, exit 1; only a traceback or kdeploy's line is a crash
    (the first committed campaign took the first for the second)."""
    from kdeploy_lab.chaos.controller import Controller

    def run(out: str, err: list[str]) -> Controller:
        return Controller(["push"], None, 0.0, stderr=err, out=out)  # type: ignore[arg-type]

    router_out = json.dumps({"hosts": [{"host": "h4", "result": "failed", "error": "left OUT of the router"}]})
    assert not run(router_out, ["h4 | OUT of its router: `kdeploy router admit h4` puts it back"]).crashed()
    assert run(json.dumps({"hosts": [{"host": "h1", "traceback": "Traceback ..."}]}), []).crashed()
    assert run("", ["kdeploy: internal error: NameError: x (rerun with --debug for the trace)"]).crashed()
    assert not run("", ["kdeploy: ssh h1: echo internal error -> exit 0 in 0.01s"]).crashed()


def test_a_host_s_part_ends_with_its_last_phase_not_with_its_result():
    """Its `done` line comes at the confirm, before the router's admit: a fault in the admit is `router-readmit`;
    one after the admit ended, while other servers roll, is `after` (the first committed run folded both)."""
    from kdeploy_lab.chaos.controller import Controller

    run = Controller(["push"], None, 0.0)  # type: ignore[arg-type]
    run.starts["h1"] = [(1.0, "confirm"), (1.2, "admit")]
    run.ends["h1"] = [(1.1, "confirm"), (1.5, "admit")]
    run.ended = 9.0
    assert run.ended_for("h1") == 1.5
    assert plan.moment(run.starts["h1"], 1.3, run.ended_for("h1")) == "router-readmit"
    assert plan.moment(run.starts["h1"], 1.05, run.ended_for("h1")) == "confirm"
    assert plan.moment(run.starts["h1"], 4.0, run.ended_for("h1")) == "after"
    run.ends["h1"] = [(1.1, "confirm")]  # the admit still running when the process was killed
    assert run.ended_for("h1") == 9.0
