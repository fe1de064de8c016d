"""Reference server: a GPU-free stand-in for ``python -m sglang.launch_server`` (SGLang 0.5.23).

It runs on test hosts under systemd as ``VENV/bin/python -m kdeploy_refserver <sglang flags>``: this file
is copied as ``kdeploy_refserver.py`` next to the deployed payload. It is therefore STDLIB ONLY, Python
3.11 compatible, self-contained, and must never import the ``kdeploy`` package. It also runs in place as
``python -m kdeploy_lab.refserver`` (tests).

What it reproduces from SGLang, as far as a deploy tool can observe it:

* Launch flags: the usual ``sglang.launch_server`` flags (``--model-path`` required, ``--tp-size``/``--tp``,
  ``--host`` 127.0.0.1, ``--port`` 30000, attention/speculative/HiCache/memory flags, ...). Bad values for
  typed flags exit 2 with one line on stderr; unknown flags are tolerated and logged once as
  ``ignoring unsupported flags: ...``.
* Plugins: the main process and then every TP worker, first thing, load the entry points of group
  ``sglang.srt.plugins`` (filtered by ``SGLANG_PLUGINS``, a comma list of entry-point names): each
  ``ep.load()`` is called with no arguments. A failing plugin is logged with its name and error and the
  exception is re-raised (the process aborts; a failing worker takes the server down).
* Processes: one worker ("scheduler") per TP rank, started with ``multiprocessing.get_context("spawn")``,
  so each one is a fresh interpreter in which ``sitecustomize`` on ``PYTHONPATH`` runs. Each worker logs
  ``Load weight end. ...``, ``KV Cache is allocated. #tokens: N, K size: X GB, V size: X GB`` and
  ``Memory pool end. ...``, reports ready to the main process and stays alive until told to stop or until
  the main process dies (it watches its pipe to the parent and its parent pid).
* KV allocator: when the real ``sglang`` package is importable (the sandbox's SGLang venv), each worker then
  does what SGLang's ModelRunner does: it builds a real ``TokenToKVPoolAllocator`` (#tokens as logged,
  bfloat16, device "cpu", no KV cache) with ``need_sort`` computed as SGLang does (``--disaggregation-mode``
  prefill or decode, so False in normal serving), and logs its class and final value:
  ``KV allocator TokenToKVPoolAllocator need_sort=True``. Without sglang it logs
  ``KV allocator skipped: sglang not importable (...)``. torch and sglang are imported only there, lazily.
  After the plugins ran, hooks that plugins registered with SGLang's ``HookRegistry`` are applied (as
  ``load_plugins()`` does) when that module is loaded.
* Logs: stdout, one flushed line per event, ``[YYYY-MM-DD HH:MM:SS] msg`` in the main process and
  ``[YYYY-MM-DD HH:MM:SS TP3] msg`` in worker rank 3 (the TP tag only when tp_size > 1, like SGLang).
  Readiness is logged as ``The server is fired up and ready to roll!``.
* HTTP (bound at start, before the workers): ``GET /health``, ``/health_generate``, ``/ready``, ``/ping``
  -> 503 until ready, then 200 with an empty body; ``GET /v1/models``, ``/model_info``, ``/server_info``
  (alias ``/get_server_info``); ``GET /metrics`` only with ``--enable-metrics`` (see Metrics below);
  ``POST /v1/completions`` (OpenAI format, ``"stream": true`` as server-sent events ending
  ``data: [DONE]``; ``"logprobs": k`` as SGLang answers it: ``{tokens, token_logprobs, top_logprobs,
  text_offset}`` with the k most likely tokens per position and text offsets -1; 503 until ready; 400 on
  malformed input) and ``POST /generate`` (SGLang native, ``"stream": true`` likewise). Every generated
  token takes ``REFSERVER_TOKEN_DELAY`` seconds, so requests stay in flight as long as on a real server.
  "The capital of France is" completes to " Paris. This is a well-known fact" (cut to ``max_tokens``
  whitespace tokens); other prompts get a pseudo-text derived from a hash of the prompt. Temperature 0 is
  deterministic; temperature > 0 is random (reproducible with ``seed``).
* Logits: each position has a distribution over a small vocabulary (the words of the pseudo-text plus
  the France answer's) whose greedy token leads the next one by at least 5 nats; the rest are derived from
  a hash of the prompt and the position, so logprobs are deterministic and differ between prompts.
* Metrics (``--enable-metrics``), with the names, label sets and bucket bounds of SGLang 0.5.23's
  ``srt/observability/metrics_collector.py``: histograms ``sglang:time_to_first_token_seconds``,
  ``sglang:e2e_request_latency_seconds`` (labels ``model_name, engine_type, is_streaming``),
  ``sglang:inter_token_latency_seconds`` (``model_name, engine_type``) and ``sglang:queue_time_seconds``;
  counters ``sglang:num_requests_total``, ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``
  (with ``is_streaming``), ``sglang:num_aborted_requests_total``; scheduler gauges (labels ``model_name,
  engine_type, tp_rank, pp_rank, moe_ep_rank``) ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:gen_throughput`` and, with ``--speculative-algorithm``, ``sglang:spec_accept_length``,
  ``sglang:spec_accept_rate`` and the counter ``sglang:spec_verify_calls_total``.
* Supervision: if a worker dies, the main process logs the rank and exit code, stops the other workers
  and exits 1. SIGINT: stop the workers and exit 0.
* SIGTERM drains, as SGLang 0.5.23's ``SignalHandler.sigterm_handler`` + ``TokenizerManager.sigterm_watchdog``
  do: ``/health`` answers 503 at once, requests in flight run to their end and new ones are still served;
  a watchdog that wakes every 5 s (``REFSERVER_SHUTDOWN_POLL``) since start logs ``Gracefully exiting...
  Remaining number of requests N`` and, once none remain, stops the workers and exits 0. There is no
  limit of its own: systemd's TimeoutStopSec ends a drain that takes too long.

Fault switches (environment variables, read by the main process and inherited by the workers):

``REFSERVER_SLOW_START=<seconds>``
    Become ready that many seconds after all workers reported ready (workers are already up).
``REFSERVER_EXIT_AT_START=<code>``
    Log one line and exit with that code right at start (before plugins, HTTP and workers).
``REFSERVER_DIE_RANK=<rank>``
    That worker exits with status 1 right after logging its ``Load weight end.`` (the server fails).
``REFSERVER_NO_PLUGINS_RANK=<rank>``
    That worker does not load entry-point plugins (a worker missing the extension); all else normal.
``REFSERVER_PYTHONPATH_RANK=<rank>:<dir>``
    That worker puts ``<dir>`` first on ``sys.path`` before loading plugins: it loads another copy of the
    extension (e.g. an older release), as a worker left over from an earlier run would.
``REFSERVER_WRONG_ANSWER=1``
    The France prompt yields " Lyon. It is a city" instead.
``REFSERVER_NONDETERMINISTIC=1``
    Temperature-0 answers vary between calls (a random word is appended).
``REFSERVER_TOKEN_DELAY=<seconds>``
    Each generated token takes that long (streamed tokens are sent one by one, as they are made).
``REFSERVER_SHUTDOWN_POLL=<seconds>``
    The SIGTERM watchdog's period (SGLang: 5); tests shorten it.
``REFSERVER_LOGIT_NOISE=<amplitude>``
    Every logit gets a deterministic offset in [-amplitude, +amplitude] (a kernel that computes attention
    slightly, or grossly, differently). Greedy tokens stay the argmax of the perturbed logits: below 2.5 the
    text never changes (the greedy token leads by at least 5), only the logprobs move, by up to about
    twice the amplitude.
``REFSERVER_LATENCY=<seconds>``
    Every generation request waits that long before its first token (time to first token grows).
``REFSERVER_ERROR_RATE=<fraction>``
    That fraction of generation requests answers HTTP 500, spread evenly and deterministically (with 0.01,
    every 100th request), counted in ``sglang:num_aborted_requests_total``.
``REFSERVER_SPEC_ACCEPT_LENGTH=<tokens>``
    The ``sglang:spec_accept_length`` gauge a speculative server (``--speculative-algorithm``) exports.
``REFSERVER_IGNORE_SIGTERM=1``
    The main process and the workers ignore SIGTERM (a slow CUDA teardown; systemd SIGKILLs them after
    TimeoutStopSec). Workers still exit when the main process dies.

Keep the module-level imports tiny: every spawned worker re-imports this module (as ``__mp_main__`` when
it runs as ``python -m``), and tp=8 workers must start in well under two seconds on two cores.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

PLUGIN_GROUP = "sglang.srt.plugins"
SGLANG_VERSION = "0.5.23"
READY_MESSAGE = "The server is fired up and ready to roll!"
FRANCE_PROMPT = "The capital of France is"
FRANCE_ANSWER = " Paris. This is a well-known fact"
WRONG_FRANCE_ANSWER = " Lyon. It is a city"

ENV_SLOW_START = "REFSERVER_SLOW_START"
ENV_EXIT_AT_START = "REFSERVER_EXIT_AT_START"
ENV_DIE_RANK = "REFSERVER_DIE_RANK"
ENV_PYTHONPATH_RANK = "REFSERVER_PYTHONPATH_RANK"
ENV_NO_PLUGINS_RANK = "REFSERVER_NO_PLUGINS_RANK"
ENV_WRONG_ANSWER = "REFSERVER_WRONG_ANSWER"
ENV_NONDETERMINISTIC = "REFSERVER_NONDETERMINISTIC"
ENV_IGNORE_SIGTERM = "REFSERVER_IGNORE_SIGTERM"
ENV_TOKEN_DELAY = "REFSERVER_TOKEN_DELAY"
ENV_SHUTDOWN_POLL = "REFSERVER_SHUTDOWN_POLL"
ENV_LOGIT_NOISE = "REFSERVER_LOGIT_NOISE"
ENV_LATENCY = "REFSERVER_LATENCY"
ENV_ERROR_RATE = "REFSERVER_ERROR_RATE"
ENV_SPEC_ACCEPT_LENGTH = "REFSERVER_SPEC_ACCEPT_LENGTH"
SHUTDOWN_POLL = 5.0  # SGLang's sigterm_watchdog sleeps 5 s between looks

# Sizes of the Kimi-K2.5 INT4 TP8 service in the field notes, at mem_fraction_static=0.88.
_BASE_MEM_FRACTION = 0.88
_BASE_KV_TOKENS = 159277
_BASE_KV_GB = 10.42  # K + V per rank
_GPU_AVAIL_GB = 94.50
_WEIGHTS_GB = 72.30

_HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
_HICACHE_IO_BACKENDS = ("direct", "kernel", "kernel_ascend")
_HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")

_WORDS = (
    "the", "model", "server", "answer", "river", "north", "light", "stone", "number", "city", "small",
    "green", "paper", "window", "quiet", "signal", "garden", "winter", "market", "energy", "bridge",
    "simple", "orange", "forest", "silver", "engine", "letter", "planet", "summer", "yellow", "cloud",
    "valley", "music", "table", "ocean", "friend", "history", "system", "little", "morning", "road",
    "school", "water", "family", "voice", "circle", "island", "mountain", "travel", "picture", "house",
    "story", "language", "kernel", "memory", "cache", "token", "tensor", "vector", "matrix", "graph",
    "is", "and", "of",
)

_plugins_loaded = False


# ----------------------------------------------------------------------------------------------- logging

def _log(msg: str, tag: str | None = None) -> None:
    """One line on stdout, flushed at once, in SGLang's shape: ``[time] msg`` or ``[time TP3] msg``."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    head = f"{stamp} {tag}" if tag else stamp
    try:
        sys.stdout.write(f"[{head}] {msg}\n")  # one write per line: lines of different processes never mix
        sys.stdout.flush()
    except (OSError, ValueError):
        pass  # stdout gone (reader closed the pipe): keep serving


def _rank_tag(rank: int, tp_size: int) -> str | None:
    return f"TP{rank}" if tp_size > 1 else None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        _log(f"ignoring {name}={raw!r}: not an integer")
        return None


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        _log(f"ignoring {name}={raw!r}: not a number")
        return None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# ----------------------------------------------------------------------------------------------- plugins

def load_plugins(tag: str | None = None) -> list[str]:
    """Load general plugins like SGLang's ``load_plugins()``: idempotent per process, whitelist from
    ``SGLANG_PLUGINS``, load every entry point, then call each with no arguments. A failure is logged with
    the plugin's name and error, then re-raised. Returns the names of the plugins run."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    from importlib.metadata import entry_points

    allowed_raw = os.environ.get("SGLANG_PLUGINS", "")
    allowed = {x.strip() for x in allowed_raw.split(",") if x.strip()} if allowed_raw.strip() else None
    loaded = []
    for ep in entry_points(group=PLUGIN_GROUP):
        if allowed is not None and ep.name not in allowed:
            _log(f"Skipping plugin {ep.name} (not in SGLANG_PLUGINS)", tag)
            continue
        try:
            func = ep.load()
        except Exception as exc:
            _log(f"Failed to load plugin {ep.name} from group {PLUGIN_GROUP}: {type(exc).__name__}: {exc}", tag)
            raise
        loaded.append((ep.name, func))
    for name, func in loaded:
        try:
            func()
        except Exception as exc:
            _log(f"Failed to execute general plugin: {name}: {type(exc).__name__}: {exc}", tag)
            raise
        _log(f"Executed general plugin: {name}", tag)
    hook_registry = sys.modules.get("sglang.srt.plugins.hook_registry")
    if hook_registry is not None:      # a plugin registered SGLang hooks: apply them, as load_plugins() does
        hook_registry.HookRegistry.apply_hooks()
    return [name for name, _ in loaded]


def build_kv_allocator(tokens: int, disaggregation_mode: str, tag: str | None = None) -> tuple[str, bool] | None:
    """Build the KV allocator like SGLang's ModelRunner (only when sglang is importable): returns
    (class name, need_sort) and logs them; None (and a ``skipped`` line) without sglang."""
    try:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    except Exception as exc:  # ImportError, or a broken install: the reference server still serves
        _log(f"KV allocator skipped: sglang not importable ({type(exc).__name__}: {exc})", tag)
        return None
    need_sort = disaggregation_mode in ("decode", "prefill")   # SGLang's kv_cache_configurator
    allocator = TokenToKVPoolAllocator(size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=None,
                                       need_sort=need_sort)
    _log(f"KV allocator {type(allocator).__name__} need_sort={allocator.need_sort}", tag)
    return type(allocator).__name__, bool(allocator.need_sort)


# ----------------------------------------------------------------------------------------------- workers

def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]  # optional, like SGLang

        setproctitle.setproctitle(title)
        return
    except Exception:
        pass
    try:
        with open("/proc/self/comm", "w") as f:  # the kernel keeps 15 characters
            f.write(title.split("::")[-1][:15])
    except OSError:
        pass


def _kv_numbers(cfg: dict) -> tuple[int, float]:
    """(#tokens, K size GB) per rank, derived from --mem-fraction-static like SGLang's rest_memory."""
    kv_gb = _BASE_KV_GB + (cfg["mem_fraction_static"] - _BASE_MEM_FRACTION) * _GPU_AVAIL_GB
    kv_gb = max(kv_gb, 0.02)
    return round(_BASE_KV_TOKENS * kv_gb / _BASE_KV_GB), kv_gb / 2


def _scheduler_main(rank: int, tp_size: int, conn, cfg: dict) -> None:
    """Body of one TP worker process (the target of a spawn Process: must stay a module-level function)."""
    tag = _rank_tag(rank, tp_size)
    _set_process_title(f"sglang::scheduler_TP{rank}")
    stale_rank, _, stale_dir = os.environ.get(ENV_PYTHONPATH_RANK, "").partition(":")
    if stale_dir and stale_rank.strip() == str(rank):
        sys.path.insert(0, stale_dir)
    if _env_int(ENV_NO_PLUGINS_RANK) != rank:
        load_plugins(tag)  # first thing, as SGLang's scheduler does
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent coordinates
    if _env_flag(ENV_IGNORE_SIGTERM):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()

    _log(f"Load weight begin. avail mem={_GPU_AVAIL_GB:.2f} GB", tag)
    _log(f"Load weight end. type=RefServerForCausalLM, dtype=torch.bfloat16, "
         f"avail mem={_GPU_AVAIL_GB - _WEIGHTS_GB:.2f} GB, mem usage={_WEIGHTS_GB:.2f} GB.", tag)
    if _env_int(ENV_DIE_RANK) == rank:
        _log(f"Scheduler hit an exception: RuntimeError: {ENV_DIE_RANK}={rank}: simulated worker failure", tag)
        sys.exit(1)
    tokens, half_gb = _kv_numbers(cfg)
    _log(f"KV Cache is allocated. #tokens: {tokens}, K size: {half_gb:.2f} GB, V size: {half_gb:.2f} GB", tag)
    build_kv_allocator(tokens, cfg.get("disaggregation_mode", "null"), tag)
    if cfg["enable_hierarchical_cache"]:
        host_gb = cfg["hicache_size"] if cfg["hicache_size"] else cfg["hicache_ratio"] * 2 * half_gb
        _log(f"Allocating {host_gb:.2f} GB host memory for hierarchical KV cache.", tag)
    _log(f"Memory pool end. avail mem={max(_GPU_AVAIL_GB - _WEIGHTS_GB - 2 * half_gb, 0.0):.2f} GB", tag)

    try:
        conn.send(("ready", rank, os.getpid()))
        while True:  # long-lived until told to stop or the parent is gone
            if conn.poll(0.5):
                if conn.recv() == "stop":
                    return
            elif os.getppid() != parent:
                return
    except (EOFError, OSError):
        return  # the parent died or closed our pipe


# ----------------------------------------------------------------------------------------------- CLI

def _build_parser():
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, exit 2, like argparse minus the usage block
            self.exit(2, f"{self.prog}: error: {message}\n")

    def positive_int(text: str) -> int:
        value = int(text)
        if value < 1:
            raise ValueError(text)
        return value

    positive_int.__name__ = "positive int"

    def port(text: str) -> int:
        value = int(text)
        if not 0 <= value <= 65535:
            raise ValueError(text)
        return value

    def fraction(text: str) -> float:
        value = float(text)
        if not 0.0 < value <= 1.0:
            raise ValueError(text)
        return value

    fraction.__name__ = "fraction in (0, 1]"

    def non_negative_float(text: str) -> float:
        value = float(text)
        if value < 0:
            raise ValueError(text)
        return value

    non_negative_float.__name__ = "non-negative float"

    p = _Parser(prog="kdeploy_refserver", allow_abbrev=False,
                description="GPU-free stand-in for `python -m sglang.launch_server` (see the module docstring).")
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--served-model-name")
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=positive_int, default=1)
    p.add_argument("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=positive_int, default=1)
    p.add_argument("--ep-size", "--ep", dest="ep_size", type=positive_int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=30000)
    p.add_argument("--attention-backend")
    p.add_argument("--decode-attention-backend")
    p.add_argument("--prefill-attention-backend")
    p.add_argument("--sampling-backend")
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model")
    p.add_argument("--speculative-num-steps", type=positive_int)
    p.add_argument("--speculative-eagle-topk", type=positive_int)
    p.add_argument("--speculative-num-draft-tokens", type=positive_int)
    p.add_argument("--mem-fraction-static", type=fraction, default=_BASE_MEM_FRACTION)
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-ratio", type=non_negative_float, default=2.0)
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--hicache-host-memory-fraction", type=fraction, default=0.8)
    p.add_argument("--hicache-write-policy", choices=_HICACHE_WRITE_POLICIES, default="write_through")
    p.add_argument("--hicache-io-backend", choices=_HICACHE_IO_BACKENDS, default="kernel")
    p.add_argument("--hicache-mem-layout", choices=_HICACHE_MEM_LAYOUTS, default="layer_first")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--context-length", type=positive_int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization")
    p.add_argument("--page-size", type=positive_int, default=1)
    p.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-running-requests", type=positive_int)
    p.add_argument("--max-total-tokens", type=positive_int)
    p.add_argument("--cuda-graph-max-bs", type=positive_int)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--watchdog-timeout", type=float)
    return p


def parse_args(argv: list[str] | None = None):
    """(namespace, unknown flags). Exits 2 with one line on a bad value."""
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    if args.tokenizer_path is None:
        args.tokenizer_path = args.model_path
    return args, unknown


# ----------------------------------------------------------------------------------------------- text

def _word_tokens(text: str) -> list[str]:
    return text.split()


def complete_tokens(prompt: str, max_tokens: int, temperature: float, seed: int | None,
                    noise: float = 0.0) -> list[str]:
    """The completion's whitespace tokens, at most ``max_tokens`` (before a fault word). At temperature 0
    each is the argmax of its position's (maybe perturbed) logits."""
    import random

    if max_tokens <= 0:
        return []
    tokens = _intended(prompt, max_tokens)
    if temperature > 0:  # sampled: keep the most likely first token, then wander
        rng = random.Random(f"{seed}:{prompt}") if seed is not None else random.Random()
        tokens = tokens[:1] + [rng.choice(_WORDS) for _ in range(max_tokens - 1)]
    elif noise:
        tokens = [max(logits.items(), key=lambda kv: kv[1])[0]
                  for logits in (_logits(prompt, i, t, noise) for i, t in enumerate(tokens))]
    if temperature == 0 and _env_flag(ENV_NONDETERMINISTIC):
        tokens.append(f"{random.choice(_WORDS)}{random.randrange(10**6)}")
    return tokens


def complete_text(prompt: str, max_tokens: int, temperature: float, seed: int | None, noise: float = 0.0) -> str:
    tokens = complete_tokens(prompt, max_tokens, temperature, seed, noise)
    return " " + " ".join(tokens) if tokens else ""


def _intended(prompt: str, max_tokens: int) -> list[str]:
    """The unperturbed greedy tokens: the France answer, or pseudo-words from a hash of the prompt."""
    import hashlib
    import random

    if prompt.strip().endswith(FRANCE_PROMPT):
        answer = WRONG_FRANCE_ANSWER if _env_flag(ENV_WRONG_ANSWER) else FRANCE_ANSWER
        return _word_tokens(answer)[:max_tokens]
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    return [rng.choice(_WORDS) for _ in range(max_tokens)]


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts``."""
    import hashlib

    digest = hashlib.blake2b("\0".join(map(str, parts)).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _logits(prompt: str, position: int, greedy: str, noise: float = 0.0) -> dict[str, float]:
    """Position ``position``'s logits over the vocabulary: ``greedy`` at 7..8, every other word at -4..2,
    each then offset by up to ``noise`` either way (``REFSERVER_LOGIT_NOISE``)."""
    vocab = dict.fromkeys((*_WORDS, *_word_tokens(FRANCE_ANSWER), *_word_tokens(WRONG_FRANCE_ANSWER), greedy))
    logits = {w: (7.0 + _unit(prompt, position, w)) if w == greedy else (-4.0 + 6.0 * _unit(prompt, position, w))
              for w in vocab}
    if noise:
        logits = {w: v + noise * (2.0 * _unit("noise", prompt, position, w) - 1.0) for w, v in logits.items()}
    return logits


def token_logprobs(prompt: str, tokens: list[str], top: int, noise: float = 0.0) -> dict:
    """SGLang's OpenAI-style ``logprobs`` of a completion (``to_openai_style_logprobs``): per position the
    chosen token's logprob and the ``top`` most likely tokens; text offsets are -1, as SGLang sends them."""
    import math

    intended = _intended(prompt, len(tokens))
    out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for i, token in enumerate(tokens):
        logits = _logits(prompt, i, intended[i] if i < len(intended) else token, noise)
        peak = max(logits.values())
        lse = peak + math.log(sum(math.exp(v - peak) for v in logits.values()))
        logprob = {w: v - lse for w, v in logits.items()}
        out["tokens"].append(" " + token)
        out["token_logprobs"].append(logprob.get(token, -9999.0))
        out["text_offset"].append(-1)
        if top:
            best = sorted(logprob.items(), key=lambda kv: -kv[1])[:top]
            out["top_logprobs"].append({" " + w: v for w, v in best})
    return out


# ----------------------------------------------------------------------------------------------- HTTP

# Bucket bounds of SGLang 0.5.23's TokenizerMetricsCollector / SchedulerMetricsCollector defaults.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
QUEUE_BUCKETS = (0.000, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60,
                 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500,
                 3000)
THROUGHPUT_WINDOW = 10.0  # seconds of generated tokens behind sglang:gen_throughput


class _Histogram:
    """Cumulative buckets, count and sum per label set, as prometheus_client keeps them."""

    def __init__(self, name: str, doc: str, buckets: tuple):
        self.name, self.doc, self.bounds = name, doc, buckets
        self.series: dict[str, list] = {}  # labels text -> [bucket counts..., count, sum]

    def observe(self, labels: str, value: float) -> None:
        row = self.series.setdefault(labels, [0] * (len(self.bounds) + 1) + [0.0])
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                row[i] += 1
        row[len(self.bounds)] += 1
        row[-1] += value

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        for labels, row in self.series.items():
            n = len(self.bounds)
            for i, bound in enumerate(self.bounds):
                lines.append(f'{self.name}_bucket{{{labels},le="{float(bound)}"}} {float(row[i])}')
            lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(row[n])}')
            lines.append(f"{self.name}_count{{{labels}}} {float(row[n])}")
            lines.append(f"{self.name}_sum{{{labels}}} {row[-1]}")
        return "\n".join(lines) + "\n"


class _Request:
    """One generation request's timing, observed into the metrics when it ends."""

    def __init__(self, streaming: bool):
        self.streaming = streaming
        self.start = time.monotonic()
        self.token_times: list[float] = []
        self.prompt_tokens = 0

    def token(self) -> None:
        self.token_times.append(time.monotonic())


class _State:
    def __init__(self, args, unknown: list[str]):
        import threading

        self.args = args
        self.unknown = unknown
        self.ready = threading.Event()
        self.draining = threading.Event()  # SIGTERM received: /health 503, requests still served
        self.started = time.time()
        self.requests = 0
        self.running = 0  # generation requests in flight (sglang:num_running_reqs)
        self.lock = threading.Lock()
        self.token_delay = max(0.0, _env_float(ENV_TOKEN_DELAY) or 0.0)
        self.latency = max(0.0, _env_float(ENV_LATENCY) or 0.0)
        self.noise = abs(_env_float(ENV_LOGIT_NOISE) or 0.0)
        self.error_rate = min(1.0, max(0.0, _env_float(ENV_ERROR_RATE) or 0.0))
        self.arrivals = 0  # generation requests received (the error schedule counts them)
        self.aborted = 0
        self.counters: dict[tuple[str, str], float] = {}  # (name, labels) -> value
        self.recent_tokens: list[float] = []  # times of tokens made in the last THROUGHPUT_WINDOW
        self.verify_calls = 0
        self.ttft = _Histogram("sglang:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = _Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              ITL_BUCKETS)
        self.e2e = _Histogram("sglang:e2e_request_latency_seconds",
                              "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)
        self.queue = _Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS)

    def fails_next(self) -> bool:
        """Whether the next generation request is one of the ``REFSERVER_ERROR_RATE`` share that fails:
        request n fails when floor((n + 1) * rate) > floor(n * rate), an exact, even spread."""
        with self.lock:
            n = self.arrivals
            self.arrivals += 1
            fail = int((n + 1) * self.error_rate) > int(n * self.error_rate)
            if fail:
                self.aborted += 1
            return fail

    @contextlib.contextmanager
    def in_flight(self, streaming: bool = False):
        """Count one generation request as running for as long as it is served (stream included), then
        observe its latencies and token counts."""
        with self.lock:
            self.running += 1
        request = _Request(streaming)
        try:
            yield request
        finally:
            with self.lock:
                self.running -= 1
                self.requests += 1
                self._observe(request)

    def _labels(self, streaming: bool | None = None) -> str:
        """Tokenizer metric labels (``tokenizer_metric_labels()``), with ``is_streaming`` where SGLang adds it."""
        text = f'model_name="{self.args.served_model_name}",engine_type="unified"'
        return text if streaming is None else text + f',is_streaming="{"true" if streaming else "false"}"'

    def _scheduler_labels(self) -> str:
        return (f'model_name="{self.args.served_model_name}",engine_type="unified",tp_rank="0",pp_rank="0",'
                'moe_ep_rank="0"')

    def _count(self, name: str, labels: str, value: float) -> None:
        self.counters[(name, labels)] = self.counters.get((name, labels), 0.0) + value

    def _observe(self, request: _Request) -> None:
        """(under the lock) What SGLang's tokenizer manager records when a request finishes."""
        import itertools

        end = time.monotonic()
        times = request.token_times
        stream = self._labels(request.streaming)
        self._count("sglang:num_requests_total", stream, 1)
        self._count("sglang:prompt_tokens_total", stream, request.prompt_tokens)
        self._count("sglang:generation_tokens_total", stream, len(times))
        self.queue.observe(self._scheduler_labels(), 0.0)
        if times:
            self.ttft.observe(stream, times[0] - request.start)
            for before, after in itertools.pairwise(times):
                self.itl.observe(self._labels(), after - before)
            self.recent_tokens = [t for t in self.recent_tokens if t > end - THROUGHPUT_WINDOW] + times
            self.verify_calls += len(times)
        self.e2e.observe(stream, end - request.start)

    def metrics(self) -> str:
        """Prometheus text with SGLang's names and labels (sglang/srt/observability/metrics_collector.py)."""
        a = self.args
        sched = self._scheduler_labels()
        with self.lock:
            now = time.monotonic()
            throughput = sum(1 for t in self.recent_tokens if t > now - THROUGHPUT_WINDOW) / THROUGHPUT_WINDOW
            out = ["# HELP sglang:num_running_reqs The number of running requests.",
                   "# TYPE sglang:num_running_reqs gauge",
                   f"sglang:num_running_reqs{{{sched}}} {float(self.running)}",
                   "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                   "# TYPE sglang:num_queue_reqs gauge",
                   f"sglang:num_queue_reqs{{{sched}}} 0.0",
                   "# HELP sglang:gen_throughput The generation throughput (token/s).",
                   "# TYPE sglang:gen_throughput gauge",
                   f"sglang:gen_throughput{{{sched}}} {throughput}"]
            if a.speculative_algorithm:
                accept = _env_float(ENV_SPEC_ACCEPT_LENGTH) or 1.0 + 0.8 * (a.speculative_num_steps or 3)
                steps = a.speculative_num_steps or 3
                out += ["# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding "
                        "(accepted drafts + bonus token per forward).",
                        "# TYPE sglang:spec_accept_length gauge",
                        f"sglang:spec_accept_length{{{sched}}} {accept}",
                        "# HELP sglang:spec_accept_rate Speculative acceptance rate (`accepted drafts / proposed "
                        "drafts` in batch).",
                        "# TYPE sglang:spec_accept_rate gauge",
                        f"sglang:spec_accept_rate{{{sched}}} {max(0.0, min(1.0, (accept - 1.0) / steps))}",
                        "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
                        "# TYPE sglang:spec_verify_calls_total counter",
                        f"sglang:spec_verify_calls_total{{{self._labels()}}} {float(self.verify_calls)}"]
            docs = {"sglang:num_requests_total": "Number of requests processed.",
                    "sglang:prompt_tokens_total": "Number of prefill tokens processed.",
                    "sglang:generation_tokens_total": "Number of generation tokens processed."}
            for name, doc in docs.items():
                out += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
                for streaming in (False, True):
                    labels = self._labels(streaming)
                    out.append(f"{name}{{{labels}}} {self.counters.get((name, labels), 0.0)}")
            out += ["# HELP sglang:num_aborted_requests_total Number of requests aborted.",
                    "# TYPE sglang:num_aborted_requests_total counter",
                    f"sglang:num_aborted_requests_total{{{self._labels()}}} {float(self.aborted)}"]
            text = "\n".join(out) + "\n"
            return text + "".join(h.text() for h in (self.ttft, self.itl, self.e2e, self.queue))


def _make_handler(state: _State):
    import itertools
    import json
    import uuid
    from http.server import BaseHTTPRequestHandler

    quiet_paths = {"/health", "/health_generate", "/ready", "/ping"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kdeploy-refserver"
        sys_version = ""

        def log_message(self, format, *args):
            pass

        def log_request(self, code="-", size="-"):
            path = self.path.split("?", 1)[0]
            if path not in quiet_paths:
                code = getattr(code, "value", code)
                _log(f'INFO: {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {code}')

        def _send(self, code: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self.send_response(code)
            if body:
                self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body:
                self.wfile.write(body)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def _error(self, code: int, message: str, kind: str) -> None:
            self._json(code, {"object": "error", "message": message, "type": kind, "param": None,
                              "code": code})

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            a = state.args
            if path in quiet_paths:
                self._send(200 if state.ready.is_set() and not state.draining.is_set() else 503)
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{
                    "id": a.served_model_name, "object": "model", "created": int(state.started),
                    "owned_by": "sglang", "root": a.served_model_name,
                    "max_model_len": a.context_length or 131072}]})
            elif path in ("/model_info", "/get_model_info"):
                self._json(200, {"model_path": a.model_path, "tokenizer_path": a.tokenizer_path,
                                 "is_generation": True, "preferred_sampling_params": None,
                                 "weight_version": "default", "has_image_understanding": False,
                                 "has_audio_understanding": False, "model_type": "refserver",
                                 "architectures": ["RefServerForCausalLM"]})
            elif path in ("/server_info", "/get_server_info"):
                info = dict(vars(a))
                info.update({"version": SGLANG_VERSION, "refserver": True, "pid": os.getpid(),
                             "ready": state.ready.is_set(), "unsupported_flags": state.unknown})
                self._json(200, info)
            elif path == "/metrics" and a.enable_metrics:
                self._send(200, state.metrics().encode(), "text/plain; version=0.0.4")
            else:
                self._error(404, f"Not Found: {path}", "NotFoundError")

        def _read_json(self):
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > 16 << 20:
                self.close_connection = True
                raise ValueError("bad Content-Length")
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"Invalid JSON body: {exc}") from None
            if not isinstance(body, dict):
                raise ValueError("The request body must be a JSON object")
            return body

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if path not in ("/v1/completions", "/generate"):
                self._error(404, f"Not Found: {path}", "NotFoundError")
                return
            try:
                body = self._read_json()
            except ValueError as exc:
                self._error(400, str(exc), "BadRequestError")
                return
            if not state.ready.is_set():
                self._error(503, "The server is not ready yet", "ServiceUnavailableError")
                return
            if state.fails_next():
                self._error(500, f"Internal server error ({ENV_ERROR_RATE}={state.error_rate:g})",
                            "InternalServerError")
                return
            try:
                with state.in_flight(bool(body.get("stream"))) as request:
                    if path == "/v1/completions":
                        self._completions(body, request)
                    else:
                        self._generate(body, request)
            except ValueError as exc:
                self._error(400, str(exc), "BadRequestError")

        @staticmethod
        def _sampling(src: dict, tokens_key: str) -> tuple[int, float, int | None]:
            max_tokens = src.get(tokens_key, 16)
            temperature = src.get("temperature", 1.0)
            seed = src.get("seed")
            if max_tokens is None:
                max_tokens = 16
            if temperature is None:
                temperature = 1.0
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
                raise ValueError(f"{tokens_key} must be a non-negative integer")
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
                raise ValueError("temperature must be a non-negative number")
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise ValueError("seed must be an integer")
            return max_tokens, float(temperature), seed

        @staticmethod
        def _prompts(prompt) -> list[str]:
            if isinstance(prompt, str):
                return [prompt]
            if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
                return [" ".join(str(p) for p in prompt)]  # token ids
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return prompt
            raise ValueError("prompt must be a string or a non-empty list of strings")

        @staticmethod
        def _stream(body: dict, prompts: list[str]) -> bool:
            """Whether to stream (one prompt only); a bad request is a 400 before anything is sent."""
            if not body.get("stream"):
                return False
            if len(prompts) != 1:
                raise ValueError("stream=true takes a single prompt")
            return True

        def _events(self, events) -> None:
            """Send server-sent events (chunked, one flush per event) as the tokens are made, then [DONE]."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in itertools.chain(events, ["[DONE]"]):
                data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        @staticmethod
        def _paced(text: str, request: _Request):
            """The completion's tokens, the first after ``REFSERVER_LATENCY``, each after
            ``REFSERVER_TOKEN_DELAY`` seconds."""
            if state.latency:
                time.sleep(state.latency)
            for token in _word_tokens(text):
                if state.token_delay:
                    time.sleep(state.token_delay)
                request.token()
                yield " " + token

        @staticmethod
        def _top_logprobs(body: dict) -> int | None:
            top = body.get("logprobs")
            if top is None:
                return None
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
                raise ValueError("logprobs must be an integer from 0 to 20")
            return top

        def _completions(self, body: dict, request: _Request) -> None:
            if "prompt" not in body:
                raise ValueError("prompt is required")
            prompts = self._prompts(body["prompt"])
            max_tokens, temperature, seed = self._sampling(body, "max_tokens")
            top = self._top_logprobs(body)
            request.prompt_tokens = sum(len(_word_tokens(p)) for p in prompts)
            if self._stream(body, prompts):
                rid, model = f"cmpl-{uuid.uuid4().hex}", state.args.served_model_name
                prompt = prompts[0]
                text = complete_text(prompt, max_tokens, temperature, seed, state.noise)
                tokens = _word_tokens(text)

                def chunk(i: int, piece: str, finish: str | None) -> dict:
                    logprobs = None
                    if top is not None and piece:
                        full = token_logprobs(prompt, tokens[:i + 1], top, state.noise)
                        logprobs = {k: v[i:] for k, v in full.items()}
                    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": [{"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish,
                                         "matched_stop": None}]}

                self._events(itertools.chain((chunk(i, t, None) for i, t in enumerate(self._paced(text, request))),
                                             [chunk(len(tokens), "", "length")]))
                return
            choices, completion_tokens = [], 0
            for i, prompt in enumerate(prompts):
                text = "".join(self._paced(complete_text(prompt, max_tokens, temperature, seed, state.noise),
                                           request))
                tokens = _word_tokens(text)
                choices.append({"index": i, "text": text,
                                "logprobs": None if top is None else token_logprobs(prompt, tokens, top, state.noise),
                                "finish_reason": "length", "matched_stop": None})
                completion_tokens += len(tokens)
            self._json(200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": state.args.served_model_name,
                             "choices": choices,
                             "usage": {"prompt_tokens": request.prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": request.prompt_tokens + completion_tokens}})

        def _generate(self, body: dict, request: _Request) -> None:
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise ValueError("sampling_params must be an object")
            prompts = self._prompts(body.get("text", body.get("input_ids")))
            max_tokens, temperature, seed = self._sampling(params, "max_new_tokens")
            request.prompt_tokens = sum(len(_word_tokens(p)) for p in prompts)

            def meta(prompt: str, text: str, done: bool) -> dict:
                return {"id": rid, "prompt_tokens": len(_word_tokens(prompt)),
                        "completion_tokens": len(_word_tokens(text)),
                        "finish_reason": {"type": "length", "length": max_tokens} if done else None}

            rid = uuid.uuid4().hex
            if self._stream(body, prompts):  # SGLang streams the text so far in every event
                prompt = prompts[0]
                full = complete_text(prompt, max_tokens, temperature, seed, state.noise)

                def events():
                    text = ""
                    for piece in self._paced(full, request):
                        text += piece
                        yield {"text": text, "meta_info": meta(prompt, text, text == full)}

                self._events(events())
                return
            out = []
            for prompt in prompts:
                text = "".join(self._paced(complete_text(prompt, max_tokens, temperature, seed, state.noise),
                                           request))
                out.append({"text": text, "meta_info": meta(prompt, text, True)})
            single = isinstance(body.get("text", body.get("input_ids")), str) or len(out) == 1
            self._json(200, out[0] if single else out)

    return Handler


# ----------------------------------------------------------------------------------------------- main

def _stop_workers(procs: list, conns: list, timeout: float = 3.0) -> None:
    """Ask every live worker to stop, then SIGTERM, then SIGKILL the stragglers; reap them all."""
    for conn in conns:
        if conn is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            conn.send("stop")
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 1.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for conn in conns:
        if conn is not None:
            conn.close()


def _drain(state: _State, wake_fd: int, received: list[int], clear_wakeup) -> None:
    """SGLang's ``sigterm_watchdog``: look every period (counted from the start) until no request is left;
    a second signal other than SIGTERM (Ctrl-C) ends the wait."""
    from multiprocessing.connection import wait

    state.draining.set()
    period = _env_float(ENV_SHUTDOWN_POLL) or SHUTDOWN_POLL
    seen = len(received)
    while True:
        elapsed = time.time() - state.started
        wait([wake_fd], period - elapsed % period)
        clear_wakeup()
        if any(sig != received[0] for sig in received[seen:]):
            _log("Interrupted while draining: exiting now")
            return
        with state.lock:
            remaining = state.running
        _log(f"Gracefully exiting... Remaining number of requests {remaining}.")
        if not remaining:
            return


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _server_args_line(args) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(args).items())
    return f"server_args=ServerArgs({fields})"


def main(argv: list[str] | None = None) -> int:
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)
    args, unknown = parse_args(argv)

    exit_code = _env_int(ENV_EXIT_AT_START)
    if exit_code is not None:
        _log(f"{ENV_EXIT_AT_START}={exit_code}: exiting at start before any worker")
        return exit_code

    if unknown:
        _log("ignoring unsupported flags: " + " ".join(unknown))
    _log(_server_args_line(args))
    load_plugins()

    import multiprocessing
    import signal
    import socket
    import threading
    from http.server import ThreadingHTTPServer
    from multiprocessing.connection import wait

    state = _State(args, unknown)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in args.host else socket.AF_INET  # `--host ::` as SGLang takes it

        def handle_error(self, request, client_address):  # e.g. a client hanging up: one line, no traceback
            exc = sys.exc_info()[1]
            _log(f"WARNING: request from {client_address[0]}:{client_address[1]} failed: {exc!r}")

    try:
        httpd = Server((args.host, args.port), _make_handler(state))
    except OSError as exc:
        _log(f"ERROR: cannot listen on {_hostport(args.host, args.port)}: {exc}")
        return 1
    http_thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                   name="http", daemon=True)
    http_thread.start()
    _log(f"HTTP server listening on http://{_hostport(*httpd.server_address[:2])} (health: 503 until ready)")

    # Signals: handlers only note the signal; the wakeup fd interrupts the supervision wait at once.
    received: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def on_signal(signum, _frame):
        received.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    if _env_flag(ENV_IGNORE_SIGTERM):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _log(f"{ENV_IGNORE_SIGTERM}=1: ignoring SIGTERM")
    else:
        signal.signal(signal.SIGTERM, on_signal)

    def drain_wakeup() -> None:
        try:
            while os.read(wake_r, 512):
                pass
        except OSError:
            pass

    ctx = multiprocessing.get_context("spawn")
    cfg = {"mem_fraction_static": args.mem_fraction_static,
           "enable_hierarchical_cache": args.enable_hierarchical_cache,
           "hicache_ratio": args.hicache_ratio, "hicache_size": args.hicache_size,
           "disaggregation_mode": args.disaggregation_mode}
    procs: list = []
    conns: list = []
    t0 = time.monotonic()
    try:
        for rank in range(args.tp_size):
            if received:
                break
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(target=_scheduler_main, args=(rank, args.tp_size, child_conn, cfg),
                            name=f"scheduler_TP{rank}", daemon=True)
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
            _log(f"Started scheduler process TP{rank} pid={p.pid}")

        slow = _env_float(ENV_SLOW_START) or 0.0
        ready_ranks: set[int] = set()
        ready_at: float | None = None
        while not received:
            timeout = 0.5
            if ready_at is not None and not state.ready.is_set():
                timeout = max(0.0, min(timeout, ready_at - time.monotonic()))
            waitables = [wake_r] + [p.sentinel for p in procs] + [c for c in conns if c is not None]
            fired = wait(waitables, timeout)
            drain_wakeup()
            if received:
                break
            for i, conn in enumerate(conns):
                if conn is None or conn not in fired:
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    conns[i] = None  # the worker is gone: its sentinel tells how
                    continue
                if isinstance(msg, tuple) and msg and msg[0] == "ready":
                    ready_ranks.add(msg[1])
                    if len(ready_ranks) == args.tp_size and ready_at is None:
                        _log(f"All {args.tp_size} scheduler(s) ready in {time.monotonic() - t0:.2f} s")
                        if slow > 0:
                            _log(f"{ENV_SLOW_START}={slow:g}: becoming ready in {slow:g} s")
                        ready_at = time.monotonic() + slow
            dead = [(rank, p) for rank, p in enumerate(procs) if p.sentinel in fired or not p.is_alive()]
            if dead:
                # systemd SIGTERMs the whole cgroup at once: a worker may die of it just before we see ours.
                if wait([wake_r], 0.5):
                    drain_wakeup()
                if received:
                    break
                dead = [(rank, p) for rank, p in enumerate(procs) if not p.is_alive()]
                for rank, p in dead:
                    p.join(0.1)
                    _log(f"ERROR: scheduler TP{rank} (pid {p.pid}) died with exit code {p.exitcode}; "
                         f"terminating the other scheduler(s) and exiting")
                _stop_workers(procs, conns)
                httpd.shutdown()
                httpd.server_close()
                return 1
            if ready_at is not None and not state.ready.is_set() and time.monotonic() >= ready_at:
                state.ready.set()
                _log(READY_MESSAGE)
    except BaseException:
        _stop_workers(procs, conns, timeout=1.0)
        raise

    name = signal.Signals(received[0]).name
    if received[0] == signal.SIGTERM:
        _log(f"SIGTERM received. signum={int(signal.SIGTERM)}. Draining requests and shutting down...")
        _drain(state, wake_r, received, drain_wakeup)
    else:
        _log(f"Received {name}, shutting down")
    _stop_workers(procs, conns)
    httpd.shutdown()
    httpd.server_close()
    _log("Shutdown complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
