"""kdeploy/flows/logs.py: the journalctl command each host runs, and the checks made before connecting."""

from __future__ import annotations

import os
import subprocess

import pytest

from kdeploy.cli import app as cli
from kdeploy.core.errors import InvalidInput
from kdeploy.core.step import RunResult
from kdeploy.flows.logs import LogQuery, Run, journal_command, journal_step, prefixed


def test_default_is_the_last_50_lines_of_the_unit():
    assert journal_command("s.service", LogQuery()) == "journalctl --no-pager -o short-iso -n 50 -u s.service"


def test_a_run_is_picked_by_its_invocation_id():
    cmd = journal_command("s.service", LogQuery(run=Run.CURRENT, lines=0))
    assert cmd.startswith("cur=$(systemctl show -p InvocationID --value s.service)")
    assert cmd.endswith('journalctl --no-pager -o short-iso -n all "_SYSTEMD_INVOCATION_ID=$inv"')


@pytest.mark.parametrize(("current", "expected"), [("c3", "b2"), ("", "c3"), ("zz", "c3")])
def test_the_previous_run_is_the_newest_that_is_not_the_current_one(tmp_path, current, expected):
    """Read backwards through journalctl's export records (as `-r` prints them) until the first other run."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    records = "".join(f"__CURSOR=s;i={n}\n_SYSTEMD_INVOCATION_ID={inv}\n\n"
                      for n, inv in enumerate(["c3", "c3", "b2", "b2", "a1", "c3"]))  # newest first
    (bindir / "journalctl").write_text(f'#!/bin/sh\ncase "$*" in *"-r -u s.service -o export"*) '
                                       f"printf '%s' '{records}';; *) exit 9;; esac\n")
    (bindir / "systemctl").write_text(f"#!/bin/sh\necho '{current}'\n")
    for tool in bindir.iterdir():
        tool.chmod(0o755)
    prelude = journal_command("s.service", LogQuery(run=Run.PREVIOUS)).split('; journalctl --no-pager -o short')[0]
    out = subprocess.run(["sh", "-c", prelude + '; echo "$inv"'], capture_output=True, text=True, check=True,
                         env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}).stdout
    assert out == f"{expected}\n"


def test_grep_filters_on_the_host_then_keeps_the_last_n():
    cmd = journal_command("s.service", LogQuery(grep="it's (a|b)", since="1 hour ago", lines=5))
    assert "'--since=1 hour ago' -n 0 -u s.service >/dev/null || exit $?; " in cmd  # a bad --since is reported
    assert cmd.endswith("-n all -u s.service | grep --line-buffered -E -e 'it'\"'\"'s (a|b)' | tail -n 5; true")


def test_follow_never_follows_the_dry_run():
    cmd = journal_command("s.service", LogQuery(follow=True, grep="x"))
    check, _, rest = cmd.partition(" >/dev/null || exit $?; ")
    assert "--follow" not in check and "--follow -n 50 -u s.service | grep" in rest


def test_prefixed():
    assert prefixed("h1", "a\nb\n") == ["h1 | a", "h1 | b"]


def test_journal_step_reads_the_lines_or_the_hosts_refusal():
    """journalctl's own refusal of a --since (captured: systemd 255) and the no-such-run exit are bad input."""
    step = journal_step("s.service", LogQuery(since="nonsense"))
    assert step.command == journal_command("s.service", LogQuery(since="nonsense"))
    text = "2026-12-03T10:00:00+0000 h s[1]: up\n"
    assert step.parse(RunResult(0, text, "")) == text
    with pytest.raises(InvalidInput, match=r"^Failed to parse timestamp: nonsense$"):
        step.parse(RunResult(1, "", "Failed to parse timestamp: nonsense\n"))
    with pytest.raises(InvalidInput, match="no current run"):
        step.parse(RunResult(3, "", "the unit has no current run\n"))


@pytest.mark.parametrize(("query", "message"), [
    (LogQuery(grep="("), "not a valid regular expression"), (LogQuery(lines=-1), "--lines"),
])
def test_bad_queries_are_refused_before_connecting(query, message):
    with pytest.raises(InvalidInput, match=message):
        query.check()


def test_bad_input_is_exit_2(capsys):
    assert cli.main(["logs", "all", "--grep", "(", "-i", "inventory.yaml"]) == 2
    assert cli.main(["logs", "all", "--run", "last"]) == 2
