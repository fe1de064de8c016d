"""kdeploy/core/report.py and kdeploy/core/errors.py: exit codes, their severity order, and the --json shape."""

from __future__ import annotations

import itertools
import json

import pytest

from kdeploy.core.errors import (
    ExitCode,
    InvalidInput,
    KdeployError,
    LockHeld,
    PreflightRefused,
    Unreachable,
    most_severe,
)
from kdeploy.core.report import Cancelled, HostResult, Phase, PhaseFailed, Report, Result
from kdeploy.flows.views import LockView, Plan
from kdeploy.host.lock import LockInfo
from kdeploy_lab.sandbox import SandboxError

# most severe first; INVALID (2) is outside the order: it wins outright
SEVERITY = [5, 4, 3, 8, 7, 6, 1, 0]


# --- errors ----------------------------------------------------------------------------------------------------


def test_exit_code_values():
    assert {c.name: int(c) for c in ExitCode} == {"OK": 0, "INTERNAL": 1, "INVALID": 2, "UNREACHABLE": 3,
                                                   "ROLLED_BACK": 4, "ROLLBACK_FAILED": 5, "LOCKED": 6,
                                                   "PREFLIGHT": 7, "COMMAND_FAILED": 8, "INTERRUPTED": 130}


@pytest.mark.parametrize(("higher", "lower"), list(itertools.combinations(SEVERITY, 2)))
def test_most_severe_pairwise(higher, lower):
    assert most_severe([lower, higher]) == higher
    assert most_severe([higher, lower]) == higher


def test_most_severe_lists():
    assert most_severe([0, 6, 7, 3, 4, 5, 0]) == ExitCode.ROLLBACK_FAILED
    assert most_severe([0, 6, 7, 3, 4]) == ExitCode.ROLLED_BACK
    assert most_severe([6, 7, 3, 0]) == ExitCode.UNREACHABLE
    assert most_severe([6, 0, 7]) == ExitCode.PREFLIGHT
    assert most_severe([0, 6, 0]) == ExitCode.LOCKED
    assert most_severe([0, 0]) == ExitCode.OK
    assert most_severe([]) == ExitCode.OK
    assert isinstance(most_severe([4]), ExitCode)


@pytest.mark.parametrize("others", [[0], [5], [5, 4, 3, 7, 6, 1]])
def test_invalid_wins_outright(others):
    assert most_severe([*others, 2]) == ExitCode.INVALID
    assert most_severe([2, *others]) == ExitCode.INVALID


def test_most_severe_rejects_unknown_codes():
    with pytest.raises(ValueError):
        most_severe([0, 9])


@pytest.mark.parametrize(("cls", "code"), [(KdeployError, 1), (InvalidInput, 2), (Unreachable, 3), (LockHeld, 6),
                                           (PreflightRefused, 7), (SandboxError, 2)])
def test_error_classes_carry_their_exit_code(cls, code):
    exc = cls("one line")
    assert exc.exit_code == code and str(exc) == "one line"
    assert cls("x", ExitCode.ROLLED_BACK).exit_code == ExitCode.ROLLED_BACK   # overridable per instance
    assert cls.exit_code == code                                               # ...without touching the class


# --- HostResult -------------------------------------------------------------------------------------------------


def test_phase_ok_records_time_and_events():
    events = []
    result = HostResult("h1", listener=lambda host, phase, status: events.append((host, phase, status)))
    with result.phase("stage") as phase:
        phase.detail = "3 files"
    assert result.phases == [Phase("stage", True, result.phases[0].seconds, "3 files")]
    assert result.phases[0].seconds >= 0
    assert events == [("h1", "stage", "start"), ("h1", "stage", "ok")]
    result.finish("deployed")
    assert events[-1] == ("h1", "done", "deployed")
    assert (result.ok, result.exit_code, result.failed_phase()) == (True, 0, None)


def test_phase_failed_marks_phase_and_propagates():
    result = HostResult("h1")
    with pytest.raises(PhaseFailed), result.phase("unit"):
        raise PhaseFailed("failed/failed result=exit-code", ["last journal line"])
    assert result.phases[0].ok is False
    assert result.phases[0].detail == "failed/failed result=exit-code"
    assert result.log == ["last journal line"]
    assert result.failed_phase().name == "unit"
    with pytest.raises(Unreachable), result.phase("connect"):
        raise Unreachable("h1: no route to host")
    assert (result.phases[1].ok, result.phases[1].detail) == (False, "h1: no route to host")


@pytest.mark.parametrize(("result", "code"), [
    ("deployed", 0), ("unchanged", 0), ("healthy", 0), ("planned", 0), ("restored", 0), ("ok", 0), ("skipped", 0),
    ("rolled_back", 4), ("unhealthy", 4), ("rollback_failed", 5), ("unreachable", 3), ("locked", 6),
    ("preflight_refused", 7), ("incompatible", 7), ("failed", 1), ("invalid", 2), ("interrupted", 130)])
def test_finish_maps_result_to_exit_code(result, code):
    host = HostResult("h").finish(result, error="why" if code else None)
    assert (host.result, host.exit_code, host.ok) == (result, code, code == 0)
    assert json.loads(json.dumps(host.as_json()))["result"] == result


def test_every_result_is_documented_with_its_exit_code():
    assert len(Result) == 18
    assert {r.value: int(r.exit_code) for r in Result}["incompatible"] == 7
    assert {r.value: int(r.exit_code) for r in Result}["command_failed"] == 8


@pytest.mark.parametrize(("exc", "result"), [
    (Unreachable("x"), "unreachable"), (LockHeld("x"), "locked"), (PreflightRefused("x"), "preflight_refused"),
    (InvalidInput("x"), "invalid"), (Cancelled("x"), "interrupted"), (PhaseFailed("x"), "failed"),
    (KdeployError("x"), "failed"), (RuntimeError("x"), "failed")])
def test_an_exception_ends_a_host_with_the_result_of_its_exit_code(exc, result):
    host = HostResult("h")
    host.fail(exc)
    assert host.result == result and host.error == "x"


def test_finish_rejects_unknown_result():
    with pytest.raises(ValueError):
        HostResult("h").finish("exploded")


# --- Report and --json ------------------------------------------------------------------------------------------


def make_report() -> Report:
    ok = HostResult("ct200", release="20250102T030405Z-abcdef01")
    with ok.phase("stage") as phase:
        phase.detail = "+1 ~0 -0 =3"
    ok.finish("deployed")
    bad = HostResult("ct201")
    with pytest.raises(PhaseFailed), bad.phase("workers"):
        raise PhaseFailed("'[kdtree] defrag Tier-0' in 7/8 workers", ["tail line"])
    bad.finish("rolled_back", "gate failed")
    locked = HostResult("ct202").finish("locked", "held by bob")
    return Report("push", [ok, bad, locked])


def test_report_exit_code_and_summary():
    report = make_report()
    assert report.exit_code == 4 and report.ok is False
    assert report.summary() == {"hosts": 3, "deployed": 1, "locked": 1, "rolled_back": 1}
    assert Report("verify", []).exit_code == 0 and Report("verify", []).ok


def test_report_as_json_shape():
    doc = json.loads(json.dumps(make_report().as_json()))      # what --json prints must survive JSON
    assert list(doc) == ["schema_version", "kdeploy_version", "command", "ok", "exit_code", "hosts", "summary"]
    assert (doc["command"], doc["ok"], doc["exit_code"]) == ("push", False, 4)
    assert [h["host"] for h in doc["hosts"]] == ["ct200", "ct201", "ct202"]
    for host in doc["hosts"]:
        assert {"host", "ok", "result", "release", "phases"} <= set(host)
        assert "listener" not in host
        for phase in host["phases"]:
            assert list(phase) == ["name", "ok", "seconds", "detail"]
    ct200, ct201, ct202 = doc["hosts"]
    assert (ct200["ok"], ct200["result"], ct200["release"]) == (True, "deployed", "20250102T030405Z-abcdef01")
    assert ct200["phases"][0]["name"] == "stage" and ct200["phases"][0]["detail"] == "+1 ~0 -0 =3"
    assert (ct201["ok"], ct201["result"], ct201["release"]) == (False, "rolled_back", None)
    assert ct201["phases"][0]["ok"] is False
    assert ct201["log"] == ["tail line"]
    assert "log" not in ct200                                   # only when there is something to show
    assert ct202["phases"] == []


def test_typed_details_and_facts_go_under_their_keys_only_when_present():
    host = HostResult("h").finish("planned")
    assert not {"plan", "attempted", "restored", "traceback"} & set(host.as_json())
    host.details = Plan(["a.py"], [], [], "", False, True, ["never deployed"])
    host.attempted = "R1"
    doc = json.loads(json.dumps(host.as_json()))
    assert doc["plan"] == {"add": ["a.py"], "change": [], "remove": [], "unit_diff": "", "daemon_reload": False,
                           "restart": True, "reasons": ["never deployed"], "secrets": {}}
    assert doc["attempted"] == "R1"
    host.details = LockView("held", LockInfo("u", "c", 1, "t", "kdeploy push all", 42))
    assert host.as_json()["lock"] == {"state": "held", "holder": {"user": "u", "controller": "c", "pid": 1,
                                                                 "since": "t", "command": "kdeploy push all",
                                                                 "remote_pid": 42}}
