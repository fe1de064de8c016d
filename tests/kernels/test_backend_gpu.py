"""The ``kdtree`` backend's target-verify dispatch on a CUDA GPU (skipped without CUDA, and without the sglang
wheel/zip in KDTREE_SGLANG_WHEEL): bf16 at full size, SGLang's own ``extend_attention_fwd`` as the kernel the
backend replaces, CUDA-graph capture and replay through the backend.

SGLang's ``TritonAttnBackend`` cannot be imported on the GPU machine (python 3.12 there; the cp311 wheel's
``sglang.srt`` import closure needs pydantic, orjson, pyzmq, tvm_ffi and a dozen more packages it lacks), so
``StockVerifyPath`` stands in for it: it makes exactly the call ``TritonAttnBackend.forward_extend`` makes in a
target-verify pass of an absorbed-MLA layer in 0.5.23 (save the draft KV at ``out_cache_loc``, then
``self.extend_attention_fwd(...)`` with the same positional and keyword arguments, triton_backend.py lines
1691-1916). tests/kernels/backend_check.py runs the real class on CPU. Run on the GPU machine with
``python3 -m pytest -q --confcutdir=tests/kernels tests/kernels/test_backend_gpu.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1] / "kernels" / "kdtree", HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import sglang_kernels  # noqa: E402
from kdtree_ext import mla_verify as mv  # noqa: E402
from kdtree_ext.backend import KdtreeVerifyBackend  # noqa: E402
from kdtree_ext.verify_problems import make_problem, run_reference  # noqa: E402

SCALE = mv.default_sm_scale()
DEV = "cuda"
H, Q = 16, 16


class Mode:
    def __init__(self, name: str):
        self.name = name

    def is_target_verify(self) -> bool:
        return self.name == "TARGET_VERIFY"

    def is_decode(self) -> bool:
        return self.name == "DECODE"


class StockVerifyPath:
    """SGLang 0.5.23's TritonAttnBackend as the kdtree backend sees it in a target-verify MLA pass."""

    def __init__(self, kv_buffer, metadata, extend_attention_fwd):
        self.kv_buffer, self.forward_metadata = kv_buffer, metadata
        self.extend_attention_fwd = extend_attention_fwd
        self.use_mla, self.num_head, self.num_draft_tokens, self.page_size, self.device = True, H, Q, 1, DEV
        self.graph_state = None

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.graph_state = (max_bs, max_num_tokens)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if forward_batch.forward_mode.is_decode():
            return "decode"
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        md = self.forward_metadata
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache:
            self.kv_buffer[forward_batch.out_cache_loc] = k
        kbuf = self.kv_buffer
        self.extend_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.contiguous(), v.contiguous(),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim), kbuf, kbuf[..., : mv.D_LATENT], md.qo_indptr,
            md.kv_indptr, md.kv_indices, md.custom_mask, True, md.mask_indptr, md.max_extend_len, 1.0, 1.0,
            layer.scaling, logit_cap=layer.logit_cap, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
            xai_temperature_len=-1, page_size=self.page_size, score_mod=None, aux_tensors=None,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu)
        return o


@pytest.fixture(scope="module")
def extend_attention_fwd():
    try:
        return sglang_kernels.load()[0]
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def problem(prefixes, seed):
    prob = make_problem(len(prefixes), H, Q, prefixes, page_size=1, tree=True, dtype=torch.bfloat16, device=DEV,
                        seed=seed, mask_dtype=torch.uint8)
    prob["kv_buffer"][prob["draft_slots"]] = torch.randn(prob["draft_slots"].numel(), 1, mv.D_QK, device=DEV,
                                                         dtype=torch.bfloat16) * 5   # stale until SGLang writes
    return prob


def metadata(prob):
    return SimpleNamespace(qo_indptr=prob["qo_indptr"], kv_indptr=prob["kv_indptr"], kv_indices=prob["kv_indices"],
                           custom_mask=prob["custom_mask"], mask_indptr=prob["mask_indptr"], max_extend_len=Q)


def layer(**changes):
    return SimpleNamespace(**{"layer_id": 0, "tp_q_head_num": H, "qk_head_dim": mv.D_QK,
                              "v_head_dim": mv.D_LATENT, "scaling": SCALE, "logit_cap": 0.0, **changes})


def batch(prob, mode="TARGET_VERIFY"):
    return SimpleNamespace(forward_mode=Mode(mode), out_cache_loc=prob["draft_slots"],
                           extend_seq_lens_cpu=[Q] * prob["bs"], batch_size=prob["bs"])


def qkv(prob):
    return prob["q"].reshape(-1, H * mv.D_QK), prob["k_ext"], prob["v_ext"].view(-1, 1, mv.D_LATENT)


def check(out, ref, rel=1e-2):
    out = out.float().view(ref.shape)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < rel


def test_target_verify_runs_the_kdtree_kernel_and_matches_sglang(extend_attention_fwd):
    prob = problem([40000, 5000, 0], seed=3)
    clean = prob["kv_buffer"].clone()
    clean[prob["draft_slots"]] = prob["k_ext"]
    ref = run_reference(dict(prob, kv_buffer=clean), SCALE)
    backend = KdtreeVerifyBackend(StockVerifyPath(prob["kv_buffer"], metadata(prob), extend_attention_fwd), 64)
    out = backend.forward(*qkv(prob), layer(), batch(prob))
    assert (backend.kdtree_calls, backend.kdtree_fallbacks) == (1, 0), backend.kdtree_last_fallback
    assert torch.equal(prob["kv_buffer"], clean)                 # the draft KV went where SGLang writes it
    check(out, ref)
    stock = StockVerifyPath(clean.clone(), metadata(prob), extend_attention_fwd).forward(*qkv(prob), layer(),
                                                                                           batch(prob))
    check(stock, ref)
    assert (out.float() - stock.float()).abs().max().item() <= 3e-2 * ref.abs().max().item()


def test_cuda_graph_capture_and_replay_through_the_backend(extend_attention_fwd):
    first, second = problem([65536, 100, 30000, 1], seed=4), problem([9, 65536, 2000, 20000], seed=5)
    pool = torch.cat([first["kv_buffer"], second["kv_buffer"]])
    shift = first["kv_buffer"].shape[0]
    bs, cap = 4, 4 * 65536
    static = {"q": first["q"].clone(), "k_ext": first["k_ext"].clone(), "v_ext": first["v_ext"].clone(),
              "qo_indptr": first["qo_indptr"].clone(), "kv_indptr": first["kv_indptr"].clone(),
              "kv_indices": torch.zeros(cap, dtype=torch.int64, device=DEV),
              "custom_mask": torch.zeros(bs * Q * (65536 + Q), dtype=torch.uint8, device=DEV),
              "mask_indptr": torch.zeros(bs + 1, dtype=torch.int64, device=DEV),
              "draft_slots": first["draft_slots"].clone()}

    def load(prob, offset):
        for key in ("q", "k_ext", "v_ext", "qo_indptr", "kv_indptr", "mask_indptr"):
            static[key].copy_(prob[key])
        static["kv_indices"][: prob["kv_indices"].numel()].copy_(prob["kv_indices"] + offset)
        static["custom_mask"][: prob["custom_mask"].numel()].copy_(prob["custom_mask"])
        static["draft_slots"].copy_(prob["draft_slots"] + offset)

    def reference(prob, offset):
        kv = pool.clone()
        kv[prob["draft_slots"] + offset] = prob["k_ext"]
        return run_reference(dict(prob, kv_buffer=kv, kv_indices=prob["kv_indices"] + offset), SCALE)

    inner = StockVerifyPath(pool, SimpleNamespace(**{k: static[k] for k in ("qo_indptr", "kv_indptr", "kv_indices",
                                                                            "custom_mask", "mask_indptr")},
                                                  max_extend_len=Q), extend_attention_fwd)
    backend = KdtreeVerifyBackend(inner, 64)
    backend.init_cuda_graph_state(8, 8 * Q)                      # as SGLang does before it captures
    assert inner.graph_state == (8, 8 * Q)
    ws = backend._workspace
    assert ws is not None and ws.part_o.is_cuda
    fb = SimpleNamespace(forward_mode=Mode("TARGET_VERIFY"), out_cache_loc=static["draft_slots"],
                         extend_seq_lens_cpu=[Q] * bs, batch_size=bs)
    args = (static["q"].view(-1, H * mv.D_QK), static["k_ext"], static["v_ext"].view(-1, 1, mv.D_LATENT))
    load(first, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*args, layer(), fb)                      # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args, layer(), fb)
    for prob, offset in ((first, 0), (second, shift)):
        load(prob, offset)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(prob, offset))
    assert backend._workspace is ws and backend.kdtree_calls == 2 and backend.kdtree_fallbacks == 0


def test_what_the_kernel_does_not_implement_and_other_modes_stay_sglang(extend_attention_fwd):
    prob = problem([3000, 70], seed=6)
    inner = StockVerifyPath(prob["kv_buffer"], metadata(prob), extend_attention_fwd)
    backend = KdtreeVerifyBackend(inner, 64)
    capped = backend.forward(*qkv(prob), layer(logit_cap=30.0), batch(prob))
    assert (backend.kdtree_calls, backend.kdtree_fallbacks) == (0, 1)
    assert backend.kdtree_last_fallback.startswith("logit_cap")
    direct = StockVerifyPath(prob["kv_buffer"].clone(), metadata(prob), extend_attention_fwd).forward(
        *qkv(prob), layer(logit_cap=30.0), batch(prob))
    assert torch.equal(capped, direct)                           # SGLang's own kernel, unchanged
    assert backend.forward(*qkv(prob), layer(), batch(prob, "DECODE")) == "decode"
    backend.forward(*qkv(prob), layer(), batch(prob, "EXTEND"))
    assert backend.kdtree_calls == 0
