"""The split kernel of ``mla_verify`` for Hopper (sm_90) in Gluon (Triton's explicit-layout dialect).

Same schedule and output as ``mla_verify._split_kernel`` (``mla_common``: equal columns of the batch's prefix
keys; a program = 64 (token, head) rows x one column, walking the requests the column touches and writing one
normalised fp32 partial and log2-sum-exp per segment).

Warp-specialised (``gl.warp_specialize``): four producer warps gather each segment's query rows and key tiles
with ``cp.async`` into a two-slot ring (each thread's copies arrive on the slot's ``ready`` mbarrier when they
land); the eight compute warps wait on ``ready``, free a slot on ``empty`` once both warp groups' ``P V`` has
read it, and free the query rows on ``q_free`` once a segment's last tile has its scores (the producers then
load the next request's rows while that tile's ``P V`` and the partial's store run). The two warp groups split
the 64 keys of the score tile (each ``Q Kᵀ`` for 32 of them) and the 512 value channels of ``P V`` (256 each);
the probabilities meet in shared memory. The producers run in 40 registers: what a segment needs is read again
from ``kv_indptr``/``qo_indptr`` per segment, not kept. With one request (``BS`` 1) there is no segment loop: its
one segment is read before the partitions start, with no search, so the first key tile is one round trip to
memory nearer. ``TAIL``: a short last row block (at most 16 rows) over partitions of its own, on transposed tiles
(keys x rows: 16 rows cost a quarter of the matrix work of 64): with one request its programs follow the full
blocks' in the same grid; with more, where the segment loop and the transposed tile in one program would spill
registers, they are a launch of their own (the same kernel, every program a tail program).

Imported only on a CUDA device of compute capability 9.x with a Triton that has Gluon (``mla_verify._sm90_ok``);
everywhere else, and under ``TRITON_INTERPRET=1``, ``mla_verify`` runs its Triton kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kdtree_ext.mla_common import batch_chunk, segment

# scores [64, 64]: each warp group 64 rows x 32 keys; output [64, 512]: each warp group 64 rows x 256 channels
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))


@gluon.jit
def _griddep(op: gl.constexpr):
    """PDL: ``griddepcontrol.launch_dependents`` (the next launch may start) or ``.wait`` (the one before has
    finished and its writes are visible)."""
    gl.inline_asm_elementwise("griddepcontrol." + op + "; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _slots(KvIdx, kv_base, n0, end, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Cache slots of prefix keys [n0, n0 + BLOCK_N) in ``layout`` (keys >= end: slot 0, never copied)."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    return gl.load(KvIdx + kv_base + offs, mask=offs < end, other=0).to(gl.int64)


@gluon.jit
def _issue_tile(k_lat, k_rope, KBuf, loc_l, loc_r, n0, end, stride_kb,
                DL: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr,
                GL_LAT: gl.constexpr, GL_ROPE: gl.constexpr):
    """cp.async the [c_kv | k_rope] rows of keys [n0, n0 + BLOCK_N) (slots loc_*; keys >= end: zeros)."""
    n_l = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GL_LAT))
    d_l = gl.arange(0, DL, layout=gl.SliceLayout(0, GL_LAT))
    async_copy.async_copy_global_to_shared(
        k_lat, KBuf + loc_l[:, None] * stride_kb + d_l[None, :], mask=(n_l < end)[:, None])
    n_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GL_ROPE))
    d_r = gl.arange(0, DR, layout=gl.SliceLayout(0, GL_ROPE))
    async_copy.async_copy_global_to_shared(
        k_rope, KBuf + loc_r[:, None] * stride_kb + DL + d_r[None, :], mask=(n_r < end)[:, None])


@gluon.jit
def _column_requests(KvIndptr, bs, p, chunk, base0, BS: gl.constexpr):
    """The requests column ``p`` touches, [lo, hi) (``mla_common.column_requests`` with a layout; BS == 1: one
    request, no search)."""
    if BS == 1:
        lo = 0
        hi = (p * chunk < gl.load(KvIndptr + 1) - base0).to(gl.int32)
    else:
        L: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
        offs = gl.arange(0, BS, layout=L)
        ok = offs < bs
        st = gl.load(KvIndptr + offs, mask=ok, other=0) - base0
        en = gl.load(KvIndptr + 1 + offs, mask=ok, other=0) - base0
        lo = gl.sum((ok & (en <= p * chunk)).to(gl.int32), axis=0)
        hi = gl.sum((ok & (st < (p + 1) * chunk)).to(gl.int32), axis=0)
    return lo, hi


@gluon.jit
def _segment(QoIndptr, KvIndptr, b, p, chunk, base0, row0, H: gl.constexpr):
    """Request ``b``'s part of this program: (q_start, rows, kv_base, prefix keys [start, end)); nothing to do
    when start >= end (rows past the request's, an empty piece). Both partitions call it for every request of
    the column, so they agree on which segments run."""
    q_start = gl.load(QoIndptr + b)
    rows = (gl.load(QoIndptr + b + 1) - q_start) * H
    kv_base, start, end = segment(KvIndptr, b, p, chunk, base0)
    end = gl.where(row0 >= rows, start, end)
    return q_start, rows, kv_base, start, end


@gluon.jit
def _first(QoIndptr, KvIndptr, p, chunk, base0, row0, H: gl.constexpr, BS: gl.constexpr):
    """BS == 1: the one request's segment, read before the partitions start (its reads do not wait for a search,
    so the first key tile's slots are one round trip to memory nearer); else nothing (the partitions read each
    segment themselves)."""
    if BS == 1:  # noqa: SIM108 (a constexpr branch)
        seg = _segment(QoIndptr, KvIndptr, 0, p, chunk, base0, row0, H)
    else:
        seg = (0, 0, 0, 0, 0)
    return seg


@gluon.jit
def _keys_below(n0, end, BN: gl.constexpr, S_L: gl.constexpr):
    """[1, BN] in the score layout: which keys n0 .. n0 + BN of a prefix tile are < end."""
    return (n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, S_L)) < end)[None, :]


@gluon.jit
def _tile(q_lat, q_rope, kl, kr, vl, p_smem, q_free, last, acc, m_i, l_part, keep, qk_scale, S_L: gl.constexpr,
          O_L: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """One key tile already in shared memory (kl = its c_kv rows, kr = k_rope, vl = the values: kl itself for
    prefix keys; the scores where ``keep`` is false are masked): each warp group's ``Q Kᵀ`` for its 32 keys, the
    online softmax (a row that keeps no key so far stays at max -inf, sums 0), p through shared memory, ``P V``
    for its 256 channels; on a segment's ``last`` tile the query rows are free (``q_free``) once both ``Q Kᵀ`` are
    done, so the producers load the next request's while ``P V`` runs. Returns (acc, row max, per-thread row
    sums)."""
    s = gl.zeros([BM, BN], gl.float32, layout=S_L)
    s = warpgroup_mma(q_lat, kl.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    s = gl.where(keep, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    p_smem.store(p.to(kl.dtype))
    fence_async_shared()
    gl.thread_barrier()                            # both halves of p are in shared memory: both Q Kᵀ are done
    mbarrier.arrive(q_free, count=1, pred=last)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(p_smem, vl, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, m_new, l_part * alpha[:, None] + p


@gluon.jit
def _store_partial(acc, m_i, l_part, PartO, PartLse, rows, row0, slot, stride_ps, stride_pr, stride_ls,
                   DL: gl.constexpr, BM: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
    """The normalised partial output and its log2-sum-exp (every prefix segment has >= 1 key: the row sums are
    > 0; a draft-tree row that sees no draft key gets zeros and LSE -inf, which the combines' merge weighs 0)."""
    l_i = gl.sum(l_part, 1)
    out = acc / gl.convert_layout(gl.where(l_i > 0.0, l_i, 1.0), gl.SliceLayout(1, O_L))[:, None]
    m_o = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
    gl.store(PartO + slot.to(gl.int64) * stride_ps + m_o[:, None] * stride_pr + d_o[None, :], out,
             mask=(m_o < rows)[:, None])
    m_s = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L))
    gl.store(PartLse + slot.to(gl.int64) * stride_ls + m_s, m_i + gl.log2(l_i), mask=m_s < rows)


@gluon.jit
def _load_segment(Q, KBuf, KvIdx, q_lat, q_rope, k_lat, k_rope, ready, empty, q_free, q_start, rows, kv_base, start,
                  end, row0, it, seg, stride_qt, stride_qh, stride_kb, H: gl.constexpr, DL: gl.constexpr,
                  DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GL: gl.constexpr):
    """One segment's copies: once the compute warps are done with the last segment's query rows (``q_free``),
    this request's rows, then each key tile into ring slot ``it % 2`` (``it`` counts tiles over all segments) once
    the compute warps have freed it (``empty``); every thread's copies arrive on ``ready`` when they land
    (cp.async.mbarrier.arrive.noinc: the query rows with the segment's first tile). Returns ``it``."""
    mbarrier.wait(q_free, (seg & 1) ^ 1)           # the first segment passes at once
    m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, GL))
    q_row = Q + (q_start + m // H).to(gl.int64)[:, None] * stride_qt + (m % H)[:, None] * stride_qh
    d_l = gl.arange(0, DL, layout=gl.SliceLayout(0, GL))
    d_r = gl.arange(0, DR, layout=gl.SliceLayout(0, GL))
    async_copy.async_copy_global_to_shared(q_lat, q_row + d_l[None, :], mask=(m < rows)[:, None])
    async_copy.async_copy_global_to_shared(q_rope, q_row + DL + d_r[None, :], mask=(m < rows)[:, None])
    n_tiles = gl.cdiv(end - start, BN)
    loc = _slots(KvIdx, kv_base, start, end, BN, gl.SliceLayout(1, GL))
    for i in range(n_tiles):
        buf = (it + i) % 2
        mbarrier.wait(empty.index(buf), (((it + i) // 2) & 1) ^ 1)   # the first use of each slot passes at once
        n0 = start + i * BN
        _issue_tile(k_lat.index(buf), k_rope.index(buf), KBuf, loc, loc, n0, end, stride_kb, DL, DR, BN, GL, GL)
        async_copy.mbarrier_arrive(ready.index(buf), increment_count=False)
        loc = _slots(KvIdx, kv_base, n0 + BN, end, BN, gl.SliceLayout(1, GL))
    return it + n_tiles


@gluon.jit
def _ws_loader(Q, KBuf, KvIdx, QoIndptr, KvIndptr, q_lat, q_rope, k_lat, k_rope, ready, empty, q_free, b_lo, b_hi,
               first, p, chunk, base0, row0, stride_qt, stride_qh, stride_kb, H: gl.constexpr, DL: gl.constexpr,
               DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BS: gl.constexpr, LOAD_WARPS: gl.constexpr):
    """Producer warps: each segment's copies (``_load_segment``); one request's (BS == 1) one segment is ``first``,
    read before the partitions start, else each is read again from ``kv_indptr``/``qo_indptr``."""
    # 4 rows x 64 channels per warp: each thread copies 16-byte pieces of 4 rows (one slot each), so a tile needs
    # only 4 row addresses per thread (a row's pieces are immediate offsets of them)
    GL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    if BS == 1:
        q_start, rows, kv_base, start, end = first
        if start < end:
            _load_segment(Q, KBuf, KvIdx, q_lat, q_rope, k_lat, k_rope, ready, empty, q_free, q_start, rows, kv_base,
                          start, end, row0, 0, 0, stride_qt, stride_qh, stride_kb, H, DL, DR, BM, BN, GL)
    else:
        it = 0
        seg = 0
        for b in range(b_lo, b_hi):
            q_start, rows, kv_base, start, end = _segment(QoIndptr, KvIndptr, b, p, chunk, base0, row0, H)
            if start < end:
                it = _load_segment(Q, KBuf, KvIdx, q_lat, q_rope, k_lat, k_rope, ready, empty, q_free, q_start,
                                   rows, kv_base, start, end, row0, it, seg, stride_qt, stride_qh, stride_kb, H, DL,
                                   DR, BM, BN, GL)
                seg += 1


@gluon.jit
def _compute_segment(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, rows, start, end,
                     row0, slot, it, qk_scale, stride_ps, stride_pr, stride_ls, DL: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr):
    """One segment on the 8 compute warps: its key tiles (wait on ``ready``, free the ring slot on ``empty`` once
    both warp groups' ``P V`` has read it; the query rows on ``q_free`` after the last tile's ``Q Kᵀ``), its
    partial into ``slot``. Returns ``it``."""
    S_L: gl.constexpr = S_LAYOUT
    O_L: gl.constexpr = O_LAYOUT
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BM, DL], gl.float32, layout=O_L)
    l_part = gl.zeros([BM, BN], gl.float32, layout=S_L)
    n_tiles = gl.cdiv(end - start, BN)
    for i in range(n_tiles):
        buf = (it + i) % 2
        mbarrier.wait(ready.index(buf), ((it + i) // 2) & 1)
        fence_async_shared()                       # cp.async wrote through the generic proxy; wgmma reads async
        n0 = start + i * BN
        acc, m_i, l_part = _tile(q_lat, q_rope, k_lat.index(buf), k_rope.index(buf), k_lat.index(buf), p_smem,
                                 q_free, i == n_tiles - 1, acc, m_i, l_part, _keys_below(n0, end, BN, S_L),
                                 qk_scale, S_L, O_L, BM, BN)
        gl.thread_barrier()                        # both warp groups are done with slot buf and with p
        mbarrier.arrive(empty.index(buf), count=1)
    _store_partial(acc, m_i, l_part, PartO, PartLse, rows, row0, slot, stride_ps, stride_pr, stride_ls, DL, BM,
                   S_L, O_L)
    return it + n_tiles


# the short last row block (<= 16 rows) on transposed tiles: scores [64 keys, 16 rows], each warp group 8 of the
# rows (wgmma N = 8); output [512 channels, 16 rows], each warp group 256 of the channels (N = 16)
TAIL_M = gl.constexpr(16)
T_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 8, 16]))
TO_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 16, 16]))


@gluon.jit
def _tail_segment(q_lat, q_rope, k_lat, k_rope, pt_smem, ready, empty, q_free, PartO, PartLse, rows, start, end, row0,
                  slot, it, qk_scale, stride_ps, stride_pr, stride_ls, DL: gl.constexpr, BN: gl.constexpr):
    """One segment of a tail program's compute warps: per key tile ``Sᵀ = K Qᵀ`` (keys x rows: the keys are
    ``wgmma``'s M side, so 16 rows cost a quarter of a 64-row tile's matrix work), the online softmax down the
    keys, pᵀ through shared memory, ``Oᵀ += Vᵀ pᵀ`` (channels x rows); the partial, transposed back on its store,
    into ``slot``. Returns ``it``."""
    BM: gl.constexpr = TAIL_M
    T_L: gl.constexpr = T_LAYOUT
    TO_L: gl.constexpr = TO_LAYOUT
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(0, T_L))
    l_part = gl.zeros([BN, BM], gl.float32, layout=T_L)
    acc = gl.zeros([DL, BM], gl.float32, layout=TO_L)
    n_tiles = gl.cdiv(end - start, BN)
    for i in range(n_tiles):
        buf = (it + i) % 2
        mbarrier.wait(ready.index(buf), ((it + i) // 2) & 1)
        fence_async_shared()
        kl = k_lat.index(buf)
        s = gl.zeros([BN, BM], gl.float32, layout=T_L)
        s = warpgroup_mma(kl, q_lat.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(k_rope.index(buf), q_rope.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        keys = start + i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, T_L))
        s = gl.where((keys < end)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))          # every tile has >= 1 key: finite
        alpha = gl.exp2(m_i - m_new)
        pt = gl.exp2(s - m_new[None, :])
        l_part = l_part * alpha[None, :] + pt
        pt_smem.store(gl.permute(pt.to(kl.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()                        # pᵀ is in shared memory: both warp groups' Sᵀ are done
        mbarrier.arrive(q_free, count=1, pred=i == n_tiles - 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, TO_L))[None, :]
        acc = warpgroup_mma(kl.permute((1, 0)), pt_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()                        # both warp groups are done with slot buf and with pᵀ
        mbarrier.arrive(empty.index(buf), count=1)
        m_i = m_new
    l_i = gl.sum(l_part, 0)                        # every segment has >= 1 key: l_i > 0
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, TO_L))[None, :]
    slot = slot.to(gl.int64)
    d = gl.arange(0, DL, layout=gl.SliceLayout(1, TO_L))
    m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, TO_L))
    gl.store(PartO + slot * stride_ps + m[None, :] * stride_pr + d[:, None], out, mask=(m < rows)[None, :])
    m_s = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, T_L))
    gl.store(PartLse + slot * stride_ls + m_s, m_i + gl.log2(l_i), mask=m_s < rows)
    return it + n_tiles


@gluon.jit
def _run_segment(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, rows, start, end, row0,
                 slot, it, tail, qk_scale, stride_ps, stride_pr, stride_ls, DL: gl.constexpr, BM: gl.constexpr,
                 BN: gl.constexpr):
    """A segment of a 64-row program (``_compute_segment``) or of a tail program (``_tail_segment``: the first 16
    of the query rows the producers loaded, pᵀ in the first 16 rows of p's buffer); ``tail`` is a constant unless
    the grid holds both kinds, so a launch of one kind compiles only its own. Returns ``it``."""
    if tail:
        nxt = _tail_segment(q_lat.slice(0, TAIL_M), q_rope.slice(0, TAIL_M), k_lat, k_rope, p_smem.slice(0, TAIL_M),
                            ready, empty, q_free, PartO, PartLse, rows, start, end, row0, slot, it, qk_scale,
                            stride_ps, stride_pr, stride_ls, DL, BN)
    else:
        nxt = _compute_segment(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, rows,
                               start, end, row0, slot, it, qk_scale, stride_ps, stride_pr, stride_ls, DL, BM, BN)
    return nxt


@gluon.jit
def _ws_compute(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, QoIndptr, KvIndptr,
                b_lo, b_hi, first, p, chunk, base0, row0, slot0, tail, qk_scale, stride_ps, stride_pr, stride_ls,
                H: gl.constexpr, DL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BS: gl.constexpr):
    """The 8 compute warps: each segment (``_run_segment``, the first one's from ``first`` when BS == 1), its
    partial into slot ``slot0`` + column + request."""
    if BS == 1:
        _, rows, _, start, end = first
        if start < end:
            _run_segment(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, rows, start, end,
                         row0, slot0 + p, 0, tail, qk_scale, stride_ps, stride_pr, stride_ls, DL, BM, BN)
    else:
        it = 0
        for b in range(b_lo, b_hi):
            _, rows, _, start, end = _segment(QoIndptr, KvIndptr, b, p, chunk, base0, row0, H)
            if start < end:
                it = _run_segment(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, rows,
                                  start, end, row0, slot0 + p + b, it, tail, qk_scale, stride_ps, stride_pr,
                                  stride_ls, DL, BM, BN)


@gluon.jit
def _shared(dt: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr,
            LOAD_WARPS: gl.constexpr):
    """A program's shared memory: BM query rows, the two-slot key ring, the probability tile, and the ``ready``
    (every producer thread's copies), ``empty`` and ``q_free`` barriers."""
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(dt, [BM, DL], SH)
    q_rope = gl.allocate_shared_memory(dt, [BM, DR], SH)
    k_lat = gl.allocate_shared_memory(dt, [2, BN, DL], SH)
    k_rope = gl.allocate_shared_memory(dt, [2, BN, DR], SH)
    p_smem = gl.allocate_shared_memory(dt, [BM, BN], SH)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(ready.index(j), count=LOAD_WARPS * 32)
        mbarrier.init(empty.index(j), count=1)
    mbarrier.init(q_free, count=1)
    return q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free


@gluon.jit
def split_kernel_sm90(
    Q, KBuf, QoIndptr, KvIndptr, KvIdx, PartO, PartLse,
    qk_scale, bs, columns, min_chunk, blocks, tail_columns, tail_row0, tail_slot0,
    stride_qt, stride_qh, stride_kb, stride_ps, stride_pr, stride_ls,
    H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, BS: gl.constexpr, PDL: gl.constexpr, TAIL: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
):
    """Grid (``columns`` x ``blocks`` (+ ``tail_columns`` with TAIL),): program ``lin`` is row block ``lin %
    blocks`` of column ``lin // blocks`` (neighbouring programs share the column's keys in L2); with TAIL the
    last ``tail_columns`` programs are the tail programs: the (at most 16) rows from ``tail_row0`` over
    ``tail_columns`` partitions of the batch's keys of their own, on transposed tiles, their partials from slot
    ``tail_slot0``. Those come last in launch order, so that they run on the multiprocessors the full row blocks
    leave free."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    if PDL:
        _griddep("launch_dependents")
    lin = gl.program_id(0)
    if TAIL == 2:
        tail: gl.constexpr = True
        p = lin
        row0 = tail_row0
        slot0 = tail_slot0
        cols = tail_columns
    elif TAIL == 1:
        tail = lin >= columns * blocks
        p = gl.where(tail, lin - columns * blocks, lin // blocks)
        row0 = gl.where(tail, tail_row0, (lin % blocks) * BM)
        slot0 = gl.where(tail, tail_slot0, 0)
        cols = gl.where(tail, tail_columns, columns)
    else:
        tail: gl.constexpr = False
        p = lin // blocks
        row0 = (lin % blocks) * BM
        slot0 = 0
        cols = columns
    chunk, base0 = batch_chunk(KvIndptr, bs, cols, min_chunk, BN)
    b_lo, b_hi = _column_requests(KvIndptr, bs, p, chunk, base0, BS)
    if b_lo >= b_hi:
        if PDL and TAIL == 2:
            _griddep("wait")
        return
    first = _first(QoIndptr, KvIndptr, p, chunk, base0, row0, H, BS)

    q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free = _shared(KBuf.dtype.element_ty, BM, BN, DL, DR,
                                                                         LOAD_WARPS)
    gl.warp_specialize([
        (_ws_compute,
         (q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, q_free, PartO, PartLse, QoIndptr, KvIndptr, b_lo, b_hi,
          first, p, chunk, base0, row0, slot0, tail, qk_scale, stride_ps, stride_pr, stride_ls, H, DL, BM, BN, BS)),
        (_ws_loader, (Q, KBuf, KvIdx, QoIndptr, KvIndptr, q_lat, q_rope, k_lat, k_rope, ready, empty, q_free, b_lo,
                      b_hi, first, p, chunk, base0, row0, stride_qt, stride_qh, stride_kb, H, DL, DR, BM, BN, BS,
                      LOAD_WARPS)),
    ], [LOAD_WARPS], [LOAD_REGS])
    if PDL and TAIL == 2:
        _griddep("wait")
