"""Canary analysis statistics: SGLang's Prometheus text, deltas over a window, p99 from buckets, and the
canary-vs-baseline verdict. Pure functions only; scraping and the rollout that acts on the verdict live
elsewhere.

Counters and histogram buckets are cumulative since the server started, so a window's numbers are the
difference of two scrapes (a counter that went down means the server restarted: the later value is then
the window's). Quantiles are estimated from the buckets as Prometheus' ``histogram_quantile`` does
(linear inside the bucket), so they are only as fine as SGLang's bucket bounds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TTFT = "sglang:time_to_first_token_seconds"
ITL = "sglang:inter_token_latency_seconds"
E2E = "sglang:e2e_request_latency_seconds"
REQUESTS = "sglang:num_requests_total"
ABORTED = "sglang:num_aborted_requests_total"
GENERATED = "sglang:generation_tokens_total"
ACCEPT_LENGTH = "sglang:spec_accept_length"

Labels = frozenset[tuple[str, str]]
Scrape = dict[tuple[str, Labels], float]  # (sample name, labels) -> value

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


class ParseError(ValueError):
    """A line of the exposition that is not a sample or a comment."""


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


def parse(text: str) -> Scrape:
    """Every sample of a Prometheus text exposition (version 0.0.4); comments and blank lines skipped."""
    out: Scrape = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise ParseError(f"line {number}: not a sample: {line[:80]!r}")
        name, body, raw = match.groups()
        labels = []
        if body:
            pos = 0
            while pos < len(body):
                label = _LABEL.match(body, pos)
                if not label:
                    raise ParseError(f"line {number}: bad labels: {body[:80]!r}")
                labels.append((label[1], _unescape(label[2])))
                pos = label.end()
        try:
            value = float(raw)
        except ValueError:
            raise ParseError(f"line {number}: bad value {raw!r}") from None
        out[(name, frozenset(labels))] = value
    return out


def _matches(labels: Labels, where: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in where.items())


def _delta(before: float | None, after: float) -> float:
    """A counter's increase; a decrease is a restart in between (the later value is all that was counted)."""
    if before is None or after < before:
        return after
    return after - before


def counter_delta(before: Scrape, after: Scrape, name: str, where: Mapping[str, str] | None = None) -> float:
    """The increase of counter ``name`` over the window, summed over its series that match ``where``."""
    return sum(_delta(before.get(key), value) for key, value in after.items()
               if key[0] == name and _matches(key[1], where or {}))


def gauge(scrape: Scrape, name: str, where: Mapping[str, str] | None = None) -> float | None:
    """The mean of gauge ``name`` over its matching series (one per rank); None when it is not exported."""
    values = [v for (n, labels), v in scrape.items() if n == name and _matches(labels, where or {})]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Histogram:
    """A histogram over a window: cumulative counts per upper bound (``inf`` last), count and sum."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank q*count; the highest
        finite bound when it falls in the +Inf bucket; None without observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def histogram_delta(before: Scrape, after: Scrape, name: str, where: Mapping[str, str] | None = None) -> Histogram:
    """Histogram ``name`` over the window, its matching series (e.g. streaming and not) added up."""
    where = where or {}
    by_bound: dict[float, float] = {}
    count = total = 0.0
    for key, value in after.items():
        sample, labels = key
        if not _matches(labels, where):
            continue
        if sample == name + "_bucket":
            le = dict(labels).get("le", "+Inf")
            bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
            by_bound[bound] = by_bound.get(bound, 0.0) + _delta(before.get(key), value)
        elif sample == name + "_count":
            count += _delta(before.get(key), value)
        elif sample == name + "_sum":
            total += _delta(before.get(key), value)
    return Histogram(tuple(sorted(by_bound.items())), count, total)


def merge(histograms: Iterable[Histogram]) -> Histogram:
    """Several hosts' windows as one (the baseline is every not-yet-deployed host together)."""
    by_bound: dict[float, float] = {}
    count = total = 0.0
    for h in histograms:
        for bound, cumulative in h.buckets:
            by_bound[bound] = by_bound.get(bound, 0.0) + cumulative
        count += h.count
        total += h.total
    return Histogram(tuple(sorted(by_bound.items())), count, total)


@dataclass(frozen=True)
class Window:
    """One side's (canary's or baseline's) numbers over the analysis window."""

    requests: float
    errors: float
    generated: float
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    accept_length: float | None  # the gauge at the end of the window, where exported

    @property
    def error_rate(self) -> float | None:
        seen = self.requests + self.errors
        return self.errors / seen if seen else None

    @property
    def tokens_per_second(self) -> float | None:
        """Generation throughput per request: generated tokens over the requests' summed e2e time."""
        return self.generated / self.e2e.total if self.e2e.total > 0 else None


def window(before: Scrape, after: Scrape, where: Mapping[str, str] | None = None) -> Window:
    """A host's window between two scrapes (``where``: e.g. the model_name label)."""
    return Window(requests=counter_delta(before, after, REQUESTS, where),
                  errors=counter_delta(before, after, ABORTED, where),
                  generated=counter_delta(before, after, GENERATED, where),
                  ttft=histogram_delta(before, after, TTFT, where), itl=histogram_delta(before, after, ITL, where),
                  e2e=histogram_delta(before, after, E2E, where), accept_length=gauge(after, ACCEPT_LENGTH, where))


def combine(windows: Iterable[Window]) -> Window:
    """Several hosts' windows added up (the accept length averaged over those that export it)."""
    items = list(windows)
    lengths = [w.accept_length for w in items if w.accept_length is not None]
    return Window(requests=sum(w.requests for w in items), errors=sum(w.errors for w in items),
                  generated=sum(w.generated for w in items), ttft=merge(w.ttft for w in items),
                  itl=merge(w.itl for w in items), e2e=merge(w.e2e for w in items),
                  accept_length=sum(lengths) / len(lengths) if lengths else None)


@dataclass(frozen=True)
class Bounds:
    """What a canary may not exceed relative to the baseline (``gate.analysis`` in the inventory)."""

    max_p99_ratio: float = 1.2
    max_error_rate: float = 0.001
    min_throughput_ratio: float = 0.8
    min_accept_length_ratio: float = 0.95
    min_requests: int = 20  # per side: fewer and the window says nothing


@dataclass(frozen=True)
class Check:
    metric: str
    canary: float | None
    baseline: float | None
    limit: str
    ok: bool


@dataclass(frozen=True)
class Verdict:
    """``decided``: enough traffic on both sides to judge; ``ok``: every check held (meaningless when not
    decided: the caller must say it could not analyse, never promote on it)."""

    decided: bool
    ok: bool
    checks: tuple[Check, ...]
    detail: str


def _ratio_check(metric: str, canary: float | None, baseline: float | None, limit: float, at_most: bool) -> Check:
    if canary is None or baseline is None:
        return Check(metric, canary, baseline, "not measured on both sides", True)
    if baseline == 0:
        ok = canary == 0 if at_most else True
    else:
        ratio = canary / baseline
        ok = ratio <= limit if at_most else ratio >= limit
    return Check(metric, canary, baseline, f"canary/baseline {'<=' if at_most else '>='} {limit:g}", ok)


def verdict(canary: Window, baseline: Window, bounds: Bounds) -> Verdict:
    """The canary against the baseline: error rate (absolute), p99 TTFT and ITL (ratio), throughput per
    request and speculative accept length (ratio, where both export it)."""
    if min(canary.requests, baseline.requests) < bounds.min_requests:
        return Verdict(False, False, (), f"too little traffic to judge: {canary.requests:.0f} canary and "
                                         f"{baseline.requests:.0f} baseline requests in the window (need "
                                         f"{bounds.min_requests} each)")
    rate = canary.error_rate or 0.0
    checks = (
        Check("error_rate", rate, baseline.error_rate, f"<= {bounds.max_error_rate:g}", rate <= bounds.max_error_rate),
        _ratio_check("p99_ttft_seconds", canary.ttft.quantile(0.99), baseline.ttft.quantile(0.99),
                     bounds.max_p99_ratio, True),
        _ratio_check("p99_itl_seconds", canary.itl.quantile(0.99), baseline.itl.quantile(0.99), bounds.max_p99_ratio,
                     True),
        _ratio_check("tokens_per_second_per_request", canary.tokens_per_second, baseline.tokens_per_second,
                     bounds.min_throughput_ratio, False),
        _ratio_check("spec_accept_length", canary.accept_length, baseline.accept_length,
                     bounds.min_accept_length_ratio, False),
    )
    failed = [c for c in checks if not c.ok]
    if failed:
        first = failed[0]
        return Verdict(True, False, checks, f"{first.metric}: canary {_fmt(first.canary)}, baseline "
                                            f"{_fmt(first.baseline)} ({first.limit})")
    return Verdict(True, True, checks, "; ".join(f"{c.metric} {_fmt(c.canary)} vs {_fmt(c.baseline)}" for c in checks
                                                 if c.canary is not None))


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
