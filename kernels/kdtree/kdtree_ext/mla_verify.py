"""kdtree tree-verify attention for absorbed MLA (DeepSeek/Kimi style): split-K kernel + combine.

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

The prefix is addressed as SGLang's Triton backend hands it over: ``kv_indptr``/``kv_indices`` (the flattened
per-token slot list, ``kv_indices[kv_indptr[b] + t]``). Page size 1 and 64 are both just layouts of that list
(a 64-token page is 64 consecutive slots); the pages may lie anywhere in the pool.

How (three or four launches, no host sync, no allocation, grid from static maxima — CUDA-graph safe):

1. The split kernel: the batch's prefix keys, all requests one after another, are cut into ``columns`` equal
   partitions (``mla_common``: computed on the device from ``kv_indptr``, so a ragged batch keeps every
   multiprocessor busy for the same time); a program takes ``BLOCK_M`` (token, head) rows x one column and walks
   the requests the column touches (the end of one, the start of the next), streaming each one's keys in
   ``BLOCK_N`` tiles with an online softmax in fp32 (one load of ``[c_kv | k_rope]`` serves ``Q K^T`` and
   ``P V``; no mask in the prefix); it writes one normalised partial output (fp32) and log2-sum-exp per
   (column, request) segment. MLA has one KV head, so every query head of every draft token shares the key
   stream and the rows of a request are contiguous in ``q``. Portable kernel: ``_split_kernel`` (Triton). On a
   Hopper GPU: ``mla_verify_sm90.split_kernel_sm90`` (Gluon, warp-specialised). With ``KernelConfig.tail_cost``
   a short last row block (e.g. 16 of 144 rows) runs over partitions of its own on the multiprocessors the full
   blocks leave, where that gives the full blocks more columns (``plan``): on Hopper on 16-row transposed tiles,
   in the split kernel's own grid for one request, else in a launch of its own right after; in Triton in a
   launch of its own.
2. With ``KernelConfig.draft_kernel`` (the GPU default), ``_draft_kernel`` attends each request's draft tree
   (the only place the mask is read; 16 rows x 512 channels per program, scores on the tensor cores) into a slot
   of its own, its programs beside the split kernel's on the ``draft_sms`` multiprocessors the split grid leaves.
3. The combine, per (token, head) row: merges the row's request's partials (consecutive slots) by their LSE
   with the draft-tree partial (or attends the tree itself) and writes ``o`` (``[tokens, H, 512]``, the input
   dtype): ``_combine_kernel`` one row per program, or ``_combine_rows_kernel`` 16 rows x 128 channels per
   program on large launches (``KernelConfig.combine_rows``). With ``pdl`` each launch starts while the one
   before it finishes (programmatic dependent launch) and waits on it only before reading its output.

``mla_tree_verify`` launches them; ``reference_tree_verify`` is the fp32 PyTorch reference (gather, mask,
softmax, weighted sum). Under ``TRITON_INTERPRET=1`` the Triton kernels run on CPU tensors. The figures behind
each choice are in docs/benchmarks.md ("Kernel").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kdtree_ext.mla_common import (
    D_LATENT,
    D_QK,
    D_ROPE,
    LOG2E,
    batch_chunk,
    bs_block,
    column_requests,
    request_slots,
    segment,
)

__all__ = ["D_LATENT", "D_QK", "D_ROPE", "GPU_CONFIG", "INTERPRETER_CONFIG", "KERNEL_NAME", "KernelConfig",
           "Plan", "Workspace", "default_config", "default_sm_scale", "launch_min_chunk", "mla_tree_verify", "plan",
           "reference_tree_verify", "with_config", "workspace_slots"]

KERNEL_NAME = "kdtree-splitk"


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (the Gluon split kernel has its own fixed tile: 64 x 64, 8 warps)."""

    block_m: int = 64               # Triton split kernel: (token, head) rows per program
    block_n: int = 64               # keys per tile (the Gluon kernel: 64)
    num_warps: int = 8              # Triton split kernel warps
    num_stages: int = 2             # Triton split kernel software-pipeline stages
    min_chunk: int = 64             # shortest partition (tokens; rounded up to block_n)
    partial_floor: bool = False     # ... and at least the keys of its fp32 partial's bytes (launch_min_chunk)
    max_ctas: int = -1              # split programs per launch (columns x row blocks); -1: the GPU's SMs; 0: no cap
    pdl: bool = False               # draft kernel and combine as programmatic dependent launches (sm_90+)
    combine_block_s: int = 32       # per-row combine: partials merged per step
    combine_block_d: int = 256      # per-row combine: output channels per program (below combine_wide_rows)
    combine_block_j: int = 16       # per-row combine: draft keys per step when it attends the tree
    combine_warps: int = 4          # per-row combine warps (x2 for the 512-channel programs)
    combine_wide_rows: int = 0      # launches of >= this many rows: one 512-channel per-row program (0: never)
    combine_rows: int = 0           # launches of >= this many rows: the 16-row x 128-channel combine (0: never)
    tail_m: int = 0                 # Triton split kernel: a last row block of <= this many rows on a short tile
    sm90: bool = False              # on Hopper, the Gluon warp-specialised split kernel
    draft_kernel: bool = False      # the draft tree in _draft_kernel (tensor cores) between split and combine
    draft_sms: int = 0              # multiprocessors the split grid leaves free for the draft kernel's programs
    draft_block_d: int = 512        # draft kernel: value channels per program (16 rows each)
    draft_warps: int = 4            # draft kernel warps on launches the per-row combine merges
    draft_warps_rows: int = 8       # draft kernel warps on launches the row-block combine merges
    tail_cost: float = 0.0          # a short last row block's programs' cost per key over a full block's (0: none)
    tail_rows_min: int = 1          # ... for last row blocks of at least this many rows (and at most block_m / 4)

    def describe(self) -> str:
        return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.__dict__.items())


GPU_CONFIG = KernelConfig(pdl=True, combine_wide_rows=256, tail_m=16, sm90=True, combine_rows=1024,
                          combine_block_s=64, draft_kernel=True, draft_sms=3, partial_floor=True, tail_cost=0.72,
                          tail_rows_min=16)
INTERPRETER_CONFIG = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, min_chunk=16, max_ctas=0,
                                  combine_block_s=8, combine_block_d=256)


def default_config(device: torch.device | str) -> KernelConfig:
    return GPU_CONFIG if torch.device(device).type == "cuda" else INTERPRETER_CONFIG


# ------------------------------------------------------------------------------------------------ kernels

@triton.jit
def _prefix_tile(acc, m_i, l_i, q_lat, q_rope, KBuf, loc, n0, end, qk_scale, stride_kb,
                 DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_N tile of prefix keys (their cache slots ``loc``): gather the rows, scores, online softmax
    update, P V."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dl = tl.arange(0, DL)
    offs_dr = tl.arange(0, DR)
    k_row = KBuf + loc[:, None] * stride_kb
    if MASKED:
        n_ok = offs_n < end
        k_lat = tl.load(k_row + offs_dl[None, :], mask=n_ok[:, None], other=0.0)
        k_rope = tl.load(k_row + DL + offs_dr[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_lat = tl.load(k_row + offs_dl[None, :])
        k_rope = tl.load(k_row + DL + offs_dr[None, :])
    s = tl.dot(q_lat, tl.trans(k_lat))
    s = tl.dot(q_rope, tl.trans(k_rope), s)
    s = s * qk_scale
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(k_lat.dtype), k_lat, acc)
    return acc, m_new, l_i


@triton.jit
def _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, slot, kv_base, start, end, qk_scale,
               stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls,
               H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [row0, row0 + BLOCK_M) of one request x its prefix keys [start, end) -> partial output + log2-sum-exp
    in partition slot ``slot``."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    offs_dl = tl.arange(0, DL)
    offs_dr = tl.arange(0, DR)
    q_row = Q + (q_start + offs_m // H).to(tl.int64)[:, None] * stride_qt + (offs_m % H)[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_dl[None, :], mask=row_ok[:, None], other=0.0).to(KBuf.dtype.element_ty)
    q_rope = tl.load(q_row + DL + offs_dr[None, :], mask=row_ok[:, None], other=0.0).to(KBuf.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DL], dtype=tl.float32)
    # whole BLOCK_N tiles run unmasked; the segment's last partial tile (if any) runs masked
    n_full = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in tl.range(start, n_full, BLOCK_N):
        loc = tl.load(KvIdx + kv_base + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc, m_i, l_i = _prefix_tile(acc, m_i, l_i, q_lat, q_rope, KBuf, loc, n0, end, qk_scale, stride_kb,
                                     DL, DR, BLOCK_N, False)
    if n_full < end:
        offs_n = n_full + tl.arange(0, BLOCK_N)
        loc = tl.load(KvIdx + kv_base + offs_n, mask=offs_n < end, other=0).to(tl.int64)
        acc, m_i, l_i = _prefix_tile(acc, m_i, l_i, q_lat, q_rope, KBuf, loc, n_full, end, qk_scale, stride_kb,
                                     DL, DR, BLOCK_N, True)

    out = acc / l_i[:, None]                       # every segment has >= 1 key: l_i > 0
    lse = m_i + tl.log2(l_i)
    part = slot.to(tl.int64) * stride_ps
    tl.store(PartO + part + offs_m[:, None] * stride_pr + offs_dl[None, :], out, mask=row_ok[:, None])
    tl.store(PartLse + slot.to(tl.int64) * stride_ls + offs_m, lse, mask=row_ok)


@triton.jit
def _split_kernel(
    Q, KBuf, QoIndptr, KvIndptr, KvIdx, PartO, PartLse,
    qk_scale, bs, columns, min_chunk, row_base, slot_base,
    stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BS: tl.constexpr, PDL: tl.constexpr, TAIL_M: tl.constexpr, CHAINED: tl.constexpr,
):
    """BLOCK_M (token, head) rows (row block ``program_id(0)`` from row ``row_base``) of every request column
    ``program_id(1)`` touches x that request's keys in the column (``mla_common``) -> one partial output +
    log2-sum-exp per segment, in slot ``slot_base`` + column + request. TAIL_M > 0: a request's last few rows
    (e.g. 8 of 72) on a TAIL_M-row tile. CHAINED (PDL): the tail's launch behind the full blocks' one; program
    (0, 0) waits for that one before it exits, so that this launch's end implies that one's."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()      # the combine may be launched once every program runs
    row0 = row_base + tl.program_id(0) * BLOCK_M
    p = tl.program_id(1)
    chunk, base0 = batch_chunk(KvIndptr, bs, columns, min_chunk, BLOCK_N)
    b_lo, b_hi = column_requests(KvIndptr, bs, p, chunk, base0, BS)
    for b in range(b_lo, b_hi):
        q_start = tl.load(QoIndptr + b)
        rows = (tl.load(QoIndptr + b + 1) - q_start) * H
        kv_base, start, end = segment(KvIndptr, b, p, chunk, base0)
        slot = slot_base + p + b
        if (row0 < rows) & (start < end):
            if TAIL_M > 0:
                if rows - row0 <= TAIL_M:
                    _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, slot, kv_base, start, end,
                               qk_scale, stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls, H, DL, DR,
                               TAIL_M, BLOCK_N)
                else:
                    _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, slot, kv_base, start, end,
                               qk_scale, stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls, H, DL, DR,
                               BLOCK_M, BLOCK_N)
            else:
                _partition(Q, KBuf, KvIdx, PartO, PartLse, q_start, rows, row0, slot, kv_base, start, end,
                           qk_scale, stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls, H, DL, DR,
                           BLOCK_M, BLOCK_N)
    if PDL and CHAINED:  # noqa: SIM102 (a constexpr branch)
        if tl.program_id(0) + p == 0:
            tl.extra.cuda.gdc_wait()


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
def _row_slots(KvIndptr, b, row0, bs, columns, min_chunk, tail_row0, tail_columns, tail_slot0,
               BLOCK_N: tl.constexpr):
    """Request ``b``'s prefix partials for rows from ``row0``: (first slot, how many, its prefix length). Rows
    from ``tail_row0`` were split over ``tail_columns`` partitions of their own, into slots from ``tail_slot0``
    (the tail programs); the others over ``columns``, from slot 0."""
    tail = row0 >= tail_row0
    chunk, base0 = batch_chunk(KvIndptr, bs, tl.where(tail, tail_columns, columns), min_chunk, BLOCK_N)
    first, n_act, prefix = request_slots(KvIndptr, b, chunk, base0)
    return first + tl.where(tail, tail_slot0, 0), n_act, prefix


@triton.jit
def _combine_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, Out, QoIndptr, KvIndptr,
    qk_scale, bs, columns, min_chunk, draft_slot0, tail_row0, tail_columns, tail_slot0,
    stride_qt, stride_qh, stride_ket, stride_vet, stride_ps, stride_pr, stride_ls, stride_ot, stride_oh,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr,
    DRAFT_SLOT: tl.constexpr,
):
    """One (token, head) row x BLOCK_D output channels: attention over the draft tree (done here, once per
    row, in fp32; the tree mask is read only here — or, DRAFT_SLOT, by ``_draft_kernel`` into slot
    ``draft_slot0 + b``), merged with the request's prefix partials by their log2-sum-exp; writes the
    output."""
    row = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if row >= q_len * H:
        return
    first, n_act, prefix = _row_slots(KvIndptr, b, row, bs, columns, min_chunk, tail_row0, tail_columns, tail_slot0,
                                      BLOCK_N)
    tok = row // H
    head = row % H
    offs_dl = tl.arange(0, DL)
    offs_dr = tl.arange(0, DR)
    offs_d = d0 + tl.arange(0, BLOCK_D)

    if DRAFT_SLOT:
        # ---- the draft tree's partial: loaded here, merged after the prefix partials, so that its loads are
        # in flight with theirs (one round trip after the wait, not two)
        if PDL:
            tl.extra.cuda.gdc_wait()               # the draft kernel (and so the split kernel) has finished
        slot_d = (draft_slot0 + b).to(tl.int64)
        lse_d = tl.load(PartLse + slot_d * stride_ls + row)
        part_d = tl.load(PartO + slot_d * stride_ps + row * stride_pr + offs_d)
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

    # ---- the request's prefix partials (normalised partial outputs, weight 2^lse), BLOCK_S at a time
    base_o = PartO + first.to(tl.int64) * stride_ps + row * stride_pr
    base_l = PartLse + first.to(tl.int64) * stride_ls + row
    for s0 in range(0, n_act, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < n_act
        lse = tl.load(base_l + offs_s * stride_ls, mask=s_ok, other=float("-inf"))
        part = tl.load(base_o + offs_s.to(tl.int64)[:, None] * stride_ps + offs_d[None, :], mask=s_ok[:, None],
                       other=0.0)
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse, part, True)
    if DRAFT_SLOT:                                 # a row that sees no draft key: LSE -inf, partial 0
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse_d, part_d, False)
    out = acc / tl.where(w_run > 0.0, w_run, 1.0)
    tl.store(Out + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit
def _mask_base(Mask, MaskIndptr, b, HAS_MASK: tl.constexpr):
    """Request ``b``'s rows of the tree mask (``Mask`` itself without one)."""
    if HAS_MASK:
        return Mask + tl.load(MaskIndptr + b).to(tl.int64)
    return Mask


@triton.jit
def _draft_tile(Q, KExt, VExt, MaskB, q_start, q_len, prefix, r_ok, tok, head, offs_d, qk_scale,
                stride_qt, stride_qh, stride_ket, stride_vet, DL: tl.constexpr, DR: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr):
    """The draft tree of BLOCK_R (token, head) rows of a request (``MaskB``: its rows of the tree mask): scores
    against its draft keys as one [BLOCK_R, BLOCK_J] tile, the tree mask (each row sees its token's ancestors),
    softmax, ``P V`` for channels ``offs_d`` -> (row max, -inf where a row sees no draft key; the row sums; the
    unnormalised output). The tile lies between the split kernel's end and the output: with up to 16 draft keys
    every load (query, keys, values, mask) is issued before the first product, one round trip to memory instead
    of one per 64 channels (larger trees keep the loop over channels: their keys would not fit in registers at
    once)."""
    offs_j = tl.arange(0, BLOCK_J)
    j_ok = offs_j < q_len
    q_row = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    k_row = KExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_ket
    v = tl.load(VExt + (q_start + offs_j).to(tl.int64)[:, None] * stride_vet + offs_d[None, :], mask=j_ok[:, None],
                other=0.0)
    if HAS_MASK:
        mask_row = MaskB + tok.to(tl.int64) * (prefix + q_len) + prefix
        seen = tl.load(mask_row[:, None] + offs_j[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0) != 0
    else:
        seen = offs_j[None, :] <= tok[:, None]
    seen = seen & j_ok[None, :]
    if BLOCK_J <= 16:
        offs_dl = tl.arange(0, DL)
        offs_dr = tl.arange(0, DR)
        q_lat = tl.load(q_row + offs_dl[None, :], mask=r_ok[:, None], other=0.0)
        q_rope = tl.load(q_row + DL + offs_dr[None, :], mask=r_ok[:, None], other=0.0)
        k_lat = tl.load(k_row + offs_dl[None, :], mask=j_ok[:, None], other=0.0)
        k_rope = tl.load(k_row + DL + offs_dr[None, :], mask=j_ok[:, None], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee" if v.dtype == tl.float32 else None)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee" if v.dtype == tl.float32 else None)
    else:
        s = tl.zeros([BLOCK_R, BLOCK_J], dtype=tl.float32)
        for c in range(0, DL + DR, 64):
            offs_c = c + tl.arange(0, 64)
            qc = tl.load(q_row + offs_c[None, :], mask=r_ok[:, None], other=0.0)
            kc = tl.load(k_row + offs_c[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(qc, tl.trans(kc), s, input_precision="ieee" if v.dtype == tl.float32 else None)
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    return m, tl.sum(p, 1), tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else None)


@triton.jit
def _draft_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, QoIndptr, KvIndptr,
    qk_scale, draft_slot0,
    stride_qt, stride_qh, stride_ket, stride_vet, stride_ps, stride_pr, stride_ls,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr,
):
    """BLOCK_R (token, head) rows of one request x BLOCK_D channels of the draft tree alone: scores against the
    request's draft keys as one tensor-core tile, the tree mask, softmax, ``P V`` -> the normalised partial and
    log2-sum-exp in slot ``draft_slot0 + b`` (a row that sees no draft key: LSE -inf).

    Launched right after the split kernel (PDL: it starts once every split program runs, on the ``draft_sms``
    multiprocessors the split grid leaves free) and before the combine, which waits for it: program (0, 0, 0)
    waits for the launch before it (the split kernel, or the tail's launch, whose end implies the split kernel's)
    before it exits, so this kernel's end implies theirs and the combine's one wait covers all."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rb = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    prefix = tl.load(KvIndptr + b + 1) - tl.load(KvIndptr + b)
    mask_b = _mask_base(Mask, MaskIndptr, b, HAS_MASK)
    rows = q_len * H
    if rb * BLOCK_R < rows:
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        tok = r // H
        head = r % H
        offs_d = d0 + tl.arange(0, BLOCK_D)
        m, w, acc = _draft_tile(Q, KExt, VExt, mask_b, q_start, q_len, prefix, r_ok, tok, head,
                                offs_d, qk_scale, stride_qt, stride_qh, stride_ket, stride_vet,
                                DL, DR, BLOCK_R, BLOCK_J, HAS_MASK)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        out = acc / tl.where(w > 0.0, w, 1.0)[:, None]
        slot = (draft_slot0 + b).to(tl.int64)
        tl.store(PartO + slot * stride_ps + r[:, None] * stride_pr + offs_d[None, :], out, mask=r_ok[:, None])
        if d0 == 0:
            tl.store(PartLse + slot * stride_ls + r,
                     tl.where(w > 0.0, m_use + tl.log2(tl.where(w > 0.0, w, 1.0)), float("-inf")), mask=r_ok)
    if PDL:  # noqa: SIM102 (a constexpr branch)
        if rb + b + d0 == 0:
            tl.extra.cuda.gdc_wait()               # the split (and tail) launches have finished


@triton.jit
def _combine_rows_kernel(
    Q, KExt, VExt, Mask, MaskIndptr, PartO, PartLse, Out, QoIndptr, KvIndptr,
    qk_scale, bs, columns, min_chunk, draft_slot0, tail_row0, tail_columns, tail_slot0,
    stride_qt, stride_qh, stride_ket, stride_vet, stride_ps, stride_pr, stride_ls, stride_ot, stride_oh,
    H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, HAS_MASK: tl.constexpr,
    PDL: tl.constexpr, DRAFT_SLOT: tl.constexpr,
):
    """BLOCK_R (token, head) rows of one request x BLOCK_D output channels (``combine_rows``): the draft tree as
    one [BLOCK_R, BLOCK_J] score tile on the tensor cores (every row of a request sees the same draft keys; the
    mask picks, per row, its token's ancestors) — or, DRAFT_SLOT, its partial from slot ``draft_slot0 + b``,
    written by ``_draft_kernel`` — merged with the request's prefix partials BLOCK_S at a time.
    Rows per program instead of one: a batch of thousands of rows in one-row programs waits through thousands
    of chains of dependent loads."""
    rb = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    rows = q_len * H
    if rb * BLOCK_R >= rows:
        return
    first, n_act, prefix = _row_slots(KvIndptr, b, rb * BLOCK_R, bs, columns, min_chunk, tail_row0, tail_columns,
                                      tail_slot0, BLOCK_N)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    tok = r // H
    head = r % H
    offs_d = d0 + tl.arange(0, BLOCK_D)

    offs_o = r[:, None] * stride_pr + offs_d[None, :]
    if DRAFT_SLOT:
        # ---- the draft tree's partial: loaded right after the wait, merged after the prefix partials
        if PDL:
            tl.extra.cuda.gdc_wait()               # the draft kernel (and so the split kernel) has finished
        slot_d = (draft_slot0 + b).to(tl.int64)
        lse_d = tl.load(PartLse + slot_d * stride_ls + r, mask=r_ok, other=float("-inf"))
        part_d = tl.load(PartO + slot_d * stride_ps + offs_o, mask=r_ok[:, None], other=0.0)
        m_run = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        w_run = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    else:
        # ---- the draft tree
        m_run, w_run, acc = _draft_tile(Q, KExt, VExt, _mask_base(Mask, MaskIndptr, b, HAS_MASK), q_start, q_len,
                                        prefix, r_ok, tok, head, offs_d, qk_scale, stride_qt, stride_qh, stride_ket,
                                        stride_vet, DL, DR, BLOCK_R, BLOCK_J, HAS_MASK)
        if PDL:
            tl.extra.cuda.gdc_wait()

    # ---- the request's prefix partials, BLOCK_S at a time (their loads issued together)
    base_o = PartO + first.to(tl.int64) * stride_ps
    base_l = PartLse + first.to(tl.int64) * stride_ls
    for s0 in range(0, n_act, BLOCK_S):
        for k in tl.static_range(BLOCK_S):
            ok = r_ok & (s0 + k + tl.zeros_like(r) < n_act)
            lse = tl.load(base_l + (s0 + k) * stride_ls + r, mask=ok, other=float("-inf"))
            part = tl.load(base_o + (s0 + k) * stride_ps + offs_o, mask=ok[:, None], other=0.0)
            m_run, w_run, acc = _merge(m_run, w_run, acc, lse, part, False)
    if DRAFT_SLOT:                                 # a row that sees no draft key: LSE -inf, partial 0
        m_run, w_run, acc = _merge(m_run, w_run, acc, lse_d, part_d, False)
    out = acc / tl.where(w_run > 0.0, w_run, 1.0)[:, None]
    tl.store(Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=r_ok[:, None])


# ------------------------------------------------------------------------------------------------ launch

class Workspace:
    """Partial outputs/LSEs: ``slots`` partition slots of ``max_rows`` (token, head) rows each (a launch uses
    ``plan(...).slots`` of them). Allocate once (e.g. at CUDA-graph state init) with :meth:`for_batches`."""

    def __init__(self, slots: int, max_rows: int, device):
        self.slots, self.max_rows = slots, max_rows
        self.part_o = torch.empty((slots, max_rows, D_LATENT), dtype=torch.float32, device=device)
        self.part_lse = torch.empty((slots, max_rows), dtype=torch.float32, device=device)

    @classmethod
    def for_batches(cls, max_bs: int, rows: int, nsplit: int, config: KernelConfig, device) -> Workspace:
        """Big enough for every batch of 1..max_bs requests of up to ``rows`` rows, whichever split kernel runs."""
        return cls(max(workspace_slots(bs, rows, nsplit, config) for bs in range(1, max_bs + 1)), rows, device)

    def fits(self, slots: int, rows: int) -> bool:
        return slots <= self.slots and rows <= self.max_rows

    @property
    def nbytes(self) -> int:
        return self.part_o.numel() * 4 + self.part_lse.numel() * 4


@dataclass(frozen=True)
class Plan:
    """A launch's static shape: ``columns`` equal partitions of the batch's prefix keys, ``blocks`` row blocks
    per request in the split kernel; ``draft``: ``_draft_kernel`` writes request b's draft-tree partial into slot
    ``draft_slot0 + b``; ``tail`` > 0: the last, short row block (from row ``blocks`` x block_m) runs in programs
    of its own over ``tail`` partitions of the keys, its partials from slot ``tail_slot0``."""

    bs: int
    columns: int
    blocks: int
    draft: bool
    tail: int = 0

    @property
    def draft_slot0(self) -> int:
        return self.columns + self.bs - 1          # the segments' slots p + b are below (mla_common)

    @property
    def tail_slot0(self) -> int:
        return self.draft_slot0 + (self.bs if self.draft else 0)

    @property
    def slots(self) -> int:
        return self.tail_slot0 + (self.tail + self.bs - 1 if self.tail else 0)


def plan(bs: int, rows: int, nsplit: int, config: KernelConfig, block_m: int, draft: bool,
         tail: bool = False) -> Plan:
    """Columns: at most ``nsplit`` per request on average, and one wave of split programs (``max_ctas``: columns
    x row blocks) on all but ``draft_sms`` multiprocessors when the draft kernel runs (its programs start beside
    the split kernel's there instead of after them). With ``tail`` and a short last row block (``tail_rows_min`` to a
    quarter of a block: 144 = 2 x 64 + 16), whose programs cost ``tail_cost`` of a full block's per key: it goes
    to programs of its own on the multiprocessors the full blocks leave, when that gives the full blocks more
    columns (cap / (full blocks + tail_cost) against cap / blocks). Static sizes only: CUDA-graph safe."""
    blocks = _cdiv(rows, block_m)
    cap = _sms_now() if config.max_ctas < 0 else config.max_ctas
    if draft and cap > config.draft_sms:
        cap -= config.draft_sms
    columns = max(1, nsplit * bs)
    if cap <= 0:
        return Plan(bs, columns, blocks, draft)
    plain = max(1, min(columns, cap // blocks))
    full, left = divmod(rows, block_m)
    if tail and config.tail_cost > 0 and full and max(1, config.tail_rows_min) <= left <= block_m // 4:
        more = min(columns, int(cap / (full + config.tail_cost)))
        if more > plain and cap > more * full:
            return Plan(bs, more, full, draft, cap - more * full)
    return Plan(bs, plain, blocks, draft)


def launch_min_chunk(rows: int, blocks: int, block_n: int, config: KernelConfig) -> int:
    """Shortest partition of a launch (a multiple of ``block_n``). With ``partial_floor`` a partition is at least
    as many keys as make the bytes of the fp32 partial it writes per row block (``rows`` x 512 x 4 over ``blocks``
    x 576 x 2 per key): below that its partial costs the split kernel and the combine more than its keys save
    (bs=1 H=8 Q=16 4k: 128 rows in 2 blocks, 64 partitions of 64 keys -> 32 of 128; 72 rows keep 64)."""
    keys = max(config.min_chunk, 1)
    if config.partial_floor:
        keys = max(keys, _cdiv(rows * D_LATENT * 4, blocks * D_QK * 2))
    return _cdiv(keys, block_n) * block_n


def workspace_slots(bs: int, rows: int, nsplit: int, config: KernelConfig) -> int:
    """Partition slots a launch of ``bs`` requests of up to ``rows`` rows may use, whichever split kernel runs."""
    return max(plan(bs, rows, nsplit, config, block_m, True, tail).slots for block_m in {config.block_m, 64}
               for tail in (False, True))


@functools.lru_cache(maxsize=8)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` goes through Triton's constexpr unwrapping: a few us a call)."""
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def _cuda_ok() -> bool:
    return torch.cuda.is_available()


def _sms_now() -> int:
    """The current CUDA device's multiprocessor count (0 without CUDA)."""
    return _device_sms(torch.cuda.current_device()) if _cuda_ok() else 0


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


def _sm90_kernel(config: KernelConfig, q: torch.Tensor, kbuf: torch.Tensor):
    """The Gluon split kernel when ``config.sm90`` asks for it and it applies (Hopper, 16-bit q and cache of one
    dtype), else None."""
    if not (config.sm90 and q.is_cuda and q.dtype == kbuf.dtype and q.dtype in (torch.bfloat16, torch.float16)
            and _sm90_ok(q.device.index if q.device.index is not None else torch.cuda.current_device())):
        return None
    from kdtree_ext.mla_verify_sm90 import split_kernel_sm90

    return split_kernel_sm90


def launch_tail_m(rows: int, block_m: int, config: KernelConfig) -> int:
    """Rows of the short tile for the last row block: ``tail_m`` when the static row count leaves at most that
    many rows over whole blocks (72 rows = 64 + 8), else 0 (no second tile compiled)."""
    left = rows % block_m
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
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None, max_q_len: int, sm_scale: float,
    nsplit: int = 64, workspace: Workspace | None = None, *, config: KernelConfig | None = None,
) -> torch.Tensor:
    """Tree-verify attention into ``o`` ([tokens, H, 512] or [tokens, H * 512]); returns ``o``.

    ``q`` [tokens, H, 576]; ``k_ext`` [tokens, (1,) 576] and ``v_ext`` [tokens, (1,) 512] (None: the first 512
    channels of ``k_ext``) are the draft tokens' own keys/values; ``kv_buffer`` [slots, (1,) 576] is the MLA
    cache (values = its first 512 channels); the prefix is ``kv_indptr``/``kv_indices``. ``max_q_len`` bounds
    ``qo_indptr[b+1] - qo_indptr[b]`` (a static maximum: the grid depends on it and on the batch size, never on
    tensor contents); ``nsplit`` bounds the partitions per request (on average over the batch). Nothing here
    reads device memory on the host or allocates when ``workspace`` is given, so it can be captured in a CUDA
    graph and replayed with other lengths.
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
    if bs <= 0 or rows <= 0:
        return o
    sm90 = _sm90_kernel(config, q, kbuf)
    block_m, block_n = (64, 64) if sm90 is not None else (config.block_m, config.block_n)
    draft = config.draft_kernel and max_q_len <= 64   # the draft tree in a kernel of its own, the combine merges
    pdl = config.pdl and q.is_cuda and _pdl_ok(torch.cuda.current_device() if q.device.index is None
                                               else q.device.index)
    # the tail programs pay only beside the split kernel's (PDL); on CPU (the interpreter) they run after, for tests
    pl = plan(bs, rows, nsplit, config, block_m, draft, tail=pdl or not q.is_cuda)
    if workspace is None:
        workspace = Workspace(pl.slots, rows, q.device)
    assert workspace.fits(pl.slots, rows), "workspace too small for this batch"
    part_o, part_lse = workspace.part_o, workspace.part_lse
    min_chunk = launch_min_chunk(rows, pl.blocks, block_n, config)
    has_mask = custom_mask is not None
    if has_mask:
        assert mask_indptr is not None
    mask = custom_mask if has_mask else qo_indptr      # any pointer: never read without HAS_MASK
    mindptr = mask_indptr if has_mask else qo_indptr
    qk_scale = sm_scale * LOG2E
    tail_m = launch_tail_m(rows, block_m, config) if sm90 is None else 0
    strides = (q.stride(0), q.stride(1), kbuf.stride(0))
    part_strides = (part_o.stride(0), part_o.stride(1), part_lse.stride(0))
    launch = {"launch_pdl": True} if pdl else {}
    keys = (q, kbuf, qo_indptr, kv_indptr, kv_indices, part_o, part_lse, qk_scale, bs)
    tail_row0 = pl.blocks * block_m if pl.tail else rows
    if sm90 is not None:
        # one request: the tail programs after the full blocks' in the split grid (no launch to wait for); more: in
        # a launch of their own (the segment loop and the tail's tile in one program spill registers)
        in_grid = bool(pl.tail) and bs == 1

        def split_sm90(grid: int, tail: int, **pdl_launch) -> None:
            sm90[(grid,)](
                *keys, pl.columns, min_chunk, pl.blocks, pl.tail, tail_row0, pl.tail_slot0, *strides, *part_strides,
                H=heads, DL=D_LATENT, DR=D_ROPE, BS=bs_block(bs), PDL=pdl, TAIL=tail, LOAD_WARPS=4, LOAD_REGS=40,
                num_warps=8, **pdl_launch)

        split_sm90(pl.columns * pl.blocks + (pl.tail if in_grid else 0), 1 if in_grid else 0)
        if pl.tail and not in_grid:
            split_sm90(pl.tail, 2, **launch)
    else:
        def split(blocks: int, columns: int, row_base: int, slot_base: int, chained: bool) -> None:
            _split_kernel[(blocks, columns)](
                *keys, columns, min_chunk, row_base, slot_base, *strides, *part_strides, H=heads, DL=D_LATENT,
                DR=D_ROPE, BLOCK_M=block_m, BLOCK_N=block_n, BS=bs_block(bs), PDL=pdl, TAIL_M=tail_m,
                CHAINED=chained, num_warps=config.num_warps, num_stages=config.num_stages,
                **(launch if chained else {}))

        split(pl.blocks, pl.columns, 0, 0, False)
        if pl.tail:
            split(1, pl.tail, tail_row0, pl.tail_slot0, True)
    row_block = 0 < config.combine_rows <= bs * rows   # the 16-row combine merges this launch
    draft_warps = config.draft_warps_rows if row_block else config.draft_warps
    if draft:
        _draft_kernel[(_cdiv(rows, 16), bs, D_LATENT // config.draft_block_d)](
            q, kext, vext, mask, mindptr, part_o, part_lse, qo_indptr, kv_indptr, qk_scale, pl.draft_slot0,
            q.stride(0), q.stride(1), kext.stride(0), vext.stride(0), *part_strides, H=heads, DL=D_LATENT, DR=D_ROPE,
            BLOCK_R=16, BLOCK_D=config.draft_block_d, BLOCK_J=max(16, triton.next_power_of_2(max_q_len)),
            HAS_MASK=has_mask, PDL=pdl, num_warps=draft_warps, **launch)
    combine_args = (q, kext, vext, mask, mindptr, part_o, part_lse, o3, qo_indptr, kv_indptr, qk_scale, bs,
                    pl.columns, min_chunk, pl.draft_slot0, tail_row0, pl.tail, pl.tail_slot0, q.stride(0),
                    q.stride(1), kext.stride(0), vext.stride(0), *part_strides, o3.stride(0), o3.stride(1))
    if row_block:
        _combine_rows_kernel[(_cdiv(rows, 16), bs, D_LATENT // 128)](
            *combine_args, H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_N=block_n, BLOCK_R=16, BLOCK_S=4,
            BLOCK_D=128, BLOCK_J=max(16, triton.next_power_of_2(max_q_len)), HAS_MASK=has_mask, PDL=pdl,
            DRAFT_SLOT=draft, num_warps=4, **launch)
        return o
    wide = 0 < config.combine_wide_rows <= bs * rows
    block_d = D_LATENT if wide else config.combine_block_d
    _combine_kernel[(rows, bs, D_LATENT // block_d)](
        *combine_args, H=heads, DL=D_LATENT, DR=D_ROPE, BLOCK_N=block_n,
        BLOCK_S=max(1, config.combine_block_s * config.combine_block_d // block_d), BLOCK_D=block_d,
        BLOCK_J=config.combine_block_j, HAS_MASK=has_mask, PDL=pdl, DRAFT_SLOT=draft,
        num_warps=config.combine_warps * (2 if wide else 1), **launch,
    )
    return o


def with_config(config: KernelConfig, **changes) -> KernelConfig:
    return replace(config, **changes)


# ------------------------------------------------------------------------------------------------ reference

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
