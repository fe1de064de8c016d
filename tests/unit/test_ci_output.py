"""CI output and CLI conventions: plain per-phase lines off a TTY, heartbeats, --quiet, --version, env defaults,
completion of TARGET (kdeploy/cli/progress.py, kdeploy/cli/app.py)."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest

from kdeploy import __version__
from kdeploy.cli import app as cli
from kdeploy.cli import progress
from kdeploy.core.report import HostResult, PhaseFailed, Report, Result
from kdeploy.flows import fleet

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[")
BOX = re.compile("[\u2500-\u257f]")  # box drawing


def fake_push(inventory, target, opts, *, listener=None, **kw) -> Report:
    """Two hosts through real HostResult phases: ct200 deploys, ct201 fails its gate and is rolled back."""
    hosts = []
    for name in ("ct200", "ct201"):
        host = HostResult(name, listener=listener)
        with host.phase("connect"):
            pass
        try:
            with host.phase("ready") as entry:
                if name == "ct201":
                    raise PhaseFailed("GET /health not 200 within 60s (last: 503)", ["journal line"])
                entry.detail = "GET /health 200"
            host.release = "r1"
            host.finish(Result.DEPLOYED)
        except PhaseFailed as exc:
            host.finish(Result.ROLLED_BACK, exc.detail)
        hosts.append(host)
    return Report("push", hosts)


@pytest.fixture
def ci(monkeypatch):
    monkeypatch.setattr(fleet, "push", fake_push)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("NO_COLOR", raising=False)


def test_phase_line_is_one_greppable_line():
    assert progress.phase_line("12:01:03", "ct200", "ready", "ok", 1.234, "GET /health 200") == \
        "12:01:03 ct200 ready ok 1.2s GET /health 200"
    assert progress.phase_line("12:01:03", "h1", "gate", "fail", 2.0, "a\nb\n") == "12:01:03 h1 gate FAIL 2.0s a\\nb"


@pytest.mark.parametrize(("env", "tty", "plain"), [
    ({}, True, False), ({}, False, True), ({"CI": "true"}, True, True), ({"CI": "false"}, True, False),
    ({"NO_COLOR": "1"}, True, True),
])
def test_plain_output_off_a_tty_in_ci_or_with_no_color(env, tty, plain):
    assert progress.plain_wanted(env, tty) is plain


def test_ci_log_has_a_line_per_phase_then_a_plain_summary_and_clean_json(ci, capsys):
    assert cli.main(["push", "all", "--json"]) == 4
    out, err = capsys.readouterr()
    assert json.loads(out)["exit_code"] == 4  # stdout: one document, nothing else
    assert not ANSI.search(err) and not BOX.search(err)
    lines = err.splitlines()
    stamp = r"\d\d:\d\d:\d\d"
    assert re.fullmatch(rf"{stamp} ct200 ready ok \d+\.\ds GET /health 200", lines[1])
    assert re.fullmatch(rf"{stamp} ct201 ready FAIL \d+\.\ds GET /health not 200 within 60s \(last: 503\)", lines[4])
    assert re.fullmatch(rf"{stamp} ct201 done rolled_back", lines[5])  # its error is on the FAIL line above
    assert "ct201 rolled_back release=- phase=ready" in err
    assert err.count("GET /health not 200 within 60s") == 2  # the stream's FAIL line, the summary's host line
    assert "  ct201 | journal line" in err
    assert lines[-1] == "hosts=2, deployed=1, rolled_back=1; exit code 4"


@pytest.mark.parametrize("where", [["--quiet", "push", "all"], ["push", "all", "-q"]])
def test_quiet_prints_only_failures_and_the_summary(ci, capsys, where):
    assert cli.main(where) == 4
    err = capsys.readouterr().err
    assert "ct200" not in err
    assert "ct201 ready FAIL" in err and "ct201 rolled_back" in err
    assert err.splitlines()[-1].startswith("hosts=2")


def test_no_color_on_a_tty_is_plain_too(monkeypatch, capsys):
    monkeypatch.setattr(fleet, "push", fake_push)
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich would colour a non-TTY with this
    assert cli.main(["push", "all"]) == 4
    err = capsys.readouterr().err
    assert not ANSI.search(err) and not BOX.search(err)


def test_verbose_plain_log_says_when_each_phase_starts():
    out = io.StringIO()

    def run(listener) -> Report:
        host = HostResult("h1", listener=listener)
        with host.phase("stage"):
            pass
        return Report("push", [host.finish(Result.DEPLOYED)])

    progress.PlainLog(out, starts=True, clock=lambda: "12:00:00").run(run)
    assert out.getvalue().splitlines()[:2] == ["12:00:00 h1 stage start", "12:00:00 h1 stage ok 0.0s"]
    quiet = io.StringIO()
    progress.PlainLog(quiet, clock=lambda: "12:00:00").run(run)
    assert " start" not in quiet.getvalue()


def test_a_waiting_phase_beats_every_heartbeat():
    out = io.StringIO()
    log = progress.PlainLog(out, heartbeat=0.05, clock=lambda: "12:00:00")

    def slow(listener) -> Report:
        host = HostResult("h1", listener=listener)
        with host.phase("ready"):
            time.sleep(0.18)
        return Report("verify", [host.finish(Result.HEALTHY)])

    log.run(slow)
    lines = out.getvalue().splitlines()
    beats = [ln for ln in lines if " waiting " in ln]
    assert len(beats) >= 2 and re.fullmatch(r"12:00:00 h1 ready waiting 0\.\ds", beats[0])
    assert lines[-2].startswith("12:00:00 h1 ready ok") and lines[-1] == "12:00:00 h1 done healthy"


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kdeploy {__version__}\n"


def test_help_lists_debug_quiet_version_and_completion(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--debug", "--quiet", "--version", "--install-completion", "--show-completion"):
        assert flag in out


def test_env_var_defaults(monkeypatch, capsys, tmp_path):
    seen = []
    monkeypatch.setattr(fleet, "push", lambda inventory, target, opts, **kw: seen.append((opts, kw)) or
                        Report("push", []))
    monkeypatch.chdir(tmp_path)  # no inventory.yaml here: KDEPLOY_INVENTORY must be the one read
    monkeypatch.setenv("KDEPLOY_INVENTORY", str(REPO / "inventory.yaml"))
    monkeypatch.setenv("KDEPLOY_PARALLEL", "3")
    monkeypatch.setenv("KDEPLOY_LOCK_WAIT", "45")
    assert cli.main(["push", "all"]) == 0, capsys.readouterr().err
    opts, kw = seen[0]
    assert (opts.lock_wait, kw["parallel"]) == (45.0, 3)
    monkeypatch.setenv("KDEPLOY_PARALLEL", "many")
    assert cli.main(["push", "all"]) == 2
    assert "KDEPLOY_PARALLEL" in capsys.readouterr().err


def test_completion_of_target_from_the_inventory(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for words, expected in (("kdeploy push k", ["kimi"]), ("kdeploy verify ct200,", None)):
        monkeypatch.setenv("_KDEPLOY_COMPLETE", "complete_bash")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", "2")
        assert cli.main([]) == 0
        got = capsys.readouterr().out.split()
        if expected:
            assert got == expected
        else:
            assert "ct200,ct201" in got and "ct200,ct200" not in got and "ct200,all" in got
