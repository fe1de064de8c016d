"""Target-verify problems shaped the way SGLang hands them to an attention backend, for tests and benchmarks.

A problem is a batch of requests, each with its own prefix length, ``q_len`` draft-tree tokens and ``H``
heads; the prefix lives in a paged MLA KV pool (page size 1 or 64) whose pages are handed out in a random
order (scattered, as a long-running server's allocator leaves them); the draft tokens' own KV is written at
the slots after each prefix, as SGLang does before it runs attention. The tree mask is SGLang's flattened
``custom_mask`` (``[q_len, prefix + q_len]`` per request, prefix columns all ones) with ``mask_indptr``.
"""

from __future__ import annotations

import torch

from kdtree_ext.mla_verify import D_LATENT, D_QK


def random_parents(q_len: int, gen: torch.Generator, tree: bool) -> list[int]:
    """Parent of each draft token (token 0 is the root): a random tree, or a chain."""
    if not tree:
        return [i - 1 for i in range(q_len)]
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[q, q] bool: row i sees i and its ancestors."""
    q = len(parents)
    rows = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        j = i
        while j >= 0:
            rows[i, j] = True
            j = parents[j]
    return rows


def make_problem(bs: int, heads: int, q_len: int, prefix_lens: list[int] | int, *, page_size: int = 1,
                 tree: bool = True, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0, mask: bool = True, mask_dtype: torch.dtype = torch.bool, q_scale: float = 1.0) -> dict:
    """A verify batch (the prefix as kv_indptr/kv_indices). ``mask=False`` drops the custom mask (a chain then,
    i.e. causal drafts). ``tree=False`` builds a chain mask."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    dgen = torch.Generator(device=device).manual_seed(seed)
    if isinstance(prefix_lens, int):
        prefix_lens = [prefix_lens] * bs
    assert len(prefix_lens) == bs
    spans = [p + q_len for p in prefix_lens]
    pages_per = [-(-n // page_size) for n in spans]
    n_pages = sum(pages_per) + max(2, sum(pages_per) // 4)         # spare pages: the pool is never exactly full
    order = torch.randperm(n_pages - 1, generator=gen) + 1          # page 0 unused (SGLang's padding slot)
    slots, used = [], 0
    for span, np_ in zip(spans, pages_per, strict=True):
        pages = order[used: used + np_]
        used += np_
        t = torch.arange(span)
        slots.append(pages[t // page_size] * page_size + t % page_size)
    n_slots = n_pages * page_size
    # the big tensors are drawn where they live (a GPU makes 64k-token pools in milliseconds)
    kv = torch.randn(n_slots, 1, D_QK, generator=dgen, device=device).to(dtype)
    qx = (torch.randn(bs * q_len, heads, D_QK, generator=dgen, device=device) * q_scale).to(dtype)
    prefix_slots = [s[:p] for s, p in zip(slots, prefix_lens, strict=True)]
    draft_slots = torch.cat([s[p:] for s, p in zip(slots, prefix_lens, strict=True)])
    k_ext = kv[draft_slots.to(device)].clone()
    v_ext = k_ext[..., :D_LATENT].contiguous()
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens), 0)
    kv_indices = torch.cat(prefix_slots).to(torch.int64) if bs else torch.zeros(0, dtype=torch.int64)
    qo_indptr = (torch.arange(bs + 1) * q_len).to(torch.int32)
    parents = [random_parents(q_len, gen, tree) for _ in range(bs)]
    custom_mask = mask_indptr = None
    if mask:
        parts = [torch.cat([torch.ones(q_len, p, dtype=torch.bool), ancestor_mask(par)], 1).flatten()
                 for p, par in zip(prefix_lens, parents, strict=True)]
        custom_mask = torch.cat(parts).to(mask_dtype)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(torch.tensor([q_len * (p + q_len) for p in prefix_lens]), 0)
    prob = dict(bs=bs, heads=heads, q_len=q_len, prefix_lens=list(prefix_lens), page_size=page_size, tree=tree,
                parents=parents, q=qx, k_ext=k_ext, v_ext=v_ext, kv_buffer=kv, qo_indptr=qo_indptr,
                kv_indptr=kv_indptr, kv_indices=kv_indices, custom_mask=custom_mask, mask_indptr=mask_indptr,
                draft_slots=draft_slots)
    for key, val in list(prob.items()):
        if isinstance(val, torch.Tensor):
            prob[key] = val.to(device)
    return prob


def run_kernel(prob: dict, sm_scale: float, nsplit: int, config=None, workspace=None, out=None) -> torch.Tensor:
    from kdtree_ext.mla_verify import mla_tree_verify

    o = out if out is not None else torch.empty(prob["q"].shape[0], prob["heads"], D_LATENT,
                                                dtype=prob["q"].dtype, device=prob["q"].device)
    return mla_tree_verify(prob["q"], prob["k_ext"], prob["v_ext"], o, prob["kv_buffer"], prob["qo_indptr"],
                           prob["kv_indptr"], prob["kv_indices"], prob["custom_mask"], prob["mask_indptr"],
                           prob["q_len"], sm_scale, nsplit, workspace, config=config)


def run_reference(prob: dict, sm_scale: float) -> torch.Tensor:
    from kdtree_ext.mla_verify import reference_tree_verify

    return reference_tree_verify(prob["q"], prob["k_ext"], prob["v_ext"], prob["kv_buffer"], prob["qo_indptr"],
                                 prob["kv_indptr"], prob["kv_indices"], prob["custom_mask"], prob["mask_indptr"],
                                 sm_scale)


def unique_kv_bytes(prob: dict) -> int:
    """KV bytes a verify pass must read at least once: every prefix row plus the draft rows."""
    elem = prob["kv_buffer"].element_size()
    return (sum(prob["prefix_lens"]) + prob["bs"] * prob["q_len"]) * D_QK * elem
