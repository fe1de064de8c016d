"""kdtree fallback loader: runs in every Python process that has this directory on PYTHONPATH.

SGLang builds with the plugin loader (``sglang.srt.plugins``, 0.5.x) call ``kdtree_ext.register()``
through the entry point next to this file, and then this file does nothing. For builds without it, or with
``KDTREE_LOADER=sitecustomize``, it installs post-import hooks: once SGLang has imported the allocators,
the attention registry or the ``--attention-backend`` choices, the matching piece of kdtree_ext is set up
(before the KV pool is built). Either way each piece is installed once per process.

``KDTREE_LOADER=auto`` (default) | ``sitecustomize`` (force the fallback) | ``plugin`` (never the fallback).
It must stay cheap (no SGLang import here) and never break the interpreter: any error becomes one line.
Python imports only the first ``sitecustomize`` on sys.path, so this one then runs the next one (Debian's).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGETS = ("sglang.srt.mem_cache.allocator", "sglang.srt.layers.attention.attention_registry",
            "sglang.srt.arg_groups.choices", "sglang.srt.server_args")


def _sglang_has_plugin_loader() -> bool | None:
    """None when sglang is not installed; never imports it."""
    try:
        spec = importlib.machinery.PathFinder.find_spec("sglang")
    except Exception:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any(os.path.isfile(os.path.join(d, "srt", "plugins", "__init__.py"))
               for d in spec.submodule_search_locations)


def _wanted() -> bool:
    mode = os.environ.get("KDTREE_LOADER", "auto").strip().lower() or "auto"
    if mode == "plugin":
        return False
    if mode == "sitecustomize":
        return True
    if os.environ.get("KDTREE_VERIFY", "").strip().lower() in ("off", "0", "false", "no"):
        return False
    return _sglang_has_plugin_loader() is False


class _PostImportHooks:
    """Meta-path finder: lets the real finder find a target module, then runs kdtree_ext after its body."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module

        def exec_module(module, _original=original, _name=fullname):
            _original(module)
            _fire(_name)

        spec.loader.exec_module = exec_module   # loaders of source files are per module: patch this one
        return spec


def _fire(name: str) -> None:
    try:
        import kdtree_ext
    except Exception as exc:
        sys.stdout.write(f"[kdtree] sitecustomize fallback skipped: cannot import kdtree_ext ({exc})\n")
        sys.stdout.flush()
        return
    try:
        kdtree_ext.fire_fallback(name)
    except SystemExit:
        raise                       # kdtree_ext.ConfigError: the process must not start
    except Exception as exc:
        kdtree_ext.log(f"[kdtree] sitecustomize fallback skipped after {name}: {type(exc).__name__}: {exc} "
                       f"(pid={os.getpid()})")


def _chain_next_sitecustomize() -> None:
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    if _wanted():
        sys.meta_path.insert(0, _PostImportHooks())
        for _name in _TARGETS:
            if _name in sys.modules:
                _fire(_name)
except Exception as _exc:
    sys.stdout.write(f"[kdtree] sitecustomize fallback skipped: {type(_exc).__name__}: {_exc}\n")
    sys.stdout.flush()

try:
    _chain_next_sitecustomize()
except Exception as _exc:
    sys.stderr.write(f"Error in the next sitecustomize (run by kdtree's): {type(_exc).__name__}: {_exc}\n")
