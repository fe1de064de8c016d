"""Tier-0 defrag: every KV pool allocator SGLang builds runs with ``need_sort=True``.

With ``need_sort=True`` freed slots are staged and merged + ``torch.sort``-ed into the free list when an
allocation runs short, so later allocations come out ascending and contiguous; SGLang passes
``need_sort=False`` in normal serving (only disaggregated prefill/decode sorts), which leaves the token
allocator appending frees unsorted and the paged allocator reusing freed pages LIFO: scattered KV.

The hook is an AROUND hook on ``__init__`` of every class in ``sglang.srt.mem_cache.allocator`` (and its
submodules) whose own ``__init__`` takes ``need_sort``, base class included, so subclasses elsewhere (NPU,
platform allocators) that pass ``need_sort`` up through ``super().__init__`` are covered too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil

import kdtree_ext as ext
from kdtree_ext.markers import DEFRAG

_confirmed = False
_depth = 0          # nesting of hooked __init__ calls (subclass -> base, composite -> parts)
_problems_logged: set[str] = set()


def _takes_need_sort(func) -> bool:
    try:
        return "need_sort" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def allocator_classes() -> tuple[list[type], list[str]]:
    """(classes whose own ``__init__`` takes ``need_sort``, submodules that could not be imported)."""
    package = ext._import(ext.ALLOCATOR_PACKAGE)
    modules = [package]
    problems = []
    for info in pkgutil.iter_modules(getattr(package, "__path__", None) or []):
        name = f"{ext.ALLOCATOR_PACKAGE}.{info.name}"
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:
            problems.append(f"{info.name} ({type(exc).__name__})")
    found: dict[int, type] = {}
    for module in modules:
        for obj in vars(module).values():
            if (isinstance(obj, type) and obj.__module__ == module.__name__ and "__init__" in vars(obj)
                    and _takes_need_sort(vars(obj)["__init__"])):
                found[id(obj)] = obj
    return sorted(found.values(), key=lambda c: (len(c.__mro__), c.__qualname__)), problems


def force_need_sort(original, self, *args, **kwargs):
    """AROUND hook for an allocator's ``__init__``: call it with ``need_sort=True``, then confirm."""
    try:
        bound = inspect.signature(original).bind(self, *args, **kwargs)
    except TypeError as exc:       # not the signature we know: leave the call alone, say so once
        _problem(f"{type(self).__name__}: cannot bind __init__ arguments ({exc})")
        return original(self, *args, **kwargs)
    global _depth
    asked = bound.arguments.get("need_sort", "default")
    bound.arguments["need_sort"] = True
    _depth += 1
    try:
        result = original(*bound.args, **bound.kwargs)
    finally:
        _depth -= 1
    if _depth == 0:          # the outermost allocator SGLang asked for: confirm on it, with what SGLang passed
        _confirm(self, asked)
    return result


def _problem(text: str) -> None:
    if text not in _problems_logged:
        _problems_logged.add(text)
        ext.log(f"[kdtree] Tier-0 defrag problem: {text} ({ext._who()})")


def _confirm(allocator, asked) -> None:
    """Log the marker once per worker, when an allocator was really built with need_sort=True."""
    global _confirmed
    if getattr(allocator, "need_sort", None) is not True:
        _problem(f"{type(allocator).__name__} ended with need_sort={getattr(allocator, 'need_sort', None)!r}")
        return
    if _confirmed or ext.role() != "worker":
        return
    _confirmed = True
    ext.log(f"{DEFRAG} on: {type(allocator).__name__} built with need_sort=True (SGLang asked {asked}) "
            f"({ext._who()})")


def _wrap(cls: type) -> None:
    original = vars(cls)["__init__"]
    if getattr(original, "_kdtree_need_sort", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        return force_need_sort(original, self, *args, **kwargs)

    __init__._kdtree_need_sort = True
    cls.__init__ = __init__


def install(*, use_registry: bool) -> None:
    """Hook every allocator class (raises ``_Missing`` when there is none to hook)."""
    classes, problems = allocator_classes()
    if not classes:
        raise ext._Missing(f"no allocator class with a need_sort parameter in {ext.ALLOCATOR_PACKAGE}")
    if use_registry:
        hook_registry = ext._import(ext.HOOK_REGISTRY)
        for cls in classes:
            hook_registry.HookRegistry.register(f"{cls.__module__}.{cls.__qualname__}.__init__", force_need_sort,
                                                hook_registry.HookType.AROUND)
        how = "HookRegistry (applied by load_plugins)"
    else:
        for cls in classes:
            _wrap(cls)
        how = "wrapped __init__"
    note = f"; not importable: {', '.join(problems)}" if problems else ""
    ext.log(f"[kdtree] Tier-0 defrag hooked {len(classes)} allocator classes via {how}: "
            f"{', '.join(c.__name__ for c in classes)}{note}; the marker follows when the KV pool is built "
            f"({ext._who()})")
