"""The ``kdtree`` attention backend: SGLang's stock Triton backend with its target-verify kernel replaced.

``KdtreeVerifyBackend`` wraps the backend SGLang's own ``triton`` factory builds and delegates every
attribute, method and forward mode to it — metadata, CUDA-graph buffers, KV-cache writes, decode, prefill,
draft extend all stay SGLang's code. Only inside a target-verify forward pass of an absorbed-MLA layer
(``forward_batch.forward_mode.is_target_verify()``, q/k head dim 576, v head dim 512, one KV head) does the
call SGLang's backend makes to ``extend_attention_fwd`` (the kernel it uses for tree verify: custom mask,
no split over the prefix) run :func:`kdtree_ext.mla_verify.mla_tree_verify` instead, on exactly the arguments
SGLang prepared (``qo_indptr``, ``kv_indptr``/``kv_indices``, ``custom_mask``/``mask_indptr``, the MLA KV
buffer). Any argument the kdtree kernel does not implement (sliding window, sinks, score_mod, logit cap,
k/v scales, fp8 caches, a prefix part of the mask SGLang asks to be applied, DCP's lse/skip stages) sends that
call to SGLang's kernel unchanged.

The partial-output workspace is reserved in ``init_cuda_graph_state`` (before SGLang captures its graphs) and
grown lazily in eager mode; launches never allocate, read device memory on the host or size the grid from
tensor contents, so the verify CUDA graphs capture and replay the kdtree kernels.
"""

from __future__ import annotations

import contextlib
import os

KERNEL = "kdtree-splitk"
_OWN = frozenset({"_inner", "_orig_extend", "_active", "_workspace", "kdtree_nsplit", "kdtree_config",
                  "kdtree_calls", "kdtree_fallbacks", "kdtree_last_fallback"})


def _mla_verify():
    from kdtree_ext import mla_verify

    return mla_verify


class KdtreeVerifyBackend:
    """Delegates to ``inner`` (SGLang's Triton backend); target-verify MLA attention runs the kdtree kernel."""

    def __init__(self, inner, nsplit: int, config=None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_active", False)
        object.__setattr__(self, "_workspace", None)
        object.__setattr__(self, "kdtree_nsplit", nsplit)
        object.__setattr__(self, "kdtree_config", config)
        object.__setattr__(self, "kdtree_calls", 0)
        object.__setattr__(self, "kdtree_fallbacks", 0)
        object.__setattr__(self, "kdtree_last_fallback", "")
        orig = getattr(inner, "extend_attention_fwd", None)
        object.__setattr__(self, "_orig_extend", orig)
        if callable(orig):
            inner.extend_attention_fwd = self._extend_attention_fwd

    # ---- delegation: everything not ours lives on the stock backend
    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name, value):
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __delattr__(self, name):
        delattr(self._inner, name)

    @property
    def hooked(self) -> bool:
        """True when SGLang's backend routes its extend kernel through us (its 0.5.23 layout)."""
        return callable(self._orig_extend)

    def describe(self) -> str:
        return f"kernel={KERNEL} nsplit={self.kdtree_nsplit} wraps={type(self._inner).__name__}"

    # ---- forward: mark the target-verify passes we take over, run SGLang's code
    @contextlib.contextmanager
    def _scope(self, layer, forward_batch):
        mode = getattr(forward_batch, "forward_mode", None)
        take = (self.hooked and mode is not None and mode.is_target_verify()
                and bool(getattr(self._inner, "use_mla", False))
                and getattr(layer, "qk_head_dim", None) == 576 and getattr(layer, "v_head_dim", None) == 512)
        previous = self._active
        self._active = take
        try:
            yield take
        finally:
            self._active = previous

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        with self._scope(layer, forward_batch):
            return self._inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        with self._scope(layer, forward_batch):
            return self._inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cuda_graph_state(self, max_bs, max_num_tokens, *args, **kwargs):
        result = self._inner.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        tokens = getattr(self._inner, "num_draft_tokens", None) or getattr(
            self._inner, "target_verify_num_tokens_per_req", None)
        heads = getattr(self._inner, "num_head", None)
        if self.hooked and getattr(self._inner, "use_mla", False) and tokens and heads:
            self._reserve(int(max_bs), int(tokens) * int(heads), getattr(self._inner, "device", "cuda"))
        return result

    # ---- the kernel swap
    def _config(self, device):
        return self.kdtree_config or _mla_verify().default_config(device)

    def _reserve(self, bs: int, rows: int, device):
        mv = _mla_verify()
        config = self._config(device)
        ws = self._workspace
        slots = mv.workspace_slots(bs, rows, self.kdtree_nsplit, config)
        if ws is not None and ws.fits(slots, rows) and ws.part_o.device == _device(device):
            return ws
        ws = mv.Workspace.for_batches(bs, rows, self.kdtree_nsplit, config, device)
        self._workspace = ws
        return ws

    def _why_not(self, q, k, v, o, k_buffer, v_buffer, custom_mask, is_causal, extra: dict) -> str | None:
        """None when the kdtree kernel computes exactly what SGLang's kernel was asked for."""
        import torch

        if not self._active:
            return "not a target-verify MLA pass"
        defaults = {"logit_cap": (0, 0.0, None), "skip_prefix_custom_mask": (True,), "sliding_window_size": (-1, None),
                    "sinks": (None,), "window_kv_offsets": (None,), "xai_temperature_len": (-1, 0, None),
                    "lse_extend": (None,), "skip_prefix": (False,), "skip_extend": (False,), "score_mod": (None,),
                    "aux_tensors": (None,), "k_scale": (1.0, None), "v_scale": (1.0, None)}
        for key, value in extra.items():
            if key in ("page_size", "extend_seq_lens_cpu", "identity_kv_indices", "sm_scale", "max_len_extend"):
                continue
            allowed = defaults.get(key)
            if allowed is None:
                return f"unknown argument {key}"
            if not any(value is a or (a is not None and not isinstance(value, torch.Tensor) and value == a)
                       for a in allowed):
                return f"{key}={value!r}"
        if custom_mask is None and not is_causal:
            return "non-causal without a mask"
        if q.dim() != 3 or q.shape[-1] != 576 or o.shape[-1] != 512:
            return f"shapes q={tuple(q.shape)} o={tuple(o.shape)}"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if interpreted else ())
        if k_buffer.dtype not in dtypes or q.dtype != k_buffer.dtype:
            return f"dtypes q={q.dtype} kv={k_buffer.dtype}"
        if k_buffer.dim() != 3 or k_buffer.shape[1] != 1 or k_buffer.shape[-1] != 576:
            return f"kv buffer {tuple(k_buffer.shape)}"
        if v_buffer.data_ptr() != k_buffer.data_ptr() or v_buffer.stride(0) != k_buffer.stride(0):
            return "values are not the c_kv half of the key buffer"
        if q.device.type != "cuda" and not interpreted:
            return f"device {q.device.type}"
        return None

    def _extend_attention_fwd(self, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                              is_causal, mask_indptr, max_len_extend, *args, **kwargs):
        names = ("k_scale", "v_scale", "sm_scale", "logit_cap", "skip_prefix_custom_mask", "sliding_window_size",
                 "sinks", "window_kv_offsets", "xai_temperature_len", "lse_extend", "skip_prefix", "skip_extend",
                 "page_size", "score_mod", "aux_tensors", "extend_seq_lens_cpu", "identity_kv_indices")
        extra = dict(zip(names, args, strict=False))
        if len(args) > len(names):
            extra["positional"] = args[len(names):]
        extra.update(kwargs)
        why = self._why_not(q, k, v, o, k_buffer, v_buffer, custom_mask, is_causal, extra)
        if why is not None:
            if self._active:
                self.kdtree_fallbacks += 1
                self.kdtree_last_fallback = why
            return self._orig_extend(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                     is_causal, mask_indptr, max_len_extend, *args, **kwargs)
        mv = _mla_verify()
        bs = qo_indptr.shape[0] - 1
        heads = q.shape[1]
        ws = self._reserve(bs, int(max_len_extend) * heads, q.device)
        sm_scale = extra.get("sm_scale")
        if sm_scale is None:
            sm_scale = mv.default_sm_scale()
        mv.mla_tree_verify(q, k, v, o, k_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                           mask_indptr if custom_mask is not None else None, int(max_len_extend), float(sm_scale),
                           self.kdtree_nsplit, ws, config=self._config(q.device))
        self.kdtree_calls += 1
        return None


def _device(device):
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d
