"""The kdtree tree-verify kernel (kernels/kdtree/kdtree_ext/mla_verify.py) under Triton's interpreter on CPU,
against the fp32 PyTorch reference: random trees and chains, scattered page tables (page size 1 and 64,
kv_indices and req_to_token layouts), prefix lengths 0..333, Q 1..40, H 1..16, NSPLIT 1..16.

float32 cases must match the reference to 1e-5 (the interpreter computes in fp32); float16 cases to 5e-3
absolute (p and the output are rounded to half precision: about 2^-11 relative each). bfloat16 cannot be
checked here — the interpreter reads bf16 as garbage (numpy has no bf16) — it is checked on the GPU.
"""

from __future__ import annotations

import pytest

from tests.kernels.conftest import Script, run_script

TOL = {"float32": 1e-5, "float16": 5e-3, "half_partials": 2e-3}


@pytest.fixture(scope="module")
def interp(sglang_python: str) -> Script:
    run = run_script(sglang_python, "interp_check.py")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.result["cases"] == len(run.cases) > 0
    return run


def test_matches_fp32_reference_on_every_case(interp: Script):
    def tol(case):
        half = case.get("config", {}).get("partial_dtype", "float32") != "float32"
        return TOL["half_partials"] if half else TOL[case["dtype"]]

    bad = [(c["case"], c["max_err"]) for c in interp.cases if not c["max_err"] <= tol(c["case"])]
    assert not bad, bad
    for c in interp.cases:
        assert c["ref_max"] > 0.05, c          # a real output, not zeros
        assert c["all_written"], c            # the output was poisoned with NaN first: every element written


def test_covers_trees_chains_pages_layouts_and_splits(interp: Script):
    cases = [c["case"] for c in interp.cases]
    assert {c["tree"] for c in cases} == {True, False}
    assert {c["page_size"] for c in cases} == {1, 64}
    assert {c["layout"] for c in cases} == {"indptr", "req_to_token"}
    assert {c["nsplit"] for c in cases} >= {1, 16}
    assert min(c["q_len"] for c in cases) == 1 and max(c["q_len"] for c in cases) >= 16
    prefixes = [p for c in cases for p in c["prefix_lens"]]
    assert min(prefixes) == 0 and max(prefixes) >= 300
    assert any(c.get("mask") is False for c in cases)            # no custom mask: causal chain drafts
    assert any(c.get("mask_dtype") == "uint8" for c in cases)    # SGLang's graph buffer dtype
    assert {c.get("config", {}).get("dv_split", 1) for c in cases} == {1, 2}   # value channels split or not
    assert any(c.get("config", {}).get("combine_wide_rows") for c in cases)      # one combine program per row
    assert any(c.get("config", {}).get("tail_m") for c in cases)                 # a short tile for the last rows
    assert any(c.get("config", {}).get("sm90_ws") for c in cases)                # the Gluon kernels: Triton on CPU
    rows_combine = [c for c in cases if c.get("config", {}).get("combine_rows")]  # 16 rows per combine program
    assert {c["tree"] for c in rows_combine} == {True, False} and max(c["q_len"] for c in rows_combine) > 16
    for key in ("draft_rows", "draft_kernel_rows"):       # its own kernel, slot ns (per-row / row-block combine)
        drafted = [c for c in interp.cases if c["case"].get("config", {}).get(key)]
        assert {c["case"]["tree"] for c in drafted} == {True, False} and all(c["draft_written"] for c in drafted)
    # split_draft(_rows) off Hopper: a slot reserved, not written (the combine attends the tree; outputs checked above)
    for key in ("split_draft", "split_draft_rows"):
        split = [c for c in interp.cases if c["case"].get("config", {}).get(key)]
        assert split and all(c["draft_slots"] == 1 and c["draft_written"] is False for c in split)
    # tail_pair: the short last row block on partitions of two prefix partitions' keys (_tail_kernel)
    tail = [c for c in interp.cases if c["case"].get("config", {}).get("tail_pair")]
    assert {c["case"]["tree"] for c in tail} == {True, False}
    assert tail and all(c["tail_nsplit"] == -(-c["nsplit_used"] // 2) for c in tail), tail


def test_empty_partitions_exit_early(interp: Script):
    for c in interp.cases:
        assert c["partitions_written"] == c["partitions_expected"], c
        assert c["pad_rows_untouched"], c
    # short prefixes really use fewer partitions than NSPLIT (the rest exit at once)
    assert any(sum(c["partitions_written"]) < c["nsplit_used"] * len(c["partitions_written"]) for c in interp.cases)
    # the CTA cap reduced the partitions of a batch that already fills the (pretend) GPU
    capped = [c for c in interp.cases if c["case"].get("config", {}).get("max_ctas")
              and not c["case"]["config"].get("wave_min_chunk")]
    assert capped and all(c["nsplit_used"] < c["case"]["nsplit"] for c in capped)
    # a launch of one wave of programs used the shorter wave_min_chunk partitions (4 of 6 written, not 2)
    wave = [c for c in interp.cases if c["case"].get("config", {}).get("wave_min_chunk")]
    assert wave and all(c["min_chunk_used"] == 16 and c["partitions_written"] == [4] for c in wave), wave
