"""kdeploy/core/history.py: the commands run for real with bash on a temp service dir, and the parser."""

from __future__ import annotations

import io
import subprocess

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kdeploy.core.history import append_command, columns, parse, read_command

RECORD = {"time": "2025-01-02T03:04:05Z", "user": "alice", "release": "20250102T030405Z-abcdef01",
          "result": "deployed", "note": "it's $HOME `id` \"q\" \\ ü"}


def sh(command: str) -> str:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, timeout=30).stdout


def test_append_and_read_round_trip(tmp_path):
    sdir = tmp_path / "svc dir"
    sdir.mkdir()
    for i in range(5):
        sh(append_command(str(sdir), {**RECORD, "n": i}))
    lines = (sdir / "history.jsonl").read_text().splitlines()
    assert len(lines) == 5                                   # one line per deploy
    assert parse(sh(read_command(str(sdir), 3))) == [{**RECORD, "n": i} for i in (2, 3, 4)]


def test_a_new_history_file_is_for_root_only(tmp_path):
    """Even from a shell with a permissive umask (the fallback path runs in a fresh one)."""
    sdir = tmp_path / "svc"
    sdir.mkdir()
    sh(f"umask 000; {append_command(str(sdir), RECORD)}; touch {sdir}/after")
    assert (sdir / "history.jsonl").stat().st_mode & 0o777 == 0o600
    assert (sdir / "after").stat().st_mode & 0o777 == 0o666           # the caller's umask is left alone


def test_read_without_history(tmp_path):
    assert sh(read_command(str(tmp_path / "never-deployed"), 20)) == ""


def test_parse_skips_junk():
    assert parse('{"a": 1}\nnot json\n[1, 2]\n\n{"b": 2}\n{"trunc') == [{"a": 1}, {"b": 2}]


def test_columns_take_any_json_value_a_host_file_may_hold():
    """A hand-edited or foreign line used to crash the table (exit 1 after the JSON said 0)."""
    assert columns({**RECORD, "duration": 12.5}) == ["2025-01-02T03:04:05Z", "alice", "", RECORD["release"],
                                                     "deployed", "12.5"]
    odd = {"result": 5, "release": None, "user": ["x"], "controller": "[/]", "time": {"a": 1}}
    assert columns(odd) == ["{'a': 1}", "['x']", "[/]", "-", "5", ""]
    table = Table()
    for _ in range(6):
        table.add_column()
    table.add_row(*map(Text, columns(odd)))  # as the CLI shows them: text, never markup
    out = io.StringIO()
    Console(file=out, width=120).print(table)
    assert "[/]" in out.getvalue()
