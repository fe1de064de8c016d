"""Output parity: the new run must answer a golden set as the release it replaces did, token for token and
logprob for logprob within a tolerance.

A kernel that is subtly wrong (a mask off by one, a wrong softmax scale) still answers "Paris": the greedy
text survives, the distribution does not. Before a switch kdeploy keeps a *record* of the running release's
greedy tokens and top-k logprobs for the set (``releases/<id>/.kdeploy/parity.json`` on the host, written
when a deploy of that release is confirmed, or captured from the running service just before the switch);
the gate's ``parity`` phase captures the new run and compares. Pure builders, parser and verdict here, plus
the two executors (capture over the gate's HTTP channel, read/write of the record over SSH).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError

from kdeploy.core.errors import KdeployError, PreflightRefused
from kdeploy.core.gatespec import GateSpec, ParitySpec
from kdeploy.core.layout import PARITY_RECORD, RELEASES
from kdeploy.core.report import PhaseFailed
from kdeploy.core.step import Step

if TYPE_CHECKING:
    from kdeploy.core.report import HostResult
    from kdeploy.host.pair import PairedHttp, Pairing
    from kdeploy.ssh.remote import Remote
    from kdeploy.ssh.tunnel import ServiceHttp

RECORD = PARITY_RECORD  # inside a release directory


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sample(_Frozen):
    """One prompt's greedy completion: its tokens, each token's logprob, and the top-k at each position."""

    prompt: str
    tokens: list[str]
    logprobs: list[float]
    top: list[dict[str, float]]


class Record(_Frozen):
    """A release's answers to the golden set, for one served model."""

    model: str
    release: str | None
    set_key: str
    captured: str  # UTC time
    samples: list[Sample]

    @classmethod
    def parse(cls, text: str) -> Record | None:
        """None for a missing or unreadable record (it is then captured again)."""
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return None


def request_body(model: str, prompt: str, spec: ParitySpec) -> dict:
    """A greedy ``/v1/completions`` request with SGLang's ``logprobs: k`` (top-k per position)."""
    return {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens, "temperature": 0,
            "logprobs": spec.top_logprobs}


def parse_completion(prompt: str, text: str) -> Sample:
    """The sample in a ``/v1/completions`` answer (SGLang 0.5.23's ``LogProbs``: tokens, token_logprobs,
    top_logprobs, text_offset); ValueError when it has none."""
    try:
        logprobs = json.loads(text)["choices"][0]["logprobs"]
        tokens = [str(t) for t in logprobs["tokens"]]
        values = [float(v) if v is not None else -math.inf for v in logprobs["token_logprobs"]]
        top = [{str(k): float(v) for k, v in (entry or {}).items()} for entry in logprobs["top_logprobs"]]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"no logprobs in the answer {text[:120]!r}") from None
    if len(values) != len(tokens) or len(top) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} logprobs and {len(top)} top-k entries")
    return Sample(prompt=prompt, tokens=tokens, logprobs=values, top=top)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    data: dict  # the numbers the JSON report carries


def _margin(sample: Sample, pos: int) -> float:
    """How far the greedy token led the runner-up at ``pos`` (inf when the top-k shows no runner-up)."""
    others = sorted((v for t, v in sample.top[pos].items() if t != sample.tokens[pos]), reverse=True)
    return sample.logprobs[pos] - others[0] if others else math.inf


def _gap(before: Sample, now: Sample, pos: int) -> tuple[float, str]:
    """The largest logprob difference at ``pos`` over the greedy token and the top-k tokens both runs list."""
    gap, where = abs(before.logprobs[pos] - now.logprobs[pos]), before.tokens[pos]
    for token in before.top[pos].keys() & now.top[pos].keys():
        diff = abs(before.top[pos][token] - now.top[pos][token])
        if diff > gap:
            gap, where = diff, token
    return gap, where


def compare(reference: Record, new: Record, spec: ParitySpec) -> Verdict:
    """Same greedy tokens for the first ``match_tokens`` positions and every compared logprob within
    ``logprob_tolerance``. A differing token where the reference's leader was within the tolerance of the
    runner-up is a near tie that bf16 may flip: the prompt is compared up to there and no further."""
    tol = spec.logprob_tolerance
    worst, worst_at, positions, ties = 0.0, "", 0, []
    for before, now in zip(reference.samples, new.samples, strict=True):
        label = repr(before.prompt if len(before.prompt) <= 60 else before.prompt[:57] + "...")
        for pos in range(min(spec.match_tokens, len(before.tokens))):
            if pos >= len(now.tokens):
                return _fail(f"{label}: the new run ended after {len(now.tokens)} tokens, the reference made "
                             f"{len(before.tokens)}", before.prompt, pos, before.tokens[pos], None, None, positions)
            if now.tokens[pos] != before.tokens[pos]:
                if _margin(before, pos) < tol:
                    ties.append(f"{label} position {pos}")
                    break
                was = before.logprobs[pos]
                has = now.top[pos].get(before.tokens[pos])
                gap = abs(was - has) if has is not None else None
                return _fail(f"{label}: position {pos}: token {before.tokens[pos]!r} before, {now.tokens[pos]!r} "
                             f"now; logprob of {before.tokens[pos]!r} {was:.4f} before, "
                             + (f"{has:.4f} now (gap {gap:.4f})" if has is not None
                                else f"not in the new top-{spec.top_logprobs}"),
                             before.prompt, pos, before.tokens[pos], now.tokens[pos], gap, positions)
            gap, token = _gap(before, now, pos)
            positions += 1
            if gap > tol:
                mine = before.top[pos].get(token, before.logprobs[pos])
                theirs = now.top[pos].get(token, now.logprobs[pos])
                return _fail(f"{label}: position {pos}: token {token!r} logprob {mine:.4f} before, {theirs:.4f} "
                             f"now (gap {gap:.4f} > tolerance {tol:g})", before.prompt, pos, token, token, gap,
                             positions)
            if gap >= worst:
                worst, worst_at = gap, f"{label} position {pos}"
    detail = (f"{len(new.samples)} prompts, {positions} positions: same tokens, max logprob gap {worst:.4f} "
              f"(tolerance {tol:g}) vs {reference.release or 'the running release'}")
    if ties:
        detail += f"; near ties not compared further: {', '.join(ties)}"
    return Verdict(True, detail, {"prompts": len(new.samples), "positions": positions, "max_gap": round(worst, 6),
                                  "max_gap_at": worst_at, "tolerance": tol, "reference": reference.release,
                                  "near_ties": ties})


def _fail(detail: str, prompt: str, pos: int, before: str, now: str | None, gap: float | None,
          positions: int) -> Verdict:
    return Verdict(False, detail, {"prompt": prompt, "position": pos, "token_before": before, "token_now": now,
                                   "gap": None if gap is None else round(gap, 6), "positions": positions})


@dataclass(frozen=True)
class Baseline:
    """What the gate's parity phase compares the new run with: a record, or why there is none (then the phase
    only records, unless ``required``: ``verify --parity`` has nothing to check without one)."""

    record: Record | None
    why: str
    required: bool = False


def check(baseline: Baseline, new: Record, spec: ParitySpec) -> Verdict:
    """The parity phase's verdict on the new run's record."""
    if baseline.record is None:
        if baseline.required:
            return Verdict(False, f"no parity record to compare with: {baseline.why}", {"reference": None})
        return Verdict(True, f"nothing to compare ({baseline.why}); recorded {len(new.samples)} prompts x "
                             f"{spec.max_tokens} tokens as the reference", {"reference": None,
                                                                           "prompts": len(new.samples)})
    return compare(baseline.record, new, spec)


def capture(http: ServiceHttp | PairedHttp, spec: ParitySpec, model: str, release: str | None) -> Record:
    """The running service's answers to the golden set (PhaseFailed when it does not give them)."""
    samples = []
    for prompt in spec.prompts:
        status, text = http.post_json("/v1/completions", request_body(model, prompt, spec), timeout=120)
        if status != 200:
            raise PhaseFailed(f"parity: POST /v1/completions {prompt!r} -> "
                              + (f"HTTP {status}: {text[:120]!r}" if status is not None else text))
        try:
            samples.append(parse_completion(prompt, text))
        except ValueError as exc:
            raise PhaseFailed(f"parity: {prompt!r}: {exc}") from None
    return Record(model=model, release=release, set_key=spec.set_key(),
                  captured=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), samples=samples)


def usable(record: Record | None, spec: ParitySpec, model: str) -> bool:
    """Whether a stored record answers this golden set for this model."""
    return record is not None and record.set_key == spec.set_key() and record.model == model


def record_path(service_dir: str, release_id: str) -> str:
    return f"{service_dir}/{RELEASES}/{release_id}/{RECORD}"


def read_command(service_dir: str, release_id: str) -> str:
    return f"cat {shlex.quote(record_path(service_dir, release_id))} 2>/dev/null || true"


def write_command(service_dir: str, release_id: str) -> str:
    """Write the record (stdin) atomically beside the release; nothing when the release is gone."""
    path = shlex.quote(record_path(service_dir, release_id))
    return (f"d=$(dirname {path}); [ -d \"$d\" ] || exit 0; "
            f"cat > {path}.tmp && mv -f {path}.tmp {path}")


def read_record(remote: Remote, service_dir: str, release_id: str | None) -> Record | None:
    if not release_id:
        return None
    return remote.ask(read_step(service_dir, release_id))


def write_record(remote: Remote, service_dir: str, release_id: str, record: Record) -> None:
    remote.ask(write_step(service_dir, release_id), stdin=record.model_dump_json().encode())


def own_record(remote: Remote, service_dir: str, spec: GateSpec, release_id: str | None,
               required: bool = False) -> Baseline | None:
    """``release_id``'s own record as the baseline (a rollback's target, ``verify --parity``); without one,
    no parity phase, or with ``required`` a phase that fails saying so."""
    if spec.parity is None:
        return None
    stored = read_record(remote, service_dir, release_id)
    if usable(stored, spec.parity, spec.model):
        return Baseline(stored, f"{release_id}'s own record")
    if not required:
        return None
    return Baseline(None, f"{release_id or 'nothing'} has no record of this golden set for model {spec.model!r} "
                          "(deployed before parity, or with another set)", required=True)


def model_change(host: str, current: str | None, before: GateSpec | None, spec: GateSpec, accept: bool) -> str:
    """Refuse (exit 7) a push that changes the served model unless ``accept`` (``--accept-parity-change``):
    the old release's answers say nothing about another model's. Words for the preflight phase."""
    if spec.parity is None or before is None or before.model == spec.model:
        return ""
    if not accept:
        raise PreflightRefused(f"{host}: the served model changes from {before.model!r} to {spec.model!r}: its "
                               f"answers cannot be compared with {current}'s; push with --accept-parity-change to "
                               "take the new model's answers as the parity reference")
    return f"; model {before.model!r} -> {spec.model!r}: parity reference replaced (--accept-parity-change)"


def baseline(remote: Remote, service_dir: str, result: HostResult, spec: GateSpec, target: str,
             running: tuple[str | None, GateSpec] | None, pair: Pairing | None = None) -> Baseline | None:
    """Phase ``parity-baseline``, before the switch: ``target``'s own record when it has one (a release
    deployed before, a rollback); else the running release's (``running``: its id and spec) record, or its
    answers captured now and kept beside it; nothing on a first deploy, a model change, or a service that
    does not answer (the phase then only records: an old release that does not serve must not hold its
    fix back). ``pair``: a prefill or decode server answers only through its pair."""
    golden = spec.parity
    if golden is None:
        return None
    with result.phase("parity-baseline") as phase:
        own = read_record(remote, service_dir, target)
        if usable(own, golden, spec.model):
            phase.detail = f"{target}'s own record of {own.captured}"
            return Baseline(own, phase.detail)
        current, current_spec = running or (None, spec)
        if running is None:
            phase.detail = f"no record of {target}: nothing to compare with"
        elif current is None:
            phase.detail = "first deploy: nothing to compare with"
        elif current_spec.model != spec.model:
            phase.detail = (f"model changed from {current_spec.model!r} (--accept-parity-change): "
                            "nothing to compare with")
        else:
            stored = read_record(remote, service_dir, current)
            if usable(stored, golden, spec.model):
                phase.detail = f"record of {current} of {stored.captured}"
                return Baseline(stored, phase.detail)
            record, why = _capture_running(remote, current_spec, golden, spec.model, current, pair)
            if record is not None:
                keep(remote, service_dir, result, current, record)
                phase.detail = f"captured from {current} (running): {len(record.samples)} prompts, kept beside it"
                return Baseline(record, f"answers of {current}")
            phase.detail = f"{current} does not answer ({why}): nothing to compare with"
        return Baseline(None, phase.detail)


def _capture_running(remote: Remote, running: GateSpec, golden: ParitySpec, model: str,
                     release: str, pair: Pairing | None) -> tuple[Record | None, str]:
    """The running service's answers (through its ``pair``, if it has one), or None and why it gave none."""
    from kdeploy.host.pair import PairedHttp
    from kdeploy.ssh.tunnel import ServiceHttp  # httpx loads only when a gate runs

    if pair is not None and pair.http is None:
        return None, f"no serving {pair.other} server to pair with"
    with ServiceHttp(remote, running.host, running.port) as http:
        status = http.status(running.ready_path)
        if status != 200:
            return None, f"GET {running.ready_path}: {status}"
        try:
            return capture(PairedHttp(http, pair) if pair is not None else http, golden, model, release), ""
        except PhaseFailed as exc:
            return None, exc.detail


def keep(remote: Remote, service_dir: str, result: HostResult, release_id: str, record: Record | None) -> None:
    """``record`` becomes ``release_id``'s (after a confirmed deploy, or a capture of the running release);
    a failure to write it is logged, not fatal: the next deploy captures again."""
    if record is None:
        return
    try:
        write_record(remote, service_dir, release_id, record)
    except (PhaseFailed, KdeployError) as exc:
        result.log.append(f"parity record of {release_id} not kept: {getattr(exc, 'detail', exc)}")


def read_step(service_dir: str, release_id: str) -> Step[Record | None]:
    return Step(read_command(service_dir, release_id), lambda out: Record.parse(out.stdout), 30)


def write_step(service_dir: str, release_id: str) -> Step[None]:
    """``write_command`` as a step (the record on stdin)."""
    return Step(write_command(service_dir, release_id), lambda out: None, 30,
                fails=f"could not keep the parity record of {release_id}")
