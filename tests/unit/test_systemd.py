"""kdeploy/core/systemd.py: the parsers, run on REAL systemctl/journalctl output captured from a sandbox host by
tests/data/captured/capture.py (systemd 252). No sandbox is needed here: the tests only read those files."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from kdeploy.core.systemd import (
    SHOW_PROPERTIES,
    JournalLine,
    follow_command,
    journal_command,
    parse_environment,
    parse_journal,
    parse_old_run,
    parse_restart,
    parse_show,
    restart_command,
    show_command,
    stop_command,
)

DEFAULT_MARKERS = ("[kdtree] defrag Tier-0", "[kdtree] installed verify override")
CAPTURED = Path(__file__).resolve().parents[2] / "tests/data/captured"
RANK_LINE = "Load weight end."


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


def raw_props(name: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in captured(name).splitlines())


# --- systemctl show -------------------------------------------------------------------------------------


def test_follow_command_quotes_the_unit_and_the_old_run_and_bounds_the_wait():
    cmd = follow_command("a b.service", "", 80, 0.1)
    assert "timeout 80 sh -c " in cmd and cmd.count("'a b.service'") == 2
    assert " follow '' 'a b.service' 0.1" in cmd  # a unit that never ran: any run is the new one
    assert "systemctl restart" not in cmd and "systemctl start" not in cmd  # the activation queued the start


def test_stop_command_prints_the_old_run_and_never_waits():
    cmd = stop_command("a b.service")
    assert "systemctl stop --no-block 'a b.service'" in cmd and "|| true" in cmd
    assert restart_command("a b.service") == "systemctl restart --no-block 'a b.service'"
    assert parse_old_run("noise\n@@old 0123abcd\nACTIVATED\n") == "0123abcd"
    assert parse_old_run("@@old \nACTIVATED\n") == "" == parse_old_run("")


def test_parse_restart_followed_through_a_slow_stop():
    restarted = parse_restart(captured("restart_followed.txt"))
    assert restarted.followed and restarted.stopping
    assert restarted.state.running and len(restarted.state.invocation) == 32


def test_parse_restart_timed_out_while_the_old_run_stops():
    restarted = parse_restart(captured("restart_timed_out.txt"))
    assert not restarted.followed and restarted.stopping
    assert restarted.state.active == "deactivating"


@pytest.mark.parametrize("text", ["", "@@followed\n", "@@followed\n0", "garbage\n@@show\n"])
def test_parse_restart_truncated_output_is_not_followed(text):
    restarted = parse_restart(text)
    assert not restarted.followed and restarted.state.active == "unknown"


def test_show_command():
    assert show_command("sglang-kimi.service") == (
        "systemctl show sglang-kimi.service -p ActiveState,SubState,Result,NRestarts,InvocationID,ExecMainPID,"
        "ExecMainStatus,ActiveEnterTimestamp,LoadState,UnitFileState,NeedDaemonReload --no-pager")
    assert "'a b.service'" in show_command("a b.service")


def test_captured_show_has_every_property_in_systemds_own_order():
    for name in ("show_running.txt", "show_failed.txt", "show_auto_restart.txt", "show_restart_limit.txt",
                 "show_not_found.txt"):
        keys = list(raw_props(name))
        assert sorted(keys) == sorted(SHOW_PROPERTIES), name
        assert keys != list(SHOW_PROPERTIES)      # so the parser must not rely on the order it asked for


def test_parse_show_running():
    state = parse_show(captured("show_running.txt"))
    props = raw_props("show_running.txt")
    assert (state.active, state.sub, state.result) == ("active", "running", "success")
    assert state.running
    assert state.main_pid == int(props["ExecMainPID"]) > 0
    assert re.fullmatch(r"[0-9a-f]{32}", state.invocation)
    assert state.n_restarts == 0 and state.main_status == 0
    assert state.load == "loaded" and state.file_state == "static"
    assert state.active_since.endswith(" UTC")
    assert state.summary == "active/running"


def test_parse_show_failed():
    state = parse_show(captured("show_failed.txt"))
    assert (state.active, state.sub, state.result, state.main_status) == ("failed", "failed", "exit-code", 3)
    assert not state.running
    assert state.summary == "failed/failed result=exit-code"


def test_parse_show_auto_restart():
    state = parse_show(captured("show_auto_restart.txt"))
    assert (state.active, state.sub, state.result, state.main_status) == ("activating", "auto-restart", "exit-code", 1)
    assert re.fullmatch(r"[0-9a-f]{32}", state.invocation)   # the invocation that just died
    assert not state.running


def test_parse_show_restart_limit():
    state = parse_show(captured("show_restart_limit.txt"))
    assert (state.active, state.sub, state.n_restarts) == ("failed", "failed", 3)
    assert state.summary == "failed/failed result=exit-code restarts=3"


def test_parse_show_not_found():
    state = parse_show(captured("show_not_found.txt"))
    assert state.load == "not-found"
    assert (state.active, state.sub) == ("inactive", "dead")
    assert (state.invocation, state.main_pid, state.file_state, state.active_since) == ("", 0, "", "")


def test_parse_show_degenerate_input():
    empty = parse_show("")
    assert (empty.active, empty.sub, empty.result, empty.n_restarts) == ("unknown", "unknown", "", 0)
    odd = parse_show("NRestarts=lots\nExecMainPID=\nnot a property line\nActiveEnterTimestamp=a=b\n")
    assert (odd.n_restarts, odd.main_pid, odd.active_since) == (0, 0, "a=b")


# --- journalctl ---------------------------------------------------------------------------------------------


def test_journal_command():
    assert journal_command("abc") == (
        "journalctl --no-pager -o json --output-fields=MESSAGE,_PID _SYSTEMD_INVOCATION_ID=abc")
    assert journal_command("abc", lines=12).endswith(" -n 12")
    cmd = journal_command("abc", grep=['[kdtree] say "hi"', "it's"])
    assert cmd.endswith(""" | grep -F -e '[kdtree] say \\"hi\\"' -e 'it'"'"'s' || true""")
    first = journal_command("abc", grep=["m"], first=100)
    assert first == ("journalctl --no-pager -o json --output-fields=MESSAGE,_PID _SYSTEMD_INVOCATION_ID=abc"
                     " | head -n 100 | grep -F -e m || true")


def test_journal_grep_finds_non_ascii_markers():
    """journalctl -o json writes non-ASCII text as UTF-8, not as \\u escapes: the grep must look for that."""
    markers = ["[kdtree] Größe ✓ 日本", 'say "hé" \\ done']
    cmd = journal_command("abc", grep=markers)
    assert "\\u" not in cmd
    record = [json.dumps({"MESSAGE": f"[TP{i}] {m} pid={i}", "_PID": str(i)}, ensure_ascii=False)
              for i, m in enumerate(markers)]
    journal = "\n".join(["{\"MESSAGE\":\"other\",\"_PID\":\"7\"}", *record]) + "\n"
    grep = cmd.split(" | ", 1)[1]
    out = subprocess.run(["sh", "-c", grep], input=journal.encode(), capture_output=True, check=True,
                         env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}).stdout.decode()
    assert [line.message for line in parse_journal(out)] == [f"[TP{i}] {m} pid={i}" for i, m in enumerate(markers)]


def test_parse_journal_real_output():
    lines = parse_journal(captured("journal_running.jsonl"))
    messages = [line.message for line in lines]
    assert messages[0] == "hello"
    assert messages[1] == "[x TP3] Load weight end."
    assert len(lines) == 2 + 4 * (1 + len(DEFAULT_MARKERS))
    main_pid = parse_show(captured("show_running.txt")).main_pid
    assert lines[0].pid == lines[1].pid == main_pid
    assert lines[0].rank is None
    assert lines[1].rank == 3
    # journald records each worker's own pid, even on the shared stdout stream
    workers = [line for line in lines if "pid=" in line.message]
    for line in workers:
        assert line.pid == int(line.message.rsplit("pid=", 1)[1]) != main_pid
    ranks = {line.pid: line.rank for line in workers if RANK_LINE in line.message}
    assert sorted(ranks.values()) == [0, 1, 2, 3]
    assert len(set(ranks)) == 4
    for marker in DEFAULT_MARKERS:
        assert sorted(line.pid for line in workers if marker in line.message) == sorted(ranks)
        assert all(line.rank is None for line in workers if marker in line.message)


def test_parse_journal_grep_output_is_the_filtered_journal():
    full = parse_journal(captured("journal_running.jsonl"))
    grepped = parse_journal(captured("journal_running_grep.jsonl"))
    wanted = [line for line in full if any(p in line.message for p in (*DEFAULT_MARKERS, RANK_LINE))]
    assert grepped == wanted
    assert "hello" not in [line.message for line in grepped]


def test_parse_journal_failed_unit():
    lines = parse_journal(captured("journal_failed.jsonl"))
    assert [(line.pid, line.message) for line in lines] == [
        (parse_show(captured("show_failed.txt")).main_pid, "bye")]


def test_parse_journal_robustness():
    text = "\n".join([
        "-- No entries --",
        '{"MESSAGE": [104, 105, 255], "_PID": "7"}',        # non-UTF-8 message: a byte array
        '{"MESSAGE": "no pid"}',
        '{"MESSAGE": "bad pid", "_PID": "x"}',
        "{not json",
        '{"_PID": "9"}',
        "",
    ])
    assert parse_journal(text) == [JournalLine(7, "hi\ufffd"), JournalLine(0, "no pid"), JournalLine(0, "bad pid"),
                                   JournalLine(9, "")]


@pytest.mark.parametrize(("message", "rank"), [
    ("[2025-01-01 00:00:00 TP7] Load weight end.", 7),
    ("[x TP12] foo", 12),
    ("worker rank=5 ready", 5),
    ("worker rank 2 ready", 2),
    ("TP3 without bracket", None),
    ("[xTP3] glued to a word", None),
    ("frank=3", None),
])
def test_rank(message, rank):
    assert JournalLine(1, message).rank == rank


# --- systemctl show -p Environment --value --------------------------------------------------------------------


def test_parse_environment_round_trips_real_output():
    """The unit's Environment= lines were rendered by quote_env_assignment from tricky.json's env."""
    tricky = json.loads(captured("tricky.json"))["env"]
    text = captured("environment.txt")
    assert "\\$" in text and '\\"' in text           # systemd's own escaping shows up in the raw text
    assert parse_environment(text) == tricky


def test_parse_environment_synthetic():
    assert parse_environment("") == {}
    assert parse_environment("A=1 B=2\n") == {"A": "1", "B": "2"}
    assert parse_environment(r'"A=x y" B=\x41\x42 "C=tab\there" D= noequals') == {
        "A": "x y", "B": "AB", "C": "tab\there", "D": ""}
    assert parse_environment("'E=single quoted' F=a\\ b") == {"E": "single quoted", "F": "a b"}
