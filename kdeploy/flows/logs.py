"""``kdeploy logs``: a service's journal from many hosts, over kdeploy's own SSH connections.

The journal is read on each host with one ``journalctl`` command (:func:`journal_command`, a pure builder;
:func:`journal_step` with its reading); a run is picked by ``_SYSTEMD_INVOCATION_ID``, the same key the gate
counts markers by, so "current" never mixes in lines of an earlier start. Each line is printed prefixed by its
host.
"""

from __future__ import annotations

import re
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kdeploy.core import secrets as secret
from kdeploy.core.defaults import Run
from kdeploy.core.errors import InvalidInput, KdeployError
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.render import unit_filename
from kdeploy.core.report import HostResult, Result
from kdeploy.core.step import RunResult, Step
from kdeploy.core.text import one_line
from kdeploy.flows.options import Options
from kdeploy.flows.session import connect

NO_RUN = 3  # exit status of the command when the asked-for run does not exist on the host


@dataclass(frozen=True)
class LogQuery:
    """What to read: the last ``lines`` lines (0: all) of ``run``, since ``since``, matching ``grep``."""

    lines: int = 50
    grep: str | None = None  # a POSIX extended regular expression (grep -E), applied on the host
    since: str | None = None  # anything journalctl --since takes: "1 hour ago", "2026-12-01 02:00", "today"
    run: Run = Run.ALL
    follow: bool = False

    def check(self) -> None:
        """Refuse what would only fail on the hosts (exit 2 before connecting)."""
        if self.grep is not None:
            try:
                re.compile(self.grep)
            except re.error as exc:
                raise InvalidInput(f"--grep {self.grep!r}: not a valid regular expression: {exc}") from None
        if self.lines < 0:
            raise InvalidInput("--lines must be 0 (all) or more")


def _invocation(unit: str, run: Run) -> str:
    """Shell that sets ``$inv`` to the run's invocation id (or exits NO_RUN with a reason on stderr)."""
    unit_q = shlex.quote(unit)
    current = f"cur=$(systemctl show -p InvocationID --value {unit_q})"
    if run == Run.CURRENT:
        return (f"{current}; [ -n \"$cur\" ] || {{ echo 'the unit has no current run' >&2; exit {NO_RUN}; }}; "
                "inv=$cur")
    # The previous run is the newest one that is not the current one (with the unit stopped: the newest):
    # read backwards and stop there, not through months of the unit's journal.
    runs = (f"journalctl --no-pager -r -u {unit_q} -o export --output-fields=_SYSTEMD_INVOCATION_ID | "
            "awk -F= -v cur=\"${cur:-none}\" '/^_SYSTEMD_INVOCATION_ID=/ && $2 != cur {print $2; exit}'")
    return (f"{current}; inv=$({runs}); "
            f"[ -n \"$inv\" ] || {{ echo 'the unit has no previous run in the journal' >&2; exit {NO_RUN}; }}")


def journal_command(unit: str, query: LogQuery) -> str:
    """The one shell command that prints (or follows) ``unit``'s journal as ``query`` asks."""
    words = ["journalctl", "--no-pager", "-o", "short-iso"]
    if query.since:
        words.append(f"--since={query.since}")
    pick = f"-u {shlex.quote(unit)}"
    prelude = ""
    if query.run != Run.ALL:
        prelude = _invocation(unit, query.run) + "; "
        pick = '"_SYSTEMD_INVOCATION_ID=$inv"'
    lines = query.lines if query.lines else "all"
    check = f"{shlex.join(words)} -n 0 {pick} >/dev/null || exit $?; "
    if query.follow:
        words.append("--follow")
    if query.grep is None:
        return f"{prelude}{shlex.join(words)} -n {lines} {pick}"
    # Filter first, then keep the last N matches; followed output must not wait in grep's buffer. A pipe
    # loses journalctl's status (sh has no pipefail), so a dry run with -n 0 reports a bad --since first.
    words += ["-n", "all"] if not query.follow else ["-n", str(lines)]
    grep = f"grep --line-buffered -E -e {shlex.quote(query.grep)}"
    tail = "" if query.follow or not query.lines else f" | tail -n {query.lines}"
    return f"{prelude}{check}{shlex.join(words)} {pick} | {grep}{tail}; true"


def journal_step(unit: str, query: LogQuery) -> Step[str]:
    """Read (not follow) ``unit``'s journal: its text, or the host's one-line refusal (a --since journalctl
    rejects, no such run) as invalid input."""
    return Step(journal_command(unit, query), _journal_text, timeout=120)


def _journal_text(out: RunResult) -> str:
    if not out.ok:
        raise InvalidInput(out.last_error())  # the report names the host
    return out.stdout


def prefixed(host: str, text: str) -> list[str]:
    """``host | line`` for every line of ``text``."""
    return [f"{host} | {line}" for line in text.splitlines()]


def read(inventory: Inventory, host: HostConfig, query: LogQuery, opts: Options, result: HostResult,
         emit: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> list[str]:
    """One host's journal lines; with ``query.follow`` each line goes to ``emit`` as it comes, until ``stop``."""
    unit = unit_filename(host.service)
    with connect(inventory, host, result, opts.reach) as remote:
        if not query.follow:
            with result.phase("journal") as phase:
                text = remote.ask(journal_step(unit, query))
                phase.detail = f"{len(text.splitlines())} lines"
            result.finish(Result.OK)
            return prefixed(host.name, text)
        process = remote.start(journal_command(unit, query), timeout=None)
        buffered = b""
        try:
            while not (stop and stop.is_set()):
                chunk = process.read_some(0.5)  # short waits: a stop is seen within half a second
                if chunk is None:
                    continue
                if not chunk:
                    break
                buffered += chunk
                *complete, buffered = buffered.split(b"\n")
                for line in complete:
                    if emit:
                        emit(f"{host.name} | {line.decode(errors='replace')}")
            if not (stop and stop.is_set()) and process.wait(10):
                raise InvalidInput(process.stderr().strip())
        finally:
            process.close()
        result.finish(Result.OK)
        return []


def masker(inventory: Inventory, names: list[str]) -> Callable[[str], str]:
    """Masks every value of the hosts' secrets that the controller knows now (``***``): a service that logs its
    own environment must not put a token on a CI log. Unset variables are no error here: nothing to mask."""
    known = [s for s in (secret.resolve(inventory, inventory.hosts[n], strict=False) for n in names) if s]
    values = {v for s in known for v in s.values.values()}
    return lambda text: secret.mask(text, values)


def run(inventory: Inventory, names: list[str], query: LogQuery, opts: Options,
        emit: Callable[[str], None], stop: threading.Event) -> list[HostResult]:
    """Read (or follow) every host at once; lines go to ``emit`` with secrets masked, then made one line
    (:func:`one_line`: a journal line with a ``\\r`` or an escape sequence cannot draw over its host's prefix),
    each host's in one piece unless following."""
    results = {name: inventory.result(name) for name in names}
    lock = threading.Lock()
    mask = masker(inventory, names)

    def locked_emit(line: str) -> None:
        with lock:
            emit(one_line(mask(line)))

    def one(name: str) -> None:
        result = results[name]
        try:
            lines = read(inventory, inventory.hosts[name], query, opts, result, locked_emit, stop)
        except KdeployError as exc:
            result.fail(exc)
            return
        with lock:
            for line in lines:
                emit(one_line(mask(line)))

    threads = [threading.Thread(target=one, args=(n,), name=f"kdeploy-logs-{n}", daemon=True) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)  # short joins, so Ctrl-C reaches the main thread at once
    return list(results.values())
