"""The health gate: unit state, readiness, golden completion, and per-worker markers of the current run.

Decisions are small pure functions over what the host returned; ``run_gate`` only polls and times them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kdeploy.core import systemd
from kdeploy.core.gatespec import GateSpec
from kdeploy.core.report import HostResult, PhaseFailed
from kdeploy.host import parity
from kdeploy.host.pair import PairedHttp, Pairing
from kdeploy.ssh.remote import CONNECTION_PID, Process, Remote

if TYPE_CHECKING:
    from kdeploy.ssh.tunnel import ServiceHttp

RANK_LINE = "Load weight end."
JOURNAL_TAIL = 12
# The markers come at start-up; a service that has run for weeks (verify, status) has millions of request log
# records in the same invocation, and reading them all as JSON would take minutes. An SGLang TP8 start-up
# logs a few thousand.
STARTUP_RECORDS = 100_000
MARKER_GRACE = 15.0  # seconds after readiness for late workers' markers
# While /health is not 200 yet, the unit is read at once when its main process exits (a watcher on the
# host says so) and otherwise at most this often: each read is a round trip and a process on the host,
# and a model that loads for ten minutes must not cost the host 2,400 `systemctl show` runs.
UNIT_CHECK_EVERY = 1.0


@dataclass
class Peers:
    """The nodes of one server, gated at once: the head says when it serves and any node that fails says so,
    so a follower's wait for its ranks' markers ends with its head's grace, or at once when a peer failed."""

    ready_at: float | None = None  # monotonic time the head answered its readiness path
    failed: threading.Event = field(default_factory=threading.Event)

    def marker_deadline(self, deadline: float) -> float:
        if self.failed.is_set():
            raise PhaseFailed("stopped: another node of the server failed its gate")
        return deadline if self.ready_at is None else min(deadline, self.ready_at + MARKER_GRACE)


@dataclass(frozen=True)
class UnitVerdict:
    done: bool
    failed: bool
    detail: str


def unit_verdict(state: systemd.UnitState, invocation: str | None, restarts: int | None) -> UnitVerdict:
    """Fail fast on failed/inactive units and crash loops; pass once the expected run is up."""
    if state.load == "not-found":
        return UnitVerdict(True, True, "unit not installed")
    if state.active == "failed" or (state.active == "inactive" and state.sub == "dead"):
        return UnitVerdict(True, True, f"{state.summary} (main process status {state.main_status})")
    if state.sub == "auto-restart" or (restarts is not None and state.n_restarts > restarts):
        return UnitVerdict(True, True, f"crash loop: {state.summary}, Restart=on-failure keeps restarting it")
    if invocation and state.invocation and state.invocation != invocation:
        return UnitVerdict(True, True, "crash loop: the service restarted by itself (new invocation)")
    if state.active == "active" and state.sub == "running":
        return UnitVerdict(True, False, f"{state.summary} pid {state.main_pid}")
    return UnitVerdict(False, False, state.summary)


def completion_verdict(texts: list[str], pattern: str) -> str | None:
    """None when every run matched and all runs agree; else the reason."""
    if not re.search(pattern, texts[0]):
        return f"answer {texts[0]!r} does not match /{pattern}/"
    if any(t != texts[0] for t in texts[1:]):
        return f"temperature 0 is not deterministic: {texts[0]!r} then {texts[1]!r}"
    return None


@dataclass(frozen=True)
class MarkerVerdict:
    ok: bool
    final: bool
    detail: str


def marker_verdict(lines: list[systemd.JournalLine], markers: list[str], workers: int) -> MarkerVerdict:
    """Each marker must come from exactly ``workers`` distinct processes of this invocation."""
    rank_of: dict[int, int] = {}
    pids: dict[str, set[int]] = defaultdict(set)
    for line in lines:
        if line.rank is not None:
            rank_of.setdefault(line.pid, line.rank)
        for marker in markers:
            if marker in line.message:
                pids[marker].add(line.pid)
    ranks = set(rank_of.values())
    problems = []
    final = False
    for marker in markers:
        seen = pids[marker]
        if len(seen) == workers:
            continue
        if len(seen) > workers:
            final = True
        missing_ranks = sorted(ranks - {rank_of[p] for p in seen if p in rank_of})
        missing_pids = sorted(p for p, r in rank_of.items() if p not in seen and r in missing_ranks)
        text = f"{marker!r} in {len(seen)}/{workers} workers"
        if missing_ranks:
            text += f", missing TP{','.join(map(str, missing_ranks))} (pid {','.join(map(str, missing_pids))})"
        problems.append(text)
    if problems:
        return MarkerVerdict(False, final, "; ".join(problems))
    return MarkerVerdict(True, True, f"{len(markers)} markers x {workers} workers")


def config_verdict(lines: list[systemd.JournalLine], config_line: str, expected: dict[str, str],
                   release: str | None) -> str | None:
    """None when every worker that logged ``config_line`` runs the expected settings and release, else
    the first few workers that do not, by rank and pid (their count is the markers' business)."""
    want = {**expected, **({"release": release} if release else {})}
    wrong = []
    for line in lines:
        if config_line + " " not in line.message:
            continue
        said = dict(word.split("=", 1) for word in line.message.split(config_line, 1)[1].split() if "=" in word)
        diffs = [f"{k}={said.get(k, '?')} (want {v})" for k, v in want.items() if said.get(k) != v]
        if diffs:
            who = f"TP{line.rank} pid {line.pid}" if line.rank is not None else f"pid {line.pid}"
            wrong.append(f"{who}: {', '.join(diffs)}")
    if not wrong:
        return None
    more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return "workers run another config: " + "; ".join(wrong[:3]) + more


def _tail(remote: Remote, invocation: str) -> list[str]:
    if not invocation:
        return []
    return [line.message for line in remote.ask(systemd.journal_step(invocation, lines=JOURNAL_TAIL))]


def exit_watch_command(pid: int, seconds: float) -> str:
    """Ends when process ``pid`` exits: one idle channel instead of polling the unit over SSH.

    It also ends with the SSH connection that started it (the sshd process serving it, see
    ``remote.CONNECTION_PID``) or after ``seconds``, so it never outlives the deploy.
    """
    return (f"{CONNECTION_PID}; n=0; while [ -d /proc/{int(pid)} ] && [ -d /proc/$c ] && "
            f"[ $n -lt {int(seconds * 10) + 1} ]; do sleep 0.1; n=$((n+1)); done")


def _show(remote: Remote, unit: str) -> systemd.UnitState:
    return remote.ask(systemd.show_step(unit))


def run_gate(remote: Remote, spec: GateSpec, result: HostResult, *, release: str | None = None,
             started: systemd.UnitState | None = None, baseline: parity.Baseline | None = None,
             peers: Peers | None = None, pair: Pairing | None = None) -> parity.Record | None:
    """Run the phases; raises PhaseFailed at the first failing one. Returns the run's parity record.

    ``started`` is the unit's state right after a restart (its invocation is the run under test); without
    it the gate reads the unit and checks whatever runs now. ``release``: the release every worker must
    say it loaded (when the payload logs a config line). ``baseline``: what the ``parity`` phase compares
    the run with (no phase without it, or when the spec has no golden set). ``peers``: the other nodes of a
    server gated at the same time. ``pair``: a prefill or decode server's partner, through which its
    completions and parity prompts go (``host/pair.py``).
    """
    try:
        return _gate(remote, spec, result, release, started, baseline, peers, pair)
    except BaseException:
        if peers is not None:
            peers.failed.set()
        raise


def _gate(remote: Remote, spec: GateSpec, result: HostResult, release: str | None,
          started: systemd.UnitState | None, baseline: parity.Baseline | None,
          peers: Peers | None, pair: Pairing | None) -> parity.Record | None:
    record = None
    unit = spec.unit
    interval = spec.poll_interval
    deadline = time.monotonic() + spec.timeout

    with result.phase("unit") as phase:
        state = started or _show(remote, unit)
        restarts = state.n_restarts
        invocation = state.invocation
        while True:
            verdict = unit_verdict(state, invocation, restarts)
            if verdict.failed:
                raise PhaseFailed(verdict.detail, _tail(remote, state.invocation or invocation))
            if verdict.done:
                phase.detail = verdict.detail
                break
            if time.monotonic() > deadline:
                raise PhaseFailed(f"not running after the gate timeout: {verdict.detail}")
            time.sleep(interval)
            state = _show(remote, unit)
            invocation = invocation or state.invocation

    if spec.serves:  # a follower node's HTTP is a dummy: its unit and its ranks' markers are its proof
        record = _serving_phases(remote, spec, result, state, invocation, restarts, deadline, release, baseline,
                                 pair)
        if peers is not None:
            peers.ready_at = time.monotonic()

    with result.phase("workers") as phase:
        markers = [*spec.markers, *([spec.config_line] if spec.config_line else [])]
        if not markers:
            phase.detail = "no markers configured"
            return record
        marker_deadline = min(deadline, time.monotonic() + MARKER_GRACE)
        journal = systemd.journal_step(invocation, grep=[*markers, RANK_LINE], first=STARTUP_RECORDS)
        while True:
            lines = remote.ask(journal)
            wrong = spec.config_line and config_verdict(lines, spec.config_line, spec.config, release)
            if wrong:
                raise PhaseFailed(wrong)
            verdict = marker_verdict(lines, markers, spec.workers)
            if verdict.ok:
                phase.detail = verdict.detail + (f", config {' '.join(f'{k}={v}' for k, v in spec.config.items())}"
                                                 if spec.config_line else "")
                return record
            if not spec.serves and peers is not None:  # no readiness of its own: its head's, or a peer's end
                marker_deadline = peers.marker_deadline(deadline)
            if verdict.final or time.monotonic() > marker_deadline:
                raise PhaseFailed(verdict.detail)
            time.sleep(interval)


def _serving_phases(remote: Remote, spec: GateSpec, result: HostResult, state: systemd.UnitState,
                    invocation: str | None, restarts: int | None, deadline: float, release: str | None,
                    baseline: parity.Baseline | None, pair: Pairing | None) -> parity.Record | None:
    """Readiness, golden completions and parity, through the server's HTTP (its head's, for a server that
    spans hosts; generation through its pair for a prefill or decode server); returns the parity record."""
    from kdeploy.ssh import tunnel  # httpx loads only when a gate runs

    record = None
    unit, interval = spec.unit, spec.poll_interval
    with tunnel.ServiceHttp(remote, spec.host, spec.port, timeout=min(10.0, max(2.0, interval * 4))) as http:
        with result.phase("ready") as phase:
            watch: Process | None = None  # started by the first poll that is not 200: a serving run costs none
            try:
                polls = 0
                exited = False  # the main process is gone: from then on the unit is read at every poll
                ended = False   # the watcher ended: nothing more can cut the wait short
                next_unit_check = time.monotonic() + UNIT_CHECK_EVERY
                while True:
                    polls += 1
                    status = http.status(spec.ready_path)
                    if status == 200:
                        phase.detail = f"GET {spec.ready_path} 200 after {polls} polls"
                        break
                    if watch is None:
                        watch = remote.start(exit_watch_command(state.main_pid, deadline - time.monotonic()))
                    exited = exited or watch.exit_status_ready()
                    if exited or time.monotonic() >= next_unit_check:
                        next_unit_check = time.monotonic() + max(interval, UNIT_CHECK_EVERY)
                        state = _show(remote, unit)
                        verdict = unit_verdict(state, invocation, restarts)
                        if verdict.failed:
                            raise PhaseFailed(f"service died while starting: {verdict.detail}",
                                              _tail(remote, state.invocation or invocation))
                    if time.monotonic() > deadline:
                        raise PhaseFailed(f"GET {spec.ready_path} not 200 within the gate timeout (last: {status})")
                    if ended:
                        time.sleep(interval)
                    else:  # cut short when the main process exits (the watcher's output ends)
                        ended = watch.read_some(interval) == b""
            finally:
                if watch is not None:
                    watch.close()

        if pair is not None and pair.http is None:  # no serving partner yet: this server alone, status only
            with result.phase("completion") as phase:
                status, text = http.post_json("/v1/completions", {**_body(spec.model, "kdeploy", 1), **pair.fields()},
                                              timeout=120)
                if status != 200:
                    raise PhaseFailed(f"POST /v1/completions (fake bootstrap {pair.bootstrap_host}) -> HTTP "
                                      f"{status}: {text[:120]!r}")
                phase.detail = (f"no serving {pair.other} server to pair with: answered alone through SGLang's fake "
                                f"bootstrap host (HTTP 200); the pair is proven by the next {pair.other} server's gate")
            return None
        gen = PairedHttp(http, pair) if pair is not None else http
        with result.phase("completion") as phase:
            answers = []
            for item in spec.prompts:
                texts = [_complete(gen, spec.model, item.prompt, spec.max_tokens) for _ in range(2)]
                reason = completion_verdict(texts, item.expect)
                if reason:
                    raise PhaseFailed(f"{item.prompt!r}: {reason}")
                answers.append(texts[0].strip())
            phase.detail = "; ".join(f"{a!r}" for a in answers) + " (x2, identical)" + (
                f", through a pair with {pair.partner}" if pair else "")

        if baseline is not None and spec.parity is not None:
            with result.phase("parity") as phase:
                record = parity.capture(gen, spec.parity, spec.model, release)
                verdict = parity.check(baseline, record, spec.parity)
                phase.data = verdict.data
                if not verdict.ok:
                    raise PhaseFailed(f"parity: {verdict.detail}")
                phase.detail = verdict.detail

    return record


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _complete(http: ServiceHttp | PairedHttp, model: str, prompt: str, max_tokens: int) -> str:
    status, text = http.post_json("/v1/completions", _body(model, prompt, max_tokens), timeout=120)
    if status is None:
        raise PhaseFailed(f"POST /v1/completions failed: {text}")
    if status != 200:
        raise PhaseFailed(f"POST /v1/completions -> HTTP {status}: {text[:120]!r}")
    try:
        return str(json.loads(text)["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise PhaseFailed(f"POST /v1/completions: unexpected response {text[:120]!r}") from None
