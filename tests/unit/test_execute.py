"""kdeploy/flows/execute.py: the commands ``kdeploy exec`` runs on each host, tried with the real /bin/sh here (the
sandbox test drives them over SSH): the command's exit status and output pass through, and the stop command
(what Ctrl-C and --timeout run) ends everything the command started, even what ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kdeploy.core.report import HostResult
from kdeploy.flows import execute


def _running(command: str) -> list[int]:
    """PIDs whose command line is ``command``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode() == command:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_until(condition, what: str, limit: float = 20) -> None:
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            pytest.fail(what)
        time.sleep(0.05)


def test_the_commands_status_and_output_pass_through() -> None:
    done = subprocess.run(["/bin/sh", "-c", execute.remote_command("echo out; echo err >&2; exit 3", "t")],
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_the_command_gets_no_stdin() -> None:
    done = subprocess.run(["/bin/sh", "-c", execute.remote_command("cat; echo end", "t")], input="typed\n",
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "end\n")


@pytest.mark.parametrize("ignores_term", [False, True])
def test_the_stop_command_ends_everything_the_command_started(ignores_term: bool) -> None:
    marker = f"{4000 + os.getpid() % 1000}.{int(ignores_term) + 1}"
    trap = "trap '' TERM; " if ignores_term else ""
    token = execute.new_token()
    command = f"{trap}sleep {marker} & setsid sleep {marker}; echo never"  # one escapes its process group too
    proc = subprocess.Popen(["/bin/sh", "-c", execute.remote_command(command, token)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait_until(lambda: len(_running(f"sleep {marker}")) == 2, "the command did not start")
        other = subprocess.Popen(["sleep", marker])  # the same command, not marked: left alone
        stop = subprocess.run(["/bin/sh", "-c", execute.stop_command(token)], capture_output=True, text=True,
                              timeout=30)
        assert stop.returncode == 0, stop.stderr
        _wait_until(lambda: _running(f"sleep {marker}") == [other.pid], "a marked process outlived the stop")
        assert proc.wait(timeout=30) != 0
        assert proc.stdout is not None and proc.stdout.read() == b""
        other.kill()
        other.wait()
    finally:
        for pid in _running(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_the_stop_command_with_nothing_to_stop_succeeds() -> None:
    stop = subprocess.run(["/bin/sh", "-c", execute.stop_command(execute.new_token())], capture_output=True,
                          text=True, timeout=30)
    assert (stop.returncode, stop.stderr) == (0, "")


def test_words_are_joined_as_ssh_joins_them_and_lines_are_prefixed_by_host() -> None:
    assert execute.command_line(["systemctl", "is-active", "'a b'", "|", "cat"]) == "systemctl is-active 'a b' | cat"
    result = HostResult("h1")
    result.details = execute.Output(0, "8\nx\n", "warn\n")
    assert execute.lines(result) == (["h1: 8", "h1: x"], ["h1: warn"])
    assert execute.lines(HostResult("h2")) == ([], [])


def test_lines_cannot_draw_over_their_host_prefix() -> None:
    """A ``\\r`` or an escape sequence in the output is written escaped: it cannot hide ``h1:`` on a terminal."""
    result = HostResult("h1")
    result.details = execute.Output(0, "ok\rkdeploy: fake\x1b[2K\n", "")
    assert execute.lines(result) == (["h1: ok", "h1: kdeploy: fake\\x1b[2K"], [])  # splitlines ends a line at \r


@pytest.mark.parametrize(("become", "as_become"), [(True, True), (False, False)])
def test_no_become_runs_the_command_as_the_ssh_user(monkeypatch: pytest.MonkeyPatch, become: bool,
                                                    as_become: bool) -> None:
    """With become in the inventory, exec runs as become_user unless ``become=False`` (``--no-become``)."""
    from kdeploy.core.inventory import load

    inventory = load(Path(__file__).resolve().parents[2] / "inventory.yaml")
    host = next(iter(inventory.hosts.values())).model_copy(update={"user": "deploy", "become": True})
    seen: list[bool] = []

    class Connected(Exception):
        pass

    def connect(inv, connected, result, reach):
        seen.append(connected.become)
        raise Connected

    monkeypatch.setattr(execute, "connect", connect)
    with pytest.raises(Connected):
        execute.run_host(inventory, host, "id -un", execute.Options(), HostResult(host.name), None, None, str,
                         become=become)
    assert seen == [as_become]
