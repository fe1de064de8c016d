"""SGLang 0.5.23's own Triton verify kernels, loaded straight from the sglang wheel (or a zip holding the same
``sglang/kernels/ops/attention/*.py`` files) without installing SGLang: the same approach as
shared/tools/sglang-kernel-anchor.py. Only the few ``sglang.srt`` helpers those modules import are stubbed
(``sglang.srt.utils``: is_hip/is_cuda/gfx checks/device core count; ``sglang.srt.environ``: env flags).

Used by bench/kernel.py and tests/kernels/test_mla_verify_gpu.py on the GPU machine, which has no SGLang
(the wheel is cp311-only and needs far more than these files). Where SGLang is installed (the CPU venv), the
real modules are imported instead.

``load(path)`` returns ``(extend_attention_fwd, verify_shared_kv_fwd)``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
import zipfile

NEEDED = ("verify_mla.py", "verify_splitkv.py", "extend_attention.py", "decode_attention.py", "score_mod.py")
ENV = "KDTREE_SGLANG_WHEEL"


def _pkg(name: str, path: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path] if path else []
    sys.modules[name] = module
    return module


class _Env:
    def __init__(self, name: str):
        self.name = name

    def get(self):
        return 1.0 if "MULT" in self.name else None


def load(path: str | None = None):
    """The two kernels from ``path`` (a wheel or zip; default: $KDTREE_SGLANG_WHEEL)."""
    import torch

    path = path or os.environ.get(ENV)
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"no sglang wheel/zip (set {ENV})")
    root = os.path.join(tempfile.gettempdir(), f"kdtree-sglang-kernels-{os.getpid()}")   # one per process
    with zipfile.ZipFile(path) as z:
        for name in NEEDED:
            z.extract(f"sglang/kernels/ops/attention/{name}", root)
    dev_cuda = torch.cuda.is_available()
    _pkg("sglang", f"{root}/sglang")
    _pkg("sglang.kernels", f"{root}/sglang/kernels")
    _pkg("sglang.kernels.ops", f"{root}/sglang/kernels/ops")
    _pkg("sglang.kernels.ops.attention", f"{root}/sglang/kernels/ops/attention")
    _pkg("sglang.srt")
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False
    utils.is_cuda = lambda: dev_cuda
    utils.is_gfx95_supported = lambda: False
    utils.is_gfx1250_supported = lambda: False
    utils.get_device_core_count = lambda *a, **k: (
        torch.cuda.get_device_properties(0).multi_processor_count if dev_cuda else 8)
    sys.modules["sglang.srt.utils"] = utils
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = type("Envs", (), {"__getattr__": lambda self, n: _Env(n)})()
    sys.modules["sglang.srt.environ"] = environ
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.verify_mla import verify_shared_kv_fwd

    return extend_attention_fwd, verify_shared_kv_fwd


def wheel_note(path: str | None = None) -> str:
    """What was loaded (the zip comment names the wheel and its sha256)."""
    path = path or os.environ.get(ENV, "")
    try:
        with zipfile.ZipFile(path) as z:
            return z.comment.decode() or os.path.basename(path)
    except Exception:
        return os.path.basename(path)
