"""The kdtree verify kernel on a CUDA GPU (skipped without torch + CUDA, i.e. always in CI and in `make test` on
a CPU machine): bf16 at full sizes (contexts up to 64k, NSPLIT up to 128, random trees, both page-table
layouts, page size 1 and 64), CUDA-graph capture + replay (identical output, new inputs through the same
graph), and on chain drafts the same answer as SGLang 0.5.23's ``verify_mla`` and ``extend_attention_fwd``
(loaded from the sglang wheel: set KDTREE_SGLANG_WHEEL, else those tests skip).

On the GPU machine (no kdeploy dependencies there), run it without the repo's top-level conftest:
``python3 -m pytest -q --confcutdir=tests/kernels tests/kernels/test_mla_verify_gpu.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

PAYLOAD = Path(__file__).resolve().parents[2] / "kernels" / "kdtree"
if str(PAYLOAD) not in sys.path:
    sys.path.insert(0, str(PAYLOAD))

from kdtree_ext import mla_verify as mv  # noqa: E402
from kdtree_ext.verify_problems import make_problem, run_kernel, run_reference  # noqa: E402

SCALE = mv.default_sm_scale()
DEV = "cuda"


def check(out, ref, *, rel=1e-2, peak=3e-2):
    """bf16 inputs and output, fp32 accumulation: |o - ref| / |ref| (norm) under rel, and no element off by
    more than `peak` of the largest reference value; every element written (outputs are poisoned first)."""
    out = out.float()
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    rel_err = ((out - ref).norm() / ref.norm()).item()
    assert rel_err < rel and err <= peak * ref.abs().max().item(), (rel_err, err, ref.abs().max().item())
    return err, rel_err


def poisoned(prob):
    return torch.full((prob["q"].shape[0], prob["heads"], mv.D_LATENT), float("nan"), dtype=prob["q"].dtype,
                      device=DEV)


FULL = [
    # bs, H, Q, prefix lens, page, nsplit, layout, tree, q_scale (nsplit 128 with max_ctas=0: all 128 partitions)
    (1, 8, 16, [65536], 1, 64, "indptr", True, 1.0),
    (8, 16, 16, [65536] * 8, 64, 128, "req_to_token", True, 1.0),
    (2, 8, 16, [65536, 40000], 1, 128, "indptr", True, 2.0),
    (8, 8, 9, [16384] * 8, 1, 1, "indptr", False, 1.0),
    (4, 16, 16, [0, 100, 30000, 65536], 64, 64, "indptr", True, 4.0),
    (2, 8, 16, [4096, 4095], 64, 16, "req_to_token", True, 1.0),
    (1, 16, 1, [32768], 1, 128, "indptr", True, 1.0),
    (1, 16, 9, [65536], 1, 64, "indptr", False, 1.0),     # one wave: 43 partitions + the draft programs
    (1, 8, 9, [4096], 1, 64, "indptr", False, 1.0),       # one wave: 64 partitions of wave_min_chunk=64 tokens
    (3, 8, 64, [5000, 1, 12000], 1, 32, "indptr", True, 2.0),
    (6, 16, 16, [3, 0, 17, 64, 63, 200], 64, 8, "indptr", True, 3.0),   # the draft tree dominates
]


@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "nsplit", "layout", "tree", "q_scale"), FULL)
def test_full_sizes_match_the_fp32_reference(bs, heads, q_len, prefixes, page, nsplit, layout, tree, q_scale):
    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len, layout=layout, q_scale=q_scale)
    config = mv.with_config(mv.GPU_CONFIG, max_ctas=0) if nsplit == 128 else None
    if config is not None:
        assert mv.effective_nsplit(nsplit, bs, q_len * heads, config) == 128
    out = run_kernel(prob, SCALE, nsplit, config=config, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))


def test_float16_and_no_mask_chain():
    prob = make_problem(2, 16, 9, [20000, 777], page_size=64, tree=False, mask=False, dtype=torch.float16,
                        device=DEV, seed=5)
    check(run_kernel(prob, SCALE, 64, out=poisoned(prob)), run_reference(prob, SCALE))


@pytest.mark.parametrize("overrides", [{}, {"pdl": True}, {"pdl": False, "wave_sms": 0},
                                       {"sm90": False}, {"sm90_ws": False}, {"combine_rows": 1},
                                       {"combine_rows": 0}, {"combine_rows": 0, "pdl": False},
                                       {"draft_rows": 1, "combine_rows": 0, "split_draft": False},
                                       {"draft_rows": 1, "combine_rows": 0, "split_draft": False, "pdl": False},
                                       {"split_draft_rows": True}, {"split_draft_rows": True, "pdl": False},
                                       {"split_draft_rows": False, "draft_kernel_rows": True},
                                       {"tail_pair": 2, "heads": 8, "q_len": 9},
                                       {"tail_pair": 2, "heads": 16, "q_len": 9, "pdl": False},
                                       {"tail_pair": 2, "heads": 8, "q_len": 9, "sm90": False}])
def test_cuda_graph_capture_and_replay_give_identical_output(overrides):
    overrides = dict(overrides)
    bs, heads, q_len, max_ctx, nsplit = 4, overrides.pop("heads", 16), overrides.pop("q_len", 16), 65536, 64
    config = mv.with_config(mv.default_config(DEV), **overrides)
    first = make_problem(bs, heads, q_len, [max_ctx, 1000, 0, 30000], page_size=64, dtype=torch.bfloat16,
                         device=DEV, seed=1, mask_dtype=torch.uint8)
    second = make_problem(bs, heads, q_len, [7, max_ctx, 20000, 1], page_size=1, dtype=torch.bfloat16,
                          device=DEV, seed=2, mask_dtype=torch.uint8)
    # static buffers sized for the maxima, as SGLang's graph runner keeps them
    static = {}
    for key in ("q", "k_ext", "v_ext", "qo_indptr", "kv_indptr"):
        static[key] = first[key].clone()
    static["kv_buffer"] = torch.cat([first["kv_buffer"], second["kv_buffer"]])   # one pool for both
    offset = first["kv_buffer"].shape[0]
    cap = bs * max_ctx
    static["kv_indices"] = torch.zeros(cap, dtype=torch.int64, device=DEV)
    static["custom_mask"] = torch.zeros(bs * q_len * (max_ctx + q_len), dtype=torch.uint8, device=DEV)
    static["mask_indptr"] = torch.zeros(bs + 1, dtype=torch.int64, device=DEV)

    def load(prob, shift):
        for key in ("q", "k_ext", "v_ext", "qo_indptr", "kv_indptr", "mask_indptr"):
            static[key].copy_(prob[key])
        n = prob["kv_indices"].numel()
        static["kv_indices"][:n].copy_(prob["kv_indices"] + shift)
        static["custom_mask"][: prob["custom_mask"].numel()].copy_(prob["custom_mask"])

    def view(prob, shift):
        v = dict(prob, kv_buffer=static["kv_buffer"], kv_indices=prob["kv_indices"] + shift)
        return v

    ws = mv.Workspace.for_batches(bs, q_len * heads, nsplit, config, DEV)
    out = torch.full((bs * q_len, heads, mv.D_LATENT), float("nan"), dtype=torch.bfloat16, device=DEV)

    def launch():
        mv.mla_tree_verify(static["q"], static["k_ext"], static["v_ext"], out, static["kv_buffer"],
                           static["qo_indptr"], static["kv_indptr"], static["kv_indices"], static["custom_mask"],
                           static["mask_indptr"], q_len, SCALE, nsplit, ws, config=config)

    load(first, 0)
    launch()
    eager_first = out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()                                     # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()                                     # fails on any host sync; must not allocate
    out.fill_(float("nan"))
    before = torch.cuda.memory_allocated()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(out, eager_first)
    check(out, run_reference(view(first, 0), SCALE))

    # new contents (other prefix lengths, page size, tree) through the same graph
    load(second, offset)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    launch()
    assert torch.equal(replayed, out)
    check(replayed, run_reference(view(second, offset), SCALE))


def _sglang():
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sglang_kernels

        return sglang_kernels.load()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(("bs", "heads", "q_len", "ctx"), [(1, 8, 9, 16384), (8, 16, 9, 4096), (2, 16, 16, 32768)])
def test_chain_drafts_match_sglang_verify_mla_and_extend_attention(bs, heads, q_len, ctx):
    extend_attention_fwd, verify_shared_kv_fwd = _sglang()
    prob = make_problem(bs, heads, q_len, ctx, page_size=1, tree=False, mask=True, dtype=torch.bfloat16,
                        device=DEV, seed=ctx + bs, mask_dtype=torch.uint8)
    ref = run_reference(prob, SCALE)
    ours_masked = run_kernel(prob, SCALE, 64, out=poisoned(prob))
    causal = dict(prob, custom_mask=None, mask_indptr=None)
    ours_causal = run_kernel(causal, SCALE, 64, out=poisoned(prob))
    kbuf = prob["kv_buffer"]
    args = (prob["q"], prob["k_ext"], prob["v_ext"].view(-1, 1, mv.D_LATENT))
    tail = (kbuf, kbuf[..., : mv.D_LATENT], prob["qo_indptr"], prob["kv_indptr"], prob["kv_indices"])
    o_vm = poisoned(prob)
    ran = verify_shared_kv_fwd(*args, o_vm, *tail, None, True, None, q_len, 1.0, 1.0, sm_scale=SCALE)
    assert ran is not False
    o_ext = poisoned(prob)
    extend_attention_fwd(*args, o_ext, *tail, None, True, None, q_len, 1.0, 1.0, sm_scale=SCALE)
    o_extm = poisoned(prob)
    extend_attention_fwd(*args, o_extm, *tail, prob["custom_mask"], False, prob["mask_indptr"], q_len, 1.0, 1.0,
                         sm_scale=SCALE)
    for o in (ours_masked, ours_causal, o_vm, o_ext, o_extm):
        check(o, ref)
    scale = ref.abs().max().item()
    for theirs in (o_vm, o_ext, o_extm):
        assert (ours_masked.float() - theirs.float()).abs().max().item() <= 3e-2 * scale
    assert torch.equal(ours_masked, ours_causal)     # a chain mask and no mask (causal) agree exactly


def test_tree_matches_sglang_extend_attention():
    extend_attention_fwd, _ = _sglang()
    q_len, heads = 16, 16
    prob = make_problem(2, heads, q_len, [8192, 300], page_size=64, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=9, mask_dtype=torch.uint8, q_scale=3.0)
    ref = run_reference(prob, SCALE)
    ours = run_kernel(prob, SCALE, 64, out=poisoned(prob))
    kbuf = prob["kv_buffer"]
    o_ext = poisoned(prob)
    extend_attention_fwd(prob["q"], prob["k_ext"], prob["v_ext"].view(-1, 1, mv.D_LATENT), o_ext, kbuf,
                         kbuf[..., : mv.D_LATENT], prob["qo_indptr"], prob["kv_indptr"], prob["kv_indices"],
                         prob["custom_mask"], False, prob["mask_indptr"], q_len, 1.0, 1.0, sm_scale=SCALE)
    check(ours, ref)
    check(o_ext, ref)
    assert (ours.float() - o_ext.float()).abs().max().item() <= 3e-2 * ref.abs().max().item()


SM90 = [c for c in FULL if c[5] != 128] + [(3, 8, 9, [40000, 9, 3000], 1, 64, "req_to_token", True, 2.0),
                                         (2, 16, 9, [65536, 700], 64, 64, "indptr", False, 1.0)]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon split kernel is sm_90 only")
@pytest.mark.parametrize("ws", [False, True])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "nsplit", "layout", "tree", "q_scale"), SM90)
def test_sm90_gluon_split_kernel_matches_the_fp32_reference(bs, heads, q_len, prefixes, page, nsplit, layout, tree,
                                                            q_scale, ws):
    """Both Gluon kernels (ws: the warp-specialised one), asserted to be the kernel dispatched."""
    from kdtree_ext import mla_verify_sm90

    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len + 7, layout=layout, q_scale=q_scale)
    config = mv.with_config(mv.GPU_CONFIG, sm90=True, sm90_ws=ws)
    want = mla_verify_sm90.split_kernel_sm90_ws if ws else mla_verify_sm90.split_kernel_sm90
    assert mv._sm90_split_kernel(config, prob["q"], prob["kv_buffer"]) is want
    out = run_kernel(prob, SCALE, nsplit, config=config, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))


@pytest.mark.parametrize("overrides", [dict(tail_m=16, sm90=False), dict(tail_m=16, sm90=False, num_stages=3)])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes"), [(3, 8, 9, [40000, 9, 3000]), (2, 16, 9, [65536, 700])])
def test_short_tail_tiles(overrides, bs, heads, q_len, prefixes):
    """72 rows = 64 + an 8-row tail, 144 = 128 + 16: the last row block on a short tile (tail_m)."""
    config = mv.with_config(mv.GPU_CONFIG, **overrides)
    assert mv.launch_tail_m(q_len * heads, config) == 16
    prob = make_problem(bs, heads, q_len, prefixes, page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=bs + heads, mask_dtype=torch.uint8, q_scale=2.0)
    check(run_kernel(prob, SCALE, 64, config=config, out=poisoned(prob)), run_reference(prob, SCALE))


@pytest.mark.skipif(not os.environ.get("KDTREE_GPU_ALL_CONFIGS"), reason="set KDTREE_GPU_ALL_CONFIGS=1")
@pytest.mark.parametrize("config", [dict(block_m=64, block_n=32, num_warps=8, num_stages=2),
                                    dict(block_m=64, block_n=32, num_warps=8, num_stages=3),
                                    dict(block_m=64, block_n=16, num_warps=8, num_stages=4),
                                    dict(block_m=16, block_n=32, num_warps=4, num_stages=2),
                                    dict(partial_dtype="bfloat16"),
                                    dict(dv_split=2, block_m=64, block_n=64, num_warps=4, num_stages=2),
                                    dict(dv_split=2, block_m=64, block_n=32, num_warps=4, num_stages=3),
                                    dict(dv_split=2, block_m=128, block_n=32, num_warps=8, num_stages=2),
                                    dict(dv_split=2, block_m=64, block_n=32, num_warps=4, num_stages=4),
                                    dict(pdl=True), dict(wave_sms=0), dict(combine_wide_rows=0),
                                    dict(combine_wide_rows=1, wave_min_chunk=0), dict(num_stages=3)])
def test_other_tile_configs(config):
    """The Triton split kernel's other tiles and launch rules (sm90 off: on a Hopper GPU the default is Gluon's)."""
    prob = make_problem(3, 16, 16, [40000, 9, 3000], page_size=64, dtype=torch.bfloat16, device=DEV, seed=11)
    config = mv.with_config(mv.GPU_CONFIG, **{"sm90": False, **config})
    out = run_kernel(prob, SCALE, 64, config=config, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))


@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "nsplit", "layout", "tree", "q_scale"),
                         [c for c in FULL if c[5] != 128] + [(8, 16, 9, [4096] * 8, 1, 64, "indptr", False, 1.0)])
def test_row_block_combine(bs, heads, q_len, prefixes, page, nsplit, layout, tree, q_scale):
    """combine_rows: 16 rows per combine program, the draft tree on the tensor cores (every launch here; with
    split_draft_rows the split kernel attends it instead: test_draft_kernel)."""
    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len + 11, layout=layout, q_scale=q_scale)
    config = mv.with_config(mv.GPU_CONFIG, combine_rows=1, split_draft_rows=False)
    out = run_kernel(prob, SCALE, nsplit, config=config, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))


class _NotLaunched:
    """Stands in for a kernel that must not run: ``kernel[grid](...)`` fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("launched")


@pytest.mark.parametrize(("split", "pdl", "row_block"), [(False, True, False), (False, False, False),
                                                         (True, True, False), (True, False, False),
                                                         (True, True, True), (True, False, True),
                                                         (False, True, True), (False, False, True)])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "nsplit", "layout", "tree", "q_scale"),
                         [c for c in FULL if c[5] != 128] + [(1, 16, 16, [65536], 1, 64, "indptr", True, 3.0),
                                                              (8, 16, 9, [4096] * 8, 1, 64, "indptr", False, 1.0)])
def test_draft_kernel(bs, heads, q_len, prefixes, page, nsplit, layout, tree, q_scale, split, pdl, row_block,
                      monkeypatch):
    """The draft tree's partial in slot ns (asserted written: the workspace is poisoned first), the combine
    merging only partials (every launch here): from its own kernel (draft_rows), or (split_draft) from the
    warp-specialised split kernel's programs of partition ns, with _draft_kernel asserted not launched; the
    per-row combine, or (row_block: split_draft_rows / draft_kernel_rows) the row-block combine, the split
    kernel's draft programs last in launch order."""
    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len + 13, layout=layout, q_scale=q_scale)
    rows = q_len * heads
    config = mv.with_config(mv.GPU_CONFIG, draft_rows=0 if split else 1, combine_rows=int(row_block), pdl=pdl,
                            split_draft=split and not row_block, split_draft_rows=split and row_block,
                            draft_kernel_rows=row_block and not split)
    if split:
        if mv._sm90_split_kernel(config, prob["q"], prob["kv_buffer"]) is None:
            pytest.skip("split_draft runs in the sm_90 Gluon kernel")
        monkeypatch.setattr(mv, "_draft_kernel", _NotLaunched())
    assert mv.draft_slots(bs, rows, config) == 1
    ns = mv.effective_nsplit(nsplit, bs, rows, config)
    ws = mv.Workspace.for_batches(bs, rows, nsplit, config, DEV)
    ws.part_lse.fill_(12345.0)
    out = run_kernel(prob, SCALE, nsplit, config=config, workspace=ws, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))
    draft_lse = ws.views(bs, ns + 1)[1][:, ns, :rows]
    assert (draft_lse != 12345.0).all() and torch.isfinite(draft_lse).all()


@pytest.mark.parametrize(("rows", "ns_want"), [(256, 32), (144, 43), (72, 64)])
def test_default_config_attends_the_draft_tree_in_the_split_kernel(rows, ns_want, monkeypatch):
    """GPU_CONFIG: per-row-combine launches keep a draft slot (row-block-combine launches with split_draft_rows),
    one partition fewer where the draft programs would otherwise take a second wave; on Hopper the split
    kernel's draft programs write it (_draft_kernel not launched)."""
    cfg = mv.GPU_CONFIG
    on_rows = int(cfg.split_draft_rows)
    assert [mv.draft_slots(bs, r, cfg) for bs, r in [(1, 256), (1, 144), (1, 72), (2, 256), (8, 72)]] == [
        1, 1, 1, on_rows, on_rows]
    heads = 16 if rows != 72 else 8
    prob = make_problem(1, heads, rows // heads, [30000], page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=77)
    if mv._sm90_split_kernel(cfg, prob["q"], prob["kv_buffer"]) is not None:
        monkeypatch.setattr(mv, "_draft_kernel", _NotLaunched())
    ns = mv.effective_nsplit(64, 1, rows, cfg)
    if mv._sms_now() == 132:
        assert ns == ns_want
    ws = mv.Workspace.for_batches(1, rows, 64, cfg, DEV)
    ws.part_lse.fill_(12345.0)
    check(run_kernel(prob, SCALE, 64, workspace=ws, out=poisoned(prob)), run_reference(prob, SCALE))
    assert (ws.views(1, ns + 1)[1][0, ns, :rows] != 12345.0).all()


class _Counted:
    """Wraps a kernel: counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(("tail_pair", "pdl", "sm90"), [(2, True, True), (2, False, True), (1, True, True),
                                                        (2, True, False)])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "layout", "tree", "q_scale"), [
    (1, 8, 9, [65536], 1, "indptr", True, 1.0),
    (1, 8, 9, [4096], 1, "indptr", False, 1.0),
    (1, 16, 9, [65536], 1, "indptr", True, 2.0),
    (1, 8, 9, [100], 64, "req_to_token", True, 1.0),
    (3, 8, 9, [40000, 9, 3000], 1, "req_to_token", True, 2.0),
    (2, 16, 9, [65536, 0], 64, "indptr", False, 1.0),
    (2, 8, 10, [30000, 20000], 1, "indptr", True, 4.0),      # 80 rows = 64 + 16
])
def test_tail_pair(bs, heads, q_len, prefixes, page, layout, tree, q_scale, tail_pair, pdl, sm90, monkeypatch):
    """tail_pair: the short last row block (72 = 64 + 8, 144 = 128 + 16, 80 = 64 + 16 rows) on partitions of
    tail_pair prefix partitions' keys each (every partition the tail rows should have written, no more): the
    warp-specialised Gluon split kernel's tail programs on transposed tiles (its draft programs write the draft
    slot; _draft_kernel and _tail_kernel not launched), or _tail_kernel (asserted launched once) beside the Triton
    split kernel (sm90 off); the per-row combine merges each row's own partition count."""
    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len + heads, layout=layout, q_scale=q_scale, mask_dtype=torch.uint8)
    rows = q_len * heads
    config = mv.with_config(mv.GPU_CONFIG, tail_pair=tail_pair, pdl=pdl, sm90=sm90)
    gluon = mv._sm90_split_kernel(config, prob["q"], prob["kv_buffer"]) is not None
    if sm90 and not gluon:
        pytest.skip("the warp-specialised Gluon kernel is sm_90 only")
    if gluon:                                      # the split kernel's tail programs, not _tail_kernel
        monkeypatch.setattr(mv, "_draft_kernel", _NotLaunched())
        monkeypatch.setattr(mv, "_tail_kernel", _NotLaunched())
    else:
        tail = _Counted(mv._tail_kernel)
        monkeypatch.setattr(mv, "_tail_kernel", tail)
    assert mv._tail_split(bs, rows, config)
    ns, ns_tail = mv.tail_splits(64, bs, rows, config, True)
    assert ns == mv.effective_nsplit(64, bs, rows, config) and ns_tail == -(-ns // tail_pair)
    assert bs * ((rows // 64) * ns + ns_tail + rows // 64 + 1) <= mv._sms_now()   # one wave, draft programs too
    if mv._sms_now() == 132 and (bs, heads, q_len, tail_pair) == (1, 8, 9, 2):
        assert (ns, ns_tail) == (85, 43)
    ws = mv.Workspace.for_batches(bs, rows, 64, config, DEV)
    ws.part_lse.fill_(12345.0)
    out = run_kernel(prob, SCALE, 64, config=config, workspace=ws, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))
    assert gluon or tail.launches == 1
    lse = ws.views(bs, ns + 1)[1]
    tail_row0 = rows - rows % 64
    chunk = mv.launch_min_chunk(ns, bs, rows, config, ns_tail)
    for b, pre in enumerate(prefixes):
        per = max(mv._cdiv(mv._cdiv(pre, ns), 64) * 64, chunk) * tail_pair if pre else 1
        want = -(-pre // per) if pre else 0
        assert int((lse[b, :ns, tail_row0] != 12345.0).sum()) == want
        assert int((lse[b, :ns, tail_row0:rows] != 12345.0).sum()) == want * (rows - tail_row0)
    if gluon:
        assert (lse[:, ns, :rows] != 12345.0).all()
