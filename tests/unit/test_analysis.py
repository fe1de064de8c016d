"""Canary analysis statistics on SGLang 0.5.23's Prometheus text: parsing, window deltas, p99, verdict."""

from __future__ import annotations

import math

import pytest

from kdeploy.core import analysis

TTFT_BOUNDS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4)
LABELS = 'model_name="m",engine_type="unified"'


def exposition(requests: int, errors: int, tokens: int, ttft: list[float], itl: list[float],
               accept: float | None = None) -> str:
    """A /metrics page in SGLang's shape (as the reference server writes it) for these observations."""
    lines = ["# HELP sglang:num_requests_total Number of requests processed.",
             "# TYPE sglang:num_requests_total counter",
             f'sglang:num_requests_total{{{LABELS},is_streaming="false"}} {float(requests)}',
             f'sglang:num_requests_total{{{LABELS},is_streaming="true"}} 0.0',
             f"sglang:num_aborted_requests_total{{{LABELS}}} {float(errors)}",
             f'sglang:generation_tokens_total{{{LABELS},is_streaming="false"}} {float(tokens)}']
    for name, values, labels in ((analysis.TTFT, ttft, LABELS + ',is_streaming="false"'), (analysis.ITL, itl, LABELS),
                                 (analysis.E2E, [v * 4 for v in ttft], LABELS + ',is_streaming="false"')):
        lines.append(f"# TYPE {name} histogram")
        for bound in TTFT_BOUNDS:
            lines.append(f'{name}_bucket{{{labels},le="{float(bound)}"}} {float(sum(v <= bound for v in values))}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(len(values))}')
        lines.append(f"{name}_count{{{labels}}} {float(len(values))}")
        lines.append(f"{name}_sum{{{labels}}} {sum(values)}")
    if accept is not None:
        lines.append(f'sglang:spec_accept_length{{{LABELS},tp_rank="0",pp_rank="0",moe_ep_rank="0"}} {accept}')
    return "\n".join(lines) + "\n"


def test_parse_reads_samples_labels_and_escapes_and_rejects_garbage() -> None:
    scrape = analysis.parse('# HELP x y\nfoo{a="1",b="say \\"hi\\"\\n"} 2.5 1700000000\nbar 3\n\n'
                            'baz_bucket{le="+Inf"} +Inf\n')
    assert scrape[("foo", frozenset({("a", "1"), ("b", 'say "hi"\n')}))] == 2.5
    assert scrape[("bar", frozenset())] == 3
    assert math.isinf(scrape[("baz_bucket", frozenset({("le", "+Inf")}))])
    with pytest.raises(analysis.ParseError, match="line 1: not a sample"):
        analysis.parse("this is not prometheus\n")
    with pytest.raises(analysis.ParseError, match="bad labels"):
        analysis.parse('foo{a=1} 2\n')


def test_counters_are_deltas_over_the_window_and_a_restart_counts_from_zero() -> None:
    before = analysis.parse(exposition(100, 1, 800, [0.1] * 100, []))
    after = analysis.parse(exposition(150, 3, 1200, [0.1] * 150, []))
    assert analysis.counter_delta(before, after, analysis.REQUESTS) == 50
    assert analysis.counter_delta(before, after, analysis.REQUESTS, {"is_streaming": "true"}) == 0
    assert analysis.counter_delta(before, after, analysis.ABORTED) == 2
    restarted = analysis.parse(exposition(7, 0, 56, [0.1] * 7, []))
    assert analysis.counter_delta(before, restarted, analysis.REQUESTS) == 7


def test_p99_from_bucket_deltas_interpolates_like_histogram_quantile() -> None:
    before = analysis.parse(exposition(0, 0, 0, [0.05] * 1000, []))  # lifetime: a thousand fast requests
    after = analysis.parse(exposition(0, 0, 0, [0.05] * 1000 + [0.3] * 90 + [0.7] * 10, []))
    window = analysis.histogram_delta(before, after, analysis.TTFT)
    assert window.count == 100 and window.buckets[0] == (0.1, 0.0)  # the lifetime's fast ones are not in it
    # rank 99 of 100 lies in (0.6, 0.8], which holds the last 10: 0.6 + 0.2 * 9/10
    assert window.quantile(0.99) == pytest.approx(0.78)
    assert window.quantile(0.5) == pytest.approx(0.2 + 0.2 * 50 / 90)
    lifetime = analysis.histogram_delta({}, after, analysis.TTFT)
    assert lifetime.quantile(0.99) == pytest.approx(0.2 + 0.2 * 89 / 90)  # a lifetime view hides the slow tail
    slow = analysis.histogram_delta({}, analysis.parse(exposition(0, 0, 0, [9.0] * 5, [])), analysis.TTFT)
    assert slow.quantile(0.99) == 4.0  # in the +Inf bucket: the highest finite bound
    assert analysis.histogram_delta(after, after, analysis.TTFT).quantile(0.99) is None


def _window(requests: int, errors: int = 0, ttft: float = 0.15, itl: float = 0.03, accept: float | None = None,
            lifetime: int = 500) -> analysis.Window:
    before = analysis.parse(exposition(lifetime, 0, lifetime * 8, [0.15] * lifetime, [0.03] * lifetime, accept))
    after = analysis.parse(exposition(lifetime + requests, errors, (lifetime + requests) * 8,
                                      [0.15] * lifetime + [ttft] * requests, [0.03] * lifetime + [itl] * requests,
                                      accept))
    return analysis.window(before, after, {"model_name": "m"})


def test_a_good_canary_passes_and_names_its_numbers() -> None:
    baseline = analysis.combine([_window(100, accept=3.2), _window(120, accept=3.4)])
    assert baseline.requests == 220 and baseline.accept_length == pytest.approx(3.3)
    result = analysis.verdict(_window(100, accept=3.25), baseline, analysis.Bounds())
    assert result.decided and result.ok, result.detail
    assert "p99_ttft_seconds" in result.detail and "error_rate 0 vs 0" in result.detail


def test_a_slower_canary_fails_on_p99_ttft_with_both_values() -> None:
    result = analysis.verdict(_window(100, ttft=0.5), _window(100), analysis.Bounds())
    assert result.decided and not result.ok
    assert result.detail.startswith("p99_ttft_seconds: canary 0.5")
    assert "canary/baseline <= 1.2" in result.detail


def test_a_canary_with_one_percent_errors_fails_on_error_rate() -> None:
    result = analysis.verdict(_window(99, errors=1), _window(100), analysis.Bounds())
    assert not result.ok and result.detail == "error_rate: canary 0.01, baseline 0 (<= 0.001)"


def test_a_lower_accept_length_fails_and_missing_gauges_are_not_judged() -> None:
    result = analysis.verdict(_window(100, accept=2.0), _window(100, accept=3.0), analysis.Bounds())
    assert not result.ok and result.detail.startswith("spec_accept_length: canary 2, baseline 3")
    unmeasured = analysis.verdict(_window(100), _window(100), analysis.Bounds())
    accept = next(c for c in unmeasured.checks if c.metric == "spec_accept_length")
    assert accept.ok and accept.limit == "not measured on both sides"


def test_too_little_traffic_is_undecided_not_a_pass() -> None:
    result = analysis.verdict(_window(5), _window(100), analysis.Bounds())
    assert not result.decided and not result.ok
    assert result.detail == ("too little traffic to judge: 5 canary and 100 baseline requests in the window "
                             "(need 20 each)")
