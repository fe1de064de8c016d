"""What kdeploy prints for people (issue 39): every message one line whatever the strings in it hold, click's usage
errors as one ``kdeploy:`` line naming the option (and its variable), and views that do not repeat hosts that ended
well."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.cli import progress
from kdeploy.core.report import HostResult, Phase, Report, Result
from kdeploy.core.text import one_line
from kdeploy.flows import check, execute, fleet
from kdeploy.flows.views import History

REPO = Path(__file__).resolve().parents[2]
FORGED = "evil\ninv.yaml:1: FAKE finding"


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI log, in the repository (its inventory.yaml)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("KDEPLOY_INVENTORY", raising=False)
    monkeypatch.delenv("KDEPLOY_PARALLEL", raising=False)


@pytest.mark.parametrize(("text", "shown"), [
    ("a\nb", "a\\nb"), ("a\r\n", "a\\r\\n"), ("\x1b[31mred", "\\x1b[31mred"),
    ("\x00\x7f\x85\x9b", "\\x00\\x7f\\x85\\x9b"),
    ("line\u2028sep\u2029", "line\\u2028sep\\u2029"), ("\u202egnp.exe", "\\u202egnp.exe"), ("tab\there", "tab\\there"),
    ("plain: é ü 中 /\\bParis\\b/", "plain: é ü 中 /\\bParis\\b/"),
])
def test_one_line_escapes_what_could_break_or_disguise_a_line(text: str, shown: str) -> None:
    assert one_line(text) == shown
    assert len(one_line(text).splitlines()) <= 1


@pytest.mark.parametrize("how", ["-i", "env"])
def test_a_newline_in_the_inventory_path_cannot_forge_a_line(plain, monkeypatch, capsys, how: str) -> None:
    path = "a\nkdeploy: all hosts deployed"
    if how == "env":
        monkeypatch.setenv("KDEPLOY_INVENTORY", path)
    assert cli.main(["status", *(["-i", path] if how == "-i" else [])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "kdeploy: a\\nkdeploy: all hosts deployed: inventory not found (pass --inventory PATH)\n"


def test_a_payload_file_name_cannot_forge_a_check_finding(plain, tmp_path, monkeypatch, capsys) -> None:
    """A finding that names a file with a newline stays one line: CI annotators see one finding, not two."""
    inventory = tmp_path / "inventory.yaml"
    shutil.copy(REPO / "inventory.yaml", inventory)
    monkeypatch.setattr(check.Checker, "host", lambda self, host: check.CheckView([f"{FORGED}: bad"]))
    assert cli.main(["check", "all", "-i", str(inventory)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("evil\\ninv.yaml:1: FAKE finding: bad [")
    assert not [line for line in lines if line.startswith("inv.yaml")]


def test_plain_lines_and_the_table_escape_what_hosts_said(plain, capsys) -> None:
    host = HostResult("h1", phases=[Phase("exec", False, 0.1, "x")], release="r1\x1b[2J")
    host.finish(Result.COMMAND_FAILED, FORGED)
    assert progress.host_line(host) == \
        "h1 command_failed release=r1\\x1b[2J phase=exec 0.1s evil\\ninv.yaml:1: FAKE finding"
    assert progress.phase_line("t", "h1", "exec", "fail", 0.1, "\x1b]0;title\x07") == \
        "t h1 exec FAIL 0.1s \\x1b]0;title\\x07"
    assert cli.cell("[red]x\n") == "\\[red]x\\n"  # no markup read, one line


def test_a_hosts_output_cannot_forge_a_line_of_another_host() -> None:
    result = HostResult("h1")
    result.details = execute.Output(0, "h2: fine\x1b[1A\n", "")
    assert execute.lines(result) == (["h1: h2: fine\\x1b[1A"], [])


@pytest.mark.parametrize(("argv", "env", "line"), [
    (["status", "--parallel", "x"], {}, "--parallel: 'x' is not a valid integer"),
    (["status"], {"KDEPLOY_PARALLEL": "x"}, "--parallel (KDEPLOY_PARALLEL): 'x' is not a valid integer"),
    (["status", "--parallel", "y"], {"KDEPLOY_PARALLEL": "x"}, "--parallel: 'y' is not a valid integer"),
    (["status", "--parallel", "0"], {}, "--parallel: '0' is below the minimum 1"),
    (["push", "all", "--canary", "x"], {}, "--canary: 'x' is not a valid integer"),
    (["push", "all", "--canary", "-1"], {}, "--canary: '-1' is below the minimum 0"),
    (["push", "all", "--timeout", "1e9"], {}, "--timeout: '1e9' is above the maximum 604800"),
    (["push", "all", "--lock-wait", "soon"], {}, "--lock-wait: 'soon' is not a valid number"),
    (["push", "all"], {"KDEPLOY_LOCK_WAIT": "-1"}, "--lock-wait (KDEPLOY_LOCK_WAIT): '-1' is below the minimum 0"),
    (["logs", "all", "--run", "bogus"], {}, "--run: 'bogus' is not one of 'all', 'current', 'previous'"),
    (["push", "all", "--canary"], {}, "option '--canary' requires an argument"),
    (["push"], {}, "push: missing argument 'target'"),
    (["push", "all", "--nope"], {}, "push: no such option: --nope"),
    (["nope"], {}, "no such command 'nope'"),
    (["lock", "nope"], {}, "lock: no such command 'nope'"),
    (["push", "all", "--batch", "150%"], {}, "--batch '150%': expected a count N or a percentage N% (1-100%)"),
    (["nope\nkdeploy: fake"], {}, "no such command 'nope\\nkdeploy: fake'"),
])
def test_a_usage_error_is_one_line_naming_the_option_and_its_variable(plain, monkeypatch, capsys, argv, env,
                                                                      line) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kdeploy: {line}\n"


def test_help_is_still_help(capsys) -> None:
    assert cli.main(["push", "--help"]) == 0
    assert capsys.readouterr().out.startswith("Usage: kdeploy push [OPTIONS]")


def _history(hosts: dict[str, Result]) -> Report:
    out = []
    for name, result in hosts.items():
        host = HostResult(name, phases=[Phase("connect", result == Result.OK, 0.0, "root@x:22")])
        host.details = History([{"time": "t", "user": "alice", "result": "deployed"}])
        out.append(host.finish(result, None if result == Result.OK else "connection refused"))
    return Report("history", out)


@pytest.mark.parametrize("tty", [False, True])
def test_a_view_does_not_repeat_hosts_that_ended_well(plain, monkeypatch, capsys, tty: bool) -> None:
    """history's table says it all for h1; the unreachable h2 still gets its line (a table row on a TTY)."""
    if tty:
        monkeypatch.delenv("CI")
        monkeypatch.setattr(cli.progress, "plain_wanted", lambda env, is_tty: False)
    monkeypatch.setattr(fleet, "history", lambda *a, **k: _history({"h1": Result.OK, "h2": Result.UNREACHABLE}))
    assert cli.main(["history"]) == 3
    err = capsys.readouterr().err
    assert "ok release=" not in err and "h1 ok" not in err.replace("  ", " ")
    assert "connection refused" in err
    assert err.splitlines()[-1] == "hosts=2, ok=1, unreachable=1; exit code 3"


def test_a_view_of_hosts_all_fine_prints_no_host_lines(plain, monkeypatch, capsys) -> None:
    monkeypatch.setattr(fleet, "history", lambda *a, **k: _history({"h1": Result.OK, "h2": Result.OK}))
    assert cli.main(["history"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert not [line for line in lines if " ok release=" in line]
    assert lines[-1] == "hosts=2, ok=2; exit code 0"


def test_exec_no_become_reaches_the_flow(plain, monkeypatch, capsys) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(execute, "run", lambda *a, become, **k: seen.append(become) or Report("exec", []))
    assert cli.main(["exec", "all", "--no-become", "--", "id"]) == 0
    assert cli.main(["exec", "all", "--", "id"]) == 0
    assert seen == [False, True]
