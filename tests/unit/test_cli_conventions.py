"""CLI conventions (issue 28): -h everywhere, global options anywhere on the line, environment defaults on every
command that has the option, completion scripts each shell accepts, errors that name what they are about."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer.main

from kdeploy.cli import app as cli
from kdeploy.cli import progress
from kdeploy.core.report import Report
from kdeploy.flows import fleet, logs
from kdeploy.flows.options import Options
from kdeploy.ssh import remote

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    """Every command and group of kdeploy, as the words that name it (the plugins' too: a group lists them)."""
    found: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        found.append(path)
        if isinstance(cmd, typer.core.TyperGroup):
            ctx = typer.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])

    walk(typer.main.get_command(cli.app), [])
    return found


def _params(path: list[str]) -> list:
    cmd = typer.main.get_command(cli.app)
    for word in path:
        cmd = cmd.get_command(typer.Context(cmd), word)  # type: ignore[attr-defined]
    return cmd.params  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "kdeploy")
def test_minus_h_is_help_on_every_command_and_lists_the_global_options(path: list[str], capsys) -> None:
    assert cli.main([*path, "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: kdeploy {' '.join(path)}".rstrip())
    for option in ("-h, --help", "-v, --verbose", "-q, --quiet", "--ssh-config FILE", "--debug"):
        assert option in out, (path, option)


@pytest.fixture
def pushed(monkeypatch: pytest.MonkeyPatch) -> list[Options]:
    """The Options the CLI hands to fleet.push, which does nothing here."""
    seen: list[Options] = []
    monkeypatch.setattr(fleet, "push", lambda inventory, target, opts, **kw: seen.append(opts) or Report("push", []))
    monkeypatch.chdir(REPO)
    return seen


@pytest.mark.parametrize(("argv", "ssh_config", "quiet"), [
    (["push", "all", "--ssh-config", "a", "--ssh-config", "b"], "b", False),
    (["--ssh-config", "a", "push", "all", "--ssh-config=b"], "b", False),
    (["--ssh-config=a", "-q", "push", "all"], "a", True),
    (["push", "all", "-q", "--ssh-config", "a"], "a", True),
    (["push", "all"], None, False),
])
def test_global_options_work_before_and_after_the_command_the_last_one_wins(pushed, capsys, argv, ssh_config,
                                                                           quiet) -> None:
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert [o.ssh_config for o in pushed] == [ssh_config]
    assert cli._flags.quiet is quiet


def test_a_global_option_never_steals_another_options_value(monkeypatch, capsys) -> None:
    """`--grep --debug` greps for '--debug' (click's reading, as getopt's); `-n 1` stays -n's."""
    seen: list[logs.LogQuery] = []
    monkeypatch.setattr(logs, "run", lambda inventory, names, query, *a: seen.append(query) or [])
    monkeypatch.chdir(REPO)
    assert cli.main(["logs", "ct200", "--grep", "--debug", "-n", "1"]) == 0, capsys.readouterr().err
    assert [(q.grep, q.lines) for q in seen] == [("--debug", 1)]
    assert cli.main(["logs", "ct200", "--grep", "--ssh-config", "-n", "2", "--ssh-config", "cfg"]) == 0
    assert [(q.grep, q.lines) for q in seen[1:]] == [("--ssh-config", 2)]


@pytest.mark.parametrize("where", [["--debug", "push", "all"], ["push", "all", "--debug"]])
def test_debug_anywhere_prints_the_traceback_of_an_internal_error(monkeypatch, capsys, where) -> None:
    def broken(*a: object, **k: object) -> Report:
        raise RuntimeError("boom")

    monkeypatch.setattr(fleet, "push", broken)
    monkeypatch.chdir(REPO)
    assert cli.main(where) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "kdeploy: internal error: RuntimeError: boom (rerun with " \
                                                          "--debug for the trace)"
    assert cli.main(["push", "all"]) == 1
    assert "Traceback" not in capsys.readouterr().err  # a fresh invocation: no --debug left over


def test_verbose_counts_at_both_levels(pushed, capsys) -> None:
    assert cli.main(["-v", "push", "all", "-v"]) == 0
    assert cli._flags.verbose == 2 and cli._ssh_log.level == 10  # -vv: DEBUG, the whole command
    assert cli.main(["push", "all"]) == 0
    assert cli._flags.verbose == 0 and cli._ssh_log.level == 30


def test_every_option_has_the_same_environment_default_wherever_it_is() -> None:
    """An option that reads a variable on one command reads it on every command that has it."""
    envvars: dict[str, set] = {}
    for path in _commands():
        for param in _params(path):
            for opt in param.opts:
                envvars.setdefault(opt, set()).add(param.envvar if isinstance(param.envvar, str) else None)
    mixed = {opt: found for opt, found in envvars.items() if len(found) > 1}
    assert not mixed
    assert envvars["--lock-wait"] == {"KDEPLOY_LOCK_WAIT"} and envvars["--parallel"] == {"KDEPLOY_PARALLEL"}


@pytest.mark.parametrize("command", [["set-env", "X=1"], ["set", "sglang.port=30001"], ["push", "all"],
                                     ["rollback", "all"]], ids=lambda c: c[0])
def test_kdeploy_lock_wait_is_the_default_of_every_lock_wait(monkeypatch, capsys, command) -> None:
    waits: list[float] = []
    monkeypatch.setattr(cli, "_edit", lambda *a, **k: waits.append(a[8]))
    monkeypatch.setattr(fleet, "push", lambda inv, t, opts, **k: waits.append(opts.lock_wait) or Report("push", []))
    monkeypatch.setattr(fleet, "rollback", lambda inv, t, opts, **k: waits.append(opts.lock_wait) or Report("r", []))
    monkeypatch.setenv("KDEPLOY_LOCK_WAIT", "7")
    monkeypatch.chdir(REPO)
    assert cli.main(command) == 0, capsys.readouterr().err
    assert waits == [7.0]


@pytest.mark.parametrize(("shell", "check", "first"), [
    ("bash", ["bash", "-n"], "_kdeploy_completion() {"),
    ("zsh", ["zsh", "-n"], "#compdef kdeploy"),
    ("fish", ["fish", "--no-execute"], "complete --command kdeploy"),
])
def test_each_shell_gets_its_own_completion_script_and_accepts_it(shell, check, first, capsys, tmp_path) -> None:
    assert cli.main(["--show-completion", shell]) == 0
    script = capsys.readouterr().out
    assert script.splitlines()[0].startswith(first)
    path = tmp_path / f"kdeploy.{shell}"
    path.write_text(script)
    assert shutil.which(check[0]), f"{check[0]} is missing: `make system-deps` installs it"
    done = subprocess.run([*check, str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_an_unknown_shell_is_a_usage_error_naming_the_option(capsys) -> None:
    assert cli.main(["--show-completion", "tcsh"]) == 2
    assert capsys.readouterr().err == "kdeploy: --show-completion: 'tcsh': one of bash, zsh, fish\n"


def test_completion_answers_through_main(monkeypatch, capsys) -> None:
    monkeypatch.setenv("_KDEPLOY_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "kdeploy push --can")
    monkeypatch.setenv("COMP_CWORD", "2")
    assert cli.main([]) == 0
    assert capsys.readouterr().out.split() == ["--canary"]


def test_an_invalid_setting_names_its_key_not_a_line_of_another_file(tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text((REPO / "inventory.yaml").read_text())
    before = path.read_text()
    assert cli.main(["set", "hicache.ratio=abc", "-i", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"kdeploy: {path}: not changed: defaults.service.hicache.ratio: Input should be a valid "
                   "number, unable to parse string as a number")
    assert path.read_text() == before


def test_a_hosts_error_is_said_once_in_the_plain_log() -> None:
    """The failed phase's line has it; the host's `done` line no longer repeats it."""
    out = io.StringIO()
    log = progress.PlainLog(out, clock=lambda: "12:00:00")
    why = "h1 (root@10.0.0.1:22): unreachable: Connection refused (5 attempts in 6.0s)"
    log.event("h1", "connect", "fail", 6.0, why)
    log.event("h1", "done", "unreachable", None, why)
    log.event("h2", "completion", "fail", 1.0, "expected 4, got 5")
    log.event("h2", "done", "rolled_back", None, "gate failed (expected 4, got 5); back on r1")
    assert out.getvalue().splitlines() == [
        f"12:00:00 h1 connect FAIL 6.0s {why}", "12:00:00 h1 done unreachable",
        "12:00:00 h2 completion FAIL 1.0s expected 4, got 5",
        "12:00:00 h2 done rolled_back gate failed (expected 4, got 5); back on r1"]


def test_verbose_traces_each_executor_step(caplog) -> None:
    """What -v shows: the step's command (first line; -vv: all of it), how long, how it ended."""
    class Step:
        host = SimpleNamespace(name="h1")

        @remote._traced
        def run(self, command: str) -> remote.RunResult:
            if "fail" in command:
                raise remote.Unreachable("h1: connection lost")
            return remote.RunResult(3, "", "")

    with caplog.at_level("INFO", logger="kdeploy.ssh"):  # caplog's handler on the logger itself
        Step().run("systemctl show sglang\nsecond line\nthird")
        with pytest.raises(remote.Unreachable):
            Step().run("fail now")
    lines = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"h1: systemctl show sglang \(\+2 lines\) -> exit 3 in \d+\.\d\ds", lines[0])
    assert re.fullmatch(r"h1: fail now -> Unreachable: h1: connection lost in \d+\.\d\ds", lines[1])
    caplog.clear()
    with caplog.at_level("DEBUG", logger="kdeploy.ssh"):
        Step().run("a\nb")
    assert caplog.records[0].getMessage().startswith("h1: a\nb -> exit 3")


def test_every_option_of_every_command_is_in_the_docs() -> None:
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    missing = {(" ".join(path), opt) for path in _commands() for param in _params(path) for opt in param.opts
               if opt.startswith("--") and not re.search(re.escape(opt) + r"(?![\w-])", docs)}
    assert not missing


def test_every_command_that_fans_out_over_hosts_takes_parallel() -> None:
    """Only these select hosts without a bounded fan-out: render and check contact none, logs follows every host
    at once, router drain/admit ask the router one host after another."""
    without = {" ".join(path) for path in _commands()
               if {"--limit"} <= {o for p in _params(path) for o in p.opts}
               and "--parallel" not in {o for p in _params(path) for o in p.opts}}
    assert without == {"render", "check", "logs", "router admit", "router drain"}
