#!/usr/bin/env python3
"""kdtree verify kernel benchmark (issue 17): our split-K tree-verify MLA kernel against SGLang 0.5.23's own
Triton kernels and PyTorch, side by side in one run on one GPU.

Shapes: batch 1 and 8, H = 8 and 16 heads, Q = 9 (a chain draft) and 16 (a random tree draft), prefix
contexts 4k/16k/32k/64k; MLA: query [latent 512 | rope 64] bf16, KV per token [c_kv 512 | k_rope 64] bf16 in a
page-size-1 pool scattered at random (every token's slot drawn from a permutation), values = c_kv.

Methods (each checked against the fp32 reference on the same inputs before it is timed):
  kdtree       our kernel (kernels/kdtree/kdtree_ext/mla_verify.py), KDTREE_NSPLIT=64 and the tuned config
  kdtree_ns1   our kernel with NSPLIT=1 (no split over the prefix)
  extend       SGLang's extend_attention_fwd: what SGLang runs for target-verify on NVIDIA GPUs — with the tree
               custom mask on Q=16 shapes, causal (no mask) on the Q=9 chain shapes
  verify_mla   SGLang's verify_mla.verify_shared_kv_fwd (split-KV, grouped heads; chains only — it refuses tree
               masks): run as a causal chain of Q tokens on every shape; on Q=16 shapes that is not the tree
  sdpa         PyTorch: gather the prefix rows, append the draft rows, expand the mask over heads,
               F.scaled_dot_product_attention (heads folded into the query axis: one KV head)
SGLang's kernels come from the sglang 0.5.23 wheel (or a zip of its attention files), loaded without installing
SGLang (tests/kernels/sglang_kernels.py; --sglang or $KDTREE_SGLANG_WHEEL).

Timing: triton.testing.do_bench, median, L2 flushed before every call, each method eager and replayed from a
CUDA graph (as SGLang runs target-verify in decode: no host launch time; the targets are judged on both,
eager against eager and replay against replay); the device-to-device copy bandwidth
(read + write) and a bf16 8192^3 matmul rate are measured in the same run. "GB/s" = unique KV bytes read
(bs * context * 576 * 2) / time; the bandwidth floor = those bytes / copy bandwidth; the compute floor =
2 * bs * Q * H * context * (576 + 512) FLOP / matmul rate.

Ragged batches (``--ragged``): the issue's four mixed batches and two decode-like mixes (bs=32 and 64, prefixes
log-uniform 1k-128k), each timed beside one request holding the batch's total prefix (same H and Q, same run):
``ragged_over_single`` = the batch's graph-replay time over that request's (kernel-<tag>-ragged.json).
``--kernel-path DIR``: import ``kdtree_ext`` from DIR instead of this checkout's (e.g. another checkout's
kernels/kdtree). ``--ab DIR --sweep CONFIGS``: DIR's kernel and ours under each config in one process, timed in
interleaved rounds (kernel-<tag>-ab.json: per shape each variant's median and range, ours over DIR's per round).

Phases: precompile (every kernel variant the run needs, on tiny problems, in parallel processes — Triton's
on-disk cache then serves the timed process), --tune (tile configs and split rules of our kernel on a few
shapes; the best is used for the rest), the table. Writes kernel-<tag>.json and .md under --out (default
bench/results; keep what it prints as kernel-<tag>.txt).
``--cpu-smoke``: tiny fp32 shapes under TRITON_INTERPRET=1 (checks the script, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_KPATH = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--kernel-path"), None)
sys.path.insert(0, str(REPO / "kernels" / "kdtree") if _KPATH is None else os.path.abspath(_KPATH))
sys.path.insert(0, str(REPO / "tests" / "kernels"))

import torch  # noqa: E402
from kdtree_ext import mla_verify as mv  # noqa: E402
from kdtree_ext.verify_problems import make_problem, run_reference  # noqa: E402

SCALE = mv.default_sm_scale()
NSPLIT = 64
CONTEXTS = (4096, 16384, 32768, 65536)
SHAPES = [(bs, h, q, ctx) for ctx in CONTEXTS for bs in (1, 8) for h in (8, 16) for q in (9, 16)]
TUNE_SHAPES = [(8, 16, 16, 65536), (8, 8, 9, 65536), (1, 8, 16, 16384), (1, 16, 9, 32768), (1, 8, 9, 4096),
               (8, 16, 9, 65536)]
TILE_CONFIGS = [   # on a Hopper GPU the first is the Gluon split kernel (sm90 in the default config)
    dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=64, block_n=32, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=32, num_warps=8, num_stages=2),
]
SPLIT_RULES = [dict(min_chunk=mc, max_ctas=cap) for mc in (64, 256, 512) for cap in (-1, 264)]
COMBINE_CONFIGS = [dict(combine_block_s=bs, combine_block_d=bd, combine_warps=w)
                   for bs, bd, w in ((32, 256, 4), (16, 256, 4), (32, 512, 8), (64, 256, 8))]

STATE: dict = {}


def log(*args) -> None:
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------- problems

def problem(bs, h, q, ctx, *, device, dtype, seed=0):
    """Q=16: a random tree with SGLang's custom mask; Q=9: a chain (SGLang passes it causal, without a mask).
    The chain mask is kept aside for the methods that need one explicitly (SDPA)."""
    tree = q == 16
    prob = make_problem(bs, h, q, ctx, page_size=1, tree=tree, mask=True, dtype=dtype, device=device, seed=seed,
                        mask_dtype=torch.uint8)
    prob["sdpa_mask"] = prob["custom_mask"]
    if not tree:
        prob["custom_mask"] = prob["mask_indptr"] = None
    return prob


def kv_bytes(bs, ctx) -> int:
    return bs * ctx * mv.D_QK * 2


def flops(bs, h, q, ctx) -> float:
    return 2.0 * bs * q * h * ctx * (mv.D_QK + mv.D_LATENT)


# ----------------------------------------------------------------------------------------------- methods

def sglang_kernels():
    if "sglang" not in STATE:
        import sglang_kernels

        try:
            STATE["sglang"] = sglang_kernels.load()
            STATE["sglang_note"] = sglang_kernels.wheel_note()
        except FileNotFoundError as exc:
            STATE["sglang"] = None
            STATE["sglang_note"] = f"not run: {exc}"
    return STATE["sglang"]


def out_for(prob):
    return torch.full((prob["q"].shape[0], prob["heads"], mv.D_LATENT), float("nan"), dtype=prob["q"].dtype,
                      device=prob["q"].device)


def make_fn(method: str, prob, *, config=None, nsplit=NSPLIT, kernel=None):
    """(callable, output tensor), or (None, reason) when the method cannot run this problem (``kernel``: another
    checkout's ``kdtree_ext``, from :func:`load_kernel`, for our kernel)."""
    o = out_for(prob)
    q, kext, vext = prob["q"], prob["k_ext"], prob["v_ext"].view(-1, 1, mv.D_LATENT)
    kbuf = prob["kv_buffer"]
    vbuf = kbuf[..., : mv.D_LATENT]
    qlen = prob["q_len"]
    if method.startswith("kdtree"):
        mvm = kernel.mv if kernel else mv
        config = config or mvm.default_config(q.device)
        ns = 1 if method == "kdtree_ns1" else nsplit
        ws = mvm.Workspace.for_batches(prob["bs"], qlen * prob["heads"], ns, config, q.device)

        def fn():
            if kernel:
                kernel.activate()
            mvm.mla_tree_verify(q, kext, vext, o, kbuf, prob["qo_indptr"], prob["kv_indptr"], prob["kv_indices"],
                                prob["custom_mask"], prob["mask_indptr"], qlen, SCALE, ns, ws, config=config)
        return fn, o
    if method in ("extend", "verify_mla"):
        kernels = sglang_kernels()
        if kernels is None:
            return None, STATE["sglang_note"]
        extend_attention_fwd, verify_shared_kv_fwd = kernels
        tail = (kbuf, vbuf, prob["qo_indptr"], prob["kv_indptr"], prob["kv_indices"])
        if method == "extend":
            mask, causal = prob["custom_mask"], prob["custom_mask"] is None

            def fn():
                extend_attention_fwd(q, kext, vext, o, *tail, mask, causal, prob["mask_indptr"], qlen, 1.0, 1.0,
                                     sm_scale=SCALE)
            return fn, o

        def fn():
            if verify_shared_kv_fwd(q, kext, vext, o, *tail, None, True, None, qlen, 1.0, 1.0,
                                    sm_scale=SCALE) is False:
                raise RuntimeError("verify_mla refused the problem")
        return fn, o
    if method == "sdpa":
        import torch.nn.functional as F

        bs, h, ctx = prob["bs"], prob["heads"], prob["prefix_lens"][0]
        assert all(p == ctx for p in prob["prefix_lens"])
        length = ctx + qlen
        mask = prob["sdpa_mask"]
        idx = prob["kv_indices"]

        def fn():
            keys = torch.cat([kbuf[idx, 0].view(bs, ctx, mv.D_QK), kext[:, 0].view(bs, qlen, mv.D_QK)], 1)
            seen = mask.view(bs, qlen, 1, length).bool().expand(bs, qlen, h, length).reshape(bs, 1, qlen * h, length)
            res = F.scaled_dot_product_attention(q.view(bs, 1, qlen * h, mv.D_QK), keys[:, None],
                                                 keys[:, None, :, : mv.D_LATENT], attn_mask=seen, scale=SCALE)
            o.view(bs, qlen * h, mv.D_LATENT).copy_(res[:, 0])
        return fn, o
    raise ValueError(method)


# ----------------------------------------------------------------------------------------------- timing

def bench_ms(fn) -> float:
    if STATE["device"] == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def capture(fn):
    """``fn`` captured in a CUDA graph, after one warm-up call on a side stream (as torch asks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_ms(fn) -> float | None:
    """The same call captured in a CUDA graph and replayed (launch overhead gone)."""
    if STATE["device"] == "cpu":
        return None
    return bench_ms(capture(fn).replay)


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def copy_gbps() -> float | None:
    if STATE["device"] == "cpu":
        return None
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * (2 << 30) / (ms * 1e-3) / 1e9


def matmul_tflops() -> float | None:
    if STATE["device"] == "cpu":
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def errors(o, ref) -> dict:
    o = o.float()
    if not torch.isfinite(o).all():
        return {"max_err": float("nan"), "rel_err": float("nan"), "finite": False}
    return {"max_err": round(float((o - ref).abs().max()), 6),
            "rel_err": round(float((o - ref).norm() / ref.norm()), 6), "finite": True}


def ok(err: dict) -> bool:
    return bool(err.get("finite")) and err["rel_err"] < 2e-2


def run_method(method, prob, ref, *, graph: bool = False, **kw) -> dict:
    """Check against the reference, then time eager (and, with ``graph``, replayed from a CUDA graph)."""
    fn, o = make_fn(method, prob, **kw)
    if fn is None:
        return {"skipped": o}
    try:
        fn()
        if STATE["device"] == "cuda":
            torch.cuda.synchronize()
        err = errors(o, ref)
        res = {"ms": bench_ms(fn), **err, "ok": ok(err)}
        if graph and STATE["device"] == "cuda":
            try:
                res["graph_ms"] = graph_ms(fn)
            except Exception as exc:  # a method that cannot be captured keeps its eager figure
                res["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return res
    except Exception as exc:  # one method failing must not lose the others
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        del fn


# ----------------------------------------------------------------------------------------------- precompile

def _warm(task) -> str:
    """Run one method once on a tiny problem with the same specialisation (bs, H, Q, nsplit, config)."""
    method, bs, h, q, config, nsplit = task
    t = time.time()
    try:
        STATE.setdefault("device", "cuda")
        prob = problem(bs, h, q, 96, device="cuda", dtype=torch.bfloat16, seed=1)
        fn, _ = make_fn(method, prob, config=mv.with_config(mv.GPU_CONFIG, **config) if config else None,
                        nsplit=nsplit)
        if fn is not None:
            fn()
            torch.cuda.synchronize()
        return f"ok {time.time() - t:.1f}s {task}"
    except Exception as exc:
        return f"FAILED {task}: {type(exc).__name__}: {str(exc)[:200]}"


def _pool_init():
    STATE["device"] = "cuda"


def precompile(tasks: list, workers: int) -> list[str]:
    tasks = list({repr(t): t for t in tasks}.values())
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_pool_init) as pool:
        return list(pool.imap_unordered(_warm, tasks))


def config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def tasks_for(shapes, methods, configs, nsplits) -> list:
    out = []
    for (bs, h, q, _ctx), m in itertools.product(shapes, methods):
        if m.startswith("kdtree"):
            for cfg, ns in itertools.product(configs, nsplits if m == "kdtree" else (1,)):
                out.append((m, bs, h, q, config_key(cfg), ns))
        else:
            out.append((m, bs, h, q, (), NSPLIT))
    return [(m, bs, h, q, dict(cfg), ns) if cfg else (m, bs, h, q, None, ns) for m, bs, h, q, cfg, ns in
            dict.fromkeys(out)]


# ----------------------------------------------------------------------------------------------- main

def tune(shapes, device, dtype) -> tuple[dict, list]:
    rows = []
    probs = {}
    for shape in shapes:
        prob = problem(*shape, device=device, dtype=dtype, seed=3)
        probs[shape] = (prob, run_reference(prob, SCALE))
    base = mv.GPU_CONFIG

    def score(cfg: dict) -> tuple[float, dict]:
        config = mv.with_config(base, **cfg)
        times = {}
        for shape, (prob, ref) in probs.items():
            r = run_method("kdtree", prob, ref, config=config)
            if "ms" not in r or not r["ok"]:
                return math.inf, {str(shape): r}
            times[str(shape)] = round(r["ms"] * 1e3, 1)
        geo = geomean(times.values())
        return geo, times

    def sweep(phase: str, start: dict, variants: list, best_cfg: dict | None,
              best: float) -> tuple[dict | None, float]:
        """Each variant on top of ``start``; the fastest config seen so far (``best_cfg`` at ``best`` to beat)."""
        for variant in variants:
            cfg = {**start, **variant}
            geo, times = score(cfg)
            rows.append({"phase": phase, "config": cfg, "geomean_us": round(geo, 1), "us": times})
            log(f"tune {phase} {variant}: geomean {geo:.1f} us {times}")
            if geo < best:
                best_cfg, best = cfg, geo
        return best_cfg, best

    best_tile, best = sweep("tile", {}, TILE_CONFIGS, None, math.inf)
    best_all, best = sweep("split", best_tile, SPLIT_RULES, dict(best_tile), best)
    best_all, best = sweep("combine", best_all, COMBINE_CONFIGS, best_all, best)
    probs.clear()
    return best_all, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--sglang", default=None, help="sglang wheel or zip of its attention files")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--config", default=None, help="JSON overrides of the kernel config (else the tuned/default)")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--shapes", default=None, help="JSON list of [bs, H, Q, ctx]")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--sweep", default=None, help="JSON list of config overrides: time only our kernel with each "
                    "of them on every shape, eager and replayed from a CUDA graph (kernel-<tag>-sweep.json), "
                    "no baselines")
    ap.add_argument("--parts", action="store_true", help="with --sweep: also the split kernel alone and the "
                    "combine alone, each replayed from a CUDA graph with L2 flushed (the other launch left out)")
    ap.add_argument("--ragged", action="store_true", help="only the ragged batches beside one request of their "
                    "total prefix (kernel-<tag>-ragged.json)")
    ap.add_argument("--kernel-path", default=None, help="import kdtree_ext from this directory")
    ap.add_argument("--ab", default=None, help="with --sweep: another checkout's kernels/kdtree beside ours in "
                    "this process, timed in interleaved rounds (kernel-<tag>-ab.json)")
    ap.add_argument("--rounds", type=int, default=7, help="with --ab: timing rounds per shape")
    ap.add_argument("--rep", type=float, default=20, help="with --ab: do_bench milliseconds per round")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.sglang:
        os.environ["KDTREE_SGLANG_WHEEL"] = args.sglang
    cpu = args.cpu_smoke
    STATE["device"] = device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    shapes = [tuple(s) for s in json.loads(args.shapes)] if args.shapes else SHAPES
    tune_shapes = TUNE_SHAPES
    if cpu:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--cpu-smoke needs TRITON_INTERPRET=1"
        shapes = [(1, 2, 9, 100), (2, 2, 16, 64)]
        tune_shapes = [(1, 2, 16, 80)]
    import triton

    t_start = time.time()
    info = {"device": torch.cuda.get_device_name(0) if not cpu else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "nsplit": NSPLIT}
    sglang_kernels()
    info["sglang"] = STATE["sglang_note"]
    info["copy_GBps"] = copy_gbps()
    info["matmul_bf16_TFLOPs"] = matmul_tflops()
    log("INFO " + json.dumps(info))
    if args.ragged:
        return ragged(info, args, device, dtype, cpu)
    if args.sweep and args.ab:
        return ab(json.loads(args.sweep), shapes, info, args, device, dtype)
    if args.sweep:
        return sweep(json.loads(args.sweep), shapes, info, args, device, dtype)
    methods = list(METHODS)
    user_cfg = json.loads(args.config) if args.config else None
    configs = [dict(user_cfg)] if user_cfg else [{}]
    if not cpu and not args.no_precompile:
        warm = tasks_for(shapes, methods, configs, (NSPLIT,))
        if args.tune:
            rules = list(TILE_CONFIGS) + [{**TILE_CONFIGS[0], **r} for r in SPLIT_RULES]
            rules += [{**TILE_CONFIGS[0], **c} for c in COMBINE_CONFIGS]
            warm += tasks_for(tune_shapes, ["kdtree"], rules, (NSPLIT,))
        t0 = time.time()
        results = precompile(warm, args.workers)
        failed = [r for r in results if r.startswith("FAILED")]
        log(f"precompile: {len(results)} variants in {time.time() - t0:.0f}s, {len(failed)} failed")
        for r in failed:
            log("  " + r)
        info["precompile_s"] = round(time.time() - t0, 1)
    tuning = []
    config = mv.with_config(mv.default_config(device), **(user_cfg or {}))
    if args.tune:
        try:
            best, tuning = tune(tune_shapes, device, dtype)
            config = mv.with_config(mv.default_config(device), **best)
            log(f"tuned: {config.describe()}")
        except Exception as exc:
            log(f"tuning failed ({type(exc).__name__}: {exc}); default config")
    info["config"] = config.describe()
    info["config_fields"] = {k: getattr(config, k) for k in config.__dataclass_fields__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for bs, h, q, ctx in shapes:

        prob = problem(bs, h, q, ctx, device=device, dtype=dtype, seed=ctx + 31 * bs + h + q)
        ref = run_reference(prob, SCALE)
        row = {"bs": bs, "h": h, "q": q, "ctx": ctx, "kind": "tree" if q == 16 else "chain",
               "kv_MB": round(kv_bytes(bs, ctx) / 1e6, 2)}
        row["columns"] = mv.plan(bs, q * h, NSPLIT, config, 64 if config.sm90 else config.block_m, True,
                                 config.pdl).columns
        ref_chain = ref if q != 16 else None
        for m in methods:
            if m == "verify_mla" and ref_chain is None:    # it runs the chain: check it against the chain
                ref_chain = run_reference(dict(prob, custom_mask=None, mask_indptr=None), SCALE)
            row[m] = run_method(m, prob, ref_chain if m == "verify_mla" else ref, config=config, graph=True)
        derive(row, info)
        rows.append(row)
        log("ROW " + json.dumps(row))
        (out / f"kernel-{args.tag}.json").write_text(json.dumps({"info": info, "tuning": tuning, "rows": rows,
                                                                 "partial": True}, indent=1) + "\n")
        del prob, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    info["seconds"] = round(time.time() - t_start, 1)
    report = {"info": info, "tuning": tuning, "rows": rows, "targets": targets(rows),
              "graph_targets": targets(rows, "graph_")}
    table = render(report)
    (out / f"kernel-{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"kernel-{args.tag}.md").write_text(table + "\n")
    log(table)
    return 0


def sweep(configs: list[dict], shapes, info, args, device, dtype) -> int:
    """Our kernel alone, every config on every shape (checked against the reference first): a table of us."""
    if device == "cuda" and not args.no_precompile:
        t0 = time.time()
        results = precompile(tasks_for(shapes, ["kdtree"], configs, (NSPLIT,)), args.workers)
        log(f"precompile: {len(results)} variants in {time.time() - t0:.0f}s, "
            f"{sum(r.startswith('FAILED') for r in results)} failed")
        for r in results:
            if r.startswith("FAILED"):
                log("  " + r)
    base = mv.default_config(device)
    rows = []
    for bs, h, q, ctx in shapes:
        prob = problem(bs, h, q, ctx, device=device, dtype=dtype, seed=ctx + 31 * bs + h + q)
        ref = run_reference(prob, SCALE)
        row = {"shape": [bs, h, q, ctx], "us": [], "floor_us": round(kv_bytes(bs, ctx) / (info["copy_GBps"] * 1e3), 2)
               if info.get("copy_GBps") else None}
        row["graph_us"] = []
        for cfg in configs:
            config = mv.with_config(base, **cfg)
            r = run_method("kdtree", prob, ref, config=config)
            good = "ms" in r and r["ok"]
            row["us"].append(round(r["ms"] * 1e3, 1) if good else (r.get("error") or f"WRONG {r.get('rel_err')}"))
            g = graph_ms(make_fn("kdtree", prob, config=config)[0]) if good and device == "cuda" else None
            row["graph_us"].append(round(g * 1e3, 1) if g else None)
            if args.parts and good and device == "cuda":
                row.setdefault("parts_us", []).append(
                    [round(graph_ms(only_part(part, prob, config)) * 1e3, 1) for part in ("split", "combine")])
        rows.append(row)
        log(f"SWEEP {bs} {h} {q} {ctx // 1024}k: " + " | ".join(str(u) for u in row["us"]) + "  || graph: " +
            " | ".join(str(u) for u in row["graph_us"]))
        if row.get("parts_us"):
            log(f"PARTS {bs} {h} {q} {ctx // 1024}k (split / combine, graph): " + " | ".join(
                f"{a} / {b}" for a, b in row["parts_us"]))
        del prob, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    if device == "cuda":
        log_compiled()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-{args.tag}-sweep.json").write_text(json.dumps({"info": info, "configs": configs, "rows": rows},
                                                                  indent=1) + "\n")
    for i, cfg in enumerate(configs):
        ts = [r["us"][i] for r in rows]
        gs = [r["graph_us"][i] for r in rows]
        if all(isinstance(t, float) for t in ts):
            geo = geomean(ts)
            ggeo = geomean(gs) if all(gs) else float("nan")
            log(f"config {i} {cfg}: geomean {geo:.1f} us eager, {ggeo:.1f} us graph")
        else:
            log(f"config {i} {cfg}: failed on some shapes")
    return 0


class Kernel:
    """One checkout's ``kdtree_ext`` modules, importable beside another's in one process: ``activate`` puts them
    in ``sys.modules`` (the kernels import their Hopper module lazily, by name, at the first launch)."""

    def __init__(self, name: str, modules: dict):
        self.name, self.modules = name, modules
        self.mv = modules["kdtree_ext.mla_verify"]

    def activate(self) -> None:
        sys.modules.update(self.modules)


def _ours(name: str) -> dict:
    return {k: v for k, v in sys.modules.items() if k == name or k.startswith(name + ".")}


def load_kernel(name: str, path: str | None) -> Kernel:
    """``kdtree_ext`` from ``path`` (None: the one this process imported first) as a :class:`Kernel`."""
    import importlib

    if path is None:
        with contextlib.suppress(ImportError):
            importlib.import_module("kdtree_ext.mla_verify_sm90")
        return Kernel(name, _ours("kdtree_ext"))
    mine = _ours("kdtree_ext")
    for k in mine:
        del sys.modules[k]
    sys.path.insert(0, os.path.abspath(path))
    try:
        importlib.import_module("kdtree_ext.mla_verify")
        with contextlib.suppress(ImportError):
            importlib.import_module("kdtree_ext.mla_verify_sm90")
        theirs = _ours("kdtree_ext")
    finally:
        sys.path.pop(0)
        for k in _ours("kdtree_ext"):
            del sys.modules[k]
        sys.modules.update(mine)
    return Kernel(name, theirs)


def ab(configs: list[dict], shapes, info, args, device, dtype) -> int:
    """Another checkout's kernel (``--ab DIR``, its default config) and ours under each of ``configs``, all in
    this process: per shape, every variant checked against the fp32 reference (eager, and its CUDA graph's
    replay on a poisoned output), then ``--rounds`` rounds of timing each variant's graph replay
    (``do_bench`` median, L2 flushed), the variants' order rotated each round. Reports each variant's median
    over the rounds and its range, and each of ours over the other's paired by round (median, min, max):
    run-to-run drift moves both sides of a pair alike."""
    import triton.testing

    if not args.no_precompile:
        t0 = time.time()
        results = precompile(tasks_for(shapes, ["kdtree"], configs, (NSPLIT,)), args.workers)
        log(f"precompile: {len(results)} variants in {time.time() - t0:.0f}s, "
            f"{sum(r.startswith('FAILED') for r in results)} failed")
    base = load_kernel("base", args.ab)
    ours = load_kernel("ours", None)
    variants = [("base", base, None)] + [(f"ours{i}", ours, ours.mv.with_config(ours.mv.default_config(device), **c))
                                         for i, c in enumerate(configs)]
    rows = []
    for bs, h, q, ctx in shapes:
        prob = problem(bs, h, q, ctx, device=device, dtype=dtype, seed=ctx + 31 * bs + h + q)
        ref = run_reference(prob, SCALE)
        graphs, errs = [], []
        for _name, kernel, config in variants:
            fn, o = make_fn("kdtree", prob, config=config, kernel=kernel)
            fn()
            torch.cuda.synchronize()
            e = errors(o, ref)
            g = capture(fn)
            o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            eg = errors(o, ref)
            errs.append({"eager": e, "graph": eg})
            if not (ok(e) and ok(eg)):
                raise SystemExit(f"WRONG {bs} {h} {q} {ctx} {_name}: {e} {eg}")
            graphs.append((g, fn, o))
        times = [[] for _ in variants]
        for rnd in range(args.rounds):
            n = len(variants)
            for k in range(n):
                i = (k + rnd) % n
                times[i].append(triton.testing.do_bench(graphs[i][0].replay, warmup=5, rep=args.rep,
                                                        return_mode="median") * 1e3)
        row = {"shape": [bs, h, q, ctx], "variants": []}
        for i, (name, _k, _c) in enumerate(variants):
            t = sorted(times[i])
            v = {"name": name, "graph_us": round(statistics.median(t), 2), "min_us": round(t[0], 2),
                 "max_us": round(t[-1], 2), "rounds_us": [round(x, 2) for x in times[i]], "errors": errs[i]}
            if i:
                r = sorted(a / b for a, b in zip(times[i], times[0], strict=True))
                v.update(over_base=round(statistics.median(r), 4), over_base_min=round(r[0], 4),
                         over_base_max=round(r[-1], 4))
            row["variants"].append(v)
        rows.append(row)
        log(f"AB {bs} {h} {q} {ctx // 1024}k: " + " | ".join(_ab_cell(v) for v in row["variants"]))
        del graphs, prob, ref
        torch.cuda.empty_cache()
    summary = []
    for i, (name, _k, _c) in enumerate(variants):
        ts = [r["variants"][i]["graph_us"] for r in rows]
        s_ = {"name": name, "config": configs[i - 1] if i else "base", "geomean_us": round(geomean(ts), 2)}
        if i:
            ratios = [r["variants"][i]["over_base"] for r in rows]
            s_["over_3pct"] = [r["shape"] for r in rows if r["variants"][i]["over_base"] > 1.03]
            s_["over_3pct_every_round"] = [r["shape"] for r in rows if r["variants"][i]["over_base_min"] > 1.03]
            s_["geomean_over_base"] = round(geomean(ratios), 4)
        summary.append(s_)
        log(f"AB-SUMMARY {json.dumps(s_)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-{args.tag}-ab.json").write_text(json.dumps(
        {"info": info, "base": os.path.abspath(args.ab), "configs": configs, "rounds": args.rounds,
         "rep_ms": args.rep, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


def _ab_cell(v: dict) -> str:
    cell = f"{v['name']} {v['graph_us']:.1f} [{v['min_us']:.1f}-{v['max_us']:.1f}]"
    if "over_base" in v:
        cell += (f" {100 * (v['over_base'] - 1):+.1f}% [{100 * (v['over_base_min'] - 1):+.1f}.."
                 f"{100 * (v['over_base_max'] - 1):+.1f}]")
    return cell


def loguniform(n: int, lo: int, hi: int, seed: int, total: int | None = None) -> list[int]:
    """``n`` prefix lengths drawn log-uniformly from [lo, hi] (fixed seed); ``total``: scaled to that sum."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.exp(math.log(lo) + torch.rand(n, generator=gen, dtype=torch.float64) * math.log(hi / lo))
    if total is not None:
        lens = lens * (total / float(lens.sum()))
    out = [round(x) for x in lens.tolist()]
    if total is not None:
        out[-1] += total - sum(out)
    return out


RAGGED = [  # name, H, Q, prefix lengths: the four batches, then two decode-like mixes
    ("mixed-8", 16, 9, [65536, 1, 4096, 17, 32768, 63, 64, 129]),
    ("64k+7x1k", 8, 9, [65536] + [1024] * 7),
    ("16-loguniform-1.3k-32k", 16, 9, loguniform(16, 1300, 32768, 16, total=136536)),
    ("128k+3x512", 8, 16, [131072, 512, 512, 512]),
    ("decode-32-1k-128k", 16, 9, loguniform(32, 1024, 131072, 32)),
    ("decode-64-1k-128k", 8, 9, loguniform(64, 1024, 131072, 64)),
]


def ragged(info, args, device, dtype, cpu) -> int:
    """Each ragged batch and one request of its total prefix (same H, Q), our kernel eager and replayed from a
    CUDA graph, checked against the fp32 reference first; ``ragged_over_single`` on the replay times."""
    cases = RAGGED if not cpu else [("cpu", 2, 9, [100, 0, 1, 37])]
    config = mv.with_config(mv.default_config(device), **json.loads(args.config or "{}"))
    info["config"] = config.describe()
    rows = []
    for name, h, q, lens in cases:
        row = {"name": name, "h": h, "q": q, "bs": len(lens), "prefix_lens": lens, "total": sum(lens)}
        for key, bs, ctx in (("batch", len(lens), lens), ("single", 1, [sum(lens)])):
            prob = problem(bs, h, q, ctx, device=device, dtype=dtype, seed=len(lens) + h + q)
            ref = run_reference(prob, SCALE)
            r = run_method("kdtree", prob, ref, config=config, graph=True)
            if "ms" in r:
                r["us"] = round(r.pop("ms") * 1e3, 1)
            if r.get("graph_ms"):
                r["graph_us"] = round(r.pop("graph_ms") * 1e3, 1)
            row[key] = r
            del prob, ref
            if device == "cuda":
                torch.cuda.empty_cache()
        for key, pre in (("graph_us", ""), ("us", "eager_")):
            a, b = row["batch"].get(key), row["single"].get(key)
            if a and b:
                row[f"{pre}ragged_over_single"] = round(a / b, 3)
        rows.append(row)
        log(f"RAGGED {name} H={h} Q={q} bs={len(lens)} total={sum(lens)}: batch {row['batch'].get('graph_us')} us, "
            f"single {row['single'].get('graph_us')} us (graph) -> {row.get('ragged_over_single')}; eager "
            f"{row['batch'].get('us')} / {row['single'].get('us')}; rel_err {row['batch'].get('rel_err')}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel-{args.tag}-ragged.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
    return 0


class _NoLaunch:
    """Stands in for a kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def only_part(part: str, prob, config):
    """Our kernel with the split or the combine side left out (``part``: "split" or "combine" is what runs; the
    combine alone reads whatever partials the workspace holds): where a launch's time goes."""
    full, _ = make_fn("kdtree", prob, config=config)
    names = (("_combine_kernel", "_combine_rows_kernel") if part == "split" else ("_split_kernel", "_sm90_kernel"))

    def fn():
        saved = {n: getattr(mv, n) for n in names}
        for n in names:
            setattr(mv, n, (lambda *a: _NoLaunch()) if n == "_sm90_kernel" else _NoLaunch())
        try:
            full()
        finally:
            for n, v in saved.items():
                setattr(mv, n, v)
    return fn


def log_compiled() -> None:
    """Registers, spills and shared memory of every split-kernel variant this process compiled."""
    try:
        for cache in mv._split_kernel.device_caches.values():
            for kernel in cache[0].values():
                names = kernel.src.fn.arg_names
                consts = {(names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k)): v
                          for k, v in kernel.src.constants.items() if isinstance(v, (int, bool))}
                log(f"COMPILED regs={kernel.n_regs} spills={kernel.n_spills} smem={kernel.metadata.shared} "
                    f"warps={kernel.metadata.num_warps} stages={kernel.metadata.num_stages} {consts}")
    except Exception as exc:  # introspection of Triton internals: informative only
        log(f"COMPILED n/a ({type(exc).__name__}: {exc})")


def derive(row: dict, info: dict) -> None:
    """us (eager) and graph_us (replayed from a CUDA graph), GB/s, fraction of copy bandwidth, floors, ratios
    (``speedup_vs_*`` eager against eager, ``graph_speedup_vs_*`` replay against replay)."""
    kvb = kv_bytes(row["bs"], row["ctx"])
    copy = info.get("copy_GBps")
    mm = info.get("matmul_bf16_TFLOPs")
    if copy:
        row["floor_us"] = round(kvb / (copy * 1e9) * 1e6, 2)
    if mm:
        row["compute_floor_us"] = round(flops(row["bs"], row["h"], row["q"], row["ctx"]) / (mm * 1e12) * 1e6, 2)
    for m in METHODS:
        r = row.get(m, {})
        if "ms" in r:
            r["us"] = round(r.pop("ms") * 1e3, 1)
            r["GBps"] = round(kvb / (r["us"] * 1e-6) / 1e9, 1)
            if copy:
                r["frac_copy"] = round(r["GBps"] / copy, 3)
        if r.get("graph_ms"):
            r["graph_us"] = round(r.pop("graph_ms") * 1e3, 1)
    for key, prefix in (("us", ""), ("graph_us", "graph_")):
        ours = row["kdtree"].get(key)
        if not ours:
            continue
        if copy:
            row[f"{prefix}x_floor"] = round(ours / row["floor_us"], 2)
        for m in METHODS[1:]:
            if row.get(m, {}).get(key):
                row[f"{prefix}speedup_vs_{m}"] = round(row[m][key] / ours, 2)


METHODS = ("kdtree", "kdtree_ns1", "extend", "verify_mla", "sdpa")


def targets(rows: list, prefix: str = "") -> dict:
    """The issue's targets, per shape: met / missed (``prefix`` "graph_": on CUDA-graph replay times)."""
    out = {"floor": [], "extend_100x": [], "verify_mla_3x": [], "nsplit1_3x": []}
    for r in rows:
        name = f"bs={r['bs']} H={r['h']} Q={r['q']} ctx={r['ctx']}"
        xf = r.get(f"{prefix}x_floor")
        if r["ctx"] >= 16384 and xf is not None:
            limit = 1.5 if r["bs"] == 8 else 3.0
            out["floor"].append({"shape": name, "x_floor": xf, "limit": limit, "met": xf <= limit,
                                 "compute_floor_x": round(r.get("compute_floor_us", 0) / r["floor_us"], 2)
                                 if r.get("floor_us") else None})
        for key, method, limit, when in (("extend_100x", "extend", 100, r["q"] == 16 and r["ctx"] == 65536),
                                         ("verify_mla_3x", "verify_mla", 3, r["q"] == 9),
                                         ("nsplit1_3x", "kdtree_ns1", 3, True)):
            x = r.get(f"{prefix}speedup_vs_{method}")
            if when and x is not None:
                out[key].append({"shape": name, "x": x, "met": x >= limit})
    for key, items in list(out.items()):
        out[key] = {"met": sum(i["met"] for i in items), "of": len(items), "items": items}
    return out


def render(report: dict) -> str:
    info = report["info"]
    lines = [f"device: {info['device']}; torch {info['torch']}, triton {info['triton']}; copy "
             f"{info.get('copy_GBps') or 0:.0f} GB/s; bf16 matmul {info.get('matmul_bf16_TFLOPs') or 0:.0f} TFLOP/s; "
             f"kernel config: {info['config']}; NSPLIT={info['nsplit']}; SGLang: {info['sglang']}", "",
             "Every time: eager / replayed from a CUDA graph (us); ratios likewise (baseline / ours).", "",
             "| bs | H | Q | ctx | kdtree us (eager GB/s, % copy) | x floor | NSPLIT=1 us | extend us | "
             "verify_mla us | SDPA us | vs ns1 | vs extend | vs verify_mla | vs SDPA | floor us (bw / compute) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def us(r):
        if "us" in r:
            graph = f"{r['graph_us']:,.1f}" if r.get("graph_us") else "-"
            return f"{r['us']:,.1f} / {graph}" + ("" if r.get("ok") else " (WRONG)")
        return "n/a" if "skipped" in r else "error"

    def pair(r, key):
        a, b = r.get(key, ""), r.get(f"graph_{key}", "")
        return f"{a} / {b}" if a != "" or b != "" else ""

    for r in report["rows"]:
        k = r["kdtree"]
        main = (f"{us(k)} ({k['GBps']:,.0f}, {100 * k.get('frac_copy', 0):.1f}%)") if "us" in k else "error"
        lines.append(
            f"| {r['bs']} | {r['h']} | {r['q']} | {r['ctx'] // 1024}k | {main} | {pair(r, 'x_floor')} | "
            f"{us(r['kdtree_ns1'])} | {us(r['extend'])} | {us(r['verify_mla'])} | {us(r['sdpa'])} | "
            + " | ".join(pair(r, f"speedup_vs_{m}") for m in METHODS[1:])
            + f" | {r.get('floor_us', '')} / {r.get('compute_floor_us', '')} |")
    for label, key in (("eager", "targets"), ("graph replay", "graph_targets")):
        t = report[key]
        lines += ["", f"targets ({label}): " + "; ".join(f"{k} {v['met']}/{v['of']}" for k, v in t.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
