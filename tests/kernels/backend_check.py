"""The ``kdtree`` attention backend's dispatch on the REAL sglang 0.5.23 code, on CPU under Triton's interpreter.

Run by tests/kernels/test_backend_dispatch.py with the CPU SGLang venv's python, ``TRITON_INTERPRET=1`` and
the payload on PYTHONPATH. It builds a real ``TritonAttnBackend`` object (its class from the wheel; the
instance gets the attributes its ``forward_extend`` reads, since its ``__init__`` needs a GPU model runner),
a real ``MLATokenToKVPool`` on CPU and a target-verify batch, wraps the backend the way the ``kdtree``
factory does, and runs SGLang's own ``AttentionBackend.forward`` -> ``TritonAttnBackend.forward_extend``
(which writes the draft tokens' KV into the pool and calls its extend kernel). Prints ``CHECK <json>`` lines
and ``RESULT <json>``.

SGLang's ``triton_backend`` module imports three packages this CPU venv does not have and that the attention
path never calls (``openai`` and ``partial_json_parser`` for its HTTP API / function-call parsing, ``einops``);
they are satisfied by import stubs below. Everything runs in float32: the interpreter reads bf16 as garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

STUBBED = {"openai", "partial_json_parser", "einops"}


def _schema(cls, source, handler):
    from pydantic_core import core_schema

    return core_schema.any_schema()


class _Meta(type):
    def __new__(mcs, name, bases, ns, **kw):
        return super().__new__(mcs, name, bases, ns)

    def __init__(cls, name, bases, ns, **kw):
        super().__init__(name, bases, ns)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {"__get_pydantic_core_schema__": classmethod(_schema)})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _StubFinder())

from types import SimpleNamespace  # noqa: E402

import kdtree_ext  # noqa: E402
import torch  # noqa: E402
from kdtree_ext import mla_verify as mv  # noqa: E402
from kdtree_ext.backend import KdtreeVerifyBackend  # noqa: E402
from kdtree_ext.verify_problems import make_problem  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402
from sglang.srt.layers.attention import attention_registry  # noqa: E402
from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

SCALE = mv.default_sm_scale()
H, Q, PAGE = 4, 6, 1
PREFIXES = [70, 23]


def make_pool(prob) -> MLATokenToKVPool:
    slots = prob["kv_buffer"].shape[0]
    pool = MLATokenToKVPool(size=slots, page_size=PAGE, dtype=torch.float32, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    buf = pool.get_key_buffer(0)
    n = min(buf.shape[0], slots)
    buf[:n] = prob["kv_buffer"][:n]
    # the draft slots hold stale data until SGLang's forward_extend writes the draft KV there
    drafts = draft_slots(prob)
    buf[drafts] = torch.randn(drafts.numel(), 1, 576) * 5
    return pool


def draft_slots(prob) -> torch.Tensor:
    """Where the problem put each draft token (the slots after each prefix), i.e. SGLang's out_cache_loc."""
    return prob["draft_slots"]


def make_inner(prob, pool) -> TritonAttnBackend:
    inner = TritonAttnBackend.__new__(TritonAttnBackend)
    inner.__dict__.update(
        use_dense_fp8_chunked_prefill=False, token_to_kv_pool=pool, dcp_size=1, enable_deterministic=False,
        use_verify_shared_kv=False, use_verify_splitkv=False, dllm_attention=None, page_size=PAGE, use_mla=True,
        allow_bidirectional_attention_in_extend=False, extend_attention_fwd=extend_attention_fwd,
        num_head=H, num_draft_tokens=Q, device="cpu")
    inner.forward_metadata = metadata(prob)
    return inner


def metadata(prob) -> ForwardMetadata:
    return ForwardMetadata(
        attn_logits=None, attn_lse=None, max_extend_len=prob["q_len"], num_kv_splits=None,
        kv_indptr=prob["kv_indptr"], kv_indices=prob["kv_indices"], qo_indptr=prob["qo_indptr"],
        custom_mask=prob["custom_mask"], mask_indptr=prob["mask_indptr"], window_kv_indptr=None,
        window_kv_indices=None, window_num_kv_splits=None, window_kv_offsets=None)


def layer(**changes):
    base = dict(layer_id=0, tp_q_head_num=H, tp_k_head_num=1, tp_v_head_num=1, qk_head_dim=576, v_head_dim=512,
                scaling=SCALE, logit_cap=0.0, logit_capping_method="tanh", is_cross_attention=False,
                attn_type=AttentionType.DECODER, sliding_window_size=-1, k_scale=None, v_scale=None,
                xai_temperature_len=-1)
    base.update(changes)
    return SimpleNamespace(**base)


def batch(prob, mode, slots):
    return SimpleNamespace(forward_mode=mode, out_cache_loc=slots, out_cache_loc_is_physical=True,
                           mha_one_shot=False, attn_attend_prefix_cache=None, positions=None,
                           extend_seq_lens_cpu=[prob["q_len"]] * prob["bs"], batch_size=prob["bs"])


def qkv(prob):
    q = prob["q"].reshape(-1, H * 576)
    k = prob["k_ext"]
    v = prob["k_ext"][..., :512].contiguous()
    return q, k, v


def err(a, b) -> float:
    return float((a.reshape(b.shape).float() - b).abs().max())


def main() -> int:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False):     # no distributed setup in this process
        return run()


def run() -> int:
    checks = {}
    prob = make_problem(len(PREFIXES), H, Q, PREFIXES, page_size=PAGE, tree=True, dtype=torch.float32, seed=7)
    ref = mv.reference_tree_verify(prob["q"], prob["k_ext"], None, prob["kv_buffer"], prob["qo_indptr"],
                                   prob["kv_indptr"], prob["kv_indices"], prob["custom_mask"], prob["mask_indptr"],
                                   SCALE)
    slots = draft_slots(prob)
    q, k, v = qkv(prob)

    # 1. the factory through SGLang's real registry (its 'triton' entry patched to hand back our instance)
    pool = make_pool(prob)
    inner = make_inner(prob, pool)
    real = attention_registry.ATTENTION_BACKENDS["triton"]
    attention_registry.ATTENTION_BACKENDS["triton"] = lambda runner: inner
    try:
        backend = kdtree_ext.make_backend_factory(8)("RUNNER")
    finally:
        attention_registry.ATTENTION_BACKENDS["triton"] = real
    checks["factory"] = {"type": type(backend).__name__, "hooked": backend.hooked, "nsplit": backend.kdtree_nsplit,
                         "page_size": backend.page_size, "inner_is_triton": isinstance(backend._inner,
                                                                                        TritonAttnBackend)}

    # 2. a target-verify tree batch through SGLang's own forward -> forward_extend -> our kernel
    out = backend.forward(q, k, v, layer(), batch(prob, ForwardMode.TARGET_VERIFY, slots))
    written = pool.get_key_buffer(0)[slots]
    checks["verify_tree"] = {"calls": backend.kdtree_calls, "fallbacks": backend.kdtree_fallbacks,
                             "max_err": err(out, ref), "ref_max": float(ref.abs().max()),
                             "kv_written_by_sglang": bool(torch.equal(written, prob["k_ext"])),
                             "workspace_slots": getattr(backend._workspace, "slots", None),
                             "why": backend.kdtree_last_fallback}

    # 3. the same batch on SGLang's own extend_attention_fwd (a stock backend, no kdtree): the same answer
    pool2 = make_pool(prob)
    stock = make_inner(prob, pool2)
    out_stock = stock.forward(q, k, v, layer(), batch(prob, ForwardMode.TARGET_VERIFY, slots))
    checks["sglang_extend_tree"] = {"max_err": err(out_stock, ref), "vs_kdtree": err(out_stock, out.float())}

    # 4. chain without a custom mask (causal drafts): ours vs SGLang's extend kernel vs the reference
    chain = make_problem(len(PREFIXES), H, Q, PREFIXES, page_size=PAGE, tree=False, mask=False,
                         dtype=torch.float32, seed=8)
    cref = mv.reference_tree_verify(chain["q"], chain["k_ext"], None, chain["kv_buffer"], chain["qo_indptr"],
                                    chain["kv_indptr"], chain["kv_indices"], None, None, SCALE)
    cslots = draft_slots(chain)
    cq, ck, cv = qkv(chain)
    cb = KdtreeVerifyBackend(make_inner(chain, make_pool(chain)), 4)
    cout = cb.forward(cq, ck, cv, layer(), batch(chain, ForwardMode.TARGET_VERIFY, cslots))
    cstock = make_inner(chain, make_pool(chain)).forward(cq, ck, cv, layer(),
                                                          batch(chain, ForwardMode.TARGET_VERIFY, cslots))
    checks["verify_chain"] = {"calls": cb.kdtree_calls, "max_err": err(cout, cref), "sglang_err": err(cstock, cref),
                              "vs_sglang": err(cstock, cout.float())}
    # ... and SGLang's chain-only verify kernel (verify_mla.verify_shared_kv_fwd), called straight
    try:
        from sglang.kernels.ops.attention.verify_mla import verify_shared_kv_fwd

        vo = torch.empty(cq.shape[0], H, 512)
        kb = chain["kv_buffer"]
        ran = verify_shared_kv_fwd(cq.view(-1, H, 576), ck, cv, vo, kb, kb[..., :512], chain["qo_indptr"],
                                   chain["kv_indptr"], chain["kv_indices"], None, True, None, Q, 1.0, 1.0,
                                   sm_scale=SCALE)
        checks["verify_chain"]["verify_mla"] = {"ran": ran is not False, "err": err(vo, cref),
                                                "vs_kdtree": err(vo, cout.float())}
    except Exception as exc:  # reported, asserted by the test
        checks["verify_chain"]["verify_mla"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    # 5. other modes go to SGLang untouched: prefill-style EXTEND (causal, its kernel) and DECODE
    calls = backend.kdtree_calls
    eb = make_inner(chain, make_pool(chain))
    ew = KdtreeVerifyBackend(eb, 8)
    eout = ew.forward(cq, ck, cv, layer(), batch(chain, ForwardMode.EXTEND, cslots))
    decoded = []
    backend._inner.forward_decode = lambda *a, **kw: decoded.append(kw.get("save_kv_cache")) or "decoded"
    dres = backend.forward(q, k, v, layer(), batch(prob, ForwardMode.DECODE, slots))
    checks["other_modes"] = {"extend_calls": ew.kdtree_calls, "extend_err": err(eout, cref),
                             "decode_result": dres, "decode_calls": len(decoded),
                             "verify_calls_unchanged": backend.kdtree_calls == calls}

    # 6. what the kdtree kernel does not implement goes to SGLang's kernel (logit cap), and non-MLA layers
    fb = KdtreeVerifyBackend(make_inner(prob, make_pool(prob)), 8)
    fout = fb.forward(q, k, v, layer(logit_cap=30.0), batch(prob, ForwardMode.TARGET_VERIFY, slots))
    checks["fallback"] = {"calls": fb.kdtree_calls, "fallbacks": fb.kdtree_fallbacks,
                          "why": fb.kdtree_last_fallback, "finite": bool(torch.isfinite(fout).all())}
    with fb._scope(layer(qk_head_dim=128, v_head_dim=128), batch(prob, ForwardMode.TARGET_VERIFY, slots)) as took:
        checks["fallback"]["non_mla_taken"] = took

    # 7. attribute delegation both ways, and the CUDA-graph workspace reservation
    backend.forward_metadata = None
    reserved = []
    backend._inner.init_cuda_graph_state = lambda max_bs, max_tokens, *a, **kw: reserved.append((max_bs, max_tokens))
    backend.init_cuda_graph_state(16, 16 * Q)
    ws = backend._workspace
    cfg = mv.default_config("cpu")
    checks["delegation"] = {"inner_metadata_cleared": backend._inner.forward_metadata is None,
                            "inner_init_called": reserved == [(16, 16 * Q)],
                            "workspace_rows": ws.max_rows, "workspace_slots": ws.slots,
                            "expected_slots": max(mv.workspace_slots(b, Q * H, 8, cfg) for b in range(1, 17))}
    for name, value in checks.items():
        print("CHECK " + json.dumps({"name": name, **value}), flush=True)
    print("RESULT " + json.dumps({"checks": len(checks)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
