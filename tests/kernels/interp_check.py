"""Runs the kdtree verify kernel under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) on many
small problems and prints one ``CASE <json>`` line per problem and a final ``RESULT <json>`` line.

Run by tests/kernels/test_mla_verify_interpreter.py with the CPU SGLang venv's python (torch + triton) and the
payload on PYTHONPATH. Precision: the interpreter gets bfloat16 wrong (numpy has no bfloat16: loads come back
as garbage), so the cases run in float32 (tight tolerance) and float16 (the same half-precision code path
as bf16: p and the output are rounded). bf16 itself is checked on the GPU (test_mla_verify_gpu.py).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from kdtree_ext import mla_verify as mv
from kdtree_ext.verify_problems import make_problem, run_kernel, run_reference

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

SCALE = mv.default_sm_scale()
BASE = mv.INTERPRETER_CONFIG


def cases() -> list[dict]:
    out = []
    # random trees and chains, Q 1..16, prefix 0..few hundred, page size 1 and 64, NSPLIT 1..16, both layouts
    grid = [
        # bs, H, Q, prefixes, page, tree, nsplit, layout
        (1, 1, 1, [0], 1, True, 1, "indptr"),
        (1, 2, 1, [5], 1, False, 4, "indptr"),
        (2, 2, 2, [0, 17], 1, True, 2, "req_to_token"),
        (3, 2, 5, [1, 63, 64], 64, True, 8, "indptr"),
        (2, 4, 8, [200, 31], 64, True, 16, "req_to_token"),
        (2, 3, 9, [129, 0], 1, False, 3, "indptr"),
        (1, 2, 16, [333], 64, True, 16, "indptr"),
        (4, 2, 4, [7, 100, 257, 48], 1, True, 5, "req_to_token"),
        (1, 8, 9, [96], 64, False, 1, "req_to_token"),
        (2, 2, 16, [64, 190], 1, True, 7, "indptr"),
        (1, 16, 3, [45], 64, True, 2, "indptr"),
        (2, 1, 12, [300, 299], 64, True, 16, "indptr"),
    ]
    for i, (bs, h, q, pre, page, tree, ns, layout) in enumerate(grid):
        out.append(dict(bs=bs, heads=h, q_len=q, prefix_lens=pre, page_size=page, tree=tree, nsplit=ns,
                        layout=layout, seed=i, dtype="float32"))
    # no custom mask (SGLang's chain path without a mask): causal drafts
    out.append(dict(bs=2, heads=2, q_len=6, prefix_lens=[40, 3], page_size=1, tree=False, nsplit=4,
                    layout="indptr", seed=20, mask=False, dtype="float32"))
    # uint8 mask (SGLang's CUDA-graph verify buffer is read as uint8)
    out.append(dict(bs=2, heads=2, q_len=7, prefix_lens=[70, 9], page_size=64, tree=True, nsplit=4,
                    layout="indptr", seed=21, mask_dtype="uint8", dtype="float32"))
    # peaky softmax (large scores): the online rescaling and the LSE combine must stay exact
    out.append(dict(bs=1, heads=2, q_len=5, prefix_lens=[150], page_size=1, tree=True, nsplit=6,
                    layout="indptr", seed=22, q_scale=8.0, dtype="float32"))
    # other tile shapes and split rules: larger row/key blocks, min_chunk > block, CTA cap
    out.append(dict(bs=2, heads=4, q_len=5, prefix_lens=[110, 260], page_size=64, tree=True, nsplit=16,
                    layout="indptr", seed=23, config=dict(block_m=32, block_n=32, min_chunk=64), dtype="float32"))
    out.append(dict(bs=3, heads=2, q_len=4, prefix_lens=[90, 0, 180], page_size=1, tree=True, nsplit=16,
                    layout="req_to_token", seed=24, config=dict(max_ctas=6, combine_block_s=2), dtype="float32"))
    # one wave of programs (a pretend 6-multiprocessor GPU): partitions down to wave_min_chunk, not min_chunk
    out.append(dict(bs=1, heads=2, q_len=5, prefix_lens=[100], page_size=1, tree=True, nsplit=6,
                    layout="indptr", seed=28, dtype="float32",
                    config=dict(block_n=16, min_chunk=64, wave_min_chunk=16, wave_sms=6, max_ctas=64)))
    # the wide combine (one 512-channel program per row) on a launch of >= combine_wide_rows rows
    out.append(dict(bs=2, heads=3, q_len=6, prefix_lens=[130, 45], page_size=64, tree=True, nsplit=4,
                    layout="indptr", seed=29, dtype="float32", config=dict(combine_wide_rows=36)))
    # the 512 value channels split over two programs (dv_split=2): scores from two latent halves + rope
    out.append(dict(bs=2, heads=4, q_len=7, prefix_lens=[150, 20], page_size=64, tree=True, nsplit=4,
                    layout="indptr", seed=26, config=dict(dv_split=2), dtype="float32"))
    out.append(dict(bs=1, heads=2, q_len=9, prefix_lens=[0], page_size=1, tree=False, nsplit=2,
                    layout="req_to_token", seed=27, config=dict(dv_split=2, block_m=32, block_n=32, min_chunk=32),
                    dtype="float32"))
    # a short tile for a row block's last few rows (tail_m): 36 rows = 32 + a 4-row tail; 52 = 32 + 20 rows
    # (more than tail_m: no short tile)
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[150, 33], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=33, config=dict(block_m=32, tail_m=16), dtype="float32"))
    out.append(dict(bs=1, heads=4, q_len=13, prefix_lens=[70], page_size=64, tree=False, nsplit=2,
                    layout="req_to_token", seed=34, config=dict(block_m=32, tail_m=16), dtype="float32"))
    # the sm_90 Gluon split kernels asked for on CPU tensors: the Triton kernel runs instead
    out.append(dict(bs=1, heads=2, q_len=4, prefix_lens=[40], page_size=1, tree=True, nsplit=2,
                    layout="indptr", seed=37, config=dict(sm90=True, sm90_ws=True), dtype="float32"))
    # the row-block combine (combine_rows: 16 rows per program, the draft tree on tensor cores): tree + mask, a
    # chain without a mask spanning two row blocks, Q=40 (BLOCK_J 64), float16
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[150, 0], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=40, config=dict(combine_rows=1), dtype="float32"))
    out.append(dict(bs=2, heads=3, q_len=7, prefix_lens=[40, 3], page_size=64, tree=False, nsplit=8,
                    layout="req_to_token", seed=41, mask=False, config=dict(combine_rows=1), dtype="float32"))
    out.append(dict(bs=1, heads=1, q_len=40, prefix_lens=[70], page_size=1, tree=True, nsplit=2,
                    layout="indptr", seed=42, config=dict(combine_rows=1), dtype="float32"))
    out.append(dict(bs=2, heads=8, q_len=5, prefix_lens=[90, 170], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=43, config=dict(combine_rows=1), dtype="float16"))
    # the draft tree in its own kernel (draft_rows: its partial in slot ns, the combine only merges): a tree with
    # a mask and an empty prefix, a chain without a mask and the wide combine, float16
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[150, 0], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=44, config=dict(draft_rows=1), dtype="float32"))
    out.append(dict(bs=2, heads=3, q_len=7, prefix_lens=[40, 3], page_size=64, tree=False, nsplit=8,
                    layout="req_to_token", seed=45, mask=False, config=dict(draft_rows=1, combine_wide_rows=1),
                    dtype="float32"))
    out.append(dict(bs=1, heads=8, q_len=5, prefix_lens=[90], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=46, config=dict(draft_rows=1), dtype="float16"))
    # split_draft where the Gluon kernel cannot run (here: CPU): the slot is reserved, the combine attends the tree
    out.append(dict(bs=1, heads=4, q_len=6, prefix_lens=[70], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=47, config=dict(split_draft=True), dtype="float32"))
    # the row-block combine merging the draft slot (draft_kernel_rows: _draft_kernel writes it; split_draft_rows
    # off Hopper: reserved, not written, the combine attends the tree)
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[120, 0], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=48, config=dict(combine_rows=1, draft_kernel_rows=True), dtype="float32"))
    out.append(dict(bs=2, heads=3, q_len=7, prefix_lens=[40, 70], page_size=64, tree=False, nsplit=8,
                    layout="req_to_token", seed=49, mask=False, config=dict(combine_rows=1, draft_kernel_rows=True),
                    dtype="float16"))
    out.append(dict(bs=2, heads=4, q_len=5, prefix_lens=[33, 80], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=50, config=dict(combine_rows=1, split_draft_rows=True), dtype="float32"))
    # the short last row block on partitions of two prefix partitions' keys (tail_pair: _tail_kernel's 16-row tile
    # beside the split kernel's 32-row blocks; a pretend 12-multiprocessor GPU): 40 rows = 32 + 8 (6 partitions + 3
    # tail programs), 80 = 64 + 16 with an empty prefix and a chain without a mask, float16
    out.append(dict(bs=1, heads=4, q_len=10, prefix_lens=[150], page_size=1, tree=True, nsplit=8,
                    layout="indptr", seed=51, config=dict(block_m=32, tail_m=16, split_draft=True, tail_pair=2,
                                                          max_ctas=12), dtype="float32"))
    out.append(dict(bs=2, heads=8, q_len=10, prefix_lens=[0, 130], page_size=64, tree=False, nsplit=8,
                    layout="req_to_token", seed=52, mask=False, dtype="float16",
                    config=dict(block_m=32, tail_m=16, split_draft=True, tail_pair=2, max_ctas=24)))
    # half-precision partial outputs (the interpreter cannot do bf16: fp16 stands in) and other combine tiles
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[200, 77], page_size=64, tree=True, nsplit=8,
                    layout="indptr", seed=25, dtype="float32",
                    config=dict(partial_dtype="float16", combine_block_s=4, combine_block_d=128, combine_block_j=4)))
    # float16: the half-precision path (p and o rounded); bf16 is GPU-only
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[120, 33], page_size=64, tree=True, nsplit=4,
                    layout="indptr", seed=30, dtype="float16"))
    out.append(dict(bs=1, heads=8, q_len=16, prefix_lens=[250], page_size=1, tree=False, nsplit=8,
                    layout="req_to_token", seed=31, dtype="float16"))
    out.append(dict(bs=2, heads=4, q_len=5, prefix_lens=[90, 170], page_size=1, tree=True, nsplit=4,
                    layout="indptr", seed=32, config=dict(dv_split=2), dtype="float16"))
    return out


def run_case(case: dict) -> dict:
    config = mv.with_config(BASE, **case.get("config", {}))
    prob = make_problem(case["bs"], case["heads"], case["q_len"], case["prefix_lens"], page_size=case["page_size"],
                        tree=case["tree"], dtype=getattr(torch, case["dtype"]), seed=case["seed"],
                        layout=case["layout"], mask=case.get("mask", True),
                        mask_dtype=getattr(torch, case.get("mask_dtype", "bool")),
                        q_scale=case.get("q_scale", 1.0))
    rows = case["q_len"] * case["heads"]
    ns, ns_tail = mv.tail_splits(case["nsplit"], case["bs"], rows, config, mv._tail_split(case["bs"], rows, config))
    assert ns == mv.effective_nsplit(case["nsplit"], case["bs"], rows, config)
    draft = mv.draft_slots(case["bs"], rows, config)
    ws = mv.Workspace(case["bs"] * (ns + draft) + 3, rows + 8, "cpu", dtype=config.partial_dtype)   # spares untouched
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(12345.0)                                   # sentinel: untouched partitions keep it
    out = torch.full((prob["q"].shape[0], case["heads"], mv.D_LATENT), float("nan"), dtype=prob["q"].dtype)
    t0 = time.perf_counter()
    run_kernel(prob, SCALE, case["nsplit"], config=config, workspace=ws, out=out)
    seconds = time.perf_counter() - t0
    ref = run_reference(prob, SCALE)
    err = (out.float() - ref).abs()
    # which prefix partitions were written (LSE no longer the sentinel), per request, vs the expected count
    min_chunk = mv.launch_min_chunk(ns, case["bs"], rows, config, ns_tail)
    written, expected = [], []
    lse_view = ws.views(case["bs"], ns + draft)[1]
    tail_row0 = rows - rows % config.block_m
    for b, pre in enumerate(case["prefix_lens"]):
        for row, k in [(0, 1)] + ([(tail_row0, config.tail_pair)] if ns_tail else []):   # tail rows: k partitions
            per = -(-pre // ns) if pre else 0
            per = max(-(-per // config.block_n) * config.block_n, min_chunk) * k
            expected.append(-(-pre // per) if pre else 0)
            written.append(int((lse_view[b, :ns, row] != 12345.0).sum()))
    untouched = bool((lse_view[:, :, rows:] == 12345.0).all()) and bool((ws.part_lse[-3:] == 12345.0).all())
    draft_written = bool((lse_view[:, ns:, :rows] != 12345.0).all()) if draft else None
    return dict(case=case, nsplit_used=ns, tail_nsplit=ns_tail, draft_slots=draft, draft_written=draft_written,
                min_chunk_used=min_chunk,
                max_err=float(err.max()),
                ref_max=float(ref.abs().max()),
                rel_err=float((out.float() - ref).norm() / ref.norm()), all_written=bool(torch.isfinite(out).all()),
                partitions_written=written, partitions_expected=expected, pad_rows_untouched=untouched,
                seconds=round(seconds, 3))


def main() -> int:
    results = []
    t0 = time.perf_counter()
    for case in cases():
        res = run_case(case)
        results.append(res)
        print("CASE " + json.dumps(res), flush=True)
    print("RESULT " + json.dumps({"cases": len(results), "seconds": round(time.perf_counter() - t0, 1),
                                  "torch": torch.__version__, "triton": __import__("triton").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
