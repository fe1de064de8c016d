"""kdtree tree-verify attention for absorbed MLA (DeepSeek/Kimi style): Triton split-K kernel + combine.

What it computes, per request ``b`` of a target-verify batch (SGLang's EAGLE/DDTree verify step):

* ``q_len`` draft-tree tokens (rows ``qo_indptr[b]..qo_indptr[b+1]`` of ``q``), ``H`` query heads each,
  query = ``[latent 512 | rope 64]``;
* keys = the request's prefix (``P_b`` tokens already in the paged KV cache, per token
  ``[c_kv 512 | k_rope 64]``) followed by the ``q_len`` draft tokens themselves (``k_ext``);
  values = ``c_kv`` (the first 512 channels of the same cache rows; ``v_ext`` for the draft tokens);
* draft token ``i`` sees the whole prefix and the draft tokens ``j`` with
  ``custom_mask[mask_indptr[b] + i * (P_b + q_len) + P_b + j] != 0`` — the flattened ``[q_len, P_b + q_len]``
  per-request mask SGLang's target-verify mode passes (its prefix columns are all ones there and are not
  read); without a mask, the draft part is causal (a chain).

The prefix is addressed like SGLang's Triton backend does: either ``kv_indptr``/``kv_indices`` (the flattened
per-token slot list, ``kv_indices[kv_indptr[b] + t]``) or ``req_to_token[req_pool_indices[b], t]`` with
``seq_lens[b]``. Page size 1 and 64 are both just layouts of those slot lists (a 64-token page is 64
consecutive slots); the pages may lie anywhere in the pool.

How (two launches, no host sync, no allocation, grid from static maxima — CUDA-graph safe):

1. ``_split_kernel``, grid ``(row_blocks, nsplit, bs)``. A program takes ``BLOCK_M`` (token, head) rows of one
   request (MLA has one KV head, so every query head of every draft token shares the KV stream, and the rows
   of a request are contiguous in ``q``) and one partition of the prefix: partition ``s`` is
   ``[s * chunk, (s + 1) * chunk)``, ``chunk = max(roundup(cdiv(P_b, nsplit), BLOCK_N), min_chunk)``, so short
   prefixes use fewer partitions and the rest exit at once. It streams its keys in ``BLOCK_N`` tiles (one
   load of ``[c_kv | k_rope]`` serves both ``Q K^T`` and ``P V``; no mask in the prefix), keeps an online
   softmax in fp32 and writes its normalised partial output (fp32) and log2-sum-exp.
2. ``_combine_kernel``, grid ``(max_q_len * H, bs, 512 / BLOCK_D)``: one (token, head) row, BLOCK_D output
   channels. It attends the draft tree once per row (the only place the mask is read; fp32 on the row's
   ``q_len`` draft keys), merges that with the non-empty prefix partitions by their LSE and writes ``o``
   (``[tokens, H, 512]``, the input dtype). Partials are fp32 (``partial_dtype`` can make them bf16). Large
   launches (``KernelConfig.combine_rows``) use ``_combine_rows_kernel`` instead: 16 rows x 128 channels per
   program, the draft-tree scores of those rows as one tensor-core tile (bf16 products, fp32 sums). On Hopper
   both combines usually only merge: the split kernel's programs of one more partition attend the draft tree into
   its slot (``KernelConfig.split_draft``, ``split_draft_rows``).

On a Hopper GPU the split kernel is ``mla_verify_sm90.split_kernel_sm90_ws`` (Gluon: same arguments, grid and
output; the two warp groups split the score tile instead of both computing it, and four producer warps do the
copies; a short last row block runs transposed 16-row tiles), see ``KernelConfig.sm90``, ``sm90_ws`` and
``tail_pair``.

``mla_tree_verify`` launches both; ``reference_tree_verify`` is the fp32 PyTorch reference (gather, mask,
softmax, weighted sum). Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

KERNEL_NAME = "kdtree-splitk"
D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. ``max_ctas`` caps ``row_blocks * bs * nsplit`` (0: no cap; -1: the current CUDA
    device's multiprocessor count, i.e. one wave of programs) by using fewer partitions for a batch that already
    fills the GPU; ``min_chunk`` is the shortest partition (tokens).
    ``wave_sms`` (> 0: that many multiprocessors; -1: the current CUDA device's; 0: off) picks, under those
    caps, the partition count that wastes least of the last wave of programs (one program per multiprocessor:
    time ~ waves x tiles per program); ``dv_split`` 2 gives each half of the 512 value channels its own
    program (measured slower on H200: kept as an option, see docs/benchmarks.md); ``pdl`` launches the
    combine as a programmatic dependent launch (sm_90+): it starts while the split kernel's last programs
    run, attends the draft tree, then waits (``griddepcontrol.wait``) before reading the partials;
    ``wave_min_chunk`` (> 0, with ``wave_sms``) is the shortest partition instead of ``min_chunk`` when all
    the launch's programs fit in one wave (bs=1, short prefixes): more, shorter partitions on idle
    multiprocessors rather than a few long ones, where several waves would pay each program's fixed cost
    again; ``combine_wide_rows`` (> 0): a launch of at least that many (token, head) rows in all combines
    with one program per row for all 512 channels (twice ``combine_warps``), attending the draft tree once
    per row instead of once per ``combine_block_d`` channels, and merging proportionally fewer partitions per
    step than ``combine_block_s`` (the same tile of partials: 64 x 256 channels was slower as 64 x 512) —
    smaller launches keep the narrower programs for parallelism; ``combine_rows`` (> 0): a launch of at least
    that many rows combines 16 rows x 128 channels per program instead (``_combine_rows_kernel``: the draft
    tree as one tensor-core tile; its partitions are merged four at a time, so it suits launches of few
    partitions per request, i.e. large batches);
    ``sm90_ws``: the warp-specialised Gluon split kernel (producer warps for the copies); ``draft_rows``
    (> 0): a launch of at least that many rows that combines with the per-row kernel (below ``combine_rows``)
    attends the draft tree in its own kernel (``_draft_kernel``: 16 rows per program, the scores on the tensor
    cores), launched (PDL) right after the split kernel, into one more partition slot per request; the combine
    then only merges partials. From 256 rows (bs=1 H=16 Q=16) the wide per-row combine's tree attention (fp32,
    one row per program) cost more than the extra launch; below, the extra launch costs more than it saves.
    ``split_draft``: every launch that combines with the per-row kernel reserves that slot, and where the
    warp-specialised Gluon kernel runs (``q_len`` <= 64) its grid has one more partition whose programs attend
    the draft tree into it (one masked tile each): no launch of its own, and the combine's critical path loses
    the tree attention; the launch uses one partition fewer where that keeps its programs in one wave. Where
    that kernel does not run, ``draft_rows`` decides as without ``split_draft`` (the slot may stay unused).
    ``split_draft_rows``: the same on launches the row-block combine merges (``combine_rows``), whose combine
    then only merges partials; there the launch keeps its partition count and the draft programs come last in
    launch order, on the multiprocessors the prefix programs leave free (a large batch rarely fills the last
    wave: bs=8 H=16 Q=9, 24 row blocks x 5 partitions, leaves 12 of 132). ``draft_kernel_rows``: on those
    launches, where ``split_draft_rows`` does not apply, ``_draft_kernel`` fills the slot (its small programs run
    on the multiprocessors the split kernel leaves free). ``tail_pair`` (k > 0, on launches ``split_draft``
    serves): a launch whose last row block is short (``rows % block_m`` in 1 .. ``tail_m``: 72 rows = 64 + 8,
    144 = 128 + 16) gives that block's rows partitions of k prefix partitions' keys each (tail programs: in the
    warp-specialised Gluon kernel on transposed 16-row tiles, interleaving the k ranges; elsewhere
    ``_tail_kernel``); the launch's prefix programs stay at most ``row blocks x nsplit`` and one wave (bs=1 H=8
    Q=9, k=2: 85 partitions for the 64-row block, 43 tail programs, instead of 64 each), so the 64-row programs,
    whose tiles cost the same whatever their rows, get shorter partitions. The combine merges each row's own
    partition count."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    min_chunk: int = 256
    max_ctas: int = 512
    partial_dtype: str = "float32"
    warp_specialize: bool = False
    dv_split: int = 1
    wave_sms: int = 0
    pdl: bool = False
    combine_block_s: int = 32
    combine_block_d: int = 256
    combine_block_j: int = 16
    combine_warps: int = 4
    wave_min_chunk: int = 0
    combine_wide_rows: int = 0
    tail_m: int = 0
    sm90: bool = False
    sm90_ws: bool = False
    combine_rows: int = 0
    draft_rows: int = 0
    split_draft: bool = False
    split_draft_rows: bool = False
    draft_kernel_rows: bool = False
    tail_pair: int = 0

    def describe(self) -> str:
        return (f"block_m={self.block_m} block_n={self.block_n} warps={self.num_warps} stages={self.num_stages} "
                f"dv_split={self.dv_split} min_chunk={self.min_chunk} wave_min_chunk={self.wave_min_chunk} "
                f"max_ctas={self.max_ctas} wave_sms={self.wave_sms} "
                f"pdl={int(self.pdl)} partials={self.partial_dtype} "
                f"combine=s{self.combine_block_s}/d{self.combine_block_d}/w{self.combine_warps} "
                f"combine_wide_rows={self.combine_wide_rows} tail_m={self.tail_m} sm90={int(self.sm90)} "
                f"sm90_ws={int(self.sm90_ws)} combine_rows={self.combine_rows} draft_rows={self.draft_rows} "
                f"split_draft={int(self.split_draft)} split_draft_rows={int(self.split_draft_rows)} "
                f"draft_kernel_rows={int(self.draft_kernel_rows)} tail_pair={self.tail_pair}")


# Tuned on one H200 (bench/kernel.py --tune, 2026-12-01; bench/results/kernel-h200.json): 64 (token, head) rows
# x 64 keys per tile, 8 warps, 2 cp.async stages (216 KB of shared memory, 255 registers, no spills), partitions
# of at least 256 tokens and at most 512 programs per launch, fp32 partials. Since run 3 (same day): the
# partition count that fills the last wave of programs best (wave_sms=-1) and the combine as a programmatic
# dependent launch (pdl; sm_90+ only, else off): bs=1 H=16 and bs=8 H=16 Q=9 5-24% faster, the rest 0-3%.
# Second pass (same day; A/B in bench/results/kernel-h200-run6-ab.txt, CUDA-graph replay): partitions of 64 tokens
# when the launch is one wave of programs (bs=1 at 4k: 24-33 us instead of 31-40 us; the same code path from 16k
# up), and the combine of launches of >= 256 rows (bs x Q x H) in one 512-channel program of 8 warps per row
# (bs=1 H=16 Q=16 0.4-13% faster, bs=8 Q=16 0.4-3%, bs=8 Q=9 -0.6..+2.6%).
# Third pass (same day; bench/results/kernel-h200-sweep5..11.*, kernel-h200-ab.txt): on Hopper the split kernel
# is the Gluon one of mla_verify_sm90.py (sm90: the score tile split over the two warp groups, one
# cross-warp-group reduction per tile; replay geomean over the 32 shapes 135.4 -> 103.4 us in one call), and
# launches of more than one wave use partitions of >= 512 tokens and at most 256 programs (-> 101.1 us; bs=8
# H=16 Q=9 4-8% slower, the other bs=8 shapes up to 14% faster); elsewhere the Triton kernel runs the last row
# block of 72 or 144 rows on a 16-row tile (tail_m: 134.4 -> 129.4 us on the H200 with the Triton kernel; not
# measured on other GPUs).
# Fourth pass (same day; bench/results/kernel-h200-pass4-*): the Gluon split kernel's copies in their own warps
# (sm90_ws: 4 producer warps, a two-slot ring signalled by mbarriers; replay geomean 101.0 -> 93.3 us in one call)
# and at most one wave of programs (max_ctas=-1: 132 on the H200, was 256: -> 91.7 us; bs=8 H=16 Q=9 4k 93.9 ->
# 86.0 us); launches of >= 512 rows combine 16 rows per program with the draft tree on the tensor cores
# (combine_rows: the per-row combine took 30-80 us at bs=8 whatever the context, this one 18-20 us; -> 82.3 us).
# Fifth pass (same day; bench/results/kernel-h200-pass5-*): launches of 256-511 rows (bs=1 H=16 Q=16) attend the
# draft tree in their own kernel (draft_rows; the combine only merges): 3-10% faster there (one call: 28.3 -> 25.2 us
# at 4k, 101.3 -> 98.0 us at 64k); on every bs=1 launch it was 0.5-2 us slower at H=8 and H=16 Q=9.
# Sixth pass (same day; bench/results/kernel-h200-pass6-*): on Hopper every launch the per-row combine merges
# attends the draft tree in the split kernel's programs of one more partition (split_draft; draft_rows then only
# matters off Hopper), and that combine merges 64 partitions per step, loading the draft partial beside them:
# the 16 bs=1 shapes' replay geomean 40.9 -> 38.0 us in one call (bs=1 H=8 Q=9 64k 58.1 -> 54.1 us).
# Seventh pass (bench/results/kernel-h200-pass7-*): launches the row-block combine merges (bs=8) attend the draft tree
# in the split kernel's programs too (split_draft_rows; their draft programs last in launch order, on the
# multiprocessors the prefix programs leave free), that combine only merges: the 16 bs=8 shapes' replay geomean
# 163.0 -> 155.2 us in one call (bs=8 H=16 Q=9 4k 56.2 -> 49.8 us); _draft_kernel there instead
# (draft_kernel_rows) 157.7 us.
# Ninth pass (bench/results/kernel-h200-pass9-*): the short last row block of per-row-combine launches (72 = 64 + 8,
# 144 = 128 + 16 rows) in the Gluon kernel's tail programs, on transposed 16-row tiles (tail_pair=1: the same
# partitions as the full blocks): main's code and this alternating in one call, bs=1 H=16 Q=9 1-3% faster (64k 76.0
# -> 74.0 us), H=8 Q=9 64k 54.0 -> 53.7 us but 4k-32k 0.4-0.8 us slower; tail programs of two partitions' keys
# (tail_pair=2, shorter full-block partitions) were 4-20% slower.
GPU_CONFIG = KernelConfig(wave_sms=-1, pdl=True, wave_min_chunk=64, combine_wide_rows=256, tail_m=16, sm90=True,
                          sm90_ws=True, min_chunk=512, max_ctas=-1, combine_rows=512, draft_rows=256,
                          split_draft=True, combine_block_s=64, split_draft_rows=True, tail_pair=1)
INTERPRETER_CONFIG = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, min_chunk=16, max_ctas=0,
                                  combine_block_s=8, combine_block_d=256)


def default_config(device: torch.device | str) -> KernelConfig:
    return GPU_CONFIG if torch.device(device).type == "cuda" else INTERPRETER_CONFIG


# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _chunk_len(prefix, nsplit, min_chunk, BLOCK_N: tl.constexpr):
    """Tokens per prefix partition (a multiple of BLOCK_N; min_chunk is one too). The split kernels (also the
    sm_90 Gluon ones) and the combine must agree on it: one function for all of them."""
    per = tl.cdiv(prefix, nsplit)
    per = tl.cdiv(per, BLOCK_N) * BLOCK_N
    return tl.maximum(per, min_chunk)


@triton.jit
def _request_kv(KvStart, KvLens, b, kv_start_mult, KV_INDPTR: tl.constexpr):
    """Request ``b``'s first cache-index position and prefix length (also called by the sm_90 Gluon kernel and,
    for the length alone, by the combine and draft kernels)."""
    if KV_INDPTR:
        kv_base = tl.load(KvStart + b).to(tl.int64)
        prefix = (tl.load(KvStart + b + 1) - kv_base).to(tl.int32)
    else:
        kv_base = tl.load(KvStart + b).to(tl.int64) * kv_start_mult
        prefix = tl.load(KvLens + b).to(tl.int32)
    return kv_base, prefix


@triton.jit
def _tile_slots(KvIdx, kv_base, n0, end, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Cache slots of prefix keys [n0, n0 + BLOCK_N) (masked: those >= end read slot 0, never used)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(KvIdx + kv_base + offs_n, mask=offs_n < end, other=0).to(tl.int64)
    return tl.load(KvIdx + kv_base + offs_n).to(tl.int64)


@triton.jit
def _prefix_tile(acc, m_i, l_i, q_own, q_oth, q_rope, KBuf, loc, n0, end, qk_scale, stride_kb, dv0,
                 DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr,
                 MASKED: tl.constexpr):
    """One BLOCK_N tile of prefix keys (their cache slots ``loc``): gather the rows, scores, online softmax
    update, P V.

    DV_SPLIT == 2: this program owns value channels [dv0, dv0 + 256); the latent part of Q K^T is done as
    its own half (also the values) plus the other half (q_oth / k_oth), so nothing is loaded twice."""
    BLOCK_DV: tl.constexpr = DL // DV_SPLIT
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, DR)
    if MASKED:
        n_ok = offs_n < end
    k_row = KBuf + loc[:, None] * stride_kb
    if MASKED:
        k_own = tl.load(k_row + dv0 + offs_dv[None, :], mask=n_ok[:, None], other=0.0)
        k_rope = tl.load(k_row + DL + offs_dr[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_own = tl.load(k_row + dv0 + offs_dv[None, :])
        k_rope = tl.load(k_row + DL + offs_dr[None, :])
    s = tl.dot(q_own, tl.trans(k_own))
    if DV_SPLIT == 2:
        if MASKED:
            k_oth = tl.load(k_row + (BLOCK_DV - dv0) + offs_dv[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_oth = tl.load(k_row + (BLOCK_DV - dv0) + offs_dv[None, :])
        s = tl.dot(q_oth, tl.trans(k_oth), s)
    s = tl.dot(q_rope, tl.trans(k_rope), s)
    s = s * qk_scale
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k_own.dtype), k_own, acc)
    return acc, m_new, l_i


@triton.jit
def _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, b, split, kv_base, start, end, dv0, qk_scale,
               stride_qt, stride_qh, stride_kb, stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
               H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WARP_SPEC: tl.constexpr, DV_SPLIT: tl.constexpr):
    """Rows [row0, row0 + BLOCK_M) of request b x prefix keys [start, end) -> partial output + log2-sum-exp."""
    BLOCK_DV: tl.constexpr = DL // DV_SPLIT
    offs_m = row0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, DR)
    q_row = Q + (q_start + offs_m // H).to(tl.int64)[:, None] * stride_qt + (offs_m % H)[:, None] * stride_qh
    q_own = tl.load(q_row + dv0 + offs_dv[None, :], mask=row_ok[:, None], other=0.0).to(KBuf.dtype.element_ty)
    if DV_SPLIT == 2:
        q_oth = tl.load(q_row + (BLOCK_DV - dv0) + offs_dv[None, :], mask=row_ok[:, None],
                        other=0.0).to(KBuf.dtype.element_ty)
    else:
        q_oth = q_own                              # unused
    q_rope = tl.load(q_row + DL + offs_dr[None, :], mask=row_ok[:, None], other=0.0).to(KBuf.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # no mask in the prefix; one load of [c_kv | k_rope] serves Q K^T and P V (values = c_kv).
    # Whole BLOCK_N tiles run unmasked; the partition's last partial tile (if any) runs masked.
    n_full = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in tl.range(start, n_full, BLOCK_N, warp_specialize=WARP_SPEC):
        loc = _tile_slots(KvIdx, kv_base, n0, end, BLOCK_N, False)
        acc, m_i, l_i = _prefix_tile(acc, m_i, l_i, q_own, q_oth, q_rope, KBuf, loc, n0, end, qk_scale,
                                     stride_kb, dv0, DL, DR, BLOCK_N, DV_SPLIT, False)
    if n_full < end:
        loc = _tile_slots(KvIdx, kv_base, n_full, end, BLOCK_N, True)
        acc, m_i, l_i = _prefix_tile(acc, m_i, l_i, q_own, q_oth, q_rope, KBuf, loc, n_full, end,
                                     qk_scale, stride_kb, dv0, DL, DR, BLOCK_N, DV_SPLIT, True)

    out = acc / l_i[:, None]                       # every partition has >= 1 key: l_i > 0
    lse = m_i + tl.log2(l_i)
    part = b.to(tl.int64) * stride_pb + split.to(tl.int64) * stride_ps
    tl.store(PartO + part + offs_m[:, None] * stride_pr + dv0 + offs_dv[None, :], out.to(PartO.dtype.element_ty),
             mask=row_ok[:, None])
    # both value halves compute the same scores (same instructions, same order): one of them writes the LSE
    if dv0 == 0:
        tl.store(PartLse + b.to(tl.int64) * stride_lb + split.to(tl.int64) * stride_ls + offs_m, lse, mask=row_ok)


@triton.jit
def _split_kernel(
    Q, KBuf, QoIndptr, KvStart, KvLens, KvIdx, PartO, PartLse,
    qk_scale, nsplit, min_chunk, kv_start_mult,
    stride_qt, stride_qh, stride_kb,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_INDPTR: tl.constexpr, WARP_SPEC: tl.constexpr,
    DV_SPLIT: tl.constexpr, PDL: tl.constexpr, TAIL_M: tl.constexpr,
):
    """One prefix partition x BLOCK_M (token, head) rows of one request (x one half of the 512 value channels
    when DV_SPLIT == 2: neighbouring programs take the two halves of the same rows and keys, so the second
    reads its keys from L2) -> partial output + log2-sum-exp."""
    BLOCK_DV: tl.constexpr = DL // DV_SPLIT
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()      # the combine may be launched once every program runs
    pid_m = tl.program_id(0) // DV_SPLIT
    dv0 = (tl.program_id(0) % DV_SPLIT) * BLOCK_DV
    split = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(QoIndptr + b)
    rows = (tl.load(QoIndptr + b + 1) - q_start) * H
    if pid_m * BLOCK_M >= rows:
        return
    kv_base, prefix = _request_kv(KvStart, KvLens, b, kv_start_mult, KV_INDPTR)
    chunk = _chunk_len(prefix, nsplit, min_chunk, BLOCK_N)
    start = split * chunk
    if start >= prefix:
        return                                     # empty partition: the combine skips it too
    end = tl.minimum(start + chunk, prefix)

    row0 = pid_m * BLOCK_M
    if TAIL_M > 0:  # noqa: SIM102 (a constexpr branch: no short tile is compiled when TAIL_M == 0)
        if rows - row0 <= TAIL_M:                  # the last few rows (e.g. 8 of 72): a short tile, not 64 rows
            _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, b, split, kv_base, start, end, dv0,
                       qk_scale, stride_qt, stride_qh, stride_kb, stride_pb, stride_ps, stride_pr, stride_lb,
                       stride_ls, H, DL, DR, TAIL_M, BLOCK_N, WARP_SPEC, DV_SPLIT)
            return
    _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, b, split, kv_base, start, end, dv0, qk_scale,
               stride_qt, stride_qh, stride_kb, stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, H, DL, DR,
               BLOCK_M, BLOCK_N, WARP_SPEC, DV_SPLIT)


@triton.jit
def _tail_kernel(
    Q, KBuf, QoIndptr, KvStart, KvLens, KvIdx, PartO, PartLse,
    qk_scale, nsplit, min_chunk, kv_start_mult,
    stride_qt, stride_qh, stride_kb,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, row0, tail_pair,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_INDPTR: tl.constexpr, PDL: tl.constexpr,
):
    """``tail_pair``: rows [row0, row0 + TAIL_M) of request ``program_id(1)`` (the launch's short last row block)
    x the keys of ``tail_pair`` prefix partitions of ``nsplit`` (the ``program_id(0)``-th such span) -> partial
    output + log2-sum-exp, on a TAIL_M-row tile; the split kernel (launched just before) does the full row blocks.
    With PDL it starts once every split program runs, on the multiprocessors they leave free, and program (0, 0)
    waits for the split kernel before it exits, so that the combine's one wait (which covers only the kernel
    launched just before it) covers both."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(QoIndptr + b)
    rows = (tl.load(QoIndptr + b + 1) - q_start) * H
    kv_base, prefix = _request_kv(KvStart, KvLens, b, kv_start_mult, KV_INDPTR)
    chunk = _chunk_len(prefix, nsplit, min_chunk, BLOCK_N) * tail_pair
    start = split * chunk
    end = tl.minimum(start + chunk, prefix)
    if (row0 < rows) & (start < end):
        _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, b, split, kv_base, start, end, 0, qk_scale,
                   stride_qt, stride_qh, stride_kb, stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, H, DL, DR,
                   TAIL_M, BLOCK_N, False, 1)
    if PDL:  # noqa: SIM102 (a constexpr branch)
        if split + b == 0:
            tl.extra.cuda.gdc_wait()               # the split kernel has finished: so has this kernel at its end


@triton.jit
def _merge(m_run, w_run, acc, lse, part, REDUCE: tl.constexpr):
    """Fold weighted rows into a running softmax state, log2 domain: the maximum ``m_run`` (-inf: nothing yet),
    the weight sum ``w_run`` and the unnormalised output ``acc``, both relative to 2^max. ``lse`` are the new
    rows' log2 weights (-inf: weight 0; their ``part`` must be finite), ``part`` the rows: prefix partitions'
    normalised outputs by their log2-sum-exp, or draft keys' values by their scaled scores. REDUCE: ``lse`` [N],
    ``part`` [N, D], N rows for one output row; else one per output row (``lse`` shaped like ``m_run``, ``part``
    like ``acc``). Returns (m_run, w_run, acc). The one merge step of both combines."""
    m_new = tl.maximum(m_run, tl.max(lse, 0) if REDUCE else lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: the weights stay 0, no NaN
    alpha = tl.exp2(m_run - m_use)
    w = tl.exp2(lse - m_use)
    if REDUCE:
        w_run = w_run * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
    else:
        w_run = w_run * alpha + w
        acc = acc * tl.expand_dims(alpha, -1) + tl.expand_dims(w, -1) * part
    return m_new, w_run, acc


@triton.jit
def _combine_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, Out, QoIndptr, KvStart, KvLens,
    qk_scale, nsplit, min_chunk,
    stride_qt, stride_qh, stride_ket, stride_vet,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, stride_ot, stride_oh, tail_row0, tail_pair,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, KV_INDPTR: tl.constexpr, HAS_MASK: tl.constexpr,
    PDL: tl.constexpr, DRAFT_SLOT: tl.constexpr,
):
    """One (token, head) row x BLOCK_D output channels: attention over the draft tree (done here, once per
    row, in fp32; the tree mask is read only here — or, DRAFT_SLOT, by the split kernel's draft programs or
    ``_draft_kernel`` into partition slot ``nsplit``), merged with the non-empty prefix partitions by their
    log2-sum-exp; writes the output. Rows from ``tail_row0`` on have partitions of ``tail_pair`` prefix
    partitions' keys each (``tail_pair``: the tail programs wrote them); the draft slot is ``nsplit`` for all."""
    row = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if row >= q_len * H:
        return
    _, prefix = _request_kv(KvStart, KvLens, b, 1, KV_INDPTR)  # the length only: no cache read here
    tok = row // H
    head = row % H
    offs_dl = tl.arange(0, DL)
    offs_dr = tl.arange(0, DR)
    offs_d = d0 + tl.arange(0, BLOCK_D)

    if DRAFT_SLOT:
        # ---- the draft tree's partial: loaded here, merged after the prefix partitions, so that its loads are
        # in flight with theirs (one round trip after the wait, not two)
        if PDL:
            tl.extra.cuda.gdc_wait()               # the kernel that wrote it (and so the split kernel) has finished
        lse_d = tl.load(PartLse + b.to(tl.int64) * stride_lb + nsplit * stride_ls + row)
        part_d = tl.load(PartO + b.to(tl.int64) * stride_pb + nsplit * stride_ps + row * stride_pr + offs_d)
        m_run = tl.full([], float("-inf"), dtype=tl.float32)
        w_run = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    else:
        # ---- the draft tree: this row's token sees the draft tokens its mask row allows (itself, ancestors)
        q_row = Q + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q_lat = tl.load(q_row + offs_dl).to(tl.float32)
        q_rope = tl.load(q_row + DL + offs_dr).to(tl.float32)
        if HAS_MASK:
            mask_row = Mask + tl.load(MaskIndptr + b).to(tl.int64) + tok.to(tl.int64) * (prefix + q_len) + prefix
        m_run = tl.full([], float("-inf"), dtype=tl.float32)
        w_run = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j0 in range(0, q_len, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            j_ok = offs_j < q_len
            k_row = KExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_ket
            k_lat = tl.load(k_row + offs_dl[None, :], mask=j_ok[:, None], other=0.0).to(tl.float32)
            k_rope = tl.load(k_row + DL + offs_dr[None, :], mask=j_ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(k_lat * q_lat[None, :], 1) + tl.sum(k_rope * q_rope[None, :], 1)
            if HAS_MASK:  # noqa: SIM108 (a constexpr branch: mask_row exists only here)
                seen = j_ok & (tl.load(mask_row + offs_j, mask=j_ok, other=0) != 0)
            else:
                seen = j_ok & (offs_j <= tok)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            v = tl.load(VExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_vet + offs_d[None, :],
                        mask=j_ok[:, None], other=0.0).to(tl.float32)
            m_run, w_run, acc = _merge(m_run, w_run, acc, s, v, True)

        if PDL:
            tl.extra.cuda.gdc_wait()                   # the split kernel has finished and its writes are visible

    # ---- the prefix partitions (normalised partial outputs, weight 2^lse), BLOCK_S at a time
    n_act = tl.cdiv(prefix, _chunk_len(prefix, nsplit, min_chunk, BLOCK_N) * tl.where(row < tail_row0, 1, tail_pair))
    base_o = PartO + b.to(tl.int64) * stride_pb + row * stride_pr
    base_l = PartLse + b.to(tl.int64) * stride_lb + row
    for s0 in range(0, n_act, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < n_act
        lse = tl.load(base_l + offs_s * stride_ls, mask=s_ok, other=float("-inf"))
        part = tl.load(base_o + offs_s.to(tl.int64)[:, None] * stride_ps + offs_d[None, :], mask=s_ok[:, None],
                       other=0.0).to(tl.float32)
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse, part, True)
    if DRAFT_SLOT:                                 # a row that sees no draft key: LSE -inf, partial 0
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse_d, part_d.to(tl.float32), False)
    out = acc / tl.where(w_run > 0.0, w_run, 1.0)
    tl.store(Out + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit
def _draft_tile(Q, KExt, VExt, Mask, MaskIndptr, b, q_start, q_len, prefix, r_ok, tok, head, offs_d, qk_scale,
                stride_qt, stride_qh, stride_ket, stride_vet, DL: tl.constexpr, DR: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr):
    """The draft tree of BLOCK_R (token, head) rows of request ``b``: scores against its draft keys as one
    [BLOCK_R, BLOCK_J] tile (the 576 channels 64 at a time), the tree mask (each row sees its token's
    ancestors), softmax, ``P V`` for channels ``offs_d`` -> (row max, -inf where a row sees no draft key; the
    row sums; the unnormalised output)."""
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < q_len
    q_row = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    k_row = KExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_ket
    s = tl.zeros([BLOCK_R, BLOCK_J], dtype=tl.float32)
    for c in range(0, DL + DR, 64):
        offs_c = c + tl.arange(0, 64)
        qc = tl.load(q_row + offs_c[None, :], mask=r_ok[:, None], other=0.0)
        kc = tl.load(k_row + offs_c[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(qc, tl.trans(kc), s, input_precision="ieee" if qc.dtype == tl.float32 else None)
    if HAS_MASK:
        mask_row = Mask + tl.load(MaskIndptr + b).to(tl.int64) + tok.to(tl.int64) * (prefix + q_len) + prefix
        seen = tl.load(mask_row[:, None] + offs_j[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0) != 0
    else:
        seen = offs_j[None, :] <= tok[:, None]
    seen = seen & j_ok[None, :]
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    v = tl.load(VExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_vet + offs_d[None, :], mask=j_ok[:, None],
                other=0.0)
    return m, tl.sum(p, 1), tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else None)


@triton.jit
def _combine_rows_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, Out, QoIndptr, KvStart, KvLens,
    qk_scale, nsplit, min_chunk,
    stride_qt, stride_qh, stride_ket, stride_vet,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, stride_ot, stride_oh,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, KV_INDPTR: tl.constexpr,
    HAS_MASK: tl.constexpr, PDL: tl.constexpr, DRAFT_SLOT: tl.constexpr,
):
    """BLOCK_R (token, head) rows of one request x BLOCK_D output channels (``combine_rows``): the draft tree as
    one [BLOCK_R, BLOCK_J] score tile on the tensor cores (every row of a request sees the same draft keys; the
    mask picks, per row, its token's ancestors) — or, DRAFT_SLOT, its partial from partition slot ``nsplit``,
    written by the split kernel's draft programs or ``_draft_kernel`` (``split_draft_rows``, ``draft_kernel_rows``)
    — merged with the prefix partitions BLOCK_S at a time. Rows per program instead of one: the per-row kernel's
    programs are few per multiprocessor (registers) and each waits through a chain of dependent loads, so a batch
    of thousands of rows took 30-80 us."""
    rb = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    rows = q_len * H
    if rb * BLOCK_R >= rows:
        return
    _, prefix = _request_kv(KvStart, KvLens, b, 1, KV_INDPTR)  # the length only: no cache read here
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    tok = r // H
    head = r % H
    offs_d = d0 + tl.arange(0, BLOCK_D)

    base_o = PartO + b.to(tl.int64) * stride_pb
    base_l = PartLse + b.to(tl.int64) * stride_lb
    offs_o = r[:, None] * stride_pr + offs_d[None, :]
    if DRAFT_SLOT:
        # ---- the draft tree's partial: loaded right after the wait, merged after the prefix partitions
        if PDL:
            tl.extra.cuda.gdc_wait()               # the kernel that wrote it (and so the split kernel) has finished
        lse_d = tl.load(base_l + nsplit * stride_ls + r, mask=r_ok, other=float("-inf"))
        part_d = tl.load(base_o + nsplit * stride_ps + offs_o, mask=r_ok[:, None], other=0.0)
        m_run = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        w_run = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    else:
        # ---- the draft tree
        m_run, w_run, acc = _draft_tile(Q, KExt, VExt, Mask, MaskIndptr, b, q_start, q_len, prefix, r_ok, tok,
                                        head, offs_d, qk_scale, stride_qt, stride_qh, stride_ket, stride_vet,
                                        DL, DR, BLOCK_R, BLOCK_J, HAS_MASK)
        if PDL:
            tl.extra.cuda.gdc_wait()

    # ---- the prefix partitions, BLOCK_S at a time (their loads issued together)
    n_act = tl.cdiv(prefix, _chunk_len(prefix, nsplit, min_chunk, BLOCK_N))
    for s0 in range(0, n_act, BLOCK_S):
        for k in tl.static_range(BLOCK_S):
            ok = r_ok & (s0 + k + tl.zeros_like(r) < n_act)
            lse = tl.load(base_l + (s0 + k) * stride_ls + r, mask=ok, other=float("-inf"))
            part = tl.load(base_o + (s0 + k) * stride_ps + offs_o, mask=ok[:, None], other=0.0).to(tl.float32)
            m_run, w_run, acc = _merge(m_run, w_run, acc, lse, part, False)
    if DRAFT_SLOT:                                 # a row that sees no draft key: LSE -inf, partial 0
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse_d, part_d.to(tl.float32), False)
    out = acc / tl.where(w_run > 0.0, w_run, 1.0)[:, None]
    tl.store(Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=r_ok[:, None])


@triton.jit
def _draft_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, QoIndptr, KvStart, KvLens,
    qk_scale, nsplit,
    stride_qt, stride_qh, stride_ket, stride_vet,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr, KV_INDPTR: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr,
):
    """BLOCK_R (token, head) rows of one request x BLOCK_D channels of the draft tree alone (``draft_rows``):
    scores against the request's draft keys as one tensor-core tile, the tree mask, softmax, ``P V`` -> the
    normalised partial and log2-sum-exp in partition slot ``nsplit`` (a row that sees no draft key: LSE -inf).

    Launched right after the split kernel (PDL: it starts once every split program runs, on multiprocessors they
    leave free, if any) and before the combine, which waits for it: program (0, 0, 0) waits for the split kernel
    before it exits, so this kernel's end implies the split kernel's and the combine's one wait covers both."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rb = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    rows = q_len * H
    if rb * BLOCK_R < rows:
        _, prefix = _request_kv(KvStart, KvLens, b, 1, KV_INDPTR)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        tok = r // H
        head = r % H
        offs_d = d0 + tl.arange(0, BLOCK_D)
        m, w, acc = _draft_tile(Q, KExt, VExt, Mask, MaskIndptr, b, q_start, q_len, prefix, r_ok, tok, head,
                                offs_d, qk_scale, stride_qt, stride_qh, stride_ket, stride_vet,
                                DL, DR, BLOCK_R, BLOCK_J, HAS_MASK)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        out = acc / tl.where(w > 0.0, w, 1.0)[:, None]
        base = b.to(tl.int64) * stride_pb + nsplit * stride_ps
        tl.store(PartO + base + r[:, None] * stride_pr + offs_d[None, :], out.to(PartO.dtype.element_ty),
                 mask=r_ok[:, None])
        if d0 == 0:
            tl.store(PartLse + b.to(tl.int64) * stride_lb + nsplit * stride_ls + r,
                     tl.where(w > 0.0, m_use + tl.log2(tl.where(w > 0.0, w, 1.0)), float("-inf")), mask=r_ok)
    if PDL:  # noqa: SIM102 (a constexpr branch)
        if rb + b + d0 == 0:
            tl.extra.cuda.gdc_wait()               # the split kernel has finished: so has this kernel at its end


# ------------------------------------------------------------------------------------------------ launch

class Workspace:
    """Partial outputs/LSEs: ``slots`` partition slots of ``max_rows`` (token, head) rows each. A launch with
    ``bs`` requests and ``ns`` prefix partitions uses ``bs * ns`` slots (viewed as ``[bs, ns, rows]``, without
    allocating). Allocate once (e.g. at CUDA-graph state init) with :meth:`for_batches`."""

    def __init__(self, slots: int, max_rows: int, device, *, dv: int = D_LATENT, dtype: str = "float32"):
        self.slots, self.max_rows = slots, max_rows
        self.part_o = torch.empty((slots, max_rows, dv), dtype=getattr(torch, dtype), device=device)
        self.part_lse = torch.empty((slots, max_rows), dtype=torch.float32, device=device)

    @classmethod
    def for_batches(cls, max_bs: int, rows: int, nsplit: int, config: KernelConfig, device) -> Workspace:
        """Big enough for every batch of 1..max_bs requests of up to ``rows`` rows (with ``tail_pair`` whichever
        split kernel runs: the launch decides)."""
        def per_request(bs: int) -> int:
            tail = {False, _tail_split(bs, rows, config)}
            return max(tail_splits(nsplit, bs, rows, config, t)[0] for t in tail) + draft_slots(bs, rows, config)

        slots = max(bs * per_request(bs) for bs in range(1, max_bs + 1))
        return cls(slots, rows, device, dtype=config.partial_dtype)

    def fits(self, bs: int, rows: int, nsplit: int, dtype: str | None = None) -> bool:
        return (bs * nsplit <= self.slots and rows <= self.max_rows
                and (dtype is None or self.part_o.dtype == getattr(torch, dtype)))

    def views(self, bs: int, nsplit: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = bs * nsplit
        return (self.part_o[:n].view(bs, nsplit, self.max_rows, self.part_o.shape[-1]),
                self.part_lse[:n].view(bs, nsplit, self.max_rows))

    @property
    def nbytes(self) -> int:
        return self.part_o.numel() * self.part_o.element_size() + self.part_lse.numel() * 4


@functools.lru_cache(maxsize=8)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _wave_nsplit(ns: int, blocks: int, sms: int) -> int:
    """The n <= ns with the most partitions per wave (n / ceil(blocks * n / sms)); ties: the larger n.
    Cached: it runs on every launch, and at bs=1 the host time is part of the latency."""
    return max(range(1, ns + 1), key=lambda n: (n / -(-(blocks * n) // sms), n))


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` goes through Triton's constexpr unwrapping: a few us a call,
    and the launch path makes several)."""
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def _cuda_ok() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=8)
def _pdl_ok(index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs sm_90 or newer."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=8)
def _sm90_ok(index: int) -> bool:
    """A Hopper GPU (compute capability 9.x) and a Triton with Gluon: the sm_90 split kernel can run."""
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        from kdtree_ext import mla_verify_sm90  # noqa: F401
    except ImportError:
        return False
    return True


def _sm90_split_kernel(config: KernelConfig, q: torch.Tensor, kbuf: torch.Tensor):
    """The Gluon split kernel (``sm90_ws``: its warp-specialised variant) when ``config.sm90`` asks for it and it
    applies (Hopper, 16-bit q and cache of one dtype, the 64 x 64 tile with 8 warps and all 512 value channels per
    program), else None."""
    if not (config.sm90 and q.is_cuda and q.dtype == kbuf.dtype and q.dtype in (torch.bfloat16, torch.float16)
            and (config.block_m, config.block_n, config.num_warps, config.dv_split) == (64, 64, 8, 1)
            and _sm90_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())):
        return None
    from kdtree_ext.mla_verify_sm90 import split_kernel_sm90, split_kernel_sm90_ws

    return split_kernel_sm90_ws if config.sm90_ws else split_kernel_sm90


def _sms_now() -> int:
    """The current CUDA device's multiprocessor count (0 without CUDA)."""
    return _device_sms(torch.cuda.current_device()) if _cuda_ok() else 0


def _wave_sms(config: KernelConfig) -> int:
    return config.wave_sms if config.wave_sms >= 0 else _sms_now()


def effective_nsplit(nsplit: int, bs: int, rows: int, config: KernelConfig) -> int:
    """Partitions a launch uses: ``nsplit``, fewer when ``bs`` requests already make ``max_ctas`` programs,
    and (``wave_sms``) the count under that which maximises partitions per wave of programs: e.g. 3 row
    blocks on 132 multiprocessors run 44 partitions in one wave rather than 64 in two (a host-side function
    of static sizes only: CUDA-graph safe). With ``tail_pair`` (where it applies: ``tail_splits``) the full
    row blocks' count, which may exceed ``nsplit``."""
    return tail_splits(nsplit, bs, rows, config, _tail_split(bs, rows, config))[0]


def _tail_split(bs: int, rows: int, config: KernelConfig) -> bool:
    """``tail_pair`` applies to a launch the per-row combine merges with ``split_draft`` on whose last row block
    is short, behind at least one full one (static sizes only; the launch also checks which split kernel runs)."""
    left = rows % config.block_m
    return (config.tail_pair > 0 and _split_draft(bs, rows, config) and config.dv_split == 1
            and rows > config.block_m and 0 < left <= config.tail_m)


def tail_splits(nsplit: int, bs: int, rows: int, config: KernelConfig, tail: bool) -> tuple[int, int]:
    """(partitions of the full row blocks, tail programs of the short last block; 0: none). Without ``tail``:
    ``effective_nsplit``'s rule. With it: per request ``nb`` full blocks x n + m, m = cdiv(n, ``tail_pair``), at
    most (nb + 1) x ``nsplit`` prefix programs (what the launch would have without it) and, with the nb + 1 draft
    programs, one wave of the launch's cap (static sizes only)."""
    cap = _sms_now() if config.max_ctas < 0 else config.max_ctas
    if cap <= 0:
        return nsplit, 0
    if not tail:
        blocks = max(bs * _cdiv(rows, config.block_m) * config.dv_split, 1)
        ns = max(1, min(nsplit, cap // blocks - _split_draft(bs, rows, config)))
        sms = _wave_sms(config)
        return (_wave_nsplit(ns, blocks, sms) if sms > 0 else ns), 0
    nb = rows // config.block_m
    limit = min((nb + 1) * nsplit, cap // bs - nb - 1)
    ns = max(1, int(limit / (nb + 1 / config.tail_pair)))
    while nb * ns + _cdiv(ns, config.tail_pair) > limit and ns > 1:
        ns -= 1
    return ns, _cdiv(ns, config.tail_pair)


def _row_block(bs: int, rows: int, config: KernelConfig) -> bool:
    """The row-block combine merges this launch (``combine_rows``), not the per-row one (static sizes only)."""
    return 0 < config.combine_rows <= bs * rows


def _split_draft(bs: int, rows: int, config: KernelConfig) -> bool:
    """``split_draft`` applies: a launch the per-row combine merges (static sizes only)."""
    return config.split_draft and not _row_block(bs, rows, config)


def draft_slots(bs: int, rows: int, config: KernelConfig) -> int:
    """Partition slots per request a launch uses beyond its prefix partitions: 1 for the draft tree's partial
    (``draft_rows`` or ``split_draft`` on launches the per-row combine merges, ``split_draft_rows`` or
    ``draft_kernel_rows`` on the others; written by the split kernel's draft programs or ``_draft_kernel``, see
    ``mla_tree_verify``), else 0 (static sizes only)."""
    if _row_block(bs, rows, config):
        return int(config.split_draft_rows or config.draft_kernel_rows)
    return int(0 < config.draft_rows <= bs * rows or config.split_draft)


def launch_min_chunk(ns: int, bs: int, rows: int, config: KernelConfig, tail_ns: int = 0) -> int:
    """Shortest prefix partition (tokens, a multiple of block_n) of a launch with ``ns`` partitions (and
    ``tail_ns`` tail programs, ``tail_pair``): ``wave_min_chunk`` when its programs fit in one
    wave, else ``min_chunk`` (static sizes only)."""
    chunk = config.min_chunk
    if config.wave_min_chunk > 0:
        sms = _wave_sms(config)
        per_b = ((rows // config.block_m) * ns + tail_ns if tail_ns
                 else _cdiv(rows, config.block_m) * config.dv_split * ns)
        if sms > 0 and bs * per_b <= sms:
            chunk = config.wave_min_chunk
    return _cdiv(max(chunk, 1), config.block_n) * config.block_n


def launch_tail_m(rows: int, config: KernelConfig) -> int:
    """Rows of the short tile a launch compiles for its last row block: ``tail_m`` when the static row count
    leaves at most that many rows over whole ``block_m`` blocks (72 rows = 64 + 8), else 0: a launch without
    such a block keeps the kernel without the second tile (its code is measurably slower with it)."""
    left = rows % config.block_m
    return config.tail_m if 0 < left <= config.tail_m else 0


def _flat(t: torch.Tensor, last: int) -> torch.Tensor:
    """[N, 1, D] or [N, D] -> [N, D] view (last dim contiguous)."""
    if t.dim() == 3:
        assert t.shape[1] == 1, "MLA keeps one latent KV head"
        t = t[:, 0]
    assert t.shape[-1] >= last and t.stride(-1) == 1, f"need a contiguous last dim of at least {last}"
    return t


def mla_tree_verify(
    q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor | None, o: torch.Tensor, kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor | None, kv_indices: torch.Tensor | None,
    custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None, max_q_len: int, sm_scale: float,
    nsplit: int = 64, workspace: Workspace | None = None, *, req_to_token: torch.Tensor | None = None,
    req_pool_indices: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Tree-verify attention into ``o`` ([tokens, H, 512] or [tokens, H * 512]); returns ``o``.

    ``q`` [tokens, H, 576]; ``k_ext`` [tokens, (1,) 576] and ``v_ext`` [tokens, (1,) 512] (None: the first 512
    channels of ``k_ext``) are the draft tokens' own keys/values; ``kv_buffer`` [slots, (1,) 576] is the MLA
    cache (values = its first 512 channels). Prefix: ``kv_indptr``/``kv_indices``, or ``req_to_token`` +
    ``req_pool_indices`` + ``seq_lens``. ``max_q_len`` bounds ``qo_indptr[b+1] - qo_indptr[b]`` (a static
    maximum: the grid depends on it, never on tensor contents). Nothing here reads device memory on the host
    or allocates when ``workspace`` is given, so it can be captured in a CUDA graph.
    """
    config = config or default_config(q.device)
    tokens, heads, dqk = q.shape
    assert dqk == D_QK and q.stride(-1) == 1, "q must be [tokens, H, 576] with a contiguous last dim"
    kbuf = _flat(kv_buffer, D_QK)
    kext = _flat(k_ext, D_QK)
    vext = kext if v_ext is None else _flat(v_ext, D_LATENT)
    o3 = o.view(o.shape[0], heads, D_LATENT) if o.dim() == 2 else o
    assert o3.stride(-1) == 1 and o3.shape[0] >= tokens
    bs = qo_indptr.shape[0] - 1
    rows = max_q_len * heads
    use_indptr = req_to_token is None
    if use_indptr:
        assert kv_indptr is not None and kv_indices is not None
        kv_start, kv_lens, kv_idx, mult = kv_indptr, kv_indptr, kv_indices, 1
    else:
        assert req_pool_indices is not None and seq_lens is not None and req_to_token.stride(1) == 1
        kv_start, kv_lens, kv_idx, mult = req_pool_indices, seq_lens, req_to_token, req_to_token.stride(0)
    sm90 = _sm90_split_kernel(config, q, kbuf)
    # the short last row block's tail programs: in the warp-specialised Gluon kernel (its draft programs run: q_len
    # <= 64); beside the Triton kernel (_tail_kernel) only for tail_pair > 1 (its own tail_m tile does 1)
    tail = (_tail_split(bs, rows, config) and max_q_len <= 64
            and (config.sm90_ws if sm90 is not None else config.tail_pair > 1))
    ns, ns_tail = tail_splits(nsplit, bs, rows, config, tail)
    draft = draft_slots(bs, rows, config)          # 1: the draft tree's partial in slot ns
    if workspace is None:
        workspace = Workspace(bs * (ns + draft), rows, q.device, dtype=config.partial_dtype)
    assert workspace.fits(bs, rows, ns + draft, config.partial_dtype), \
        "workspace too small for this batch (or other dtype)"
    part_o, part_lse = workspace.views(bs, ns + draft)
    min_chunk = launch_min_chunk(ns, bs, rows, config, ns_tail)
    has_mask = custom_mask is not None
    if has_mask:
        assert mask_indptr is not None
    mask = custom_mask if has_mask else qo_indptr      # any pointer: never read without HAS_MASK
    mindptr = mask_indptr if has_mask else qo_indptr
    qk_scale = sm_scale * LOG2E
    pdl = config.pdl and q.is_cuda and _pdl_ok(torch.cuda.current_device() if q.device.index is None
                                               else q.device.index)
    assert config.dv_split in (1, 2), "dv_split: 1 or 2 programs per row block (512 or 256 value channels)"
    split_args = (q, kbuf, qo_indptr, kv_start, kv_lens, kv_idx, part_o, part_lse, qk_scale, ns, min_chunk, mult,
                  q.stride(0), q.stride(1), kbuf.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
                  part_lse.stride(0), part_lse.stride(1))
    blocks = _cdiv(rows, config.block_m) * config.dv_split
    grid = (blocks, ns, bs)
    # the draft tree's partial in slot ns: from the warp-specialised kernel's programs of partition ns, else from
    # _draft_kernel (draft_rows, draft_kernel_rows); where neither applies the combine attends the tree itself (the
    # slot stays unused)
    row_block = _row_block(bs, rows, config)
    split_draft = (bool(draft) and (config.split_draft_rows if row_block else config.split_draft)
                   and config.sm90_ws and sm90 is not None and max_q_len <= 64)
    draft_kernel = bool(draft) and not split_draft and (config.draft_kernel_rows if row_block
                                                        else 0 < config.draft_rows <= bs * rows)
    pre_blocks = blocks - (ns_tail > 0)            # the row blocks with prefix programs in the split kernel
    if sm90 is not None:
        extra = {}
        if config.sm90_ws:
            extra = dict(KExt=kext, VExt=vext, Mask=mask, MaskIndptr=mindptr, stride_ket=kext.stride(0),
                         stride_vet=vext.stride(0), blocks=blocks, pre_blocks=pre_blocks, nsplit_tail=ns_tail,
                         LOAD_WARPS=4, LOAD_REGS=40, DRAFT=split_draft, HAS_MASK=has_mask,
                         TAIL=config.tail_pair if ns_tail else 0)
            if split_draft:                        # prefix programs, tail programs, draft programs
                grid = (pre_blocks * ns + ns_tail + blocks, 1, bs)
        sm90[grid](*split_args, H=heads, DL=D_LATENT, DR=D_ROPE, KV_INDPTR=use_indptr, PDL=pdl,
                   num_warps=config.num_warps, **extra)
    else:
        _split_kernel[(pre_blocks, ns, bs)](
            *split_args, H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            KV_INDPTR=use_indptr, WARP_SPEC=config.warp_specialize, DV_SPLIT=config.dv_split, PDL=pdl,
            TAIL_M=launch_tail_m(rows, config), num_warps=config.num_warps,
            num_stages=config.num_stages)
    launch = {"launch_pdl": True} if pdl else {}
    tail_row0 = (blocks - 1) * config.block_m if ns_tail else rows
    if ns_tail and sm90 is None:                   # the short last row block, ns_tail partitions of its own
        _tail_kernel[(ns_tail, bs)](*split_args, tail_row0, config.tail_pair, H=heads, DL=D_LATENT, DR=D_ROPE,
                                    TAIL_M=config.tail_m, BLOCK_N=config.block_n, KV_INDPTR=use_indptr, PDL=pdl,
                                    num_warps=config.num_warps, num_stages=config.num_stages, **launch)
    if draft_kernel:
        _draft_kernel[(_cdiv(rows, 16), bs, 2)](
            q, kext, vext, mask, mindptr, part_o, part_lse, qo_indptr, kv_start, kv_lens, qk_scale, ns, q.stride(0),
            q.stride(1), kext.stride(0), vext.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_R=16, BLOCK_D=256,
            BLOCK_J=max(16, triton.next_power_of_2(max_q_len)), KV_INDPTR=use_indptr, HAS_MASK=has_mask, PDL=pdl,
            num_warps=4, **launch)
    combine_args = (q, kext, vext, mask, mindptr, part_o, part_lse, o3, qo_indptr, kv_start, kv_lens, qk_scale, ns,
                    min_chunk, q.stride(0), q.stride(1), kext.stride(0), vext.stride(0), part_o.stride(0),
                    part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1), o3.stride(0),
                    o3.stride(1))
    if row_block:
        block_j = max(16, triton.next_power_of_2(max_q_len))
        _combine_rows_kernel[(_cdiv(rows, 16), bs, D_LATENT // 128)](
            *combine_args, H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_N=config.block_n, BLOCK_R=16, BLOCK_S=4,
            BLOCK_D=128, BLOCK_J=block_j, KV_INDPTR=use_indptr, HAS_MASK=has_mask, PDL=pdl,
            DRAFT_SLOT=split_draft or draft_kernel, num_warps=4, **launch)
        return o
    wide = 0 < config.combine_wide_rows <= bs * rows
    block_d = D_LATENT if wide else config.combine_block_d
    _combine_kernel[(rows, bs, D_LATENT // block_d)](
        *combine_args, H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_N=config.block_n,
        BLOCK_S=max(1, config.combine_block_s * config.combine_block_d // block_d), BLOCK_D=block_d,
        tail_row0=tail_row0, tail_pair=max(config.tail_pair, 1), BLOCK_J=config.combine_block_j, KV_INDPTR=use_indptr,
        HAS_MASK=has_mask, PDL=pdl, DRAFT_SLOT=split_draft or draft_kernel,
        num_warps=config.combine_warps * (2 if wide else 1), **launch,
    )
    return o


def with_config(config: KernelConfig, **changes) -> KernelConfig:
    return replace(config, **changes)


# ------------------------------------------------------------------------------------------------ reference

def kv_indices_from_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened (kv_indptr, kv_indices) form of a req_to_token table (host-side, for references)."""
    lens = seq_lens.to(torch.int64).cpu()
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    rows = [req_to_token[int(r), : int(n)].to(torch.int64) for r, n in zip(req_pool_indices.cpu(), lens, strict=True)]
    idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return indptr.to(req_to_token.device), idx.to(req_to_token.device)


def reference_tree_verify(
    q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor | None, kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None, sm_scale: float,
) -> torch.Tensor:
    """fp32 reference: gather the prefix rows, append the draft tokens, apply the full per-request mask
    (prefix columns included), softmax, weighted sum of c_kv. Returns [tokens, H, 512] float32."""
    kbuf = _flat(kv_buffer, D_QK).float()
    kext = _flat(k_ext, D_QK).float()
    vext = kext[:, :D_LATENT] if v_ext is None else _flat(v_ext, D_LATENT).float()
    out = torch.zeros(q.shape[0], q.shape[1], D_LATENT, dtype=torch.float32, device=q.device)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    mi = mask_indptr.tolist() if mask_indptr is not None else None
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        slots = kv_indices[kv[b]: kv[b + 1]].to(torch.int64)
        prefix = slots.numel()
        keys = torch.cat([kbuf[slots], kext[q0:q1]])
        vals = torch.cat([kbuf[slots, :D_LATENT], vext[q0:q1]])
        if custom_mask is not None:
            seen = custom_mask[mi[b]: mi[b] + ql * (prefix + ql)].view(ql, prefix + ql).bool()
        else:
            seen = torch.cat([torch.ones(ql, prefix, dtype=torch.bool, device=q.device),
                              torch.ones(ql, ql, dtype=torch.bool, device=q.device).tril()], 1)
        scores = torch.einsum("thd,nd->thn", q[q0:q1].float(), keys) * sm_scale
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        out[q0:q1] = torch.einsum("thn,nd->thd", scores.softmax(-1), vals)
    return out


def default_sm_scale() -> float:
    return 1.0 / math.sqrt(D_QK)
