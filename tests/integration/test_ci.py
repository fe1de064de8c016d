"""CI output and JUnit against real sandbox hosts: plain per-phase lines, heartbeats, --quiet, --junit.

The command runs as CI runs it: a child process, stderr a pipe (no TTY), ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema

from kdeploy.cli import app as cli
from kdeploy.cli import progress, schema
from tests.conftest import TEST_MARKER, Deployment

XSD = xmlschema.XMLSchema10(Path(__file__).resolve().parents[1] / "data" / "junit" / "junit-10.xsd")
ANSI = re.compile(r"\x1b")
BOX = re.compile("[\u2500-\u257f]")
STAMP = r"\d\d:\d\d:\d\d"


def run_ci(dep: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CI": "true", "KDEPLOY_INVENTORY": str(dep.path)}
    return subprocess.run([sys.executable, "-m", "kdeploy", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=300, check=False)


@pytest.mark.hosts(2)
def test_push_in_ci_logs_each_phase_and_writes_json_and_junit(deployment: Deployment, tmp_path: Path) -> None:
    junit = tmp_path / "reports" / "kdeploy.xml"
    done = run_ci(deployment, "push", "all", "--json", "--junit", str(junit))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    schema.ReportDoc.model_validate(report)
    assert [h["result"] for h in report["hosts"]] == ["deployed", "deployed"]
    assert not ANSI.search(done.stderr) and not BOX.search(done.stderr)
    lines = done.stderr.splitlines()
    for host in deployment.hosts:
        assert any(re.fullmatch(rf"{STAMP} {host} connect ok \d+\.\ds.*", ln) for ln in lines), done.stderr
        assert any(re.fullmatch(rf"{STAMP} {host} workers ok \d+\.\ds 1 markers x 8 workers", ln) for ln in lines)
        assert any(re.fullmatch(rf"{STAMP} {host} done deployed", ln) for ln in lines)
    assert lines[-1] == "hosts=2, deployed=2; exit code 0"
    XSD.validate(str(junit))
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("name"), suite.get("tests"), suite.get("failures")) == ("kdeploy push", "2", "0")
    assert [(c.get("classname"), c.get("name")) for c in suite.iter("testcase")] == [
        (deployment.service, h) for h in deployment.hosts]
    assert {p.get("name") for p in suite.iter("property")} >= {f"{h}.ready" for h in deployment.hosts}


@pytest.mark.hosts(2)
def test_a_failed_gate_in_ci_quiet_and_junit_name_the_phase(deployment: Deployment, tmp_path: Path) -> None:
    assert run_ci(deployment, "push", "all").returncode == 0
    deployment.set_service(env={"REFSERVER_WRONG_ANSWER": "1"},
                           gate={"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 30})
    junit = tmp_path / "junit.xml"
    done = run_ci(deployment, "--quiet", "push", deployment.hosts[0], "--junit", str(junit))
    assert done.returncode == 4, done.stderr
    assert not ANSI.search(done.stderr) and not BOX.search(done.stderr)
    lines = done.stderr.splitlines()
    assert not any(" ok " in ln for ln in lines), "--quiet prints no phase that passed"
    assert any(re.fullmatch(rf"{STAMP} h1 completion FAIL \d+\.\ds .+", ln) for ln in lines), done.stderr
    assert lines[-1] == "hosts=1, rolled_back=1; exit code 4"
    XSD.validate(str(junit))
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert failure.get("type") == "rolled_back" and failure.get("message").startswith("completion: ")


def test_a_waiting_phase_beats_in_the_log(deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress, "HEARTBEAT_S", 1.0)
    deployment.set_service(env={"REFSERVER_SLOW_START": "4"},
                           gate={"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60})
    assert deployment.kdeploy("push", "all") == 0
    err = capsys.readouterr().err
    assert re.search(rf"^{STAMP} h1 ready waiting [1-9]\.\ds$", err, re.MULTILINE), err
    assert cli.main(["verify", "all", "--inventory", str(deployment.path), "--junit",
                     str(deployment.path.parent / "v.xml")]) == 0
    XSD.validate(str(deployment.path.parent / "v.xml"))


def test_set_env_writes_junit_also_when_nothing_changes(deployment: Deployment, tmp_path: Path) -> None:
    assert run_ci(deployment, "push", "all").returncode == 0
    for expected in ("1", "0"):  # the rollout to h1, then the same edit again: nothing to change, an empty suite
        junit = tmp_path / f"set-env-{expected}.xml"
        done = run_ci(deployment, "set-env", "KDT_CI_FLAG=1", "--junit", str(junit))
        assert done.returncode == 0, done.stderr
        assert not ANSI.search(done.stderr) and not BOX.search(done.stderr)
        XSD.validate(str(junit))
        suite = ET.parse(junit).getroot().find("testsuite")
        assert (suite.get("name"), suite.get("tests")) == ("kdeploy set-env", expected)
