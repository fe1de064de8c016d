"""The kdtree tree-verify kernel (kernels/kdtree/kdtree_ext/mla_verify.py) under Triton's interpreter on CPU,
against the fp32 PyTorch reference: random trees and chains, scattered page tables (page size 1 and 64),
prefix lengths 0..333, Q 1..40, H 1..16, NSPLIT 1..16, and the batch schedule (``mla_common``) on ragged
batches: columns shared by several requests, prefixes of 0 and 1 beside long ones, more requests than columns.

float32 cases must match the reference to 1e-5 (the interpreter computes in fp32); float16 cases to 5e-3
absolute (p and the output are rounded to half precision: about 2^-11 relative each). bfloat16 cannot be
checked here — the interpreter reads bf16 as garbage (numpy has no bf16) — it is checked on the GPU.
"""

from __future__ import annotations

import pytest

from tests.kernels.conftest import Script, run_script

TOL = {"float32": 1e-5, "float16": 5e-3}


@pytest.fixture(scope="module")
def interp(sglang_python: str) -> Script:
    run = run_script(sglang_python, "interp_check.py")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.result["cases"] == len(run.cases) > 0
    return run


def test_matches_fp32_reference_on_every_case(interp: Script):
    bad = [(c["case"], c["max_err"]) for c in interp.cases if not c["max_err"] <= TOL[c["case"]["dtype"]]]
    assert not bad, bad
    for c in interp.cases:
        assert c["ref_max"] > 0.05, c          # a real output, not zeros
        assert c["all_written"], c            # the output was poisoned with NaN first: every element written


def test_covers_trees_chains_pages_and_combines(interp: Script):
    cases = [c["case"] for c in interp.cases]
    assert {c["tree"] for c in cases} == {True, False}
    assert {c["page_size"] for c in cases} == {1, 64}
    assert {c["nsplit"] for c in cases} >= {1, 16}
    assert min(c["q_len"] for c in cases) == 1 and max(c["q_len"] for c in cases) >= 16
    prefixes = [p for c in cases for p in c["prefix_lens"]]
    assert min(prefixes) == 0 and max(prefixes) >= 300
    assert any(c.get("mask") is False for c in cases)            # no custom mask: causal chain drafts
    assert any(c.get("mask_dtype") == "uint8" for c in cases)    # SGLang's graph buffer dtype
    assert any(c.get("config", {}).get("combine_wide_rows") for c in cases)      # one combine program per row
    assert any(c.get("config", {}).get("tail_m") for c in cases)                 # a short tile for the last rows
    assert any(c.get("config", {}).get("sm90") for c in cases)                   # the Gluon kernel: Triton on CPU
    rows_combine = [c for c in cases if c.get("config", {}).get("combine_rows")]  # 16 rows per combine program
    assert {c["tree"] for c in rows_combine} == {True, False} and max(c["q_len"] for c in rows_combine) > 16
    drafted = [c for c in interp.cases if c["case"].get("config", {}).get("draft_kernel")]  # _draft_kernel's slot
    assert {c["case"]["tree"] for c in drafted} == {True, False} and all(c["draft_slots"] for c in drafted)


def test_schedule_writes_exactly_the_segments_slots(interp: Script):
    """Every (column, request) segment the schedule, worked out independently in interp_check.py, gives writes
    its slot column + request (all rows), and nothing else is touched (spare slots and rows keep the sentinel)."""
    for c in interp.cases:
        assert c["slots_written"] == c["slots_partly"] == c["slots_expected"], c
        assert all(s < c["slots"] for s in c["slots_written"]), c
        assert c["pad_rows_untouched"], c


def test_schedule_shares_columns_on_ragged_batches(interp: Script):
    """The ragged batches really exercise the batch schedule: columns that cover the end of one request and the
    start of the next, and batches with more requests than columns (at most one segment per column and request
    boundary: columns + bs - 1 slots)."""
    ragged = [c for c in interp.cases if c["columns_shared"] > 0]
    assert len(ragged) >= 3
    assert any(c["case"]["bs"] > c["columns"] for c in interp.cases)
    many = next(c for c in interp.cases if c["case"]["bs"] == 9)
    assert many["columns"] == 4 and len(many["slots_written"]) <= many["columns"] + 9 - 1


def test_partial_floor_lengthens_short_partitions(interp: Script):
    """``partial_floor``: partitions as long as the keys of their partial's bytes, so a short prefix fills fewer
    columns than the launch has (the slots match the schedule worked out with the floor, test above)."""
    floor = next(c for c in interp.cases if c["case"].get("config", {}).get("partial_floor"))
    total = sum(floor["case"]["prefix_lens"])
    assert floor["min_chunk"] > -(-total // floor["columns"])
    assert len(floor["slots_written"]) == -(-total // floor["min_chunk"]) < floor["columns"]


def test_short_last_row_block_gets_its_own_partitions(interp: Script):
    """``tail_cost``: a last row block of ``tail_rows_min`` rows to a quarter of a block goes to a launch of its own
    over partitions of its own exactly when that gives the full blocks more columns; its partials (slots after
    the draft ones, its rows only) are written as worked out independently (test above) and combined right."""
    tailed = [c for c in interp.cases if c["tail"]]
    assert {c["case"]["config"].get("combine_rows", 0) > 0 for c in tailed} == {False, True}
    for c in tailed:
        assert c["blocks"] == c["case"]["q_len"] * c["case"]["heads"] // 16          # the full blocks only
        assert c["columns"] > c["case"]["config"]["max_ctas"] // (c["blocks"] + 1)
    for p in interp.result["plans"]:
        full, left = divmod(p["rows"], 64)
        plain = min(64 * p["bs"], p["cap"] // (full + (left > 0)))
        gains = (p["tail_rows_min"] <= left <= 16
                 and min(64 * p["bs"], int(p["cap"] / (full + p["tail_cost"]))) > plain)
        assert (p["tail"] > 0) == gains, p
        if gains:
            assert p["blocks"] == full and p["columns"] > plain and p["columns"] * full + p["tail"] == p["cap"], p
        else:
            assert p["blocks"] == full + (left > 0) and p["columns"] == plain, p
    assert [p["tail"] > 0 for p in interp.result["plans"]] == [True, True, False, False, False, False, True]
