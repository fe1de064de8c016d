"""The parity verdict on captured answers, the answer parser, and how the golden set is resolved."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kdeploy.core import gatespec
from kdeploy.core.inventory import Service
from kdeploy.host import parity

CAPTURED = {  # the reference server's answer (SGLang 0.5.23's LogProbs shape) to the France prompt, logprobs=2
    "tokens": [" Paris.", " This", " is"],
    "token_logprobs": [-0.053347, -0.048349, -0.044146],
    "top_logprobs": [{" Paris.": -0.053347, " matrix": -5.430846}, {" This": -0.048349, " ocean": -5.609241},
                     {" is": -0.044146, " bridge": -5.442803}],
    "text_offset": [-1, -1, -1],
}
FRANCE = "The capital of France is"
SPEC = parity.ParitySpec(prompts=[FRANCE], max_tokens=3, top_logprobs=2, match_tokens=3, logprob_tolerance=0.1)


def answer(logprobs: dict) -> str:
    return json.dumps({"choices": [{"index": 0, "text": "".join(logprobs["tokens"]), "logprobs": logprobs,
                                    "finish_reason": "length"}]})


def record(logprobs: dict, release: str = "r1") -> parity.Record:
    return parity.Record(model="m", release=release, set_key=SPEC.set_key(), captured="2026-12-03T08:00:00Z",
                         samples=[parity.parse_completion(FRANCE, answer(logprobs))])


def shifted(by: float, at: int = 1) -> dict:
    """CAPTURED with every logprob at position ``at`` moved by ``by``."""
    out = json.loads(json.dumps(CAPTURED))
    out["token_logprobs"][at] += by
    out["top_logprobs"][at] = {k: v + by for k, v in out["top_logprobs"][at].items()}
    return out


def test_parse_reads_sglang_logprobs_and_rejects_answers_without_them() -> None:
    sample = parity.parse_completion(FRANCE, answer(CAPTURED))
    assert sample.tokens == [" Paris.", " This", " is"]
    assert sample.top[0] == {" Paris.": -0.053347, " matrix": -5.430846}
    with pytest.raises(ValueError, match="no logprobs"):
        parity.parse_completion(FRANCE, json.dumps({"choices": [{"text": " Paris", "logprobs": None}]}))
    broken = {**CAPTURED, "token_logprobs": [-0.1]}
    with pytest.raises(ValueError, match="3 tokens but 1 logprobs"):
        parity.parse_completion(FRANCE, answer(broken))


def test_same_answers_within_tolerance_pass_with_their_numbers() -> None:
    verdict = parity.compare(record(CAPTURED), record(shifted(0.04), "r2"), SPEC)
    assert verdict.ok, verdict.detail
    assert verdict.data["positions"] == 3 and verdict.data["max_gap"] == pytest.approx(0.04)
    assert "max logprob gap 0.0400" in verdict.detail and "vs r1" in verdict.detail


def test_a_logprob_gap_over_the_tolerance_names_prompt_position_tokens_and_gap() -> None:
    verdict = parity.compare(record(CAPTURED), record(shifted(-0.5, at=2)), SPEC)
    assert not verdict.ok
    assert verdict.detail.startswith(f"{FRANCE!r}: position 2: token")
    assert "gap 0.5000 > tolerance 0.1" in verdict.detail
    assert verdict.data["position"] == 2 and verdict.data["gap"] == pytest.approx(0.5)
    assert verdict.data["prompt"] == FRANCE  # the prompt itself; the detail quotes it


def test_a_different_token_fails_with_both_tokens() -> None:
    other = json.loads(json.dumps(CAPTURED))
    other["tokens"][1] = " Lyon"
    other["top_logprobs"][1] = {" Lyon": -0.01, " This": -4.7}
    verdict = parity.compare(record(CAPTURED), record(other), SPEC)
    assert not verdict.ok
    assert "position 1: token ' This' before, ' Lyon' now" in verdict.detail
    assert "-0.0483 before, -4.7000 now (gap 4.6517)" in verdict.detail
    assert (verdict.data["token_before"], verdict.data["token_now"]) == (" This", " Lyon")


def test_a_flip_at_a_near_tie_stops_the_comparison_instead_of_failing() -> None:
    tie = json.loads(json.dumps(CAPTURED))
    tie["top_logprobs"][1] = {" This": -0.69, " That": -0.72}
    tie["token_logprobs"][1] = -0.69
    flipped = json.loads(json.dumps(tie))
    flipped["tokens"][1:] = [" That", " was"]
    flipped["token_logprobs"][1:] = [-0.69, -0.2]
    flipped["top_logprobs"][1:] = [{" That": -0.69, " This": -0.71}, {" was": -0.2}]
    verdict = parity.compare(record(tie), record(flipped), SPEC)
    assert verdict.ok, verdict.detail
    assert verdict.data["positions"] == 1 and "near ties not compared further" in verdict.detail


def test_only_the_first_match_tokens_positions_count_and_a_short_answer_fails() -> None:
    late = shifted(2.0, at=2)
    two = SPEC.model_copy(update={"match_tokens": 2})
    assert parity.compare(record(CAPTURED), record(late), two).ok
    short = {k: v[:2] for k, v in CAPTURED.items()}
    verdict = parity.compare(record(CAPTURED), record(short), SPEC)
    assert not verdict.ok and "ended after 2 tokens" in verdict.detail


def test_check_without_a_record_records_or_fails_when_required() -> None:
    new = record(CAPTURED)
    assert parity.check(parity.Baseline(None, "first deploy: nothing to compare with"), new, SPEC).ok
    required = parity.check(parity.Baseline(None, "r1 has no record", required=True), new, SPEC)
    assert not required.ok and "no parity record to compare with: r1 has no record" in required.detail


def test_a_record_is_usable_only_for_its_golden_set_and_model() -> None:
    rec = record(CAPTURED)
    assert parity.usable(rec, SPEC, "m")
    assert not parity.usable(rec, SPEC, "other-model")
    assert not parity.usable(rec, SPEC.model_copy(update={"prompts": ["x"]}), "m")
    assert parity.usable(rec, SPEC.model_copy(update={"logprob_tolerance": 0.5}), "m")  # tolerance is not the set
    assert parity.Record.parse(rec.model_dump_json()) == rec
    assert parity.Record.parse("") is None and parity.Record.parse("{") is None


def _service(gate: dict) -> Service:
    return Service.model_validate({"name": "s", "payload": "p", "python": "/v/bin/python",
                                   "sglang": {"model_path": "/models/m"}, "gate": gate})


def test_golden_set_defaults_to_the_gate_prompts_and_can_be_turned_off(tmp_path: Path) -> None:
    spec = gatespec.gate_spec(_service({}), None)
    assert spec.parity == parity.ParitySpec(prompts=[FRANCE], max_tokens=8, top_logprobs=5, match_tokens=8,
                                            logprob_tolerance=0.1)
    assert gatespec.gate_spec(_service({"parity": False}), None).parity is None
    own = gatespec.gate_spec(_service({"parity": {"prompts": ["a", "b"], "max_tokens": 4, "match_tokens": 9}}),
                             None).parity
    assert own is not None and own.prompts == ["a", "b"] and own.match_tokens == 4
    (tmp_path / gatespec.MANIFEST).write_text(json.dumps({"parity": {"prompts": ["from payload"],
                                                                     "logprob_tolerance": 0.05}}))
    payload = gatespec.load_payload_gate(tmp_path)
    shipped = gatespec.gate_spec(_service({}), payload).parity
    assert shipped is not None and shipped.prompts == ["from payload"] and shipped.logprob_tolerance == 0.05
    assert gatespec.gate_spec(_service({"parity": {"max_tokens": 2}}), payload).parity.prompts == [FRANCE]
    assert math.isfinite(spec.parity.logprob_tolerance)
