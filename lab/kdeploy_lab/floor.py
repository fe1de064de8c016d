"""The floor of a deploy: what a perfect tool could reach, read from the hosts' own journals.

A deploy that restarts a service cannot be faster than the service's own restart. Per host that is the
time from systemd's "Stopping <unit>" entry to the service's ready line; for a fleet pushed at once it is
the slowest host's. The bench reports a tool's wall time as a ratio over this floor.
"""

from __future__ import annotations

import json

READY_LINE = "The server is fired up and ready to roll!"


def restart_window(journal_json: str, since: float = 0.0,
                   ready_line: str = READY_LINE) -> tuple[float, float] | None:
    """(first "Stopping" entry at or after ``since``, first ready line after it), in epoch seconds, from
    ``journalctl -u UNIT -o json --output-fields=MESSAGE,SYSLOG_IDENTIFIER`` output; None when the journal
    shows no complete restart.

    The window leaves out the time the unit sat stopped, waiting for its start: from the record before
    systemd's "Starting"/"Started" entry to that entry. A restart job spends ~10 ms there (systemd's own
    fork and exec, also left out: the floor errs low); a tool that starts the unit only after the old run
    has gone and its own work is done spends its work there, which is the tool's time, not the service's.
    The ready time returned is moved earlier by that much.
    """
    stop = idle = previous = None
    for line in journal_json.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        msg = rec.get("MESSAGE")
        if not isinstance(msg, str) or "__REALTIME_TIMESTAMP" not in rec:
            continue
        t = int(rec["__REALTIME_TIMESTAMP"]) / 1e6
        by_systemd = rec.get("SYSLOG_IDENTIFIER", "systemd") == "systemd"
        if stop is None:
            if by_systemd and msg.startswith("Stopping") and t >= since:
                stop = t
        elif ready_line in msg:
            return stop, t - (idle or 0.0)
        elif idle is None and by_systemd and msg.startswith(("Starting ", "Started ")) and previous is not None:
            idle = t - previous
        previous = t
    return None


def fleet_floor(windows: dict[str, tuple[float, float] | None]) -> tuple[float, str] | None:
    """(seconds, host) of the slowest host's restart; None unless every host has a window."""
    if not windows or any(w is None for w in windows.values()):
        return None
    host = max(windows, key=lambda h: windows[h][1] - windows[h][0])  # type: ignore[index]
    stop, ready = windows[host]  # type: ignore[misc]
    return ready - stop, host
