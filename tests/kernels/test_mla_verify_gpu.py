"""The kdtree verify kernel on a CUDA GPU (skipped without torch + CUDA, i.e. always in CI and in `make test` on
a CPU machine): bf16 at full sizes (contexts up to 128k, random trees, page size 1 and 64) against the fp32
reference; ragged batches (prefixes of 0 and 1 beside 128k ones, more requests than multiprocessors) against
the reference and SGLang 0.5.23's ``extend_attention_fwd`` (loaded from the sglang wheel: set
KDTREE_SGLANG_WHEEL, else the SGLang comparisons skip); CUDA-graph capture + replay with other lengths than at
capture; the Hopper (Gluon) and portable (Triton) split kernels, both combines.

On the GPU machine (no kdeploy dependencies there), run it without the repo's top-level conftest:
``python3 -m pytest -q --confcutdir=tests/kernels tests/kernels/test_mla_verify_gpu.py``.
"""

from __future__ import annotations

import math
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
    # bs, H, Q, prefix lens, page, nsplit, tree, q_scale
    (1, 8, 16, [65536], 1, 64, True, 1.0),
    (8, 16, 16, [65536] * 8, 64, 64, True, 1.0),
    (8, 8, 9, [16384] * 8, 1, 1, False, 1.0),
    (4, 16, 16, [0, 100, 30000, 65536], 64, 64, True, 4.0),
    (1, 16, 1, [32768], 1, 128, True, 1.0),
    (1, 16, 9, [65536], 1, 64, False, 1.0),
    (1, 8, 9, [4096], 1, 64, False, 1.0),
    (3, 8, 64, [5000, 1, 12000], 1, 32, True, 2.0),
    (6, 16, 16, [3, 0, 17, 64, 63, 200], 64, 8, True, 3.0),   # the draft tree dominates
    (2, 8, 80, [3000, 70], 1, 16, True, 1.0),                  # Q > 64: no draft kernel, the combine attends the tree
]

# the ragged batches, and more: (H, Q, prefix lens)
RAGGED = [
    (16, 9, [65536, 1, 4096, 17, 32768, 63, 64, 129]),
    (8, 9, [65536] + [1024] * 7),
    (8, 16, [131072, 512, 512, 512]),
    (8, 9, [131072, 0, 1, 131072, 1, 0]),                      # prefixes of 0 and 1 beside 128k ones
]


def many_requests(n: int, seed: int) -> list[int]:
    """``n`` prefixes, log-uniform 1..32k, with a 0, a 1 and a 128k among them."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.rand(n, generator=gen) * math.log(32768)).long().tolist()
    lens[:3] = [0, 1, 131072]
    return lens


def both_kernels(prob):
    """Configs to run: the default (the Gluon split kernel on Hopper) and the portable Triton split kernel."""
    return [mv.GPU_CONFIG, mv.with_config(mv.GPU_CONFIG, sm90=False)]


@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes", "page", "nsplit", "tree", "q_scale"), FULL)
def test_full_sizes_match_the_fp32_reference(bs, heads, q_len, prefixes, page, nsplit, tree, q_scale):
    prob = make_problem(bs, heads, q_len, prefixes, page_size=page, tree=tree, dtype=torch.bfloat16, device=DEV,
                        seed=bs * 100 + q_len, q_scale=q_scale)
    ref = run_reference(prob, SCALE)
    for config in both_kernels(prob):
        check(run_kernel(prob, SCALE, nsplit, config=config, out=poisoned(prob)), ref)


def test_float16_and_no_mask_chain():
    prob = make_problem(2, 16, 9, [20000, 777], page_size=64, tree=False, mask=False, dtype=torch.float16,
                        device=DEV, seed=5)
    check(run_kernel(prob, SCALE, 64, out=poisoned(prob)), run_reference(prob, SCALE))


def _sglang():
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sglang_kernels

        return sglang_kernels.load()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def sglang_extend(prob):
    """SGLang 0.5.23's extend_attention_fwd on the same problem (tree mask, or causal without one)."""
    extend_attention_fwd, _ = _sglang()
    kbuf = prob["kv_buffer"]
    o = poisoned(prob)
    mask = prob["custom_mask"]
    extend_attention_fwd(prob["q"], prob["k_ext"], prob["v_ext"].view(-1, 1, mv.D_LATENT), o, kbuf,
                         kbuf[..., : mv.D_LATENT], prob["qo_indptr"], prob["kv_indptr"], prob["kv_indices"], mask,
                         mask is None, prob["mask_indptr"], prob["q_len"], 1.0, 1.0, sm_scale=SCALE)
    return o


def check_with_sglang(prob, outs):
    """Each output matches the fp32 reference, and SGLang's kernel on the same inputs as closely."""
    ref = run_reference(prob, SCALE)
    theirs = sglang_extend(prob)
    check(theirs, ref)
    scale = ref.abs().max().item()
    for out in outs:
        check(out, ref)
        assert (out.float() - theirs.float()).abs().max().item() <= 3e-2 * scale


@pytest.mark.parametrize(("heads", "q_len", "prefixes"), RAGGED)
def test_ragged_batches_match_the_reference_and_sglang(heads, q_len, prefixes):
    prob = make_problem(len(prefixes), heads, q_len, prefixes, page_size=1, tree=q_len == 16, dtype=torch.bfloat16,
                        device=DEV, seed=len(prefixes) + heads, q_scale=2.0, mask_dtype=torch.uint8)
    outs = [run_kernel(prob, SCALE, 64, config=c, out=poisoned(prob)) for c in both_kernels(prob)]
    check_with_sglang(prob, outs)


def test_more_requests_than_multiprocessors():
    """160 requests (the H200 has 132 multiprocessors): columns hold many requests each; tree drafts, H=8 Q=4."""
    prefixes = many_requests(160, 3)
    prob = make_problem(len(prefixes), 8, 4, prefixes, page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=160, mask_dtype=torch.uint8)
    plan = mv.plan(len(prefixes), 32, 64, mv.GPU_CONFIG, 64, True)
    assert plan.columns < len(prefixes)
    assert plan.columns * plan.blocks <= mv._sms_now() - mv.GPU_CONFIG.draft_sms   # SMs left to the draft kernel
    outs = [run_kernel(prob, SCALE, 64, config=c, out=poisoned(prob)) for c in both_kernels(prob)]
    check_with_sglang(prob, outs)


@pytest.mark.parametrize("overrides", [{}, {"pdl": False}, {"combine_rows": 1}, {"sm90": False},
                                       {"draft_block_d": 256, "draft_sms": 0}])
def test_draft_kernel_writes_its_slot(overrides):
    """The default config attends the draft tree in _draft_kernel (slot draft_slot0 + b; the workspace is poisoned
    first); the combine then only merges partials."""
    bs, heads, q_len = 3, 16, 16
    config = mv.with_config(mv.GPU_CONFIG, **overrides)
    prob = make_problem(bs, heads, q_len, [30000, 0, 5], page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=77)
    rows = q_len * heads
    block_m = 64 if mv._sm90_kernel(config, prob["q"], prob["kv_buffer"]) is not None else config.block_m
    plan = mv.plan(bs, rows, 64, config, block_m, True)
    ws = mv.Workspace.for_batches(bs, rows, 64, config, DEV)
    ws.part_lse.fill_(12345.0)
    check(run_kernel(prob, SCALE, 64, config=config, workspace=ws, out=poisoned(prob)), run_reference(prob, SCALE))
    draft = ws.part_lse[plan.draft_slot0: plan.draft_slot0 + bs, :rows]
    assert (draft != 12345.0).all() and torch.isfinite(draft).all()


GRAPH = [
    # overrides, H, Q, capture lens, replay lens
    ({}, 16, 16, [65536, 1000, 0, 30000], [7, 65536, 20000, 1]),
    ({}, 8, 9, [131072, 1, 0, 4096], [0, 0, 1, 1]),                 # ragged at capture, nearly empty at replay
    ({}, 8, 9, [1, 1, 1, 1], [131072, 512, 512, 131072]),
    ({"pdl": False}, 16, 9, [65536, 100, 0, 30000], [100, 100, 100, 100]),
    ({"sm90": False}, 16, 16, [65536, 1000, 0, 30000], [7, 131072, 20000, 1]),
    ({"combine_rows": 1}, 8, 9, [65536, 1000, 0, 30000], [3000, 0, 131072, 17]),
    ({"combine_rows": 0, "combine_wide_rows": 0}, 8, 9, [4096] * 4, [131072, 1, 1, 1]),
    ({}, 16, 9, [65536, 100, 0, 30000], [7, 131072, 20000, 1]),      # 144 rows: the tail launch
    ({"tail_cost": 0}, 16, 9, [65536, 100, 0, 30000], [7, 131072, 20000, 1]),
    ({}, 16, 9, [65536], [100]),                                        # one request: its tail in the split grid
    ({}, 8, 16, [1000], [131072]),
    ({"sm90": False}, 16, 9, [65536], [100]),
]


@pytest.mark.parametrize(("overrides", "heads", "q_len", "first_lens", "second_lens"), GRAPH)
def test_cuda_graph_replays_other_lengths_than_at_capture(overrides, heads, q_len, first_lens, second_lens):
    bs, nsplit = len(first_lens), 64
    config = mv.with_config(mv.default_config(DEV), **overrides)
    first = make_problem(bs, heads, q_len, first_lens, page_size=64, dtype=torch.bfloat16, device=DEV, seed=1,
                         mask_dtype=torch.uint8)
    second = make_problem(bs, heads, q_len, second_lens, page_size=1, dtype=torch.bfloat16, device=DEV, seed=2,
                          mask_dtype=torch.uint8)
    # static buffers sized for the maxima, as SGLang's graph runner keeps them
    static = {key: first[key].clone() for key in ("q", "k_ext", "v_ext", "qo_indptr", "kv_indptr")}
    static["kv_buffer"] = torch.cat([first["kv_buffer"], second["kv_buffer"]])   # one pool for both
    offset = first["kv_buffer"].shape[0]
    cap = max(sum(first_lens), sum(second_lens)) + 1
    static["kv_indices"] = torch.zeros(cap, dtype=torch.int64, device=DEV)
    static["custom_mask"] = torch.zeros(cap * q_len + bs * q_len * q_len, dtype=torch.uint8, device=DEV)
    static["mask_indptr"] = torch.zeros(bs + 1, dtype=torch.int64, device=DEV)

    def load(prob, shift):
        for key in ("q", "k_ext", "v_ext", "qo_indptr", "kv_indptr", "mask_indptr"):
            static[key].copy_(prob[key])
        static["kv_indices"][: prob["kv_indices"].numel()].copy_(prob["kv_indices"] + shift)
        static["custom_mask"][: prob["custom_mask"].numel()].copy_(prob["custom_mask"])

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
    check(out, run_reference(first, SCALE))

    # other lengths (and page size, trees) through the same graph: the schedule is re-derived on the device
    load(second, offset)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    launch()
    assert torch.equal(replayed, out)
    check(replayed, run_reference(dict(second, kv_buffer=static["kv_buffer"],
                                       kv_indices=second["kv_indices"] + offset), SCALE))


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


@pytest.mark.parametrize("overrides", [dict(combine_rows=1), dict(combine_rows=0, combine_wide_rows=0),
                                       dict(combine_rows=1, sm90=False), dict(draft_kernel=False),
                                       dict(tail_m=0, sm90=False), dict(block_n=32, num_stages=3, sm90=False)])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes"), [(3, 8, 9, [40000, 9, 3000]),
                                                                (2, 16, 9, [65536, 700]),
                                                                (2, 8, 10, [30000, 0])])   # 80 rows = 64 + 16
def test_combines_tiles_and_tails(overrides, bs, heads, q_len, prefixes):
    """The row-block and per-row combines on every launch, the combine attending the draft tree itself, the Triton
    kernel's short last row block (72 = 64 + 8, 144 = 128 + 16, 80 = 64 + 16 rows) on its short tile or not,
    another Triton tile."""
    config = mv.with_config(mv.GPU_CONFIG, **overrides)
    prob = make_problem(bs, heads, q_len, prefixes, page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=bs + heads, mask_dtype=torch.uint8, q_scale=2.0)
    check(run_kernel(prob, SCALE, 64, config=config, out=poisoned(prob)), run_reference(prob, SCALE))


TAIL = [
    # bs, H, Q, prefix lens
    (1, 16, 9, [65536]),
    (1, 16, 9, [1000]),
    (8, 16, 9, [4096] * 8),
    (8, 16, 9, [65536, 1, 4096, 17, 32768, 63, 64, 129]),
    (4, 8, 9, [16384, 0, 1, 131072]),
]


@pytest.mark.parametrize("tail_cost", [0.5, 0.72, 0.9])
@pytest.mark.parametrize(("bs", "heads", "q_len", "prefixes"), TAIL)
def test_tail_launch_writes_the_last_row_blocks_partials(tail_cost, bs, heads, q_len, prefixes):
    """A short last row block (16 of 144 rows, 8 of 72) over partitions of its own, on the multiprocessors the
    full blocks' programs leave (one request: in the split kernel's grid, more: a launch of its own; a column past
    the batch's keys at 1000 keys); the workspace is poisoned with NaN first, so a partial it
    failed to write, or one the combine looked for in the wrong slot, shows in the output."""
    config = mv.with_config(mv.GPU_CONFIG, tail_cost=tail_cost, tail_rows_min=1)     # 8-row tails too
    prob = make_problem(bs, heads, q_len, prefixes, page_size=1, tree=False, dtype=torch.bfloat16, device=DEV,
                        seed=bs + heads + len(prefixes), mask_dtype=torch.uint8, q_scale=2.0)
    rows = q_len * heads
    if mv._sm90_kernel(config, prob["q"], prob["kv_buffer"]) is None:
        pytest.skip("no Gluon split kernel here")
    pl = mv.plan(bs, rows, 64, config, 64, True, True)
    assert pl.tail > 0 and pl.blocks == rows // 64
    assert pl.columns * pl.blocks + pl.tail == mv._sms_now() - config.draft_sms
    ws = mv.Workspace.for_batches(bs, rows, 64, config, DEV)
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    out = run_kernel(prob, SCALE, 64, config=config, workspace=ws, out=poisoned(prob))
    check(out, run_reference(prob, SCALE))
    off = run_kernel(prob, SCALE, 64, config=mv.with_config(config, tail_cost=0), out=poisoned(prob))
    assert (out.float() - off.float()).abs().max().item() <= 2e-2 * off.float().abs().max().item()
