"""The split kernel of ``mla_verify`` for Hopper (sm_90) in Gluon (Triton's explicit-layout dialect).

Same arguments, grid and output as ``mla_verify._split_kernel`` (DV_SPLIT 1, BLOCK_M 64, BLOCK_N 64, 8 warps):
one program per 64 (token, head) rows of a request x one prefix partition -> a normalised fp32 partial
output and its log2-sum-exp. What differs is who computes what: the two warp groups split the 64 keys of the
score tile (each computes ``Q Kᵀ`` for 32 of them) and the 512 value channels of ``P V`` (256 each); the
probabilities meet in shared memory (``p_smem``). Triton's ``tl.dot`` chain lays the score tile out so that
both warp groups compute all of it (``Q Kᵀ`` twice). Key tiles are gathered with ``cp.async`` into two
buffers: the next tile's copies are issued right after the barrier that opens a tile (which also frees the
buffer the previous tile's ``P V`` read), and the cache slots of the tile after that are loaded a tile ahead
into registers. Each thread keeps its own share of the row sums (``l_part``), summed across the warp groups
once at the end, so a tile has one cross-warp-group reduction (the row maximum), not two.

``split_kernel_sm90_ws`` (the default, ``KernelConfig.sm90_ws``) is the same computation warp-specialised
(``gl.warp_specialize``): four producer warps gather the query and the key tiles into a two-slot ring with
``cp.async`` (each thread's copies arrive on the slot's ``ready`` mbarrier when they land), the eight compute
warps wait on ``ready`` and free a slot on ``empty`` once both warp groups' ``P V`` has read it — no copy
instructions, slot loads or copy waits in the compute warps (232 registers there, 40 in the producers). With
``TAIL`` (``KernelConfig.tail_pair``) the short last row block's programs (at most 16 rows) run their tiles
transposed (``_tail_tiles``: keys x rows, so the rows are ``wgmma``'s N side rather than padding its 64-row M side).

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

from kdtree_ext.mla_verify import _chunk_len, _request_kv

# scores [64, 64]: each warp group 64 rows x 32 keys; output [64, 512]: each warp group 64 rows x 256 channels
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))


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
def _program(QoIndptr, KvStart, KvLens, nsplit, min_chunk, kv_start_mult, blocks, pre_blocks, nsplit_tail,
             H: gl.constexpr, KV_INDPTR: gl.constexpr, PDL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             DRAFT: gl.constexpr = False, TAIL: gl.constexpr = 0):
    """This program's request b, partition, query rows and prefix keys [start, end) (start == end: nothing to
    do — rows past the request's, or a partition past its prefix), and whether it is a tail program. DRAFT
    (grid (pre_blocks * nsplit + nsplit_tail + blocks, 1, bs)): each request's first ``pre_blocks`` row blocks
    get the ``nsplit`` prefix partitions, its short last row block (``tail_pair``: TAIL > 0, ``pre_blocks`` =
    ``blocks`` - 1) ``nsplit_tail`` partitions of TAIL prefix partitions' keys each (tail programs), and all ``blocks``
    its draft-tree programs (partition ``nsplit``). In launch order: every request's prefix programs, then the
    tail programs, then the draft programs, so that those run on the multiprocessors the others leave free (or
    after them) rather than pushing a later request's prefix programs into a second wave (with one request: the
    grid's own order)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    rb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    tail = split < 0                               # no tail program (a tensor: the DRAFT branch reassigns it)
    if DRAFT:
        per_b = pre_blocks * nsplit                # prefix programs per request
        lin = rb + gl.num_programs(0) * b
        n_pre = per_b * gl.num_programs(2)
        t = lin - n_pre                            # the tail programs: nsplit_tail per request
        d = t - nsplit_tail * gl.num_programs(2)
        pre = lin < n_pre
        tail = (t >= 0) & (d < 0)
        n_t = gl.maximum(nsplit_tail, 1)
        b = gl.where(pre, lin // per_b, gl.where(tail, t // n_t, d // blocks))
        split = gl.where(pre, (lin % per_b) // pre_blocks, gl.where(tail, t % n_t, nsplit))
        rb = gl.where(pre, lin % pre_blocks, gl.where(tail, pre_blocks, d % blocks))
    row0 = rb * BM
    q_start = gl.load(QoIndptr + b)
    rows = (gl.load(QoIndptr + b + 1) - q_start) * H
    kv_base, prefix = _request_kv(KvStart, KvLens, b, kv_start_mult, KV_INDPTR)
    chunk = _chunk_len(prefix, nsplit, min_chunk, BN)
    span = chunk * gl.where(tail, TAIL, 1)         # a tail program: TAIL partitions' keys
    start = split * span
    end = gl.minimum(start + span, prefix)
    if row0 >= rows:
        end = start
    return b, split, q_start, rows, row0, kv_base, prefix, start, end, tail, chunk


@gluon.jit
def _keys_below(n0, end, BN: gl.constexpr, S_L: gl.constexpr):
    """[1, BN] in the score layout: which keys n0 .. n0 + BN of a prefix tile are < end."""
    return (n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, S_L)) < end)[None, :]


@gluon.jit
def _tile(q_lat, q_rope, kl, kr, vl, p_smem, acc, m_i, l_part, keep, qk_scale, S_L: gl.constexpr,
          O_L: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """One key tile already in shared memory (kl = its c_kv rows, kr = k_rope, vl = the values: kl itself for
    prefix keys; the scores where ``keep`` is false are masked): each warp group's ``Q Kᵀ`` for its 32 keys, the
    online softmax (a row that keeps no key so far stays at max -inf, sums 0), p through shared memory, ``P V``
    for its 256 channels. Returns (acc, row max, per-thread row sums)."""
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
    gl.thread_barrier()                            # both halves of p are in shared memory
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(p_smem, vl, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, m_new, l_part * alpha[:, None] + p


@gluon.jit
def _store_partial(acc, m_i, l_part, PartO, PartLse, rows, row0, b, split, stride_pb, stride_ps, stride_pr,
                   stride_lb, stride_ls, DL: gl.constexpr, BM: gl.constexpr, S_L: gl.constexpr,
                   O_L: gl.constexpr):
    """The normalised partial output and its log2-sum-exp (every prefix partition has >= 1 key: the row sums are
    > 0; a draft-tree row that sees no draft key gets zeros and LSE -inf, which the combines' merge weighs 0)."""
    l_i = gl.sum(l_part, 1)
    out = acc / gl.convert_layout(gl.where(l_i > 0.0, l_i, 1.0), gl.SliceLayout(1, O_L))[:, None]
    m_o = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
    part = b.to(gl.int64) * stride_pb + split.to(gl.int64) * stride_ps
    gl.store(PartO + part + m_o[:, None] * stride_pr + d_o[None, :], out.to(PartO.dtype.element_ty),
             mask=(m_o < rows)[:, None])
    m_s = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L))
    gl.store(PartLse + b.to(gl.int64) * stride_lb + split.to(gl.int64) * stride_ls + m_s, m_i + gl.log2(l_i),
             mask=m_s < rows)


@gluon.jit
def split_kernel_sm90(
    Q, KBuf, QoIndptr, KvStart, KvLens, KvIdx, PartO, PartLse,
    qk_scale, nsplit, min_chunk, kv_start_mult,
    stride_qt, stride_qh, stride_kb,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
    H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, KV_INDPTR: gl.constexpr, PDL: gl.constexpr,
):
    """One prefix partition x 64 (token, head) rows of one request -> partial output + log2-sum-exp (8 warps)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    S_L: gl.constexpr = S_LAYOUT
    O_L: gl.constexpr = O_LAYOUT
    GL_LAT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    GL_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    b, split, q_start, rows, row0, kv_base, _, start, end, _, _ = _program(
        QoIndptr, KvStart, KvLens, nsplit, min_chunk, kv_start_mult, 0, 0, 0, H, KV_INDPTR, PDL, BM, BN)
    if start >= end:
        return

    dt: gl.constexpr = KBuf.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dt, [BM, DL], SH)
    q_rope = gl.allocate_shared_memory(dt, [BM, DR], SH)
    k_lat = gl.allocate_shared_memory(dt, [2, BN, DL], SH)
    k_rope = gl.allocate_shared_memory(dt, [2, BN, DR], SH)
    p_smem = gl.allocate_shared_memory(dt, [BM, BN], SH)

    # the query rows (zeros past this request's rows) and the first key tile: one copy group
    m_l = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, GL_LAT))
    d_l = gl.arange(0, DL, layout=gl.SliceLayout(0, GL_LAT))
    q_l = Q + (q_start + m_l // H).to(gl.int64)[:, None] * stride_qt + (m_l % H)[:, None] * stride_qh
    async_copy.async_copy_global_to_shared(q_lat, q_l + d_l[None, :], mask=(m_l < rows)[:, None])
    m_r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, GL_ROPE))
    d_r = gl.arange(0, DR, layout=gl.SliceLayout(0, GL_ROPE))
    q_r = Q + (q_start + m_r // H).to(gl.int64)[:, None] * stride_qt + (m_r % H)[:, None] * stride_qh
    async_copy.async_copy_global_to_shared(q_rope, q_r + DL + d_r[None, :], mask=(m_r < rows)[:, None])
    loc_l = _slots(KvIdx, kv_base, start, end, BN, gl.SliceLayout(1, GL_LAT))
    loc_r = _slots(KvIdx, kv_base, start, end, BN, gl.SliceLayout(1, GL_ROPE))
    _issue_tile(k_lat.index(0), k_rope.index(0), KBuf, loc_l, loc_r, start, end, stride_kb, DL, DR, BN,
                GL_LAT, GL_ROPE)
    async_copy.commit_group()
    loc_l = _slots(KvIdx, kv_base, start + BN, end, BN, gl.SliceLayout(1, GL_LAT))
    loc_r = _slots(KvIdx, kv_base, start + BN, end, BN, gl.SliceLayout(1, GL_ROPE))

    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BM, DL], gl.float32, layout=O_L)
    n_tiles = gl.cdiv(end - start, BN)
    l_part = gl.zeros([BM, BN], gl.float32, layout=S_L)
    for i in range(n_tiles):
        n0 = start + i * BN
        buf = i % 2
        async_copy.wait_group(0)                   # tile i (and the query) has landed, own copies
        fence_async_shared()
        gl.thread_barrier()                        # everyone's copies; tile i - 1's buffer and p are free
        _issue_tile(k_lat.index(1 - buf), k_rope.index(1 - buf), KBuf, loc_l, loc_r, n0 + BN, end, stride_kb,
                    DL, DR, BN, GL_LAT, GL_ROPE)
        async_copy.commit_group()
        loc_l = _slots(KvIdx, kv_base, n0 + 2 * BN, end, BN, gl.SliceLayout(1, GL_LAT))
        loc_r = _slots(KvIdx, kv_base, n0 + 2 * BN, end, BN, gl.SliceLayout(1, GL_ROPE))
        acc, m_i, l_part = _tile(q_lat, q_rope, k_lat.index(buf), k_rope.index(buf), k_lat.index(buf), p_smem, acc,
                                 m_i, l_part, _keys_below(n0, end, BN, S_L), qk_scale, S_L, O_L, BM, BN)
    async_copy.wait_group(0)
    _store_partial(acc, m_i, l_part, PartO, PartLse, rows, row0, b, split, stride_pb, stride_ps, stride_pr,
                   stride_lb, stride_ls, DL, BM, S_L, O_L)


# ------------------------------------------------------------------------------------ warp-specialised variant

@gluon.jit
def _tile_at(i, start, end, chunk, BN: gl.constexpr):
    """Key tile i of a program's keys [start, end) -> (its first key, the end of its range). A tail program's keys
    (``tail_pair`` 2: two prefix partitions', up to 2 x ``chunk``) are taken alternately from the two halves while
    both have tiles, so that it reads each tile about when the 64-row programs of those partitions do (the tile's
    lines are then in L2); every other program's in order (end <= start + chunk)."""
    mid = gl.minimum(start + chunk, end)
    t_b = gl.cdiv(gl.maximum(end - mid, 0), BN)    # tiles of the second half
    inter = i < 2 * t_b
    half = gl.where(inter, i % 2, 0)
    n0 = start + half * chunk + gl.where(inter, i // 2, i - t_b) * BN
    return n0, gl.where(half == 1, end, mid)


@gluon.jit
def _ws_loader(Q, KBuf, KvIdx, KExt, VExt, q_lat, q_rope, k_lat, k_rope, ready, empty, q_start, rows, row0, kv_base,
               start, end, chunk, d_len, stride_qt, stride_qh, stride_kb, stride_ket, stride_vet, H: gl.constexpr,
               DL: gl.constexpr, DR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, LOAD_WARPS: gl.constexpr,
               DRAFT: gl.constexpr, TAIL: gl.constexpr = 0):
    """Producer warps: the query rows, then each key tile into ring slot i % 2 once the compute warps have freed
    it (``empty``); every thread's copies arrive on ``ready`` when they land (cp.async.mbarrier.arrive.noinc).
    The draft program (``d_len`` > 0) loads, instead, the request's draft keys into slot 0 and their values into
    slot 1's c_kv part: one tile."""
    # 4 rows x 64 channels per warp: each thread copies 16-byte pieces of 4 rows (one slot each), so a tile needs
    # only 4 row addresses per thread (a row's pieces are immediate offsets of them)
    GL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])
    m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, GL))
    q_row = Q + (q_start + m // H).to(gl.int64)[:, None] * stride_qt + (m % H)[:, None] * stride_qh
    d_l = gl.arange(0, DL, layout=gl.SliceLayout(0, GL))
    d_r = gl.arange(0, DR, layout=gl.SliceLayout(0, GL))
    async_copy.async_copy_global_to_shared(q_lat, q_row + d_l[None, :], mask=(m < rows)[:, None])
    async_copy.async_copy_global_to_shared(q_rope, q_row + DL + d_r[None, :], mask=(m < rows)[:, None])
    if DRAFT:  # noqa: SIM102 (a constexpr branch: launches without a draft program compile none of this)
        if d_len > 0:
            j = gl.arange(0, BN, layout=gl.SliceLayout(1, GL))
            loc_d = (q_start + j).to(gl.int64)
            _issue_tile(k_lat.index(0), k_rope.index(0), KExt, loc_d, loc_d, 0, d_len, stride_ket, DL, DR, BN, GL, GL)
            async_copy.async_copy_global_to_shared(k_lat.index(1), VExt + loc_d[:, None] * stride_vet + d_l[None, :],
                                                   mask=(j < d_len)[:, None])
            async_copy.mbarrier_arrive(ready.index(0), increment_count=False)
    n_tiles = gl.cdiv(end - start, BN)
    if TAIL:                                       # tiles in _tile_at's order (the tail programs interleave)
        n0, e = _tile_at(0, start, end, chunk, BN)
        loc = _slots(KvIdx, kv_base, n0, e, BN, gl.SliceLayout(1, GL))
        for i in range(n_tiles):
            buf = i % 2
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
            _issue_tile(k_lat.index(buf), k_rope.index(buf), KBuf, loc, loc, n0, e, stride_kb, DL, DR, BN, GL, GL)
            async_copy.mbarrier_arrive(ready.index(buf), increment_count=False)
            n0, e = _tile_at(i + 1, start, end, chunk, BN)
            loc = _slots(KvIdx, kv_base, n0, e, BN, gl.SliceLayout(1, GL))
    else:
        loc = _slots(KvIdx, kv_base, start, end, BN, gl.SliceLayout(1, GL))
        for i in range(n_tiles):
            buf = i % 2
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)     # the first use of each slot passes at once
            n0 = start + i * BN
            _issue_tile(k_lat.index(buf), k_rope.index(buf), KBuf, loc, loc, n0, end, stride_kb, DL, DR, BN, GL, GL)
            async_copy.mbarrier_arrive(ready.index(buf), increment_count=False)
            loc = _slots(KvIdx, kv_base, n0 + BN, end, BN, gl.SliceLayout(1, GL))


@gluon.jit
def _draft_keep(Mask, MaskIndptr, b, row0, q_len, prefix, H: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                S_L: gl.constexpr, HAS_MASK: gl.constexpr):
    """[BM, BN] in the score layout: row m's token sees draft key j (the tree mask row, SGLang's layout: after the
    prefix columns; without a mask, a chain: j <= token)."""
    tok = (row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L))) // H
    j = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    ok = (tok < q_len)[:, None] & (j < q_len)[None, :]
    if HAS_MASK:
        mask_row = Mask + gl.load(MaskIndptr + b).to(gl.int64) + tok.to(gl.int64) * (prefix + q_len) + prefix
        return gl.load(mask_row[:, None] + j[None, :], mask=ok, other=0) != 0
    return ok & (j[None, :] <= tok[:, None])


@gluon.jit
def _ws_compute(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, PartO, PartLse, Mask, MaskIndptr, rows,
                row0, b, split, prefix, start, end, chunk, d_len, tail, qk_scale, stride_pb, stride_ps, stride_pr,
                stride_lb, stride_ls, H: gl.constexpr, DL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                DRAFT: gl.constexpr, HAS_MASK: gl.constexpr, TAIL: gl.constexpr):
    """The 8 compute warps: a tail program's transposed tiles (``TAIL``; pᵀ in the first 16 rows of p's buffer),
    else ``_ws_tiles``."""
    if TAIL:
        if tail:
            _tail_tiles(q_lat.slice(0, TAIL_M), q_rope.slice(0, TAIL_M), k_lat, k_rope, p_smem.slice(0, TAIL_M),
                        ready, empty, PartO, PartLse, rows, row0, b, split, start, end, chunk, qk_scale, stride_pb,
                        stride_ps, stride_pr, stride_lb, stride_ls, DL, BN)
        else:
            _ws_tiles(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, PartO, PartLse, Mask, MaskIndptr, rows,
                      row0, b, split, prefix, start, end, d_len, qk_scale, stride_pb, stride_ps, stride_pr, stride_lb,
                      stride_ls, H, DL, BM, BN, DRAFT, HAS_MASK)
    else:
        _ws_tiles(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, PartO, PartLse, Mask, MaskIndptr, rows, row0,
                  b, split, prefix, start, end, d_len, qk_scale, stride_pb, stride_ps, stride_pr, stride_lb,
                  stride_ls, H, DL, BM, BN, DRAFT, HAS_MASK)


@gluon.jit
def _ws_tiles(q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, PartO, PartLse, Mask, MaskIndptr, rows, row0, b,
              split, prefix, start, end, d_len, qk_scale, stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
              H: gl.constexpr, DL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DRAFT: gl.constexpr,
              HAS_MASK: gl.constexpr):
    """A 64-row program's tiles, as in ``split_kernel_sm90``, without the copies (the compute warps wait on
    ``ready`` and free a ring slot on ``empty`` once both warp groups' ``P V`` has read it); the draft program
    runs its one tile with the tree mask (keys in slot 0, values in slot 1)."""
    S_L: gl.constexpr = S_LAYOUT
    O_L: gl.constexpr = O_LAYOUT
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BM, DL], gl.float32, layout=O_L)
    l_part = gl.zeros([BM, BN], gl.float32, layout=S_L)
    n_tiles = gl.cdiv(end - start, BN)
    for i in range(n_tiles):
        buf = i % 2
        mbarrier.wait(ready.index(buf), (i // 2) & 1)
        fence_async_shared()                       # cp.async wrote through the generic proxy; wgmma reads async
        n0 = start + i * BN
        acc, m_i, l_part = _tile(q_lat, q_rope, k_lat.index(buf), k_rope.index(buf), k_lat.index(buf), p_smem, acc,
                                 m_i, l_part, _keys_below(n0, end, BN, S_L), qk_scale, S_L, O_L, BM, BN)
        gl.thread_barrier()                        # both warp groups are done with slot buf and with p
        mbarrier.arrive(empty.index(buf), count=1)
    if DRAFT:  # noqa: SIM102 (a constexpr branch; after the loop, which the draft program skips: 0 prefix tiles)
        if d_len > 0:
            keep = _draft_keep(Mask, MaskIndptr, b, row0, d_len, prefix, H, BM, BN, S_L, HAS_MASK)
            mbarrier.wait(ready.index(0), 0)
            fence_async_shared()
            acc, m_i, l_part = _tile(q_lat, q_rope, k_lat.index(0), k_rope.index(0), k_lat.index(1), p_smem, acc,
                                     m_i, l_part, keep, qk_scale, S_L, O_L, BM, BN)
    _store_partial(acc, m_i, l_part, PartO, PartLse, rows, row0, b, split, stride_pb, stride_ps, stride_pr,
                   stride_lb, stride_ls, DL, BM, S_L, O_L)


# a tail program (tail_pair): scores transposed [64 keys, 16 rows], each warp group 8 of the rows (wgmma N = 8);
# output transposed [512 channels, 16 rows], each warp group 256 of the channels (N = 16)
TAIL_M = gl.constexpr(16)
T_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 8, 16]))
TO_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 16, 16]))


@gluon.jit
def _tail_tiles(q_lat, q_rope, k_lat, k_rope, pt_smem, ready, empty, PartO, PartLse, rows, row0, b, split, start,
                end, chunk, qk_scale, stride_pb, stride_ps, stride_pr, stride_lb, stride_ls, DL: gl.constexpr,
                BN: gl.constexpr):
    """A tail program's tiles (the first 16 of the 64 query rows the producers loaded; the rest are zeros): per
    key tile ``Sᵀ = K Qᵀ`` (keys x rows: the keys are ``wgmma``'s M side, so 16 rows cost a quarter of a 64-row
    tile's matrix work, not all of it), the online softmax down the keys, pᵀ through shared memory,
    ``Oᵀ += Vᵀ pᵀ`` (channels x rows); then the partial, transposed back on its store."""
    BM: gl.constexpr = TAIL_M
    T_L: gl.constexpr = T_LAYOUT
    TO_L: gl.constexpr = TO_LAYOUT
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(0, T_L))
    l_part = gl.zeros([BN, BM], gl.float32, layout=T_L)     # each thread's share of the row sums (as _tile)
    acc = gl.zeros([DL, BM], gl.float32, layout=TO_L)
    n_tiles = gl.cdiv(end - start, BN)
    for i in range(n_tiles):
        buf = i % 2
        mbarrier.wait(ready.index(buf), (i // 2) & 1)
        fence_async_shared()
        kl = k_lat.index(buf)
        s = gl.zeros([BN, BM], gl.float32, layout=T_L)
        s = warpgroup_mma(kl, q_lat.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(k_rope.index(buf), q_rope.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        n0, e = _tile_at(i, start, end, chunk, BN)
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, T_L))
        s = gl.where((keys < e)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))          # every tile has >= 1 key: finite
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_part = l_part * alpha[None, :] + p
        pt_smem.store(gl.permute(p.to(kl.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()                            # pᵀ is in shared memory
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, TO_L))[None, :]
        acc = warpgroup_mma(kl.permute((1, 0)), pt_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()                            # both warp groups are done with slot buf and with pᵀ
        mbarrier.arrive(empty.index(buf), count=1)
        m_i = m_new
    l_i = gl.sum(l_part, 0)                            # every partition has >= 1 key: l_i > 0
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, TO_L))[None, :]
    d = gl.arange(0, DL, layout=gl.SliceLayout(1, TO_L))
    m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, TO_L))
    part = b.to(gl.int64) * stride_pb + split.to(gl.int64) * stride_ps
    gl.store(PartO + part + m[None, :] * stride_pr + d[:, None], out.to(PartO.dtype.element_ty),
             mask=(m < rows)[None, :])
    m_s = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, T_L))
    gl.store(PartLse + b.to(gl.int64) * stride_lb + split.to(gl.int64) * stride_ls + m_s, m_i + gl.log2(l_i),
             mask=m_s < rows)


@gluon.jit
def split_kernel_sm90_ws(
    Q, KBuf, QoIndptr, KvStart, KvLens, KvIdx, PartO, PartLse,
    qk_scale, nsplit, min_chunk, kv_start_mult,
    stride_qt, stride_qh, stride_kb,
    stride_pb, stride_ps, stride_pr, stride_lb, stride_ls,
    KExt, VExt, Mask, MaskIndptr, stride_ket, stride_vet, blocks, pre_blocks, nsplit_tail,
    H: gl.constexpr, DL: gl.constexpr, DR: gl.constexpr, KV_INDPTR: gl.constexpr, PDL: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, DRAFT: gl.constexpr, HAS_MASK: gl.constexpr,
    TAIL: gl.constexpr = 0,
):
    """``split_kernel_sm90`` with its copies in their own warps (``gl.warp_specialize``): LOAD_WARPS producer
    warps gather the query and key tiles into a two-slot ring, signalled by mbarriers, while the 8 compute warps
    run the tiles; same arguments, grid and output. ``DRAFT``: the grid has one more partition, ``nsplit``,
    whose programs attend the draft tree (one masked tile: ``q_len`` <= 64) into partition slot ``nsplit``
    instead of a prefix partition — what ``_draft_kernel`` does, without a launch of its own (the combine then
    only merges partials); they come last in launch order, and the grid is (``pre_blocks`` x ``nsplit`` +
    ``nsplit_tail`` + ``blocks``, 1, bs): the prefix programs of the first ``pre_blocks`` row blocks, (``TAIL``,
    with DRAFT: ``tail_pair``) the short last row block's ``nsplit_tail`` tail programs, which run its 16 rows
    on transposed tiles (``_tail_tiles``), then the draft programs of all ``blocks`` (``_program``)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 64
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b, split, q_start, rows, row0, kv_base, prefix, start, end, tail, chunk = _program(
        QoIndptr, KvStart, KvLens, nsplit, min_chunk, kv_start_mult, blocks, pre_blocks, nsplit_tail, H, KV_INDPTR,
        PDL, BM, BN, DRAFT, TAIL)
    d_len = 0
    if DRAFT:  # noqa: SIM102 (a constexpr branch)
        if split == nsplit and row0 < rows:
            d_len = rows // H
    if start >= end and d_len == 0:
        return

    dt: gl.constexpr = KBuf.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dt, [BM, DL], SH)
    q_rope = gl.allocate_shared_memory(dt, [BM, DR], SH)
    k_lat = gl.allocate_shared_memory(dt, [2, BN, DL], SH)
    k_rope = gl.allocate_shared_memory(dt, [2, BN, DR], SH)
    p_smem = gl.allocate_shared_memory(dt, [BM, BN], SH)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(ready.index(j), count=LOAD_WARPS * 32)
        mbarrier.init(empty.index(j), count=1)
    gl.warp_specialize([
        (_ws_compute,
         (q_lat, q_rope, k_lat, k_rope, p_smem, ready, empty, PartO, PartLse, Mask, MaskIndptr, rows, row0,
          b, split, prefix, start, end, chunk, d_len, tail, qk_scale, stride_pb, stride_ps, stride_pr, stride_lb,
          stride_ls, H, DL, BM, BN, DRAFT, HAS_MASK, TAIL)),
        (_ws_loader, (Q, KBuf, KvIdx, KExt, VExt, q_lat, q_rope, k_lat, k_rope, ready, empty, q_start, rows, row0,
                      kv_base, start, end, chunk, d_len, stride_qt, stride_qh, stride_kb, stride_ket, stride_vet, H,
                      DL, DR, BM, BN, LOAD_WARPS, DRAFT, TAIL)),
    ], [LOAD_WARPS], [LOAD_REGS])

