"""Runs the kdtree verify kernel under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) on many
small problems (and the batch schedule on ragged ones) and prints one ``CASE <json>`` line per problem and a
final ``RESULT <json>`` line.

Run by tests/kernels/test_mla_verify_interpreter.py with the CPU SGLang venv's python (torch + triton) and the
payload on PYTHONPATH. Precision: the interpreter gets bfloat16 wrong (numpy has no bfloat16: loads come back
as garbage), so the cases run in float32 (tight tolerance) and float16 (the same half-precision code path
as bf16: p and the output are rounded). bf16 itself is checked on the GPU (test_mla_verify_gpu.py).
"""

from __future__ import annotations

import json
import math
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
    # random trees and chains, Q 1..16, prefix 0..few hundred, page size 1 and 64, NSPLIT 1..16
    grid = [
        # bs, H, Q, prefixes, page, tree, nsplit
        (1, 1, 1, [0], 1, True, 1),
        (1, 2, 1, [5], 1, False, 4),
        (2, 2, 2, [0, 17], 1, True, 2),
        (3, 2, 5, [1, 63, 64], 64, True, 8),
        (2, 4, 8, [200, 31], 64, True, 16),
        (2, 3, 9, [129, 0], 1, False, 3),
        (1, 2, 16, [333], 64, True, 16),
        (4, 2, 4, [7, 100, 257, 48], 1, True, 5),
        (1, 8, 9, [96], 64, False, 1),
        (1, 16, 3, [45], 64, True, 2),
    ]
    for i, (bs, h, q, pre, page, tree, ns) in enumerate(grid):
        out.append(dict(bs=bs, heads=h, q_len=q, prefix_lens=pre, page_size=page, tree=tree, nsplit=ns, seed=i,
                        dtype="float32"))
    # the batch schedule on ragged batches: columns shared by the requests (a pretend GPU of max_ctas programs),
    # columns crossing request boundaries, prefixes of 0 and 1 beside long ones, more requests than columns
    out.append(dict(bs=9, heads=2, q_len=3, prefix_lens=[300, 0, 1, 17, 0, 64, 5, 2, 130], page_size=1, tree=True,
                    nsplit=8, seed=60, config=dict(max_ctas=4), dtype="float32"))
    out.append(dict(bs=5, heads=4, q_len=5, prefix_lens=[250, 1, 0, 40, 90], page_size=64, tree=True, nsplit=8,
                    seed=61, config=dict(max_ctas=6, tail_m=16), dtype="float32"))      # 20 rows = 16 + a 4-row tail
    out.append(dict(bs=3, heads=2, q_len=4, prefix_lens=[0, 0, 0], page_size=1, tree=True, nsplit=4, seed=62,
                    dtype="float32"))                                                   # nothing in the prefix
    out.append(dict(bs=4, heads=2, q_len=6, prefix_lens=[16, 16, 16, 16], page_size=1, tree=False, nsplit=2,
                    seed=63, config=dict(max_ctas=3), dtype="float32"))                 # boundaries on tiles
    # no custom mask (SGLang's chain path without a mask): causal drafts; uint8 mask (SGLang's graph buffer)
    out.append(dict(bs=2, heads=2, q_len=6, prefix_lens=[40, 3], page_size=1, tree=False, nsplit=4, seed=20,
                    mask=False, dtype="float32"))
    out.append(dict(bs=2, heads=2, q_len=7, prefix_lens=[70, 9], page_size=64, tree=True, nsplit=4, seed=21,
                    mask_dtype="uint8", dtype="float32"))
    # peaky softmax (large scores): the online rescaling and the LSE combine must stay exact
    out.append(dict(bs=1, heads=2, q_len=5, prefix_lens=[150], page_size=1, tree=True, nsplit=6, seed=22,
                    q_scale=8.0, dtype="float32"))
    # other tiles: larger row/key blocks with min_chunk > block; a short tile for the last rows (36 = 32 + 4)
    out.append(dict(bs=2, heads=4, q_len=5, prefix_lens=[110, 260], page_size=64, tree=True, nsplit=16, seed=23,
                    config=dict(block_m=32, block_n=32, min_chunk=64), dtype="float32"))
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[150, 33], page_size=1, tree=True, nsplit=4, seed=33,
                    config=dict(block_m=32, tail_m=16), dtype="float32"))
    # the wide combine (one 512-channel program per row) and the row-block combine (16 rows per program, the
    # draft tree on the tensor cores): a tree, a chain without a mask, Q=40 (BLOCK_J 64), float16
    out.append(dict(bs=2, heads=3, q_len=6, prefix_lens=[130, 45], page_size=64, tree=True, nsplit=4, seed=29,
                    config=dict(combine_wide_rows=36), dtype="float32"))
    out.append(dict(bs=2, heads=4, q_len=9, prefix_lens=[150, 0], page_size=1, tree=True, nsplit=4, seed=40,
                    config=dict(combine_rows=1), dtype="float32"))
    out.append(dict(bs=2, heads=3, q_len=7, prefix_lens=[40, 3], page_size=64, tree=False, nsplit=8, seed=41,
                    mask=False, config=dict(combine_rows=1, max_ctas=2), dtype="float32"))
    out.append(dict(bs=1, heads=1, q_len=40, prefix_lens=[70], page_size=1, tree=True, nsplit=2, seed=42,
                    config=dict(combine_rows=1), dtype="float32"))
    # the draft tree in its own kernel (its partial in a slot of its own; the combines only merge): per-row and
    # row-block combines, a tree with an empty prefix, a chain without a mask
    out.append(dict(bs=3, heads=4, q_len=9, prefix_lens=[150, 0, 7], page_size=1, tree=True, nsplit=4, seed=44,
                    config=dict(draft_kernel=True, max_ctas=5), dtype="float32"))
    out.append(dict(bs=2, heads=3, q_len=7, prefix_lens=[40, 3], page_size=64, tree=False, nsplit=8, seed=45,
                    mask=False, config=dict(draft_kernel=True, combine_rows=1), dtype="float32"))
    # partitions no shorter than the keys of their fp32 partial's bytes (32 rows in 2 blocks: 29 -> 32 keys, where
    # 200 keys over 16 columns would give 16)
    out.append(dict(bs=1, heads=4, q_len=8, prefix_lens=[200], page_size=1, tree=True, nsplit=16, seed=46,
                    config=dict(partial_floor=True), dtype="float32"))
    # the short last row block (18 rows = 16 + 2) over partitions of its own, in a launch of its own, because that
    # gives the full block more columns (a pretend GPU of max_ctas programs): per-row and row-block combines
    out.append(dict(bs=2, heads=2, q_len=9, prefix_lens=[150, 37], page_size=1, tree=True, nsplit=8, seed=47,
                    config=dict(max_ctas=9, tail_cost=0.5), dtype="float32"))
    out.append(dict(bs=3, heads=2, q_len=9, prefix_lens=[90, 0, 41], page_size=64, tree=True, nsplit=4, seed=48,
                    config=dict(max_ctas=7, tail_cost=0.5, draft_kernel=True, combine_rows=1), dtype="float32"))
    # the sm_90 Gluon split kernel asked for on CPU tensors: the Triton kernel runs instead
    out.append(dict(bs=1, heads=2, q_len=4, prefix_lens=[40], page_size=1, tree=True, nsplit=2, seed=37,
                    config=dict(sm90=True), dtype="float32"))
    # float16: the half-precision path (p and o rounded); bf16 is GPU-only
    out.append(dict(bs=2, heads=8, q_len=5, prefix_lens=[90, 170], page_size=1, tree=True, nsplit=4, seed=43,
                    config=dict(combine_rows=1), dtype="float16"))
    out.append(dict(bs=3, heads=4, q_len=9, prefix_lens=[120, 1, 33], page_size=64, tree=True, nsplit=4, seed=30,
                    config=dict(max_ctas=5), dtype="float16"))
    return out


def expected_slots(prefix_lens: list[int], q_rows: int, columns: int, block_n: int, min_chunk: int) -> dict:
    """The schedule worked out here, independently of the kernel: slot -> (request, keys), for every segment
    (a column's piece of one request); the kernel must write exactly these slots."""
    total = sum(prefix_lens)
    per = -(-total // columns) if total else 0
    chunk = max(-(-per // block_n) * block_n, min_chunk)
    starts = [sum(prefix_lens[:b]) for b in range(len(prefix_lens))]
    slots = {}
    for p in range(columns):
        for b, (st, n) in enumerate(zip(starts, prefix_lens, strict=True)):
            lo, hi = max(p * chunk, st), min((p + 1) * chunk, st + n)
            if lo < hi:
                assert p + b not in slots
                slots[p + b] = (b, hi - lo)
    return slots


def run_case(case: dict) -> dict:
    config = mv.with_config(BASE, **case.get("config", {}))
    prob = make_problem(case["bs"], case["heads"], case["q_len"], case["prefix_lens"], page_size=case["page_size"],
                        tree=case["tree"], dtype=getattr(torch, case["dtype"]), seed=case["seed"],
                        mask=case.get("mask", True), mask_dtype=getattr(torch, case.get("mask_dtype", "bool")),
                        q_scale=case.get("q_scale", 1.0))
    rows = case["q_len"] * case["heads"]
    draft = config.draft_kernel and case["q_len"] <= 64
    plan = mv.plan(case["bs"], rows, case["nsplit"], config, config.block_m, draft, tail=True)  # CPU: no PDL
    ws = mv.Workspace(plan.slots + 3, rows + 8, "cpu")           # spare slots and rows: must stay untouched
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(12345.0)                                   # sentinel: untouched slots keep it
    out = torch.full((prob["q"].shape[0], case["heads"], mv.D_LATENT), float("nan"), dtype=prob["q"].dtype)
    t0 = time.perf_counter()
    run_kernel(prob, SCALE, case["nsplit"], config=config, workspace=ws, out=out)
    seconds = time.perf_counter() - t0
    ref = run_reference(prob, SCALE)
    err = (out.float() - ref).abs()
    min_chunk = config.min_chunk
    if config.partial_floor:                  # a row block's partial: rows / blocks x 512 fp32; a key: 576 bf16
        min_chunk = max(min_chunk, math.ceil(rows / plan.blocks * 512 * 4 / (576 * 2)))
    min_chunk = -(-min_chunk // config.block_n) * config.block_n
    expect = expected_slots(case["prefix_lens"], rows, plan.columns, config.block_n, min_chunk)
    bs = case["bs"]
    drafts = {plan.columns + bs - 1 + b: (b, 0) for b in range(bs)} if draft else {}
    # the short last row block's own partitions: slots after the draft ones, its rows only
    tail_row0 = plan.blocks * config.block_m if plan.tail else rows
    tail0 = plan.columns + bs - 1 + (bs if draft else 0)
    tails = ({tail0 + s: v for s, v in expected_slots(case["prefix_lens"], rows, plan.tail, config.block_n,
                                                      min_chunk).items()} if plan.tail else {})
    slot_rows = {**{s: (0, tail_row0) for s in expect}, **{s: (tail_row0, rows) for s in tails},
                 **{s: (0, rows) for s in drafts}}
    seen = ws.part_lse[:, :rows] != 12345.0
    partly = sorted(int(s) for s in range(ws.slots) if bool(seen[s].any()))
    written = sorted(s for s, (lo, hi) in slot_rows.items()
                     if bool(seen[s, lo:hi].all()) and not bool(seen[s, :lo].any() or seen[s, hi:].any()))
    return dict(case=case, columns=plan.columns, blocks=plan.blocks, tail=plan.tail, slots=plan.slots,
                min_chunk=min_chunk,
                max_err=float(err.max()), ref_max=float(ref.abs().max()),
                rel_err=float((out.float() - ref).norm() / ref.norm()), all_written=bool(torch.isfinite(out).all()),
                slots_written=written, slots_partly=partly, slots_expected=sorted(slot_rows),
                draft_slots=sorted(drafts),
                columns_shared=sum(1 for p in range(plan.columns)
                                   if sum(1 for s in expect if s - expect[s][0] == p) > 1),
                pad_rows_untouched=bool((ws.part_lse[:, rows:] == 12345.0).all()),
                seconds=round(seconds, 3))


def main() -> int:
    results = []
    t0 = time.perf_counter()
    for case in cases():
        res = run_case(case)
        results.append(res)
        print("CASE " + json.dumps(res), flush=True)
    h200 = mv.with_config(mv.GPU_CONFIG, max_ctas=132)            # the GPU launch plan on 132 multiprocessors
    plans = [dict(bs=bs, rows=rows, **{k: getattr(p, k) for k in ("columns", "blocks", "tail", "slots")},
                  cap=132 - h200.draft_sms, tail_cost=h200.tail_cost, tail_rows_min=h200.tail_rows_min)
             for bs, rows in ((1, 144), (8, 144), (1, 72), (8, 72), (1, 128), (1, 256), (4, 80))
             for p in [mv.plan(bs, rows, 64, h200, 64, True, True)]]
    print("RESULT " + json.dumps({"cases": len(results), "seconds": round(time.perf_counter() - t0, 1), "plans": plans,
                                  "torch": torch.__version__, "triton": __import__("triton").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
