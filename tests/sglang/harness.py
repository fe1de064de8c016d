"""Runs inside the CPU SGLang venv (or plain /usr/bin/python3): starts "TP workers" the way SGLang does.

Usage: ``python harness.py '<json options>'``. The main process plays the launcher (optionally calling
SGLang's ``load_plugins()`` first, as ``sglang.launch_server`` does), then starts each worker with
multiprocessing **spawn**; every worker calls ``load_plugins()`` first thing (as SGLang's
``run_scheduler_process`` does), then builds KV allocators with ``need_sort=False`` (as SGLang computes it
in normal serving) and runs a fragmentation scenario. The main process prints one ``RESULT <json>`` line.

Options: ``launcher_plugins`` (bool), ``control`` (run the scenario in the launcher too, where kdtree
installs no defrag), ``workers``: list of {``load_plugins``: bool (default true), ``title``: process title
to set first (e.g. ``sglang::detokenizer``), ``scenario``: bool (default true), ``entry_point``: call the
``sglang.srt.plugins`` entry points with the stdlib (no SGLang), ``import_targets``: import SGLang's
allocators and attention registry without ``load_plugins()`` (the sitecustomize fallback), then
``load_plugins()`` if ``then_load_plugins``}.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys


def _set_title(title: str) -> None:
    with open("/proc/self/comm", "w") as fh:   # what kdtree_ext reads; the kernel keeps 15 characters
        fh.write(title[:15])


def scenario() -> dict:
    """Out-of-order frees, then an allocation that runs short of the never-used slots."""
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    out = {}
    tok = TokenToKVPoolAllocator(size=16, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    first = tok.alloc(12).tolist()                         # slots 1..12; 13..16 stay free
    for idx in ([7, 8], [3, 4], [5, 6]):                   # requests finish out of order
        tok.free(torch.tensor(idx, dtype=torch.int64))
    out["token"] = {"class": type(tok).__name__, "need_sort": tok.need_sort, "first": first,
                    "next": tok.alloc(6).tolist()}         # 6 > 4 never-used slots: runs short
    paged = PagedTokenToKVPoolAllocator(size=64, page_size=4, dtype=torch.float16, device="cpu", kvcache=None,
                                        need_sort=False)
    first = paged.alloc(48).tolist()                       # pages 1..12 (tokens 4..51); 13..16 stay free
    for page in (7, 3, 5, 4, 6, 8):
        paged.free(torch.arange(page * 4, page * 4 + 4, dtype=torch.int64))
    out["paged"] = {"class": type(paged).__name__, "need_sort": paged.need_sort, "first": first,
                    "next": paged.alloc(24).tolist()}      # 6 pages > 4 never-used pages: runs short
    return out


def _attention_state() -> dict:
    from types import SimpleNamespace

    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention import attention_registry as registry

    state = {"choices": ATTENTION_BACKEND_CHOICES.count("kdtree"),
             "registered": "kdtree" in registry.ATTENTION_BACKENDS}
    factory = registry.ATTENTION_BACKENDS.get("kdtree")
    if factory is not None:
        state["doc"] = factory.__doc__ or ""
        real = registry.ATTENTION_BACKENDS["triton"]
        registry.ATTENTION_BACKENDS["triton"] = lambda runner: SimpleNamespace(made_by="triton", runner=runner)
        try:
            backend = factory("RUNNER")
        finally:
            registry.ATTENTION_BACKENDS["triton"] = real
        state["delegated"] = {"made_by": backend.made_by, "runner": backend.runner,
                              "nsplit": getattr(backend, "kdtree_nsplit", None)}
    return state


def _call_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="sglang.srt.plugins"):
        ep.load()()


def worker(conn, spec: dict) -> None:
    if spec.get("title"):
        _set_title(spec["title"])
    if spec.get("entry_point"):
        _call_entry_points()
        _call_entry_points()
    elif spec.get("import_targets"):
        import sglang.srt.layers.attention.attention_registry
        import sglang.srt.mem_cache.allocator  # noqa: F401

        if spec.get("then_load_plugins"):
            from sglang.srt.plugins import load_plugins

            load_plugins()
    elif spec.get("load_plugins", True):
        from sglang.srt.plugins import load_plugins

        load_plugins()
        load_plugins()   # idempotent, as SGLang calls it from several places
    result: dict = {"pid": os.getpid()}
    if spec.get("scenario", True):
        result["scenario"] = scenario()
        result["attention"] = _attention_state()
        hook_registry = sys.modules.get("sglang.srt.plugins.hook_registry")
        if hook_registry is not None:
            result["patched"] = sorted(hook_registry.HookRegistry._patched)
    conn.send(result)
    conn.close()


def main() -> int:
    opts = json.loads(sys.argv[1])
    if opts.get("launcher_plugins"):
        from sglang.srt.plugins import load_plugins

        load_plugins()
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for spec in opts.get("workers", []):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, spec))
        proc.start()
        child.close()
        procs.append((proc, parent))
    workers = []
    for proc, conn in procs:
        try:
            workers.append(conn.recv() if conn.poll(300) else {"error": "timeout"})
        except EOFError:
            workers.append({"error": "died"})
        proc.join(60)
        workers[-1]["exitcode"] = proc.exitcode
        workers[-1]["pid"] = proc.pid
    result = {"launcher_pid": os.getpid(), "workers": workers}
    if opts.get("control"):
        result["control"] = scenario()
    if opts.get("launcher_plugins"):
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

        result["launcher_choices"] = ATTENTION_BACKEND_CHOICES.count("kdtree")
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
