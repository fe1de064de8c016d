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
* Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``, default ``null``: unified), as SGLang
  0.5.23's ``srt/disaggregation`` behaves toward a router and a deploy tool. Flags: ``--disaggregation-bootstrap-port``
  (default 8998), ``--disaggregation-transfer-backend`` (SGLang's choices; ``mooncake_tcp`` becomes ``mooncake``
  with ``MC_FORCE_TCP=1`` and no IB device; a prefill refuses ``fake``: ``Prefill server does not support 'fake' as
  the transfer backend``, exit 2), ``--disaggregation-ib-device`` (accepted and logged), ``--load-balance-method``
  (``auto`` resolves to ``follow_bootstrap_room`` on a prefill, ``round_robin`` otherwise). ``/server_info``
  reports them all; ``/model_info`` reports ``disaggregation_mode`` (what the router's registration reads).

  - A prefill's head runs a bootstrap server on ``--host``:``--disaggregation-bootstrap-port`` from the start
    (logs ``CommonKVBootstrapServer started successfully on HOST:PORT``; a port in use is logged as ``ERROR:
    Server error: ...`` and the server runs on without one, as SGLang's does). Routes, as SGLang's
    ``CommonKVBootstrapServer``: ``GET /health`` -> 200 ``OK`` (always); ``PUT /route`` (a rank registers: JSON
    ``attn_tp_size/rank``, ``attn_cp_size/rank``, ``attn_dp_size/rank``, ``pp_size/rank``, ``rank_ip``,
    ``rank_port``, ``page_size``, ``kv_cache_dtype``, ``prefill_http_port``, ``decode_allocation_policy``, ...)
    -> 200 ``OK``; ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=`` -> 400
    ``Missing inputs for bootstrap server.``, 503 ``Prefill server not fully registered yet (N workers
    registered).``, with all four -1 200 and the ``PrefillServerInfo`` JSON (``attn_tp_size``, ``attn_cp_size``,
    ``dp_size``, ``pp_size``, ``page_size``, ``kv_cache_dtype``, ``follow_bootstrap_room``,
    ``prefill_http_port``, ``decode_allocation_policy``, ...), with ranks 200 ``{"rank_ip", "rank_port"}`` or 404;
    ``POST /register_dp_rank`` and ``POST /query_dp_ranks``. Every prefill node registers one row per TP rank
    once its schedulers are up (SGLang's ``register_to_bootstrap``: to the dist-init-addr host when given, else
    ``--host`` with a wildcard rewritten to loopback; 5 tries with backoff, then ``ERROR: Prefill instance failed
    to register to bootstrap server after 5 retries``) and is ready only after; ``rank_ip`` is the node's address
    toward that host and ``rank_port`` the bootstrap port. So on a prefill spanning nodes only the head serves
    the bootstrap port, and every follower must reach it.
  - Where this server moves the KV instead of SGLang's transfer engine: ``GET /kv?room=R&timeout=T`` on the
    bootstrap server. It tells the prefill's request for room R that its decode is here, waits up to T s (at most
    120) until that request left its KV, and answers 200 JSON ``{"bootstrap_room", "rid", "prompt",
    "first_token", "first_logits", "page_size", "kv_cache_dtype", "tp_size"}`` (the prompt, the first generated
    word and position 0's logits over the vocabulary), once: the room is then done; else 404 ``No KV for
    bootstrap_room R within T s``.
  - A generation request (``/generate`` or ``/v1/completions``) on a PD server needs ``bootstrap_room`` (an int,
    or one per prompt; an int for several prompts is room + i, as SGLang normalizes), with ``bootstrap_host``
    and ``bootstrap_port``, as the router adds them to the one body it sends to a prefill and a decode at once.
    Without a room (and backend not ``fake``): 400 ``Invalid request: Disaggregated request received without
    bootstrap room id. req.rid='RID'`` (``/generate``: ``{"error": {"message": ...}}``; ``/v1/completions``: an
    error object of type ``BadRequest``). ``bootstrap_host`` ``2.2.2.2`` (SGLang's fake bootstrap host, which its
    own health check and warmup use) contacts no peer: a prefill answers 1 token, a decode a full answer
    generated from KV that never came (meaningless text: not the unified answer).
  - On a prefill, a request for room R waits until R's decode asks for the KV (SGLang's bootstrap queue, at most
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` seconds, default 300; then 500 ``Prefill bootstrap failed for
    request rank=0 req.rid='RID' req.bootstrap_room=R with exception KVTransferError(bootstrap_room=R): Request R
    timed out after Ts in KVPoll.Bootstrapping``), computes the first token (``max_new_tokens`` is forced to 1,
    ``REFSERVER_LATENCY``/``REFSERVER_TOKEN_DELAY`` apply), leaves the KV and waits until the decode received it
    (the inflight queue; a decode that went away: 500 ``Prefill transfer failed ...``), then answers its 1 token.
    So a prefill answers only once its decode got the KV, as SGLang's does.
  - On a decode, a request fetches ``GET http://bootstrap_host:bootstrap_port/route?...=-1`` (``bootstrap_port``
    null: its own ``--disaggregation-bootstrap-port``), retried each second, then ``GET /kv?room=R``, all within
    ``REFSERVER_HANDSHAKE_TIMEOUT`` seconds (default 15, SGLang's 15 tries); then it generates from the KV: the
    unified server's text and logprobs for the KV's prompt, position 0 being the prefill's token and logits.
    A failed handshake (bootstrap unreachable or silent, no KV for the room in time, a wrong room) answers 500
    ``{"object": "error", "message": "Decode handshake failed for request rank=0 decode_req.req.rid='RID'
    decode_req.req.bootstrap_room=R with exception KVTransferError(bootstrap_room=R): WHY", "type": "500",
    "param": null, "code": 500}`` (SGLang's f-string, ``{decode_req.req.rid=}``). A prefill whose
    ``--page-size`` or ``--kv-cache-dtype`` differs from the decode's raises in SGLang's decode scheduler: the
    decode logs ``Scheduler hit an exception: RuntimeError: Page size mismatch: ...``, answers nothing and exits
    1. Streamed, an abort is an error event then ``data: [DONE]`` (``/v1/completions``: ``{"error": {...}}``;
    ``/generate``: a ``meta_info.finish_reason`` of type ``abort`` with ``status_code``).
  - ``/health`` works as on a unified server: SGLang's is a fake-bootstrap 1-token generate, which proves this
    server only, nothing about any pair.
* Metrics (``--enable-metrics``), with the names, label sets and bucket bounds of SGLang 0.5.23's
  ``srt/observability/metrics_collector.py``, ``engine_type`` being ``unified``, ``prefill`` or ``decode`` after
  ``--disaggregation-mode``: histograms ``sglang:time_to_first_token_seconds``,
  ``sglang:e2e_request_latency_seconds`` (labels ``model_name, engine_type, is_streaming``),
  ``sglang:inter_token_latency_seconds`` (``model_name, engine_type``) and ``sglang:queue_time_seconds``;
  counters ``sglang:num_requests_total``, ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``
  (with ``is_streaming``), ``sglang:num_aborted_requests_total``; scheduler gauges (labels ``model_name,
  engine_type, tp_rank, pp_rank, moe_ep_rank``) ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:gen_throughput`` and, with ``--speculative-algorithm``, ``sglang:spec_accept_length``,
  ``sglang:spec_accept_rate`` and the counter ``sglang:spec_verify_calls_total``; the disaggregation gauges
  ``sglang:num_prefill_bootstrap_queue_reqs``, ``sglang:num_prefill_inflight_queue_reqs`` (a prefill's requests
  waiting for their decode, and whose KV is not taken yet), ``sglang:num_decode_prealloc_queue_reqs``,
  ``sglang:num_decode_transfer_queue_reqs`` (a decode's requests reaching the bootstrap server, and waiting for
  the KV), 0 outside their role as SGLang sets them, and not counted in ``sglang:num_running_reqs`` (as in
  SGLang); the counters ``sglang:num_bootstrap_failed_reqs_total`` and ``sglang:num_transfer_failed_reqs_total``,
  which (a labelled prometheus_client counter) have no sample before their first failure: read absent as 0.
* Supervision: if a worker dies, the main process logs the rank and exit code, stops the other workers
  and exits 1. SIGINT: stop the workers (the head: and its followers) and exit 0.
* SIGTERM drains, as SGLang 0.5.23's ``SignalHandler.sigterm_handler`` + ``TokenizerManager.sigterm_watchdog``
  do: ``/health`` answers 503 at once, requests in flight run to their end and new ones are still served;
  a watchdog that wakes every 5 s (``REFSERVER_SHUTDOWN_POLL``) since start logs ``Gracefully exiting...
  Remaining number of requests N`` and, once none remain, stops the workers and exits 0. There is no
  limit of its own: systemd's TimeoutStopSec ends a drain that takes too long.
* Multi-node (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``, ``--tp`` the total over all nodes and
  divisible by N; ``--dist-timeout`` seconds bounds the rendezvous, default 600): node R runs the workers of TP
  ranks R*tp/N .. (R+1)*tp/N-1 (tagged ``TP8``..``TP15`` on node 1 of tp 16), as SGLang's
  ``_calculate_rank_ranges``. The nodes meet over TCP at dist-init-addr: the head (rank 0) listens on that
  port on every address; each follower connects (retrying until the head listens) and joins; once all N-1
  have joined the group is formed and every node starts its workers. The group lives and dies whole, like a
  torch process group: each side heartbeats every 1 s, and EOF or 3 s of silence from a peer, a worker's
  death on any node, or a join that cannot be accepted makes the nodes that see it log why and exit 1; a
  join after the group formed is refused (a node restarted alone cannot rejoin). The head serves the full
  HTTP API and is ready once its workers and every follower's are; a follower has no tokenizer and no API:
  once its workers are ready it serves SGLang's dummy health server on ``--port`` (``/health``,
  ``/health_generate``, ``/ping``: always 200; other paths 404; nothing listens before). SIGTERM: the head
  drains as above, then sends every follower SGLang's ShutdownReq and waits (up to 15 s) until each has
  stopped its workers and closed; a follower only logs ``SIGTERM received on node_rank R; waiting for the
  rank-0 ShutdownReq broadcast to stop the schedulers.`` (systemd's TimeoutStopSec is the backstop) and
  exits 0 when the head's shutdown comes. The rendezvous protocol is one JSON object per line, ``op`` naming
  it: follower -> head ``join`` (``node_rank``, ``nnodes``, ``tp_size``, ``pid``) and ``ready``; head ->
  follower ``welcome``, ``refused`` (``reason``; the head then closes), ``formed`` and ``shutdown``; both ways
  ``heartbeat``. Log lines for a deploy tool to grep: ``Node R joined from ADDR (k/N-1 follower node(s))``,
  ``All N nodes joined: the process group is formed``, ``Node R is ready: scheduler(s) TPa..TPb``,
  ``Refused node_rank R from ADDR: REASON``, ``Sending shutdown to k follower node(s)``, ``Node R shut down``
  (head); ``Joined the process group at ADDR as node_rank R``, ``Dummy health check server started in
  background thread at HOST:PORT``, ``Shutdown received from the head (node_rank 0): stopping the
  scheduler(s)`` (follower); ``ERROR: lost node_rank R (ADDR): WHY; the process group is broken, exiting``,
  ``ERROR: lost the head (node_rank 0) at ADDR: WHY; ...``, ``ERROR: the rendezvous at ADDR refused node_rank R:
  REASON``, ``ERROR: rendezvous at ADDR timed out after T s: ...`` (exit 1).

Fault switches (environment variables, read by the main process and inherited by the workers):

``REFSERVER_SLOW_START=<seconds>``
    Become ready that many seconds after all workers reported ready (workers are already up).
``REFSERVER_EXIT_AT_START=<code>``
    Log one line and exit with that code right at start (before plugins, HTTP and workers).
``REFSERVER_DIE_RANK=<rank>``
    That worker exits with status 1 right after logging its ``Load weight end.`` (the server fails; the rank
    is the TP rank over all nodes, so on a multi-node server the node that runs it fails, and the group with it).
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
    twice the amplitude. Through a prefill/decode pair: on the decode it moves positions 1 and later, on the
    prefill position 0 (its logits travel with the KV), so parity through the pair sees either.
``REFSERVER_LATENCY=<seconds>``
    Every generation request waits that long before its first token (time to first token grows).
``REFSERVER_ERROR_RATE=<fraction>``
    That fraction of generation requests answers HTTP 500, spread evenly and deterministically (with 0.01,
    every 100th request), counted in ``sglang:num_aborted_requests_total``.
``REFSERVER_SPEC_ACCEPT_LENGTH=<tokens>``
    The ``sglang:spec_accept_length`` gauge a speculative server (``--speculative-algorithm``) exports.
``REFSERVER_BOOTSTRAP_DOWN=1``
    (prefill) The bootstrap port is bound and accepts connections but never answers (a hung bootstrap server):
    decodes fail their handshake (500 ``Decode handshake failed ...``), the prefill's own requests time out
    waiting for their decode, and the head does not register its ranks.
``REFSERVER_HANDSHAKE_TIMEOUT=<seconds>``
    (decode) How long a request may take to reach its prefill's bootstrap server and get its KV (default 15);
    tests shorten it.
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=<seconds>``
    (prefill; SGLang's own variable) How long a request waits for its decode (default 300).
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
from collections.abc import Callable
from typing import Any

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
ENV_BOOTSTRAP_DOWN = "REFSERVER_BOOTSTRAP_DOWN"
ENV_HANDSHAKE_TIMEOUT = "REFSERVER_HANDSHAKE_TIMEOUT"
ENV_BOOTSTRAP_TIMEOUT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"  # SGLang's own variable, honoured as SGLang does
SHUTDOWN_POLL = 5.0  # SGLang's sigterm_watchdog sleeps 5 s between looks

# Prefill/decode disaggregation (SGLang 0.5.23's srt/disaggregation).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's FAKE_BOOTSTRAP_HOST: no peer, no transfer (its /health and warmup use it)
FAKE_KV_SUFFIX = "\0fake-kv"  # a decode's fake transfer generates from no real KV: text from a prompt nobody sent
BOOTSTRAP_PORT = 8998
BOOTSTRAP_TIMEOUT = 300.0        # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: a prefill request waits this for its decode
DECODE_HANDSHAKE_TIMEOUT = 15.0  # a decode reaches the bootstrap server and gets the KV within this (15 tries, 1 s)
KV_TTL = 120.0                   # a prefill keeps a room's KV this long for its decode (SGLang's entry cleanup)
_TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")
_LOAD_BALANCE_METHODS = ("auto", "round_robin", "follow_bootstrap_room", "total_requests", "total_tokens")
_ENGINE_TYPES = {"null": "unified", "prefill": "prefill", "decode": "decode"}

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

    def checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], name: str) -> Callable[[str], Any]:
        """An argparse type: ``convert`` the text, refused unless ``ok``; argparse names it ``name`` in errors."""
        def parse(text: str) -> Any:
            value = convert(text)
            if not ok(value):
                raise ValueError(text)
            return value

        parse.__name__ = name
        return parse

    positive_int = checked(int, lambda v: v >= 1, "positive int")
    port = checked(int, lambda v: 0 <= v <= 65535, "port")
    fraction = checked(float, lambda v: 0.0 < v <= 1.0, "fraction in (0, 1]")
    non_negative_float = checked(float, lambda v: v >= 0, "non-negative float")
    non_negative_int = checked(int, lambda v: v >= 0, "non-negative int")

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
    p.add_argument("--disaggregation-transfer-backend", choices=_TRANSFER_BACKENDS, default="mooncake")
    p.add_argument("--disaggregation-bootstrap-port", type=port, default=BOOTSTRAP_PORT)
    p.add_argument("--disaggregation-ib-device")
    p.add_argument("--load-balance-method", choices=_LOAD_BALANCE_METHODS, default="auto")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-running-requests", type=positive_int)
    p.add_argument("--max-total-tokens", type=positive_int)
    p.add_argument("--cuda-graph-max-bs", type=positive_int)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--watchdog-timeout", type=float)
    p.add_argument("--nnodes", type=positive_int, default=1)
    p.add_argument("--node-rank", type=non_negative_int, default=0)
    p.add_argument("--dist-init-addr", "--nccl-init-addr", type=_dist_init_addr)
    p.add_argument("--dist-timeout", type=positive_int)
    return p


def parse_dist_init_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as SGLang's ``NetworkAddress.parse`` reads it: an IPv4 address or a hostname, or a
    bracketed IPv6 address (``[::1]:25000``; a bare one is ambiguous). Port 0 is refused: nothing could meet
    there."""
    import argparse
    import ipaddress
    import re

    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an IPv6 address in brackets: {text!r}") from None
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            raise argparse.ArgumentTypeError(f"an IPv6 address must be bracketed ([{host}]:{port}): {text!r}")
        if sep and not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252}[A-Za-z0-9_])?", host):
            raise argparse.ArgumentTypeError(f"not a hostname or IPv4 address: {host!r}")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT: {text!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535: {text!r}")
    return host, int(port)


def _dist_init_addr(text: str) -> str:
    """Checked as ``parse_dist_init_addr`` does, kept as given (SGLang's ServerArgs holds the string)."""
    parse_dist_init_addr(text)
    return text


_dist_init_addr.__name__ = "HOST:PORT"


def parse_args(argv: list[str] | None = None):
    """(namespace, unknown flags). Exits 2 with one line on a bad value."""
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    # One line each, as for other bad values (SGLang asserts the tp and dp ones in check_server_args).
    if args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is not below --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.dist_init_addr is None:
        parser.error(f"argument --dist-init-addr: required with --nnodes {args.nnodes}")
    if args.tp_size % args.nnodes:
        parser.error(f"argument --tp-size: {args.tp_size} is not divisible by --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.dp_size > 1:
        parser.error("argument --dp-size: multi-node data-parallel replicas are not supported")
    if args.disaggregation_mode == "prefill" and args.disaggregation_transfer_backend == "fake":
        parser.error("Prefill server does not support 'fake' as the transfer backend")  # SGLang asserts this
    if args.load_balance_method == "auto":  # SGLang's serving hook resolves it
        args.load_balance_method = ("follow_bootstrap_room" if args.disaggregation_mode == "prefill"
                                    else "round_robin")
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


def token_logprobs(prompt: str, tokens: list[str], top: int, noise: float = 0.0,
                   first_logits: dict[str, float] | None = None) -> dict:
    """SGLang's OpenAI-style ``logprobs`` of a completion (``to_openai_style_logprobs``): per position the
    chosen token's logprob and the ``top`` most likely tokens; text offsets are -1, as SGLang sends them.
    ``first_logits``: position 0's logits as computed elsewhere (a decode's, from its prefill with the KV)."""
    import math

    intended = _intended(prompt, len(tokens))
    out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for i, token in enumerate(tokens):
        if i == 0 and first_logits is not None:
            logits = first_logits
        else:
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
        self.engine_type = _ENGINE_TYPES[args.disaggregation_mode]
        # PD: requests in SGLang's disaggregation queues (not counted in num_running_reqs), failure counters
        self.pd_queues = {"prefill_bootstrap": 0, "prefill_inflight": 0, "decode_prealloc": 0, "decode_transfer": 0}
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.rooms = _Rooms() if args.disaggregation_mode == "prefill" else None
        self.handshake_timeout = _env_float(ENV_HANDSHAKE_TIMEOUT) or DECODE_HANDSHAKE_TIMEOUT
        self.bootstrap_timeout = _env_float(ENV_BOOTSTRAP_TIMEOUT) or BOOTSTRAP_TIMEOUT
        self.fatal: str | None = None  # a scheduler exception: the main loop takes the server down
        self.wake: Callable[[], None] = lambda: None  # wakes the main loop (set by main)
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

    @contextlib.contextmanager
    def pd_queue(self, name: str):
        """Count one request in a disaggregation queue (``prefill_bootstrap``, ``decode_transfer``, ...) while
        it waits there."""
        with self.lock:
            self.pd_queues[name] += 1
        try:
            yield
        finally:
            with self.lock:
                self.pd_queues[name] -= 1

    def pd_failed(self, kind: str) -> None:
        """``bootstrap`` or ``transfer``: one more request failed so (``sglang:num_*_failed_reqs_total``)."""
        with self.lock:
            if kind == "bootstrap":
                self.bootstrap_failed += 1
            else:
                self.transfer_failed += 1

    def die(self, message: str) -> None:
        """A scheduler exception (SGLang: ``Scheduler hit an exception``, then the server exits)."""
        self.fatal = message
        self.wake()

    def _labels(self, streaming: bool | None = None) -> str:
        """Tokenizer metric labels (``tokenizer_metric_labels()``), with ``is_streaming`` where SGLang adds it."""
        text = f'model_name="{self.args.served_model_name}",engine_type="{self.engine_type}"'
        return text if streaming is None else text + f',is_streaming="{"true" if streaming else "false"}"'

    def _scheduler_labels(self) -> str:
        return (f'model_name="{self.args.served_model_name}",engine_type="{self.engine_type}",tp_rank="0",'
                'pp_rank="0",moe_ep_rank="0"')

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

    def _pd_metrics(self, sched: str) -> list[str]:
        """(under the lock) The disaggregation queue gauges, which SGLang's scheduler sets on every server (0
        outside their role), and its failure counters, which appear with their first increment (a labelled
        prometheus_client counter has no sample before)."""
        out = []
        gauges = (("prefill_bootstrap", "sglang:num_prefill_bootstrap_queue_reqs",
                   "The number of requests in the prefill bootstrap queue."),
                  ("prefill_inflight", "sglang:num_prefill_inflight_queue_reqs",
                   "The number of requests in the prefill inflight queue."),
                  ("decode_prealloc", "sglang:num_decode_prealloc_queue_reqs",
                   "The number of requests in the decode prealloc queue."),
                  ("decode_transfer", "sglang:num_decode_transfer_queue_reqs",
                   "The number of requests in the decode transfer queue."))
        for key, name, doc in gauges:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{sched}}} {float(self.pd_queues[key])}"]
        counters = (("sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.",
                     self.bootstrap_failed),
                    ("sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests.",
                     self.transfer_failed))
        for name, doc, value in counters:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            if value:
                out.append(f"{name}{{{sched}}} {float(value)}")
        return out

    def metrics(self) -> str:
        """Prometheus text with SGLang's names and labels (sglang/srt/observability/metrics_collector.py)."""
        a = self.args
        sched = self._scheduler_labels()
        with self.lock:
            now = time.monotonic()
            throughput = sum(1 for t in self.recent_tokens if t > now - THROUGHPUT_WINDOW) / THROUGHPUT_WINDOW
            out = ["# HELP sglang:num_running_reqs The number of running requests.",
                   "# TYPE sglang:num_running_reqs gauge",
                   f"sglang:num_running_reqs{{{sched}}} {float(self.running - sum(self.pd_queues.values()))}",
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
            out += self._pd_metrics(sched)
            out += ["# HELP sglang:num_aborted_requests_total Number of requests aborted.",
                    "# TYPE sglang:num_aborted_requests_total counter",
                    f"sglang:num_aborted_requests_total{{{self._labels()}}} {float(self.aborted)}"]
            text = "\n".join(out) + "\n"
            return text + "".join(h.text() for h in (self.ttft, self.itl, self.e2e, self.queue))


# ----------------------------------------------------------------------------------------------- disaggregation

class _Abort(Exception):
    """A request the scheduler aborts with an HTTP status (SGLang's ``prepare_abort(req, message, status_code)``)."""

    def __init__(self, status: int, message: str, rid: str):
        super().__init__(message)
        self.status, self.message, self.rid = status, message, rid


class _Fatal(Exception):
    """The scheduler died while serving this request: no answer, the server goes down."""


class _Gen:
    """What one prompt's answer is made of: the prompt its logits derive from (on a decode: the one in the KV it
    received), its text, position 0's logits when they came with the KV, and its pieces as they are made."""

    def __init__(self, prompt: str, text: str, pieces, first_logits: dict[str, float] | None = None):
        self.prompt, self.text, self.pieces, self.first_logits = prompt, text, pieces, first_logits


class _Rooms:
    """A prefill server's bootstrap rooms. Its generation request for room R waits here for R's decode (SGLang's
    bootstrap queue), then leaves the KV it computed and waits until the decode took it (the inflight queue);
    the decode's ``GET /kv?room=R`` (on the bootstrap server) waits here for that KV. Either side may come first,
    as the router sends both requests at once."""

    def __init__(self):
        import threading

        self.cond = threading.Condition()
        self.rooms: dict[int, dict] = {}

    def _room(self, room: int) -> dict:
        now = time.monotonic()
        for key in [k for k, e in self.rooms.items() if now - e["touched"] > KV_TTL and not e["waiters"]]:
            del self.rooms[key]  # left behind by a side that went away
        entry = self.rooms.setdefault(room, {"decodes": 0, "kv": None, "claimed": False, "delivered": None,
                                             "waiters": 0, "touched": now})
        entry["touched"] = now
        return entry

    def _wait(self, entry: dict, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        entry["waiters"] += 1
        try:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
            return True
        finally:
            entry["waiters"] -= 1
            entry["touched"] = time.monotonic()

    def wait_decode(self, room: int, timeout: float) -> bool:
        """(prefill) Whether a decode asked for this room within ``timeout``."""
        with self.cond:
            entry = self._room(room)
            if self._wait(entry, lambda: entry["decodes"] > 0, timeout):
                return True
            if not entry["waiters"] and entry["kv"] is None:
                self.rooms.pop(room, None)
            return False

    def offer(self, room: int, kv: dict, timeout: float) -> bool:
        """(prefill) Leave the room's KV and wait until a decode received it (False: the decode went away or
        ``timeout`` passed); the room is gone afterwards."""
        with self.cond:
            entry = self._room(room)
            entry["kv"] = kv
            self.cond.notify_all()
            ok = self._wait(entry, lambda: entry["delivered"] is not None
                            or (entry["decodes"] == 0 and not entry["claimed"]), timeout)
            if self.rooms.get(room) is entry:
                del self.rooms[room]
            return ok and entry["delivered"] is True

    def take(self, room: int, timeout: float) -> dict | None:
        """(decode, through the bootstrap server) The room's KV once its prefill left it, or None after
        ``timeout``; then call ``delivered``."""
        with self.cond:
            entry = self._room(room)
            entry["decodes"] += 1
            self.cond.notify_all()
            try:
                got = self._wait(entry, lambda: entry["kv"] is not None and not entry["claimed"], timeout)
            finally:
                entry["decodes"] -= 1
                self.cond.notify_all()
            if not got:
                if not entry["waiters"] and entry["kv"] is None and self.rooms.get(room) is entry:
                    del self.rooms[room]
                return None
            entry["claimed"] = True
            return entry["kv"]

    def delivered(self, room: int, kv: dict, ok: bool) -> None:
        """(decode) Whether the KV taken from the room reached the decode."""
        with self.cond:
            entry = self.rooms.get(room)
            if entry is not None and entry["kv"] is kv:
                entry["delivered"] = ok
            self.cond.notify_all()


def _kv_cache_dtype(args) -> str:
    return "bfloat16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def _prefill_info(args) -> dict:
    """The ``PrefillServerInfo`` a bootstrap server answers ``GET /route`` with all ranks -1."""
    return {"attn_tp_size": args.tp_size, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
            "page_size": args.page_size, "kv_cache_dtype": _kv_cache_dtype(args),
            "follow_bootstrap_room": args.load_balance_method == "follow_bootstrap_room",
            "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
            "prefill_http_port": args.port, "decode_allocation_policy": "early"}


class _BootstrapTable:
    """What a bootstrap server knows: the ranks registered through ``PUT /route`` and the rooms' DP ranks."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.ranks: dict[tuple[int, int, int, int], dict] = {}  # (dp, cp, tp, pp) -> {rank_ip, rank_port}
        self.sizes: dict | None = None
        self.info: dict | None = None
        self.dp_rooms: dict[int, tuple[int, float]] = {}

    def expected(self) -> int | None:
        s = self.sizes
        return None if s is None else s["dp"] * s["cp"] * s["tp"] * s["pp"]


def _make_bootstrap_handler(state: _State, table: _BootstrapTable):
    """A prefill head's bootstrap server (SGLang's ``CommonKVBootstrapServer``: ``/health``, ``/route``,
    ``/register_dp_rank``, ``/query_dp_ranks``), plus ``GET /kv``, where this reference server moves the KV."""
    import json
    from http.server import BaseHTTPRequestHandler
    from urllib.parse import parse_qs

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kdeploy-refserver-bootstrap"
        sys_version = ""

        def log_message(self, format, *args):
            pass

        def _send(self, code: int, body, ctype: str = "text/plain; charset=utf-8") -> None:
            if not isinstance(body, bytes | str):
                body, ctype = json.dumps(body), "application/json"
            data = body.encode() if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self):
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) if 0 < length <= 1 << 20 else b"null")

        def do_GET(self):
            path, _, query = self.path.partition("?")
            q = {k: v[0] for k, v in parse_qs(query).items()}
            if path == "/health":
                self._send(200, "OK")
            elif path == "/route":
                self._route_get(q)
            elif path == "/kv":
                self._kv(q)
            else:
                self._send(404, "Not Found")

        def _route_get(self, q: dict) -> None:
            keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
            try:
                wanted = tuple(int(q[k]) for k in keys)
            except (KeyError, ValueError):
                self._send(400, "Missing inputs for bootstrap server.")
                return
            with table.lock:
                expected, registered = table.expected(), len(table.ranks)
                if expected is None or registered < expected:
                    self._send(503, f"Prefill server not fully registered yet ({registered} workers registered).")
                elif wanted == (-1, -1, -1, -1):
                    self._send(200, table.info)
                elif wanted in table.ranks:
                    self._send(200, table.ranks[wanted])
                else:
                    self._send(404, f"Bootstrap info not found for dp_rank={wanted[0]} cp_rank={wanted[1]} "
                                    f"tp_rank={wanted[2]} pp_rank={wanted[3]}")

        def _kv(self, q: dict) -> None:
            """``GET /kv?room=R&timeout=T``: wait up to T s (at most KV_TTL) for room R's KV, then send it once."""
            try:
                room = int(q["room"])
                timeout = min(max(float(q.get("timeout", DECODE_HANDSHAKE_TIMEOUT)), 0.0), KV_TTL)
            except (KeyError, ValueError):
                self._send(400, "Missing inputs for bootstrap server.")
                return
            kv = state.rooms.take(room, timeout)
            if kv is None:
                self._send(404, f"No KV for bootstrap_room {room} within {timeout:g} s")
                return
            try:
                self._send(200, kv)
                ok = True
            except OSError:
                ok = False
            state.rooms.delivered(room, kv, ok)

        def do_PUT(self):
            if self.path.partition("?")[0] != "/route":
                self._send(405, "Method not allowed")
                return
            try:
                row = self._body()
                key = (int(row["attn_dp_rank"]), int(row["attn_cp_rank"]), int(row["attn_tp_rank"]),
                       int(row["pp_rank"]))
                sizes = {"dp": int(row["attn_dp_size"]), "cp": int(row["attn_cp_size"]),
                         "tp": int(row["attn_tp_size"]), "pp": int(row["pp_size"])}
                rank = {"rank_ip": str(row["rank_ip"]), "rank_port": int(row["rank_port"])}
                info = {k: row[k] for k in ("page_size", "kv_cache_dtype", "prefill_http_port",
                                            "decode_allocation_policy")}
            except (ValueError, KeyError, TypeError):
                self._send(400, "Bad registration")
                return
            with table.lock:
                if table.ranks and table.info and info["decode_allocation_policy"] != \
                        table.info["decode_allocation_policy"]:
                    self._send(400, "Inconsistent prefill allocation policies")
                    return
                table.ranks[key] = rank
                table.sizes = sizes
                table.info = {**_prefill_info(state.args), "attn_tp_size": sizes["tp"], "attn_cp_size": sizes["cp"],
                              "dp_size": sizes["dp"], "pp_size": sizes["pp"], **info}
            self._send(200, "OK")

        def do_POST(self):
            path = self.path.partition("?")[0]
            try:
                body = self._body()
                if path == "/register_dp_rank":
                    with table.lock:
                        table.dp_rooms[int(body["bootstrap_room"])] = (int(body["dp_rank"]), time.monotonic())
                    self._send(200, "OK")
                elif path == "/query_dp_ranks":
                    now = time.monotonic()
                    with table.lock:
                        for room in [r for r, (_, t) in table.dp_rooms.items() if now - t > KV_TTL]:
                            del table.dp_rooms[room]
                        found = {str(int(r)): table.dp_rooms[int(r)][0] for r in body["bootstrap_rooms"]
                                 if int(r) in table.dp_rooms}
                    self._send(200, found)
                elif path == "/route":
                    self._send(405, "Method not allowed")
                else:
                    self._send(404, "Not Found")
            except (ValueError, KeyError, TypeError):
                self._send(400, "Bad request")

    return Handler


def _registration_target(args) -> tuple[str, str]:
    """(host, URL) where a prefill node registers its ranks, as SGLang's ``register_to_bootstrap``: the
    dist-init-addr host when given (multi-node: the head's bootstrap server), else ``--host`` (a wildcard
    rewritten to loopback)."""
    if args.dist_init_addr:
        host = parse_dist_init_addr(args.dist_init_addr)[0]
    else:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(args.host, args.host)
    return host, f"http://{_hostport(host, args.disaggregation_bootstrap_port)}/route"


def _local_ip_towards(host: str) -> str:
    """The address this machine uses to reach ``host`` (SGLang's rank_ip)."""
    import socket

    try:
        family, kind, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, IndexError):
        return "127.0.0.1"


def register_ranks(args, ranks: range) -> bool:
    """PUT one row per local TP rank to the prefill's bootstrap server, each with SGLang's 5 tries and backoff.
    False (and SGLang's error line) when a rank could not register."""
    import json
    import urllib.error
    import urllib.request

    host, url = _registration_target(args)
    rank_ip = _local_ip_towards(host)
    for rank in ranks:
        row = {"attn_tp_size": args.tp_size, "attn_tp_rank": rank, "attn_cp_size": 1, "attn_cp_rank": 0,
               "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
               "system_dp_rank": 0, "rank_ip": rank_ip, "rank_port": args.disaggregation_bootstrap_port,
               "page_size": args.page_size, "kv_cache_dtype": _kv_cache_dtype(args),
               "load_balance_method": args.load_balance_method, "prefill_http_port": args.port,
               "decode_allocation_policy": "early"}
        tag = _rank_tag(rank, args.tp_size)
        for attempt in range(5):
            request = urllib.request.Request(url, data=json.dumps(row).encode(), method="PUT",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    if resp.status == 200:
                        break
                    why = f"status {resp.status}"
            except urllib.error.HTTPError as exc:
                why = f"status {exc.code}"
            except (OSError, ValueError) as exc:
                why = str(getattr(exc, "reason", None) or exc)
            _log(f"Prefill register attempt {attempt + 1}/5 failed: {why}", tag)
            if attempt < 4:
                time.sleep(min(2.0 ** attempt, 30.0))
        else:
            _log("ERROR: Prefill instance failed to register to bootstrap server after 5 retries", tag)
            return False
    _log(f"Registered TP{ranks[0]}..TP{ranks[-1]} to the bootstrap server at {url}")
    return True


def _fetch(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of a GET; raises OSError when nothing answered in ``timeout``."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=max(timeout, 0.1)) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def decode_handshake(state: _State, rid: str, host: str | None, port: int | None, room: int) -> dict:
    """A decode's side of one room: fetch the prefill's server info from its bootstrap server (retried each
    second, SGLang's ``try_ensure_parallel_info``), check it matches this server, then receive the room's KV,
    all within ``REFSERVER_HANDSHAKE_TIMEOUT``. Raises ``_Abort`` (500, SGLang's message) on a failed handshake
    and ``_Fatal`` on a mismatched prefill (SGLang raises RuntimeError in the scheduler: the server dies)."""
    import json

    args = state.args
    port = args.disaggregation_bootstrap_port if port is None else port  # SGLang's fallback, scheduler.py
    addr = _hostport(str(host), port)
    start = time.monotonic()
    deadline = start + state.handshake_timeout

    def failed(why: str) -> _Abort:
        state.pd_failed("bootstrap")
        message = (f"Decode handshake failed for request rank=0 decode_req.req.rid={rid!r} "
                   f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): "
                   f"{why}")
        _log(f"ERROR: {message}")
        return _Abort(500, message, rid)

    info, attempts, last = None, 0, ""
    with state.pd_queue("decode_prealloc"):
        while info is None:
            attempts += 1
            try:
                status, raw = _fetch(f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                     f"&target_tp_rank=-1&target_pp_rank=-1",
                                     min(5.0, deadline - time.monotonic()))
                if status == 200:
                    info = json.loads(raw)
                    break
                last = f"HTTP {status}: {raw.decode(errors='replace')[:200]}"
            except (OSError, ValueError) as exc:
                last = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
            if time.monotonic() + 1.0 > deadline:
                raise failed(f"Could not fetch prefill parallel info from {addr} after {attempts} attempts "
                             f"({last})")
            time.sleep(1.0)
    if info.get("page_size") is not None and info["page_size"] != args.page_size:
        state.die(f"Page size mismatch: prefill server has page_size={info['page_size']}, but decode server "
                  f"has page_size={args.page_size}. Both servers must use the same --page-size value.")
        raise _Fatal(state.fatal)
    if info.get("kv_cache_dtype") is not None and info["kv_cache_dtype"] != _kv_cache_dtype(args):
        state.die(f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info['kv_cache_dtype']}, but "
                  f"decode server has kv_cache_dtype={_kv_cache_dtype(args)}. Both servers must use the same "
                  f"--kv-cache-dtype value.")
        raise _Fatal(state.fatal)
    with state.pd_queue("decode_transfer"):
        wait = max(deadline - time.monotonic(), 0.0)
        try:
            status, raw = _fetch(f"http://{addr}/kv?room={room}&timeout={wait:.3f}", wait + 5.0)
        except OSError as exc:
            raise failed(f"Lost connection with prefill instance (bootstrap_addr: {addr}): "
                         f"{getattr(exc, 'reason', None) or exc}") from None
    if status != 200:
        raise failed(f"Request {room} timed out after {time.monotonic() - start:.1f}s in KVPoll.WaitingForInput "
                     f"(HTTP {status}: {raw.decode(errors='replace')[:200]})")
    try:
        kv = json.loads(raw)
        sent_room = kv["bootstrap_room"]
        well_formed = (isinstance(kv["prompt"], str) and isinstance(kv["first_token"], str)
                       and isinstance(kv["first_logits"], dict))
    except (ValueError, KeyError, TypeError):
        well_formed, sent_room = False, None
    if not well_formed:
        raise failed("malformed KV from the prefill")
    if sent_room != room:
        raise failed(f"received the KV of bootstrap_room {sent_room}")
    return kv


def _make_handler(state: _State):
    import itertools
    import json
    import uuid
    from http import HTTPStatus
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
                self._json(200, {"model_path": a.model_path, "served_model_name": a.served_model_name,
                                 "tokenizer_path": a.tokenizer_path,
                                 "is_generation": True, "preferred_sampling_params": None,
                                 "weight_version": "default", "disaggregation_mode": a.disaggregation_mode,
                                 "has_image_understanding": False,
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
            except _Abort as exc:
                self._abort(path, bool(body.get("stream")), exc)
            except _Fatal:
                self.close_connection = True  # the scheduler died: no answer, the server goes down

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
            stream = self._stream(body, prompts)
            rids, pd = self._rids(body, len(prompts)), self._pd_fields(body, len(prompts))
            if stream:
                cid, model = f"cmpl-{uuid.uuid4().hex}", state.args.served_model_name
                gen = self._prepare(prompts[0], rids[0], pd[0], max_tokens, temperature, seed, request)
                tokens = _word_tokens(gen.text)

                def chunk(i: int, piece: str, finish: str | None) -> dict:
                    logprobs = None
                    if top is not None and piece:
                        full = token_logprobs(gen.prompt, tokens[:i + 1], top, state.noise, gen.first_logits)
                        logprobs = {k: v[i:] for k, v in full.items()}
                    return {"id": cid, "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": [{"index": 0, "text": piece, "logprobs": logprobs,
                                                         "finish_reason": finish, "matched_stop": None}]}

                self._events(itertools.chain((chunk(i, t, None) for i, t in enumerate(gen.pieces)),
                                             [chunk(len(tokens), "", "length")]))
                return
            choices, completion_tokens = [], 0
            for i, prompt in enumerate(prompts):
                gen = self._prepare(prompt, rids[i], pd[i], max_tokens, temperature, seed, request)
                text = "".join(gen.pieces)
                tokens = _word_tokens(text)
                logprobs = None if top is None else token_logprobs(gen.prompt, tokens, top, state.noise,
                                                                   gen.first_logits)
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": "length",
                                "matched_stop": None})
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
            rids, pd = self._rids(body, len(prompts)), self._pd_fields(body, len(prompts))
            limit = 1 if state.args.disaggregation_mode == "prefill" else max_tokens

            def meta(rid: str, prompt: str, text: str, done: bool) -> dict:
                return {"id": rid, "prompt_tokens": len(_word_tokens(prompt)),
                        "completion_tokens": len(_word_tokens(text)),
                        "finish_reason": {"type": "length", "length": limit} if done else None}

            if self._stream(body, prompts):  # SGLang streams the text so far in every event
                gen = self._prepare(prompts[0], rids[0], pd[0], max_tokens, temperature, seed, request)

                def events():
                    text = ""
                    for piece in gen.pieces:
                        text += piece
                        yield {"text": text, "meta_info": meta(rids[0], prompts[0], text, text == gen.text)}

                self._events(events())
                return
            out = []
            for i, prompt in enumerate(prompts):
                gen = self._prepare(prompt, rids[i], pd[i], max_tokens, temperature, seed, request)
                text = "".join(gen.pieces)
                out.append({"text": text, "meta_info": meta(rids[i], prompt, text, True)})
            single = isinstance(body.get("text", body.get("input_ids")), str) or len(out) == 1
            self._json(200, out[0] if single else out)

        # Prefill/decode disaggregation ------------------------------------------------------------------

        @staticmethod
        def _rids(body: dict, n: int) -> list[str]:
            """Request ids: the body's ``rid`` (a string, or one per prompt), else fresh ones as SGLang makes."""
            rid = body.get("rid")
            if isinstance(rid, str) and n == 1:
                return [rid]
            if isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
                return rid
            return [uuid.uuid4().hex for _ in range(n)]

        @staticmethod
        def _pd_fields(body: dict, n: int) -> list[tuple]:
            """Per prompt (bootstrap_host, bootstrap_port, bootstrap_room), normalized as SGLang's
            ``GenerateReqInput``: one value for all prompts, one per prompt, and an int room is room + i."""
            def per_prompt(key: str, ok, step: bool) -> list:
                value = body.get(key)
                if isinstance(value, list):
                    if len(value) != n:
                        raise ValueError(f"{key} must have one entry per prompt")
                    values = value
                else:
                    values = [value + i if step and value is not None and ok(value) else value for i in range(n)]
                for v in values:
                    if v is not None and not ok(v):
                        raise ValueError(f"invalid {key}: {v!r}")
                return values

            def is_int(v) -> bool:
                return isinstance(v, int) and not isinstance(v, bool) and v >= 0

            hosts = per_prompt("bootstrap_host", lambda v: isinstance(v, str), False)
            ports = per_prompt("bootstrap_port", lambda v: is_int(v) and v <= 65535, False)
            rooms = per_prompt("bootstrap_room", is_int, True)
            return list(zip(hosts, ports, rooms, strict=True))

        def _prepare(self, prompt: str, rid: str, pd: tuple, max_tokens: int, temperature: float,
                     seed: int | None, request: _Request) -> _Gen:
            """One prompt's answer as this server's role makes it; raises ``_Abort`` or ``_Fatal`` before
            anything is sent."""
            args = state.args
            mode = args.disaggregation_mode
            if mode == "null":
                text = complete_text(prompt, max_tokens, temperature, seed, state.noise)
                return _Gen(prompt, text, self._paced(text, request))
            host, port, room = pd
            fake = host == FAKE_BOOTSTRAP_HOST or args.disaggregation_transfer_backend == "fake"
            if room is None and args.disaggregation_transfer_backend != "fake":
                message = (f"Invalid request: Disaggregated request received without bootstrap room id. "
                           f"req.rid={rid!r}")
                _log(f"ERROR: {message}")
                raise _Abort(400, message, rid)
            if mode == "prefill":  # SGLang's _process_req: max_new_tokens = 1, whatever was asked
                text = complete_text(prompt, 1, temperature, seed, state.noise)
                if fake:
                    return _Gen(prompt, text, self._paced(text, request))
                made = self._prefill_room(prompt, rid, room, text, request)
                return _Gen(prompt, "".join(made), iter(made))
            if fake:  # a fake transfer: no KV arrived, the text is meaningless
                text = complete_text(prompt + FAKE_KV_SUFFIX, max_tokens, temperature, seed, state.noise)
                return _Gen(prompt + FAKE_KV_SUFFIX, text, self._paced(text, request))
            kv = decode_handshake(state, rid, host, port, room)
            if kv["prompt"] != prompt:
                _log(f"WARNING: the KV of bootstrap_room {room} is for another prompt: generating from it")
            tokens = complete_tokens(kv["prompt"], max_tokens, temperature, seed, state.noise)
            if tokens:
                tokens[0] = kv["first_token"]  # the prefill's token, sent with the KV
            text = " " + " ".join(tokens) if tokens else ""
            return _Gen(kv["prompt"], text, self._paced(text, request), kv["first_logits"])

        def _prefill_room(self, prompt: str, rid: str, room: int, text: str, request: _Request) -> list[str]:
            """A prefill's side of one room: wait for the decode (bootstrap queue), compute (the first token's
            latency), leave the KV and wait until the decode took it (inflight queue); the tokens made."""
            start = time.monotonic()
            with state.pd_queue("prefill_bootstrap"):
                connected = state.rooms.wait_decode(room, state.bootstrap_timeout)
            if not connected:
                state.pd_failed("bootstrap")
                message = (f"Prefill bootstrap failed for request rank=0 req.rid={rid!r} req.bootstrap_room={room} "
                           f"with exception KVTransferError(bootstrap_room={room}): Request {room} timed out after "
                           f"{time.monotonic() - start:.1f}s in KVPoll.Bootstrapping")
                _log(f"WARNING: {message}")
                raise _Abort(500, message, rid)
            made = list(self._paced(text, request))
            first = _word_tokens(text)[0]
            kv = {"bootstrap_room": room, "rid": rid, "prompt": prompt, "first_token": first,
                  "first_logits": _logits(prompt, 0, _intended(prompt, 1)[0], state.noise),
                  "page_size": state.args.page_size, "kv_cache_dtype": _kv_cache_dtype(state.args),
                  "tp_size": state.args.tp_size}
            with state.pd_queue("prefill_inflight"):
                taken = state.rooms.offer(room, kv, KV_TTL)
            if not taken:
                state.pd_failed("transfer")
                message = (f"Prefill transfer failed for request rank=0 req.rid={rid!r} req.bootstrap_room={room} "
                           f"with exception KVTransferError(bootstrap_room={room}): the decode did not receive "
                           f"the KV")
                _log(f"WARNING: {message}")
                raise _Abort(500, message, rid)
            return made

        def _abort(self, path: str, stream: bool, exc: _Abort) -> None:
            """An aborted request as SGLang answers it: non-streamed, 400 as a ValueError and 500 as an
            HTTPException; streamed, an error event then ``[DONE]``."""
            code, message = exc.status, exc.message
            if stream and path == "/v1/completions":
                self._events([{"error": {"object": "error", "message": message, "type": HTTPStatus(code).name,
                                         "param": None, "code": code}}])
            elif stream:
                self._events([{"text": "", "output_ids": [], "meta_info": {
                    "id": exc.rid, "finish_reason": {"type": "abort", "message": message, "status_code": code},
                    "completion_tokens": 0}}])
            elif code == 400 and path == "/generate":
                self._json(400, {"error": {"message": message}})
            elif code == 400:
                self._json(400, {"object": "error", "message": message, "type": "BadRequest", "param": None,
                                 "code": 400})
            else:
                self._json(code, {"object": "error", "message": message, "type": str(code), "param": None,
                                  "code": code})

    return Handler


# ----------------------------------------------------------------------------------------------- multi-node

HEARTBEAT_INTERVAL = 1.0   # each side of a rendezvous connection sends a heartbeat this often
HEARTBEAT_TIMEOUT = 3.0    # ... and counts its peer dead after this much silence
HANDSHAKE_TIMEOUT = 5.0    # a connection to the head must say `join` within this
SHUTDOWN_GRACE = 15.0      # the head waits this long for its followers to close after `shutdown` (SGLang: 15 s)
DIST_TIMEOUT = 600.0       # the rendezvous bound without --dist-timeout (torch's default for NCCL groups)


class _LinkError(Exception):
    """A rendezvous connection is closed, reset, or spoke out of protocol."""


class _Link:
    """One rendezvous connection: a JSON object per line both ways; knows when it last heard its peer."""

    MAX_LINE = 65536

    def __init__(self, sock, peer: str):
        self.sock, self.peer = sock, peer
        self.rank: int | None = None
        self.buf = b""
        self.opened = self.last_seen = self.last_sent = time.monotonic()
        sock.settimeout(2.0)  # a peer that stops reading fails a send instead of hanging the group thread

    def send(self, op: str, **fields) -> None:
        import json

        self.sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        self.last_sent = time.monotonic()

    def receive(self) -> list[dict]:
        """The messages completed by what is readable now (call it when the socket is readable)."""
        import json

        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise _LinkError(f"connection error: {exc}") from None
        if not data:
            raise _LinkError("connection closed")
        self.last_seen = time.monotonic()
        *lines, self.buf = (self.buf + data).split(b"\n")
        if len(self.buf) > self.MAX_LINE:
            raise _LinkError("protocol error: line too long")
        messages = []
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                raise _LinkError(f"protocol error: not JSON: {line[:60]!r}") from None
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                raise _LinkError(f"protocol error: not a message: {line[:60]!r}")
            messages.append(msg)
        return messages

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Group:
    """The nodes of one server (``--nnodes`` > 1) meeting at ``--dist-init-addr``, in a daemon thread.

    The head (node_rank 0) listens there; each follower connects and joins; the group is formed once all
    have joined, and from then on a member cannot be replaced: like a torch process group, it lives and dies
    whole. The thread keeps heartbeats going both ways and tells the main loop of every change through
    ``notify_r`` (readable); the main loop reads ``formed``, ``ready_nodes``, ``shutdown_received`` and
    ``failure`` (set once: the group is unusable and this node must exit non-zero).
    """

    def __init__(self, args):
        import threading

        self.nnodes, self.rank, self.tp_size = args.nnodes, args.node_rank, args.tp_size
        self.host, self.port = parse_dist_init_addr(args.dist_init_addr)
        self.addr = _hostport(self.host, self.port)
        self.timeout = float(args.dist_timeout or DIST_TIMEOUT)
        self.per_node = args.tp_size // args.nnodes
        self.formed = threading.Event()
        self.shutdown_received = threading.Event()
        self.ready_nodes: set[int] = set()
        self.failure: str | None = None
        self.links: dict[int, _Link] = {}  # head: follower node_rank -> link; follower: {0: link to the head}
        self.listener = None
        self._send_lock = threading.Lock()
        self._stop: str | None = None  # "close", or "shutdown" (the head tells its followers first)
        self.notify_r, self._notify_w = os.pipe()
        os.set_blocking(self.notify_r, False)
        os.set_blocking(self._notify_w, False)
        self._thread = threading.Thread(target=self._run_head if self.rank == 0 else self._run_follower,
                                        name="rendezvous", daemon=True)

    def ranks(self, node_rank: int) -> str:
        """The TP ranks of a node, as SGLang's ``_calculate_rank_ranges`` gives them (pp_size 1)."""
        return f"TP{node_rank * self.per_node}..TP{(node_rank + 1) * self.per_node - 1}"

    def listen(self) -> None:
        """(head) Bind the rendezvous port on every address, as torch's TCPStore does; raises OSError."""
        import socket

        try:
            sock = socket.create_server(("", self.port), family=socket.AF_INET6, dualstack_ipv6=True)
        except (OSError, ValueError):  # no IPv6 on this machine
            sock = socket.create_server(("", self.port), family=socket.AF_INET)
        self.listener = sock
        _log(f"Rendezvous listening on port {self.port} (dist_init_addr={self.addr}) for {self.nnodes - 1} "
             f"follower node(s)")

    def start(self) -> None:
        self._thread.start()

    def stop(self, shutdown: bool = False) -> None:
        """Ask the thread to end; with ``shutdown`` (head) it first tells every follower to shut down."""
        self._stop = "shutdown" if shutdown else "close"

    def join(self) -> None:
        """Wait for the thread (the head's shutdown: until the followers closed, at most SHUTDOWN_GRACE) and
        close what is left."""
        self._thread.join(SHUTDOWN_GRACE + 2.0)
        for link in self.links.values():
            link.close()
        os.close(self._notify_w)
        os.close(self.notify_r)

    def drain_notify(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.notify_r, 512):
                pass

    def send_ready(self) -> None:
        """(follower) This node's schedulers are all ready."""
        head = self.links.get(0)
        if head is not None:
            with self._send_lock, contextlib.suppress(OSError):  # a lost head is the thread's to report
                head.send("ready", node_rank=self.rank)

    def _notify(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._notify_w, b"!")

    def _fail(self, message: str) -> None:
        self.failure = message
        self._notify()

    def _heartbeat(self, links) -> str | None:
        """Send due heartbeats and check the silences; the first broken link's description, or None."""
        now = time.monotonic()
        for link in links:
            if now - link.last_seen > HEARTBEAT_TIMEOUT:
                return f"no heartbeat for {now - link.last_seen:.1f} s"
            if now - link.last_sent >= HEARTBEAT_INTERVAL:
                try:
                    with self._send_lock:
                        link.send("heartbeat")
                except OSError as exc:
                    return f"connection error: {exc}"
        return None

    # The head ---------------------------------------------------------------------------------------

    def _refusal(self, msg: dict) -> str | None:
        """Why a join cannot be accepted, or None."""
        rank, nnodes, tp_size = msg.get("node_rank"), msg.get("nnodes"), msg.get("tp_size")
        if nnodes != self.nnodes:
            return f"nnodes {nnodes} differs from the head's {self.nnodes}"
        if tp_size != self.tp_size:
            return f"tp_size {tp_size} differs from the head's {self.tp_size}"
        if not isinstance(rank, int) or not 1 <= rank < self.nnodes:
            return f"node_rank {rank} is not in 1..{self.nnodes - 1}"
        if self.formed.is_set():
            return "the process group is already formed"
        if rank in self.links:
            return f"node_rank {rank} already joined from {self.links[rank].peer}"
        return None

    def _run_head(self) -> None:
        import select

        deadline = time.monotonic() + self.timeout
        pending: list[_Link] = []  # connected, not joined yet
        try:
            while self._stop is None:
                members = list(self.links.values())
                socks = [self.listener] + [link.sock for link in pending + members]
                readable = select.select(socks, [], [], 0.2)[0]
                if self.listener in readable:
                    with contextlib.suppress(OSError):
                        conn, peer = self.listener.accept()
                        host = peer[0].removeprefix("::ffff:") if "." in peer[0] else peer[0]  # IPv4-mapped
                        pending.append(_Link(conn, _hostport(host, peer[1])))
                for link in [x for x in pending + members if x.sock in readable]:
                    try:
                        messages = link.receive()
                    except _LinkError as exc:
                        if link.rank is None:
                            _log(f"Rendezvous connection from {link.peer} ended before it joined: {exc}")
                            pending.remove(link)
                            link.close()
                            continue
                        return self._lost(link, str(exc))
                    for msg in messages:
                        if link.rank is None and link in pending:
                            self._join(link, msg, pending)
                        elif msg["op"] == "ready" and link.rank is not None:
                            self.ready_nodes.add(link.rank)
                            _log(f"Node {link.rank} is ready: scheduler(s) {self.ranks(link.rank)}")
                            self._notify()
                for link in [x for x in pending if time.monotonic() - x.opened > HANDSHAKE_TIMEOUT]:
                    _log(f"Rendezvous connection from {link.peer} did not join within {HANDSHAKE_TIMEOUT:g} s: "
                         f"closed")
                    pending.remove(link)
                    link.close()
                for link in list(self.links.values()):
                    broken = self._heartbeat([link])
                    if broken:
                        return self._lost(link, broken)
                if not self.formed.is_set() and time.monotonic() > deadline:
                    return self._fail(f"rendezvous at {self.addr} timed out after {self.timeout:g} s: "
                                      f"{len(self.links)} of {self.nnodes - 1} follower node(s) joined")
            if self._stop == "shutdown":
                self._shut_followers_down()
        finally:
            for link in pending:
                link.close()
            self.listener.close()
            if self.failure:
                for link in self.links.values():  # the other followers learn at once
                    link.close()

    def _join(self, link: _Link, msg: dict, pending: list[_Link]) -> None:
        pending.remove(link)
        reason = self._refusal(msg) if msg["op"] == "join" else f"protocol error: expected join, got {msg['op']!r}"
        if reason:
            _log(f"Refused node_rank {msg.get('node_rank')} from {link.peer}: {reason}")
            with contextlib.suppress(OSError):
                link.send("refused", reason=reason)
            link.close()
            return
        link.rank = msg["node_rank"]
        self.links[link.rank] = link
        with self._send_lock, contextlib.suppress(OSError):  # a failed send shows as a lost member
            link.send("welcome", nnodes=self.nnodes)
        _log(f"Node {link.rank} joined from {link.peer} ({len(self.links)}/{self.nnodes - 1} follower node(s))")
        if len(self.links) == self.nnodes - 1:
            self.formed.set()
            for member in self.links.values():
                with self._send_lock, contextlib.suppress(OSError):
                    member.send("formed")
            _log(f"All {self.nnodes} nodes joined: the process group is formed")
            self._notify()

    def _lost(self, link: _Link, why: str) -> None:
        self._fail(f"lost node_rank {link.rank} ({link.peer}): {why}; the process group is broken, exiting")

    def _shut_followers_down(self) -> None:
        """SGLang's ShutdownReq, which rank 0 broadcasts to every TP rank: tell each follower, then wait
        until it closed (it stopped its schedulers), at most SHUTDOWN_GRACE."""
        import select

        open_links = dict(self.links)
        _log(f"Sending shutdown to {len(open_links)} follower node(s)")
        for rank, link in list(open_links.items()):
            try:
                with self._send_lock:
                    link.send("shutdown")
            except OSError as exc:
                _log(f"WARNING: cannot send the shutdown to node {rank}: {exc}")
                open_links.pop(rank).close()
        deadline = time.monotonic() + SHUTDOWN_GRACE
        while open_links and time.monotonic() < deadline:
            for sock in select.select([link.sock for link in open_links.values()], [], [], 0.2)[0]:
                rank = next(r for r, link in open_links.items() if link.sock is sock)
                try:
                    open_links[rank].receive()
                except _LinkError:
                    _log(f"Node {rank} shut down")
                    open_links.pop(rank).close()
        if open_links:
            _log(f"WARNING: node(s) {sorted(open_links)} still connected {SHUTDOWN_GRACE:g} s after the shutdown")

    # A follower -------------------------------------------------------------------------------------

    def _connect(self):
        """A socket to the head, retried until the head listens; None (with ``failure`` set) at the deadline
        or when asked to stop."""
        import socket

        deadline = time.monotonic() + self.timeout
        waiting_logged = False
        while self._stop is None:
            try:
                return socket.create_connection((self.host, self.port), timeout=1.0)
            except OSError as exc:
                why = exc.strerror or str(exc)
            if time.monotonic() >= deadline:
                self._fail(f"rendezvous at {self.addr} timed out after {self.timeout:g} s: cannot connect ({why})")
                return None
            if not waiting_logged:
                _log(f"Waiting for the head at {self.addr} ({why}); retrying for {self.timeout:g} s")
                waiting_logged = True
            time.sleep(0.25)
        return None

    def _run_follower(self) -> None:
        import select

        start = time.monotonic()
        _log(f"Joining the process group at {self.addr} as node_rank {self.rank} of {self.nnodes}")
        sock = self._connect()
        if sock is None:
            return
        head = _Link(sock, self.addr)
        head.rank = 0
        try:
            head.send("join", node_rank=self.rank, nnodes=self.nnodes, tp_size=self.tp_size, pid=os.getpid())
        except OSError as exc:
            head.close()
            return self._fail(f"lost the head (node_rank 0) at {self.addr}: connection error: {exc}; "
                              f"the process group is broken, exiting")
        self.links[0] = head
        joined = False  # no heartbeats before the welcome: a refusal must not meet unread data (a reset)
        while self._stop is None:
            if not self.formed.is_set() and time.monotonic() - start > self.timeout:
                return self._fail(f"rendezvous at {self.addr} timed out after {self.timeout:g} s: "
                                  f"the process group did not form")
            broken = None
            if select.select([head.sock], [], [], 0.2)[0]:
                try:
                    messages = head.receive()
                except _LinkError as exc:
                    messages, broken = [], str(exc)
                for msg in messages:
                    if msg["op"] == "refused":
                        head.close()
                        return self._fail(f"the rendezvous at {self.addr} refused node_rank {self.rank}: "
                                          f"{msg.get('reason')}")
                    if msg["op"] == "welcome":
                        joined = True
                        _log(f"Joined the process group at {self.addr} as node_rank {self.rank}")
                    elif msg["op"] == "formed":
                        _log(f"The process group is formed: all {self.nnodes} nodes joined")
                        self.formed.set()
                        self._notify()
                    elif msg["op"] == "shutdown":  # the link stays open until the schedulers stopped
                        _log("Shutdown received from the head (node_rank 0): stopping the scheduler(s)")
                        self.shutdown_received.set()
                        self._notify()
                        return None
            if joined and not broken:
                broken = self._heartbeat([head])
            if broken:
                head.close()
                return self._fail(f"lost the head (node_rank 0) at {self.addr}: {broken}; "
                                  f"the process group is broken, exiting")
        return None


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


def _drain(state: _State, wake_fd: int, received: list[int], clear_wakeup, group: _Group | None) -> bool:
    """SGLang's ``sigterm_watchdog``: look every period (counted from the start) until no request is left;
    a second signal other than SIGTERM (Ctrl-C) ends the wait. False if the group broke meanwhile."""
    from multiprocessing.connection import wait

    state.draining.set()
    period = _env_float(ENV_SHUTDOWN_POLL) or SHUTDOWN_POLL
    seen = len(received)
    while True:
        elapsed = time.time() - state.started
        due, signals = time.monotonic() + period - elapsed % period, len(received)
        while True:  # a group event wakes us too: it is not the watchdog's look
            wait([wake_fd] + ([group.notify_r] if group else []), max(0.0, due - time.monotonic()))
            clear_wakeup()
            if group:
                group.drain_notify()
                if group.failure:
                    return False
            if len(received) > signals or time.monotonic() >= due:
                break
        if any(sig != received[0] for sig in received[seen:]):
            _log("Interrupted while draining: exiting now")
            return True
        with state.lock:
            remaining = state.running
        _log(f"Gracefully exiting... Remaining number of requests {remaining}.")
        if not remaining:
            return True


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _server_args_line(args) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in vars(args).items())
    return f"server_args=ServerArgs({fields})"


def _make_health_handler():
    """A follower's HTTP: SGLang's ``launch_dummy_health_check_server`` (``/health``, ``/health_generate`` and
    ``/ping`` always 200; FastAPI's 404 elsewhere)."""
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kdeploy-refserver"
        sys_version = ""

        def log_message(self, format, *args):
            pass

        def do_GET(self):
            if self.path.split("?", 1)[0] in ("/health", "/health_generate", "/ping"):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = b'{"detail":"Not Found"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.close_connection = True  # the body stays unread
            self.do_GET()

    return Handler


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
    if args.disaggregation_transfer_backend == "mooncake_tcp":  # SGLang's handle_pd_disaggregation
        os.environ.setdefault("MC_FORCE_TCP", "1")
        args.disaggregation_transfer_backend, args.disaggregation_ib_device = "mooncake", None
        _log("disaggregation transfer backend 'mooncake_tcp' -> mooncake with MC_FORCE_TCP=1 (TCP transport, no RDMA)")
    _log(_server_args_line(args))
    if args.disaggregation_mode != "null":
        _log(f"Disaggregation mode {args.disaggregation_mode}: transfer backend "
             f"{args.disaggregation_transfer_backend}, IB device(s) {args.disaggregation_ib_device or 'auto'}, "
             f"bootstrap port {args.disaggregation_bootstrap_port}")
    load_plugins()

    import multiprocessing
    import signal
    import socket
    import threading
    from http.server import ThreadingHTTPServer
    from multiprocessing.connection import wait

    follower = args.node_rank >= 1  # SGLang's node_rank >= 1: its schedulers and a dummy health server only
    state = _State(args, unknown)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in args.host else socket.AF_INET  # `--host ::` as SGLang takes it

        def handle_error(self, request, client_address):  # e.g. a client hanging up: one line, no traceback
            exc = sys.exc_info()[1]
            _log(f"WARNING: request from {client_address[0]}:{client_address[1]} failed: {exc!r}")

    # A follower binds its port now (a conflict fails at start) but listens only once its schedulers are
    # ready, as SGLang starts the dummy server after them: until then connections are refused.
    try:
        httpd = Server((args.host, args.port), _make_health_handler() if follower else _make_handler(state),
                       bind_and_activate=False)
        try:
            httpd.server_bind()
            if not follower:
                httpd.server_activate()
        except OSError:
            httpd.server_close()
            raise
    except OSError as exc:
        _log(f"ERROR: cannot listen on {_hostport(args.host, args.port)}: {exc}")
        return 1
    serving = False

    def serve() -> None:
        nonlocal serving
        if follower:
            httpd.server_activate()
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="http",
                         daemon=True).start()
        serving = True

    bootstrap_httpd = None  # a prefill head's bootstrap server
    bootstrap_dead = None   # REFSERVER_BOOTSTRAP_DOWN: a socket that accepts connections and never answers

    def close_http() -> None:
        if serving:
            httpd.shutdown()
        httpd.server_close()
        if bootstrap_httpd is not None:
            bootstrap_httpd.shutdown()
            bootstrap_httpd.server_close()
        if bootstrap_dead is not None:
            bootstrap_dead.close()

    if not follower:
        serve()
        _log(f"HTTP server listening on http://{_hostport(*httpd.server_address[:2])} (health: 503 until ready)")
    if args.disaggregation_mode == "prefill" and not follower:  # SGLang's start_disagg_service
        where = _hostport(args.host, args.disaggregation_bootstrap_port)
        try:
            if _env_flag(ENV_BOOTSTRAP_DOWN):
                bootstrap_dead = socket.socket(Server.address_family, socket.SOCK_STREAM)
                bootstrap_dead.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                bootstrap_dead.bind((args.host, args.disaggregation_bootstrap_port))
                bootstrap_dead.listen(128)
                _log(f"{ENV_BOOTSTRAP_DOWN}=1: the bootstrap server at {where} accepts connections and never answers")
            else:
                bootstrap_httpd = Server((args.host, args.disaggregation_bootstrap_port),
                                         _make_bootstrap_handler(state, _BootstrapTable()))
                threading.Thread(target=bootstrap_httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                 name="bootstrap", daemon=True).start()
                _log(f"CommonKVBootstrapServer started successfully on {where}")
        except OSError as exc:  # SGLang logs it and runs on without a bootstrap server
            _log(f"ERROR: Server error: cannot listen on {where}: {exc}")

    group = _Group(args) if args.nnodes > 1 else None
    if group and not follower:
        try:
            group.listen()
        except OSError as exc:
            _log(f"ERROR: cannot listen on dist-init-addr port {group.port}: {exc}")
            close_http()
            return 1
    if group:
        group.start()

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

    def wake() -> None:  # from another thread: the supervision wait looks again
        with contextlib.suppress(OSError):
            os.write(wake_w, b"\0")

    state.wake = wake
    # A prefill node registers its ranks with the bootstrap server once its schedulers are up (SGLang does it in
    # each scheduler's start); it is ready only after. A head whose bootstrap port never answers skips it.
    registered = threading.Event()

    def register() -> None:
        register_ranks(args, ranks)
        registered.set()
        wake()

    ctx = multiprocessing.get_context("spawn")
    cfg = {"mem_fraction_static": args.mem_fraction_static,
           "enable_hierarchical_cache": args.enable_hierarchical_cache,
           "hicache_ratio": args.hicache_ratio, "hicache_size": args.hicache_size,
           "disaggregation_mode": args.disaggregation_mode}
    per_node = args.tp_size // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)  # SGLang's tp_rank_range
    procs: list = []
    conns: list = []
    t0 = time.monotonic()

    def start_workers() -> None:
        for rank in ranks:
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

    def fail(message: str | None = None) -> int:
        if message:
            _log(message)
        _stop_workers(procs, conns)
        if group:
            group.stop()
            group.join()
        close_http()
        return 1

    try:
        if group is None:
            start_workers()
        slow = _env_float(ENV_SLOW_START) or 0.0
        announced = False  # a follower told the head it is ready
        ready_ranks: set[int] = set()
        ready_at: float | None = None
        while True:
            if group and group.formed.is_set() and not procs and not received:
                t0 = time.monotonic()
                start_workers()
            timeout = 0.5
            if ready_at is not None and not state.ready.is_set():
                timeout = max(0.0, min(timeout, ready_at - time.monotonic()))
            waitables = [wake_r] + [p.sentinel for p in procs] + [c for c in conns if c is not None]
            fired = wait(waitables + ([group.notify_r] if group else []), timeout)
            drain_wakeup()
            if group:
                group.drain_notify()
            if follower and signal.SIGTERM in received:  # SGLang's follower waits for rank 0's ShutdownReq
                _log(f"SIGTERM received on node_rank {args.node_rank}; waiting for the rank-0 ShutdownReq "
                     "broadcast to stop the schedulers.")
                received[:] = [sig for sig in received if sig != signal.SIGTERM]
            if received:
                break
            if group and group.failure:
                return fail(f"ERROR: {group.failure}")
            if group and group.shutdown_received.is_set():
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
                    if len(ready_ranks) == len(ranks):
                        _log(f"All {len(ranks)} scheduler(s) ready in {time.monotonic() - t0:.2f} s")
                        if args.disaggregation_mode == "prefill" and (follower or bootstrap_dead is None):
                            threading.Thread(target=register, name="register", daemon=True).start()
                        else:
                            registered.set()
            if follower and registered.is_set() and not announced:
                announced = True
                group.send_ready()
                serve()
                _log("Dummy health check server started in background thread at "
                     f"{_hostport(*httpd.server_address[:2])}")
            if state.fatal:
                _log(f"Scheduler hit an exception: RuntimeError: {state.fatal}", _rank_tag(ranks[0], args.tp_size))
                return fail("Received sigquit from a child process. It usually means the child failed.")
            dead = [(rank, p) for rank, p in zip(ranks, procs, strict=False)
                    if p.sentinel in fired or not p.is_alive()]
            if dead:
                # systemd SIGTERMs the whole cgroup at once: a worker may die of it just before we see ours.
                if wait([wake_r], 0.5):
                    drain_wakeup()
                if received and not follower:
                    break
                for rank, p in zip(ranks, procs, strict=False):
                    if not p.is_alive():
                        p.join(0.1)
                        _log(f"ERROR: scheduler TP{rank} (pid {p.pid}) died with exit code {p.exitcode}; "
                             f"terminating the other scheduler(s) and exiting")
                return fail()
            if (ready_at is None and not follower and len(ready_ranks) == len(ranks) and registered.is_set()
                    and (group is None or len(group.ready_nodes) == args.nnodes - 1)):
                if slow > 0:
                    _log(f"{ENV_SLOW_START}={slow:g}: becoming ready in {slow:g} s")
                ready_at = time.monotonic() + slow
            if ready_at is not None and not state.ready.is_set() and time.monotonic() >= ready_at:
                state.ready.set()
                _log(READY_MESSAGE)
    except BaseException:
        _stop_workers(procs, conns, timeout=1.0)
        raise

    if group and group.shutdown_received.is_set():
        pass  # the group thread logged it
    elif received[0] == signal.SIGTERM:
        _log(f"SIGTERM received. signum={int(signal.SIGTERM)}. Draining requests and shutting down...")
        if not _drain(state, wake_r, received, drain_wakeup, group):
            return fail(f"ERROR: {group.failure}")
    else:
        _log(f"Received {signal.Signals(received[0]).name}, shutting down")
    if group:
        group.stop(shutdown=not follower)  # the head's ShutdownReq to every follower, while its own stop
    _stop_workers(procs, conns)
    if group:
        group.join()
    close_http()
    _log("Shutdown complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
