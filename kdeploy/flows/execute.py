"""``kdeploy exec``: one command on many hosts over kdeploy's own connections (docs/exec.md).

The command goes through the one executor, :meth:`Remote.run` (host keys verified, ssh_config resolved, as
every command). Closing its channel would not end it (sshd signals no command without a pty, and ignores
SSH's ``signal`` request for root logins), so :func:`remote_command` marks it with a variable of its own
(``KDEPLOY_EXEC=<random token>``), which every process it starts inherits; on Ctrl-C or ``--timeout`` the
channel is closed and :func:`stop_command`, a second command over the same connection, ends every process
of the host that carries the mark (SIGTERM, then SIGKILL after ``KILL_GRACE`` s).
"""

from __future__ import annotations

import secrets
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.report import Cancelled, HostResult, Report, Result
from kdeploy.core.text import one_line
from kdeploy.flows import fleet
from kdeploy.flows.logs import masker
from kdeploy.flows.options import Options
from kdeploy.flows.session import connect
from kdeploy.ssh.remote import Stopped

MARK = "KDEPLOY_EXEC"  # the variable that marks the processes of one exec on a host
KILL_GRACE = 2  # seconds a stopped command's processes get between SIGTERM and SIGKILL
STOP_TIMEOUT = 30.0  # seconds the stop command may take (it waits KILL_GRACE at most)


@dataclass(frozen=True)
class Output:
    """What the command left on one host (``--json``: the host's ``exec``)."""

    key: ClassVar[str] = "exec"
    exit_status: int | None  # None: it was stopped (--timeout, Ctrl-C) before it exited; output: until then
    stdout: str
    stderr: str

    def to_json(self) -> dict:
        return {"exit_status": self.exit_status, "stdout": self.stdout, "stderr": self.stderr}


def command_line(words: list[str]) -> str:
    """COMMAND... as ssh makes it: the words joined by spaces, for the host's ``/bin/sh`` to parse."""
    return " ".join(words)


def new_token() -> str:
    """The mark of one exec: random, so that no other process on the host carries it by chance."""
    return secrets.token_hex(12)


def remote_command(command: str, token: str) -> str:
    """``command`` run by ``/bin/sh`` with stdin from /dev/null and ``KDEPLOY_EXEC=<token>`` in its
    environment (and so in that of everything it starts); its exit status is the command's."""
    return f"{MARK}={token}; export {MARK}; exec /bin/sh -c {shlex.quote(command)} </dev/null"


def stop_command(token: str) -> str:
    """End every process of the host marked with ``token``: SIGTERM, then SIGKILL to those left after
    ``KILL_GRACE`` s (one that ignores SIGTERM, one that was starting as the first look was taken)."""
    find = f"grep -lsaF -e {MARK}={token} /proc/[0-9]*/environ | cut -d/ -f3"
    return (f'pids=$({find}); [ -z "$pids" ] || kill -TERM $pids 2>/dev/null; i=0\n'
            f'while [ $i -lt {KILL_GRACE * 10} ]; do pids=$({find}); [ -n "$pids" ] || exit 0; sleep 0.1; '
            'i=$((i + 1)); done\n'
            'kill -KILL $pids 2>/dev/null; true')


def run_host(inventory: Inventory, host: HostConfig, command: str, opts: Options, result: HostResult,
             cancel: threading.Event, timeout: float | None, mask: Callable[[str], str], become: bool = True) -> None:
    """Run ``command`` on one host until it exits, ``timeout`` passes or ``cancel`` is set; as the host's
    ``become_user`` where the inventory sets ``become``, like every command, unless ``become`` is False (then
    as the SSH user, without asking sudo for anything)."""
    if not become:
        host = host.model_copy(update={"become": False})
    with connect(inventory, host, result, opts.reach) as remote, result.phase("exec") as phase:
        deadline = None if timeout is None else time.monotonic() + timeout

        def stop() -> bool:
            return cancel.is_set() or (deadline is not None and time.monotonic() >= deadline)

        token = new_token()
        try:
            out = remote.run(remote_command(command, token), timeout=None, stop=stop)
        except Stopped as stopped:
            remote.run(stop_command(token), timeout=STOP_TIMEOUT)
            result.details = Output(None, mask(stopped.stdout), mask(stopped.stderr))
            if cancel.is_set():
                raise Cancelled("interrupted: the command was stopped") from None
            phase.ok, phase.detail = False, f"timed out after {timeout:g}s: the command was stopped"
            result.finish(Result.COMMAND_FAILED, phase.detail)
            return
        result.details = Output(out.rc, mask(out.stdout), mask(out.stderr))
        phase.ok, phase.detail = out.ok, f"exit {out.rc}"
    if out.ok:
        result.finish(Result.OK)
    else:
        last = mask(out.last_error()) if out.stderr.strip() else ""
        result.finish(Result.COMMAND_FAILED, f"exit {out.rc}{f': {last}' if last else ''}")


def run(inventory: Inventory, target: str, words: list[str], opts: Options | None = None, *,
        parallel: int = fleet.DEFAULT_PARALLEL, timeout: float | None = None,
        on_done: Callable[[HostResult], None] | None = None, cancel: threading.Event | None = None,
        become: bool = True) -> Report:
    """``kdeploy exec TARGET -- COMMAND...``: at most ``parallel`` hosts at once; ``on_done`` gets each host as
    it ends (from its worker thread). Ctrl-C in the main thread (or ``cancel``) stops every running command.
    ``become=False`` (``--no-become``): as the SSH user even where the inventory sets ``become``."""
    opts = opts or Options()
    names = inventory.resolve(target)
    command = command_line(words)
    cancel = cancel or threading.Event()
    mask = masker(inventory, names)
    lock = threading.Lock()

    def one(host: HostConfig, result: HostResult) -> None:
        try:
            run_host(inventory, host, command, opts, result, cancel, timeout, mask, become)
        finally:
            if on_done is not None and result.details is not None:
                with lock:
                    on_done(result)

    return fleet.fan_out(inventory, names, "exec", one, parallel=parallel, cancel=cancel)


def lines(result: HostResult) -> tuple[list[str], list[str]]:
    """A host's stdout and stderr lines, each prefixed ``<host>: `` and made one line (a ``\\r`` or an escape
    sequence would draw over the prefix: :func:`one_line`)."""
    out = result.details if isinstance(result.details, Output) else Output(None, "", "")
    return ([f"{result.host}: {one_line(line)}" for line in out.stdout.splitlines()],
            [f"{result.host}: {one_line(line)}" for line in out.stderr.splitlines()])
