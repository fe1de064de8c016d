"""What the kdtree verify kernels share: MLA sizes and the batch's work schedule (scalar ``triton.jit`` helpers,
called by the Triton kernels of ``mla_verify`` and by the Gluon split kernel of ``mla_verify_sm90`` alike).

The schedule splits the batch's prefix keys, not each request's, into equal partitions. The prefixes of the
``bs`` requests, one after another, are ``total = kv_indptr[bs] - kv_indptr[0]`` keys; ``columns`` (a static
count from the launch's grid) partitions of ``chunk`` keys cover them, ``chunk = max(roundup(cdiv(total,
columns), BLOCK_N), min_chunk)``. Column ``p`` covers keys ``[p * chunk, (p + 1) * chunk)``: the end of one
request and the start of the next, or a part of one long one. Its piece of request ``b`` (a segment) writes its
partial output into slot ``p + b``: along the keys, each new segment starts a new column or a new request (or
both), so ``p + b`` grows by one or two from one segment to the next and no two segments share a slot. Request
``b``'s segments are then the consecutive slots ``first .. first + n - 1`` with ``first = kv_indptr[b] // chunk
+ b`` (positions relative to ``kv_indptr[0]``): the combine finds them without a search. Everything is read from
``kv_indptr`` on the device: no host sync, and a CUDA graph replays with new lengths.
"""

from __future__ import annotations

import triton
import triton.language as tl

D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE
LOG2E = 1.4426950408889634


@triton.jit
def batch_chunk(KvIndptr, bs, columns, min_chunk, BLOCK_N: tl.constexpr):
    """(keys per column, ``kv_indptr[0]``): the batch's prefix keys over ``columns`` equal partitions."""
    base0 = tl.load(KvIndptr)
    total = tl.load(KvIndptr + bs) - base0
    per = tl.cdiv(tl.cdiv(total, columns), BLOCK_N) * BLOCK_N
    return tl.maximum(per, min_chunk), base0


@triton.jit
def segment(KvIndptr, b, p, chunk, base0):
    """Request ``b``'s piece of column ``p``: (its first cache-index position, keys [start, end) of its prefix;
    start >= end: none)."""
    st = tl.load(KvIndptr + b)
    en = tl.load(KvIndptr + b + 1)
    lo = tl.maximum(p * chunk, st - base0)
    hi = tl.minimum((p + 1) * chunk, en - base0)
    first = st - base0
    return st.to(tl.int64), lo - first, hi - first


@triton.jit
def request_slots(KvIndptr, b, chunk, base0):
    """Request ``b``'s partials: (first slot, how many, its prefix length)."""
    st = tl.load(KvIndptr + b) - base0
    en = tl.load(KvIndptr + b + 1) - base0
    first = st // chunk
    n = tl.where(en > st, (en - 1) // chunk - first + 1, 0)
    return first + b, n, en - st


@triton.jit
def column_requests(KvIndptr, bs, p, chunk, base0, BS: tl.constexpr):
    """The requests column ``p`` touches: [lo, hi) (the Triton kernel's; the Gluon one has its own with a layout)."""
    offs = tl.arange(0, BS)
    ok = offs < bs
    st = tl.load(KvIndptr + offs, mask=ok, other=0) - base0
    en = tl.load(KvIndptr + 1 + offs, mask=ok, other=0) - base0
    lo = tl.sum((ok & (en <= p * chunk)).to(tl.int32), 0)
    hi = tl.sum((ok & (st < (p + 1) * chunk)).to(tl.int32), 0)
    return lo, hi


def bs_block(bs: int) -> int:
    """The vector width that holds ``bs`` requests' kv_indptr entries (a power of two; 1 for one request, which
    the Gluon kernels read without a search)."""
    return triton.next_power_of_2(bs)
