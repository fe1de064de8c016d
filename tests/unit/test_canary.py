"""kdeploy/flows/canary.py's pure parts: --analysis parsing, settings, baseline, the one decision, the live view's rows,
and the batch loop's stop after the canary."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.core import analysis
from kdeploy.core.errors import ExitCode, InvalidInput
from kdeploy.core.inventory import load
from kdeploy.core.policy import Policy
from kdeploy.core.report import HostResult
from kdeploy.flows import canary, fleet
from tests.unit.test_inventory import BASE, write

ROUTED = BASE + """\
  ct202:
    address: 10.0.0.3
    service:
      name: svc-c
      sglang: {model_path: /models/a}
"""


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30s", 30), ("2m", 120), ("1h", 3600), ("500ms", 0.5),
                                               ("1.5m", 90), (" 7 s ", 7)])
def test_durations(text: str, seconds: float) -> None:
    assert canary.parse_duration(text) == seconds


@pytest.mark.parametrize(("text", "error"), [
    ("", "expected a duration such as 90, 30s, 5m or 1h"), ("5d", "expected a duration"),
    ("-3s", "expected a duration"),
    ("0", "expected more than 0 seconds and at most a week"), ("200h", "at most a week")])
def test_bad_durations_are_invalid_input_naming_the_option(text: str, error: str) -> None:
    with pytest.raises(InvalidInput, match=error) as caught:
        canary.parse_duration(text)
    assert str(caught.value).startswith(f"--analysis {text!r}: ")


def test_analysis_without_a_canary_is_refused_by_the_policy() -> None:
    with pytest.raises(InvalidInput, match="--analysis needs --canary N"):
        Policy(analysis=30).check(3)
    Policy(canary=1, analysis=30).check(3)


@pytest.mark.parametrize("argv", [["push", "all", "--analysis", "5s"],
                                  ["push", "all", "--canary", "1", "--analysis", "soon"],
                                  ["set-env", "A=1", "--analysis", "5s"],
                                  ["set", "hicache.ratio=2", "--analysis", "0"]])
def test_cli_refuses_a_bad_analysis_before_reading_the_inventory(argv: list[str], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([*argv, "--inventory", str(tmp_path / "absent.yaml")])
    err = capsys.readouterr().err
    assert code == ExitCode.INVALID and len(err.strip().splitlines()) == 1 and "--analysis" in err, err


def _inventory(tmp_path: Path, extra: str = "", router: bool = True):
    text = ROUTED
    if router:
        text = text.replace("defaults:\n", "defaults:\n  router:\n    url: http://10.0.0.9:30000\n", 1)
    return load(write(tmp_path, text.replace("      name: svc-a\n", "      name: svc-a\n" + extra, 1)))


def test_settings_come_from_the_command_line_over_the_inventory(tmp_path: Path) -> None:
    plain = _inventory(tmp_path)
    assert canary.settings(plain, list(plain.hosts), None) is None
    asked = canary.settings(plain, list(plain.hosts), 12)
    assert asked == canary.Settings(12, 5, analysis.Bounds(), required=True)
    gated = _inventory(tmp_path, "      gate: {analysis: {duration: 8, interval: 2, max_p99_ratio: 1.5}}\n")
    assert canary.settings(gated, list(gated.hosts), None) == canary.Settings(
        8, 2, analysis.Bounds(max_p99_ratio=1.5), required=False)
    assert canary.settings(gated, list(gated.hosts), 1).duration == 1
    assert canary.settings(gated, list(gated.hosts), 1).interval == 1  # never longer than the window


def test_the_baseline_is_the_rest_behind_the_canarys_router(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    assert canary.baseline_of(inv, ["ct200"], ["ct201", "ct202"]) == (["ct201", "ct202"], None)
    baseline, why = canary.baseline_of(inv, ["ct200", "ct201"], [])
    assert baseline == [] and why.startswith("no baseline: no host behind the canary's router is left")
    bare = _inventory(tmp_path, router=False)
    baseline, why = canary.baseline_of(bare, ["ct200"], ["ct201"])
    assert baseline == [] and why.startswith("ct200: no router in the inventory")


def test_a_required_analysis_that_the_inventory_rules_out_is_refused_before_any_change(tmp_path: Path) -> None:
    from kdeploy.core.errors import PreflightRefused
    from kdeploy.flows.options import Options

    bare = _inventory(tmp_path, router=False)
    names = list(bare.hosts)
    results = {n: HostResult(n) for n in names}
    with pytest.raises(PreflightRefused, match="canary analysis impossible: ct200: no router"):
        canary.Analysis.plan(bare, names, Options(policy=Policy(canary=1, analysis=5)), results, None,
                             threading.Event())
    gated = _inventory(tmp_path, "      gate: {analysis: {duration: 8}}\n", router=False)  # from the inventory
    planned = canary.Analysis.plan(gated, names, Options(policy=Policy(canary=1)), results, None, threading.Event())
    assert planned is not None and planned.not_analysed.startswith("ct200: no router")
    assert canary.Analysis.plan(gated, names, Options(), results, None, threading.Event()) is None  # no canary


def _verdict(ok: bool, decided: bool = True) -> analysis.Verdict:
    return analysis.Verdict(decided, ok, (), "p99_ttft_seconds: canary 0.4, baseline 0.2" if decided else
                            "too little traffic to judge")


@pytest.mark.parametrize(("verdict", "impossible", "required", "action"), [
    (_verdict(True), None, True, canary.Action.PROMOTE),
    (_verdict(True), None, False, canary.Action.PROMOTE),
    (_verdict(False), None, True, canary.Action.ROLL_BACK),
    (_verdict(False), None, False, canary.Action.ROLL_BACK),  # a verdict counts, whoever asked for it
    (_verdict(False, decided=False), None, True, canary.Action.ROLL_BACK),  # too little traffic: no pass
    (_verdict(False, decided=False), None, False, canary.Action.NOT_ANALYSED),
    (None, "metrics unavailable: h1: GET /metrics answered 404", True, canary.Action.ROLL_BACK),
    (None, "metrics unavailable: h1: GET /metrics answered 404", False, canary.Action.NOT_ANALYSED),
])
def test_the_one_decision(verdict, impossible, required, action) -> None:
    got, why = canary.decide(verdict, impossible, required)
    assert got == action
    if action == canary.Action.ROLL_BACK and (verdict is None or not verdict.decided):
        assert why.startswith("no verdict: ")
    assert (impossible or verdict.detail) in why


def test_live_view_rows_show_each_metric_against_its_bound() -> None:
    snap = canary.Snapshot(3.0, 10.0, {"requests": 40, "error_rate": 0.025, "p99_ttft_seconds": 0.398,
                                       "p99_itl_seconds": None, "tokens_per_second_per_request": 5.5,
                                       "spec_accept_length": None},
                           {"requests": 80, "error_rate": 0.0, "p99_ttft_seconds": 0.199, "p99_itl_seconds": None,
                            "tokens_per_second_per_request": 7.0, "spec_accept_length": None},
                           analysis.Bounds(), (("h1",), ("h2", "h3")))
    assert canary.view_rows(snap) == [
        ("requests", "40", "80", "-"), ("error rate", "2.500%", "0.000%", "<= 0.100%"),
        ("p99 TTFT", "0.398s", "0.199s", "canary/baseline <= 1.2"), ("p99 ITL", "-", "-", "canary/baseline <= 1.2"),
        ("tokens/s per request", "5.50", "7.00", "canary/baseline >= 0.8")]
    assert snap.point() == {"t": 3.0, "canary": snap.canary, "baseline": snap.baseline}
    view = canary.LiveView(lambda *event: None)
    assert view.render() is None
    view.window(snap)
    assert "7s left" in str(view.render().title)


def test_the_analysis_after_the_canary_stops_or_lets_the_rest_go() -> None:
    names = ["h1", "h2", "h3"]
    for why in ("not restarted: the canary analysis failed (p99_ttft_seconds: ...)", None):
        results = {n: HostResult(n) for n in names}
        turns: list[str] = []
        asked: list[tuple[list[str], list[str]]] = []

        def turn(name: str, batch: int, results=results, turns=turns) -> None:
            turns.append(name)
            results[name].finish("deployed")

        def after(canary_hosts: list[str], rest: list[str], why=why, asked=asked) -> str | None:
            asked.append((canary_hosts, rest))
            return why

        fleet.in_batches(names, results, Policy(canary=1, batch="1"), 16, threading.Event(), turn,
                         lambda name, w, r, results=results: results[name].finish(r, w), after_canary=after)
        assert asked == [(["h1"], ["h2", "h3"])]
        if why:
            assert turns == ["h1"]
            assert [(results[n].result, results[n].error) for n in ("h2", "h3")] == [("skipped", why)] * 2
        else:
            assert turns == names


def test_a_terminal_run_hands_the_rollout_a_live_view_and_keeps_stdout_for_json(monkeypatch,
                                                                               capsys: pytest.CaptureFixture[str]):
    from kdeploy.cli import progress
    from kdeploy.core.report import Report

    monkeypatch.setattr(progress, "plain_wanted", lambda env, tty: False)
    ui = cli.Ui(as_json=True)
    seen: list = []

    def rollout(listener) -> Report:
        seen.append(listener)
        listener("h1", "analysis", "start")
        listener.window(canary.Snapshot(1.0, 5.0, {"requests": 3}, {"requests": 9}, analysis.Bounds(),
                                        (("h1",), ("h2",))))
        return Report("push", [])

    ui.run(rollout)
    assert isinstance(seen[0], canary.AnalysisWatcher) and ui.live_state["h1"][0] == "analysis"
    assert seen[0].render() is not None
    assert capsys.readouterr().out == ""
