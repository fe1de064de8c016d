"""kdeploy/core/policy.py and its one batch loop: the rollout policy push, set-env, set and rollback share."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.core.errors import InvalidInput
from kdeploy.core.policy import Policy, count, plan_batches
from kdeploy.core.report import HostResult, Report
from kdeploy.flows import fleet

REPO = Path(__file__).resolve().parents[2]
RESTARTING = ["push", "set-env", "set", "rollback"]


def test_batch_and_canary_plans() -> None:
    names = [f"h{i}" for i in range(1, 11)]
    assert plan_batches(names, 1, 4) == [["h1"], names[1:5], names[5:9], names[9:]]
    assert plan_batches(names, 0, 5) == [names[:5], names[5:]]
    assert Policy(canary=1, batch="1").batches(names[:3], 16) == [["h1"], ["h2"], ["h3"]]
    assert Policy(batch="50%").batches(names[:3], 16) == [names[:2], names[2:3]]
    assert Policy().batches(names, 4) == [names[:4], names[4:8], names[8:]]  # default: --parallel
    assert Policy(canary=1).routed().batches(names[:3], 16) == [["h1"], ["h2"], ["h3"]]  # behind a router: 1
    assert Policy(batch="50%").routed() == Policy(batch="50%")  # a --batch given is kept
    assert count("25%", 10, 3) == 3 and count("1%", 10, 3) == 1 and count(None, 10, 3) == 3
    assert count("2", 10, 3) == 2
    assert Policy(max_fail="0").failures_allowed(10) == 0 and Policy().failures_allowed(10) == 10


@pytest.mark.parametrize(("policy", "selected", "error"), [
    (Policy(canary=5), 2, "--canary 5: only 2 hosts selected"),
    (Policy(batch="3"), 2, "--batch 3: only 2 hosts selected"),
    (Policy(batch="0"), 2, "--batch 0: a batch restarts at least one host"),
    (Policy(batch="150%"), 2, "--batch '150%': expected a count N or a percentage N%"),
    (Policy(batch="x"), 0, "--batch 'x': expected"),
    (Policy(max_fail="-1"), 2, "--max-fail '-1': expected"),
    (Policy(max_fail="0%"), 2, "--max-fail '0%': expected"),
])
def test_a_policy_that_does_not_fit_is_refused_naming_its_option(policy: Policy, selected: int, error: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        policy.check(selected)
    assert str(caught.value).startswith(error)


@pytest.mark.parametrize("policy", [Policy(canary=2, batch="2", max_fail="5"), Policy(batch="100%", max_fail="0"),
                                    Policy(canary=5, batch="9")])
def test_a_policy_that_fits_passes(policy: Policy) -> None:
    policy.check(2 if policy.canary < 5 else 0)  # no host selected: nothing to fit (the command acts on none)


def _run(names: list[str], policy: Policy, failing: set[str]) -> tuple[list[list[str]], dict[str, HostResult]]:
    results = {n: HostResult(n) for n in names}
    turns: list[tuple[int, str]] = []

    def turn(name: str, batch: int) -> None:
        turns.append((batch, name))
        results[name].finish("rolled_back" if name in failing else "deployed")

    fleet.in_batches(names, results, policy, 16, threading.Event(), turn,
                     lambda name, why, result: results[name].finish(result, why))
    batches = [sorted(n for b, n in turns if b == i) for i in sorted({b for b, _ in turns})]
    return batches, results


def test_one_host_at_a_time_after_the_canary() -> None:
    batches, results = _run(["h1", "h2", "h3"], Policy(canary=1, batch="1"), set())
    assert batches == [["h1"], ["h2"], ["h3"]]
    assert {r.result for r in results.values()} == {"deployed"}


def test_a_failed_canary_skips_every_other_host() -> None:
    batches, results = _run(["h1", "h2", "h3"], Policy(canary=1), {"h1"})
    assert batches == [["h1"]]
    assert [(results[n].result, results[n].error) for n in ("h2", "h3")] == \
        [("skipped", "not restarted: the canary failed")] * 2


def test_max_fail_stops_new_batches() -> None:
    batches, results = _run([f"h{i}" for i in range(1, 7)], Policy(batch="2", max_fail="1"), {"h1", "h2"})
    assert batches == [["h1", "h2"]]
    assert results["h3"].error == "not restarted: max-fail exceeded (2 failed > 1)"


def _options_of(command: str) -> dict[str, tuple]:
    import typer.main

    group = typer.main.get_command(cli.app)
    params = group.commands[command].params  # type: ignore[attr-defined]
    return {p.opts[0]: (p.default, p.help, getattr(p, "min", None)) for p in params
            if p.opts and p.opts[0] in ("--canary", "--batch", "--max-fail")}


def test_every_restarting_command_takes_the_same_policy_options() -> None:
    options = {command: _options_of(command) for command in RESTARTING}
    assert set(options["push"]) == {"--canary", "--batch", "--max-fail"}
    assert all(found == options["push"] for found in options.values()), options


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example inventory (2 hosts) in a directory of its own: an edit must leave it as it was."""
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    text = (REPO / "inventory.yaml").read_text().replace("payload: kdtree", f"payload: {REPO / 'kernels/kdtree'}")
    (tmp_path / "inventory.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "inventory.yaml"


@pytest.mark.parametrize("command", [["push", "all"], ["rollback", "all"], ["set-env", "X=1"],
                                     ["set", "sglang.port=30001"]], ids=lambda c: c[0])
@pytest.mark.parametrize(("option", "error"), [
    (["--canary", "5"], "kdeploy: --canary 5: only 2 hosts selected"),
    (["--batch", "3"], "kdeploy: --batch 3: only 2 hosts selected"),
    (["--batch", "150%"], "kdeploy: --batch '150%': expected a count N or a percentage N% (1-100%)"),
    (["--max-fail", "many"], "kdeploy: --max-fail 'many': expected a count N or a percentage N% (1-100%)"),
])
def test_every_restarting_command_refuses_a_policy_that_does_not_fit_before_any_change(
        example: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        command: list[str], option: list[str], error: str) -> None:
    before = example.read_text()
    touched: list[str] = []
    monkeypatch.setattr(fleet, "rollout", lambda *a, **k: touched.append("rollout") or Report("push", []))
    monkeypatch.setattr(fleet, "open_routers", lambda *a, **k: touched.append("routers") or {})
    assert cli.main([*command, *option]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == error
    assert example.read_text() == before and touched == []
