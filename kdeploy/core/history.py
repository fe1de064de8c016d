"""Deploy history on each host: one JSON line per deploy in ``<service dir>/history.jsonl``."""

from __future__ import annotations

import json
import shlex

from kdeploy.core.layout import HISTORY
from kdeploy.core.step import Step


def append_command(service_dir: str, record: dict) -> str:
    """Append ``record``; a new history file is for root only (umask 077), like the lock record."""
    line = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"(umask 077 && printf '%s\\n' {shlex.quote(line)} >> {shlex.quote(service_dir)}/{HISTORY})"


def read_command(service_dir: str, limit: int) -> str:
    return f"tail -n {int(limit)} {shlex.quote(service_dir)}/{HISTORY} 2>/dev/null || true"


def parse(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def columns(record: dict) -> list[str]:
    """A record's time, user, controller, release, result and seconds as text: the file is the host's and may
    hold any JSON value where kdeploy writes strings."""
    cells = [record.get(k) for k in ("time", "user", "controller")]
    cells += [record.get("release") or "-", record.get("result"), record.get("duration")]
    return ["" if c is None else str(c) for c in cells]


def read_step(service_dir: str, limit: int) -> Step[list[dict]]:
    """The last ``limit`` lines of the host's history."""
    return Step(read_command(service_dir, limit), lambda out: parse(out.stdout), 30)
