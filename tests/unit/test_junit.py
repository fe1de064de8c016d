"""kdeploy/cli/junit.py: JUnit XML valid against the schema GitLab and Jenkins read (Jenkins' junit-10.xsd)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import pytest
import xmlschema

from kdeploy.cli import app as cli
from kdeploy.cli import junit
from kdeploy.core.inventory import load
from kdeploy.core.report import HostResult, Phase, Report, Result
from kdeploy.flows import fleet
from tests.unit.test_ci_output import REPO, fake_push

XSD = xmlschema.XMLSchema10(Path(__file__).resolve().parents[1] / "data" / "junit" / "junit-10.xsd")


def host(name: str, result: Result, phases: list[Phase], error: str | None = None) -> HostResult:
    out = HostResult(name, phases=phases, release="r1" if result.exit_code == 0 else None)
    return out.finish(result, error)


def test_one_suite_one_case_per_host_a_failure_naming_the_phase():
    report = Report("push", [
        host("ct200", Result.DEPLOYED, [Phase("connect", True, 0.1, ""), Phase("ready", True, 1.2, "GET /health 200")]),
        host("ct201", Result.ROLLED_BACK, [Phase("connect", True, 0.1, ""),
                                            Phase("ready", False, 60.0, "GET /health not 200 \x1b[31m(last: 503)")],
             error="GET /health not 200"),
        host("ct202", Result.SKIPPED, [], error="max-fail reached"),
    ])
    text = junit.build(report, {"ct200": "sglang-a", "ct201": "sglang-a"},
                       started=datetime(2026, 12, 1, tzinfo=UTC), seconds=61.5)
    XSD.validate(text)
    suite = ET.fromstring(text).find("testsuite")
    assert suite.get("name") == "kdeploy push"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped"), suite.get("time")) == ("3", "1", "1",
                                                                                                     "61.500")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["ct200"].get("classname") == "sglang-a" and cases["ct200"].find("failure") is None
    failure = cases["ct201"].find("failure")
    assert failure.get("type") == "rolled_back" and failure.get("message") == "ready: GET /health not 200"
    assert cases["ct202"].find("skipped") is not None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["ct200.ready"] == "ok 1.200s GET /health 200"
    assert props["ct201.ready"] == "FAIL 60.000s GET /health not 200 \\x1b[31m(last: 503)"  # ESC written as \x1b
    assert props["exit_code"] == "4"


def test_an_empty_report_is_a_valid_empty_suite():
    XSD.validate(junit.build(Report("set-env", []), {}, started=datetime.now(UTC), seconds=0.01))


@pytest.mark.parametrize("command", [["push", "all"], ["verify", "all"], ["rollback", "all"]])
def test_junit_option_writes_the_file(monkeypatch, capsys, tmp_path, command):
    for name in ("push", "verify", "rollback"):
        monkeypatch.setattr(fleet, name, fake_push)
    monkeypatch.chdir(REPO)
    path = tmp_path / "reports" / "junit.xml"
    assert cli.main([*command, "--junit", str(path)]) == 4
    XSD.validate(str(path))
    cases = ET.parse(path).getroot().find("testsuite").findall("testcase")
    services = load(REPO / "inventory.yaml").hosts
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(services[h].service.name, h)
                                                                    for h in ("ct200", "ct201")]


@pytest.mark.parametrize("where", ["/proc/nope/junit.xml", "ro/junit.xml"])
def test_an_unwritable_junit_path_is_refused_before_any_host_is_touched(monkeypatch, capsys, tmp_path, where):
    """It was found only after the deploy: the JSON said exit 0, then the process exited 1."""
    touched = []
    monkeypatch.setattr(fleet, "push", lambda *a, **k: touched.append(a) or fake_push(*a, **k))
    monkeypatch.chdir(REPO)
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(cli.os, "access", lambda p, mode: Path(p) != ro)  # root may write anywhere: stand-in
    assert cli.main(["push", "all", "--json", "--junit", str(tmp_path / where)]) == 2
    out, err = capsys.readouterr()
    assert touched == [] and out == "" and err.startswith("kdeploy: --junit ")
