"""Canary analysis in a rollout: once the canary passed its gate and is back in its router, its SGLang
metrics are watched against the baseline's (the hosts behind the same router not yet deployed) for a
window, and the rollout goes on only if they hold up (docs/gate.md, Canary analysis).

The statistics are ``analysis.py``'s; this module plans an analysis (canary, baseline, whether it can be
done at all), scrapes ``/metrics`` over each host's SSH connection, makes the one decision (promote, roll
back, or say it was not analysed) and acts on it: a failed canary goes back as ``kdeploy rollback`` puts a
host back (drained, restarted, gated, admitted). A TTY gets a live view of the window.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kdeploy.core import analysis
from kdeploy.core.defaults import WEEK
from kdeploy.core.errors import InvalidInput, KdeployError, PreflightRefused
from kdeploy.core.inventory import Inventory
from kdeploy.core.report import Cancelled, HostResult, Listener, PhaseFailed, Result

if TYPE_CHECKING:  # the router client imports httpx: only a rollout that analyses pays for it
    from kdeploy.flows.options import Options
    from kdeploy.host.router import RouterClient

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
SCRAPE_TIMEOUT = 10.0


def parse_duration(text: str, option: str = "--analysis") -> float:
    """``90``, ``30s``, ``5m``, ``1h``, ``500ms``: seconds, more than 0 and at most a week (else exit 2)."""
    match = _DURATION.match(text)
    if not match:
        raise InvalidInput(f"{option} {text!r}: expected a duration such as 90, 30s, 5m or 1h")
    seconds = float(match[1]) * _UNIT[match[2]]
    if not 0 < seconds <= WEEK:
        raise InvalidInput(f"{option} {text!r}: expected more than 0 seconds and at most a week")
    return seconds


@dataclass(frozen=True)
class Settings:
    """One rollout's analysis. ``required``: asked for on the command line (``--analysis``), so an analysis
    that cannot be done refuses the rollout (before a change) or rolls the canary back (after it); from the
    inventory alone it is reported as not analysed and the rollout goes on."""

    duration: float
    interval: float
    bounds: analysis.Bounds
    required: bool


def settings(inventory: Inventory, names: list[str], duration: float | None) -> Settings | None:
    """``--analysis`` (``duration``) over the bounds of ``gate.analysis`` of the first selected host that sets
    one (defaults without); None when neither asks for an analysis."""
    from kdeploy.core.inventory import AnalysisGate

    gate = next((a for n in names if (a := inventory.hosts[n].service.gate.analysis) is not None), None)
    if gate is None and duration is None:
        return None
    gate = gate or AnalysisGate()
    length = duration if duration is not None else gate.duration
    return Settings(length, min(gate.interval, length), gate.bounds(), duration is not None)


def baseline_of(inventory: Inventory, canary: list[str], rest: list[str]) -> tuple[list[str], str | None]:
    """The baseline (hosts of ``rest`` behind a router of the canary's, of the canary's role) and why no analysis
    is possible, if so. A prefill server is compared with prefill servers only, a decode server with decode
    servers (time to first token is mostly a prefill's, inter-token latency a decode's)."""
    from kdeploy.host.router import key_of

    without = [n for n in canary if inventory.hosts[n].router is None]
    if without:
        return [], (f"{', '.join(without)}: no router in the inventory (the analysis compares a canary that serves "
                    "its router's traffic with the hosts the router also serves)")
    roles = {inventory.hosts[n].service.role for n in canary}
    if len(roles) > 1:
        return [], (f"a canary of servers of several roles ({', '.join(sorted(roles))}): each role is compared with "
                    "its own baseline, so a canary takes servers of one role (--canary 1)")
    keys = {key_of(r) for n in canary if (r := inventory.hosts[n].router) is not None}
    baseline = [n for n in rest if (r := inventory.hosts[n].router) is not None and key_of(r) in keys
                and inventory.hosts[n].service.role in roles]
    if not baseline:
        return [], ("no baseline: no host behind the canary's router is left to deploy after it (--canary N must "
                    "leave hosts of the router, of the canary's role, on the old release)")
    return baseline, None


class Action(StrEnum):
    PROMOTE = "promoted"
    ROLL_BACK = "rolled_back"
    NOT_ANALYSED = "not_analysed"


def decide(verdict: analysis.Verdict | None, impossible: str | None, required: bool) -> tuple[Action, str]:
    """The one decision on a canary after its window: a verdict from enough traffic promotes or rolls back;
    no verdict (too little traffic, metrics lost) rolls back when the analysis was required, else the canary
    stays, reported as not analysed (never as passed)."""
    if verdict is not None and verdict.decided:
        return (Action.PROMOTE, verdict.detail) if verdict.ok else (Action.ROLL_BACK, verdict.detail)
    why = impossible or (verdict.detail if verdict is not None else "no verdict")
    return (Action.ROLL_BACK, f"no verdict: {why}") if required else (Action.NOT_ANALYSED, why)


METRICS = ("requests", "error_rate", "p99_ttft_seconds", "p99_itl_seconds", "tokens_per_second_per_request",
           "spec_accept_length")


def values(window: analysis.Window) -> dict[str, float | None]:
    """A side's numbers as the verdict reads them, for the live view, the series and the plot."""
    return {"requests": window.requests, "error_rate": window.error_rate,
            "p99_ttft_seconds": window.ttft.quantile(0.99), "p99_itl_seconds": window.itl.quantile(0.99),
            "tokens_per_second_per_request": window.tokens_per_second, "spec_accept_length": window.accept_length}


@dataclass(frozen=True)
class Snapshot:
    """The window so far: what the live view draws and the series records."""

    elapsed: float
    duration: float
    canary: dict[str, float | None]
    baseline: dict[str, float | None]
    bounds: analysis.Bounds
    hosts: tuple[tuple[str, ...], tuple[str, ...]]  # (canary, baseline)

    def point(self) -> dict:
        return {"t": round(self.elapsed, 2), "canary": self.canary, "baseline": self.baseline}


class AnalysisWatcher:
    """A listener that also wants the window's snapshots (the TTY's live view); plain listeners do not."""

    def window(self, snapshot: Snapshot | None) -> None:
        """Called after each scrape; None once the window ended."""
        raise NotImplementedError


def _sides(first: dict[str, analysis.Scrape], last: dict[str, analysis.Scrape], canary: list[str],
           baseline: list[str]) -> tuple[analysis.Window, analysis.Window]:
    def side(names: list[str]) -> analysis.Window:
        return analysis.combine(analysis.window(first[n], last[n]) for n in names)

    return side(canary), side(baseline)


class Scraper:
    """``GET /metrics`` of each host over its own SSH connection, all hosts at once."""

    def __init__(self, inventory: Inventory, names: list[str], opts: Options) -> None:
        self.inventory, self.names, self.opts = inventory, names, opts
        self.clients: dict = {}
        self.remotes: list = []
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(names))), thread_name_prefix="kdeploy-scrape")

    def open(self) -> dict[str, str]:
        """Connect to every host; host -> why for those that cannot be reached."""
        from kdeploy.flows.session import open_remote
        from kdeploy.ssh.tunnel import ServiceHttp

        def one(name: str) -> str | None:
            host = self.inventory.hosts[name]
            try:
                remote = open_remote(self.inventory, host, self.opts.reach)
            except KdeployError as exc:
                return str(exc)
            self.remotes.append(remote)
            self.clients[name] = ServiceHttp(remote, host.service.sglang.host, host.service.sglang.port,
                                             timeout=SCRAPE_TIMEOUT)
            return None

        return {n: why for n, why in zip(self.names, self.pool.map(one, self.names), strict=True) if why}

    def scrape(self) -> dict[str, analysis.Scrape | str]:
        """Each host's parsed metrics, or why there are none (no SGLang metrics is a reason too)."""
        import httpx

        def one(name: str) -> analysis.Scrape | str:
            try:
                response = self.clients[name].client.get("/metrics")
            except httpx.HTTPError as exc:
                return f"GET /metrics: {type(exc).__name__}: {exc}"
            if response.status_code != 200:
                return f"GET /metrics answered {response.status_code} (is SGLang started with --enable-metrics?)"
            try:
                scrape = analysis.parse(response.text)
            except analysis.ParseError as exc:
                return f"/metrics: {exc}"
            if not any(key[0] == analysis.REQUESTS for key in scrape):
                return f"/metrics has no {analysis.REQUESTS} (is SGLang started with --enable-metrics?)"
            return scrape

        return dict(zip(self.names, self.pool.map(one, self.names), strict=True))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for remote in self.remotes:
            remote.close()
        self.pool.shutdown(wait=True)


def _unavailable(found: dict[str, analysis.Scrape | str] | dict[str, str]) -> str | None:
    bad = [f"{n}: {why}" for n, why in found.items() if isinstance(why, str)]
    return "metrics unavailable: " + "; ".join(bad) if bad else None


@dataclass
class Outcome:
    verdict: analysis.Verdict | None
    impossible: str | None
    series: list[dict]


class Analysis:
    """One rollout's canary analysis: ``before`` the first restart, ``after`` the canary's batch."""

    def __init__(self, inventory: Inventory, opts: Options, settings: Settings, results: dict[str, HostResult],
                 listener: Listener | None, cancel: threading.Event) -> None:
        self.inventory, self.opts, self.settings, self.results = inventory, opts, settings, results
        self.watcher = listener if isinstance(listener, AnalysisWatcher) else None
        self.cancel = cancel
        self.not_analysed: str | None = None  # why, when it cannot be done and was not required

    @classmethod
    def plan(cls, inventory: Inventory, names: list[str], opts: Options, results: dict[str, HostResult],
             listener: Listener | None, cancel: threading.Event) -> Analysis | None:
        """The rollout's analysis, if one is asked for and there is a canary; a required one that the
        inventory already rules out (no router, no baseline) is refused here, before anything changes."""
        wanted = settings(inventory, names, opts.policy.analysis)
        if wanted is None or not opts.policy.canary:
            return None
        self = cls(inventory, opts, wanted, results, listener, cancel)
        self._possible(names[:opts.policy.canary], names[opts.policy.canary:])
        return self

    def _possible(self, canary: list[str], rest: list[str]) -> list[str]:
        baseline, why = baseline_of(self.inventory, canary, rest)
        if why:
            self._impossible(why)
        return baseline

    def _impossible(self, why: str) -> None:
        if self.settings.required:
            raise PreflightRefused(f"canary analysis impossible: {why}")
        self.not_analysed = self.not_analysed or why

    def before(self, batches: list[list[str]]) -> str | None:
        """After staging, before the first restart: is there a baseline, and can every canary and baseline
        host's metrics be read? The refusal (of a required analysis only), else None."""
        if self.not_analysed or not batches:
            return None
        try:
            baseline = self._possible(batches[0], [n for batch in batches[1:] for n in batch])
            if baseline:
                scraper = Scraper(self.inventory, batches[0] + baseline, self.opts)
                try:
                    why = _unavailable(scraper.open()) or _unavailable(scraper.scrape())
                finally:
                    scraper.close()
                if why:
                    self._impossible(why)
        except PreflightRefused as exc:
            return str(exc)
        return None

    def after(self, canary: list[str], rest: list[str], previous: Callable[[str], dict[str, str | None]],
              routers: dict[str, RouterClient]) -> str | None:
        """The window, the decision, and what it asks for. Why the rest is not deployed, else None.
        ``canary``, ``rest``: servers by their heads; ``previous(head)``: the release each node of a canary
        server goes back to; ``routers``: each head's router."""
        results = [self.results[n] for n in canary]
        baseline, gone = baseline_of(self.inventory, canary, [n for n in rest if not self.results[n].done])
        impossible = self.not_analysed or gone
        with ExitStack() as stack:
            phases = [stack.enter_context(r.phase("analysis")) for r in results]
            try:
                outcome = Outcome(None, impossible, []) if impossible else self.window(canary, baseline)
            except (Cancelled, KeyboardInterrupt):  # the window runs in the main thread: Ctrl-C lands here
                self.cancel.set()
                why = "interrupted during the window"
                for phase in phases:
                    phase.ok, phase.detail = False, f"{why}: not analysed"
                    phase.data = self._data(canary, baseline, Outcome(None, why, []), "interrupted", why)
                return "not restarted: interrupted"
            action, why = decide(outcome.verdict, outcome.impossible, self.settings.required)
            data = self._data(canary, baseline, outcome, str(action), why)
            for phase in phases:
                phase.data = data
                phase.ok = action != Action.ROLL_BACK
                phase.detail = {Action.PROMOTE: f"promoted: {why}", Action.ROLL_BACK: f"FAILED: {why}",
                                Action.NOT_ANALYSED: f"NOT ANALYSED: {why}"}[action]
        if action == Action.NOT_ANALYSED:
            for result in results:
                result.log.append(f"warning: canary analysis not done ({why}); the rollout went on without it")
            return None
        if action == Action.PROMOTE:
            return None
        with ThreadPoolExecutor(max_workers=len(canary)) as pool:
            list(pool.map(lambda n: self._roll_back(n, previous(n), routers.get(n), why), canary))
        return f"not restarted: the canary analysis failed ({why})"

    def window(self, canary: list[str], baseline: list[str]) -> Outcome:
        """Scrape every host at the start, every ``interval`` and at the end of the window; the verdict on the
        deltas from the first scrape to the last."""
        s = self.settings
        scraper = Scraper(self.inventory, canary + baseline, self.opts)
        series: list[dict] = []
        try:
            why = _unavailable(scraper.open())
            first = {} if why else scraper.scrape()
            why = why or _unavailable(first)
            if why:
                return Outcome(None, why, series)
            last = dict(first)
            started = time.monotonic()
            deadline = started + s.duration
            while True:  # at least one scrape after the first, the last one at the end of the window
                left = deadline - time.monotonic()
                if left > 0 and self.cancel.wait(min(s.interval, left)):
                    raise Cancelled("interrupted during the canary analysis")
                now = scraper.scrape()
                lost = _unavailable(now)
                last.update({n: v for n, v in now.items() if not isinstance(v, str)})
                c, b = _sides(first, last, canary, baseline)  # type: ignore[arg-type]
                snap = Snapshot(time.monotonic() - started, s.duration, values(c), values(b), s.bounds,
                                (tuple(canary), tuple(baseline)))
                series.append(snap.point())
                if self.watcher:
                    self.watcher.window(snap)
                if time.monotonic() >= deadline:
                    break
            if lost:
                return Outcome(None, f"{lost} (at the end of the window)", series)
            c, b = _sides(first, last, canary, baseline)  # type: ignore[arg-type]
            return Outcome(analysis.verdict(c, b, s.bounds), None, series)
        finally:
            if self.watcher:
                self.watcher.window(None)
            scraper.close()

    def _data(self, canary: list[str], baseline: list[str], outcome: Outcome, decision: str, why: str) -> dict:
        s = self.settings
        verdict = outcome.verdict
        failed = next((c for c in verdict.checks if not c.ok), None) if verdict else None
        return {"decision": decision, "reason": why, "required": s.required, "duration": s.duration,
                "interval": s.interval, "bounds": asdict(s.bounds), "canary": canary, "baseline": baseline,
                "failed": asdict(failed) if failed else None,
                "checks": [asdict(c) for c in verdict.checks] if verdict else [],
                "series": outcome.series}

    def _roll_back(self, head: str, previous: dict[str, str | None], router: RouterClient | None,
                   why: str) -> None:
        """The canary server (known by its head) back on each node's ``previous`` release through the one way
        back of a server, ``rollback_server``; every node ends ``rolled_back``."""
        from kdeploy.flows.rollback import rollback_server

        server = self.inventory.server_of(head)
        results = {n: self.results[n] for n in server.nodes}
        to = {n: p for n, p in previous.items() if p is not None}
        if len(to) < len(server.nodes):
            for result in results.values():
                result.finish(Result.ROLLBACK_FAILED, f"canary analysis failed ({why}); first deploy of this "
                                                      "server: no release to go back to")
            return
        backs = {n: HostResult(n, listener=r.listener, server=r.server) for n, r in results.items()}
        with ExitStack() as stack:
            for back in backs.values():
                stack.enter_context(back.prefixed("rollback "))
            try:
                rollback_server(self.inventory, server, self.opts, backs, router=router, to=to)
            except (KdeployError, PhaseFailed, Cancelled) as exc:
                for back in backs.values():
                    back.fail(exc)
        for name, result in results.items():
            back = backs[name]
            result.phases += back.phases
            result.log += back.log
            result.router = back.router or result.router
            result.release = back.release or result.release
            if back.result == Result.RESTORED:
                result.finish(Result.ROLLED_BACK, f"canary analysis failed: {why}; back on {to[name]}")
            else:
                result.finish(Result.ROLLBACK_FAILED, f"canary analysis failed ({why}); putting {to[name]} back "
                                                      f"failed: {back.error}")


_SHOWN = (("requests", "requests", "{:.0f}", None),
          ("error_rate", "error rate", "{:.3%}", "max_error_rate"),
          ("p99_ttft_seconds", "p99 TTFT", "{:.3f}s", "max_p99_ratio"),
          ("p99_itl_seconds", "p99 ITL", "{:.4f}s", "max_p99_ratio"),
          ("tokens_per_second_per_request", "tokens/s per request", "{:.2f}", "min_throughput_ratio"),
          ("spec_accept_length", "spec accept length", "{:.2f}", "min_accept_length_ratio"))


def view_rows(snapshot: Snapshot) -> list[tuple[str, str, str, str]]:
    """(metric, canary, baseline, bound) per metric, as the live view shows them."""
    bounds = asdict(snapshot.bounds)
    rows = []
    for key, label, fmt, bound in _SHOWN:
        canary, baseline = snapshot.canary.get(key), snapshot.baseline.get(key)
        if key == "spec_accept_length" and canary is None and baseline is None:
            continue
        limit = "-" if bound is None else (f"<= {bounds[bound]:.3%}" if bound == "max_error_rate"
                                          else f"canary/baseline {'<=' if bound.startswith('max') else '>='} "
                                               f"{bounds[bound]:g}")
        rows.append((label, "-" if canary is None else fmt.format(canary),
                     "-" if baseline is None else fmt.format(baseline), limit))
    return rows


class LiveView(AnalysisWatcher):
    """The TTY's view of the window (canary vs baseline per metric, time left), drawn under the phase table;
    a plain listener otherwise (``inner`` gets every event)."""

    def __init__(self, inner: Listener) -> None:
        self.inner = inner
        self.snapshot: Snapshot | None = None

    def __call__(self, host: str, phase: str, status: str) -> None:
        self.inner(host, phase, status)

    def window(self, snapshot: Snapshot | None) -> None:
        self.snapshot = snapshot

    def render(self):  # -> rich Table | None
        from rich.table import Table

        snap = self.snapshot
        if snap is None:
            return None
        canary, baseline = snap.hosts
        table = Table(title=f"canary analysis: {', '.join(canary)} vs {', '.join(baseline)}, "
                            f"{max(0.0, snap.duration - snap.elapsed):.0f}s left", title_justify="left")
        for column in ("metric", "canary", "baseline", "bound"):
            table.add_column(column)
        for row in view_rows(snap):
            table.add_row(*row)
        return table
