"""kdtree: SGLang extension for speculative-decoding verify attention, loaded in every TP worker.

Deployed as a directory on PYTHONPATH (no pip install). Two ways in, both ending in the same idempotent,
once-per-process install:

* SGLang's plugin loader: ``kdtree_ext-0.1.0.dist-info/entry_points.txt`` registers ``register()`` in the
  entry-point group ``sglang.srt.plugins``; ``load_plugins()`` calls it first thing in the launcher and in
  every scheduler (TP worker) process, then applies ``HookRegistry`` hooks.
* ``sitecustomize.py`` next to this package, for SGLang builds without that loader (or with
  ``KDTREE_LOADER=sitecustomize``): it installs post-import hooks that set up each piece as soon as SGLang
  imports the module it lives in (before the KV pool is built).

What it installs in a TP worker (environment variables of the service):

``KDTREE_VERIFY=on|off`` (default on)
    ``off`` disables everything below.
``KDTREE_DEFRAG_SORT=1|0`` (default 0): Tier-0 defrag
    Every KV pool allocator SGLang builds (every allocator class whose ``__init__`` takes ``need_sort``:
    TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator and the rest of ``sglang.srt.mem_cache.allocator``)
    is constructed with ``need_sort=True``: freed slots are staged and merged + sorted into the free list
    when an allocation runs short, so allocations come out ascending and contiguous. Hooked through
    ``HookRegistry`` (AROUND ``__init__``) when called by SGLang's loader, else by wrapping ``__init__``.
    The marker ``[kdtree] defrag Tier-0`` is logged once per worker when the first allocator was really
    built with ``need_sort=True``.
``KDTREE_NSPLIT=N`` (default 64; a power of two, 1..1024): verify override
    Registers the attention backend ``kdtree`` with SGLang's registry and the ``--attention-backend``
    choices, then logs ``[kdtree] installed verify override nsplit=N kernel=kdtree-splitk``. The backend
    (:mod:`kdtree_ext.backend`) is SGLang's stock ``triton`` backend with its target-verify MLA attention
    replaced by the kdtree split-K Triton kernel (:mod:`kdtree_ext.mla_verify`): the prefix is split into
    at most N partitions (fewer for short prefixes or batches that already fill the GPU), combined by LSE.
    Every other mode delegates to SGLang's ``triton`` backend.

An invalid value (e.g. ``KDTREE_NSPLIT=abc``) logs one ``[kdtree] FATAL`` line and raises
:class:`ConfigError`, a ``SystemExit``: SGLang's ``load_plugins()`` swallows ``Exception`` from plugins but
not ``SystemExit``, so the process (the launcher first, else the worker) exits with status 1.

Markers come only from TP workers: the launcher (no multiprocessing parent) only registers the
``--attention-backend`` choice, and SGLang's helper processes (``sglang::detokenizer``, ...) do nothing.
When SGLang or a hook target is missing, a ``[kdtree] ... skipped: <reason>`` line is logged instead,
which never contains a marker. Each line is one ``write`` + flush (concurrent workers share the journal).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass

from kdtree_ext.markers import CONFIG, DEFRAG, PLUGIN_LOADED, VERIFY_OVERRIDE

__all__ = ["CONFIG", "DEFRAG", "PLUGIN_LOADED", "VERIFY_OVERRIDE", "Config", "ConfigError", "config_line",
           "read_config", "register"]

BACKEND_NAME = "kdtree"
DELEGATE_BACKEND = "triton"
DEFAULT_NSPLIT = 64
MAX_NSPLIT = 1024
ALLOCATOR_PACKAGE = "sglang.srt.mem_cache.allocator"
ATTENTION_REGISTRY = "sglang.srt.layers.attention.attention_registry"
CHOICES_MODULES = ("sglang.srt.arg_groups.choices", "sglang.srt.server_args")  # 0.5.23, then older
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"

_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")


class ConfigError(SystemExit):
    """Invalid KDTREE_* configuration. A SystemExit so that it gets past ``load_plugins()`` (which logs and
    swallows ``Exception``) and the process exits with status 1 at start."""


class _Missing(Exception):
    """A hook target is not there (reason in the message)."""


@dataclass(frozen=True)
class Config:
    verify: bool
    defrag: bool
    nsplit: int


def read_config(env: dict[str, str] | os._Environ[str] = os.environ) -> Config:
    """The KDTREE_* settings; ValueError with a one-line reason when one is invalid."""
    def flag(name: str, default: str) -> bool:
        raw = env.get(name, "").strip().lower() or default
        if raw in _ON:
            return True
        if raw in _OFF:
            return False
        raise ValueError(f"{name}={env.get(name)!r} is not one of on/off/1/0")

    verify = flag("KDTREE_VERIFY", "on")
    defrag = flag("KDTREE_DEFRAG_SORT", "0")
    raw = env.get("KDTREE_NSPLIT", "").strip()
    if not raw:
        nsplit = DEFAULT_NSPLIT
    else:
        try:
            nsplit = int(raw)
        except ValueError:
            nsplit = -1
        if not (1 <= nsplit <= MAX_NSPLIT and nsplit & (nsplit - 1) == 0):
            raise ValueError(f"KDTREE_NSPLIT={env.get('KDTREE_NSPLIT')!r} is not a power of two in 1..{MAX_NSPLIT}")
    return Config(verify=verify, defrag=defrag, nsplit=nsplit)


def loaded_release() -> str:
    """The release directory this code was imported from (``current`` resolved), as kdeploy named it."""
    return os.path.basename(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def config_line(cfg: Config) -> str:
    """What this worker runs with, in the canonical values of ``kdeploy-gate.json``: the gate compares it
    with what the inventory asked for and with the release it deployed."""
    return (f"{CONFIG} verify={'on' if cfg.verify else 'off'} defrag={int(cfg.defrag)} nsplit={cfg.nsplit} "
            f"release={loaded_release()}")


# ----------------------------------------------------------------------------------------------- process

def log(text: str) -> None:
    """One line on stdout in one write, flushed at once."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _process_title() -> str:
    """What setproctitle (SGLang) or /proc/self/comm (reference server) says this process is."""
    return f"{_read('/proc/self/cmdline')} {_read('/proc/self/comm')}"


def role() -> str:
    """``launcher`` (no multiprocessing parent), ``helper`` (an SGLang process that is not a scheduler:
    sglang::detokenizer, sglang::data_parallel_controller, ...) or ``worker`` (a TP scheduler)."""
    spawned = multiprocessing.parent_process() is not None or "--multiprocessing-fork" in sys.argv
    if not spawned:
        return "launcher"
    titles = re.findall(r"sglang::(\S+)", _process_title())
    if titles and not any(t.startswith("scheduler") for t in titles):
        return "helper"
    return "worker"


def rank() -> int | None:
    """The TP rank when it can be told: from the process title (``sglang::scheduler_TP3``, set after the
    plugins load in SGLang) or from ``tp_rank`` of SGLang's ``run_scheduler_process`` up the stack."""
    match = re.search(r"TP(\d+)", _process_title())
    if match:
        return int(match.group(1))
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run_scheduler_process":
            value = frame.f_locals.get("tp_rank")
            if isinstance(value, int):
                return value
        frame = frame.f_back
    return None


def _who() -> str:
    r = rank()
    return f"rank={r} pid={os.getpid()}" if r is not None else f"pid={os.getpid()}"


# ----------------------------------------------------------------------------------------------- setup

_setup_result: tuple[Config, str] | None = None
_setup_done = False
_installed: set[str] = set()
_registered = False


def _setup(via: str) -> tuple[Config, str] | None:
    """Once per process: validate the settings (exit on error), tell the role, log who loaded us.
    None when there is nothing to install in this process."""
    global _setup_done, _setup_result
    if _setup_done:
        return _setup_result
    _setup_done = True
    try:
        cfg = read_config()
    except ValueError as exc:
        log(f"[kdtree] FATAL: {exc}; refusing to start ({_who()})")
        raise ConfigError(1) from None
    who = role()
    if who == "helper":
        return None
    if who == "worker":
        log(f"{config_line(cfg)} ({_who()})")
    if not cfg.verify:
        log(f"[kdtree] disabled by KDTREE_VERIFY=off: no Tier-0 defrag, no kdtree attention backend ({_who()})")
        return None
    if who == "launcher":
        log(f"[kdtree] loaded in the launcher via {via} (pid={os.getpid()}): markers come from the TP workers")
    else:
        log(f"{PLUGIN_LOADED} via {via} ({_who()})")
    _setup_result = (cfg, who)
    return _setup_result


def _sglang_missing() -> str | None:
    try:
        import sglang  # noqa: F401
    except Exception as exc:
        return f"sglang not importable ({type(exc).__name__}: {exc})"
    return None


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: install everything this process needs, once."""
    global _registered
    if _registered:
        return
    _registered = True
    setup = _setup("plugin")
    if setup is None:
        return
    cfg, who = setup
    missing = _sglang_missing()
    if missing:
        if who == "worker":
            log(f"[kdtree] Tier-0 defrag skipped: {missing} ({_who()})")
            log(f"[kdtree] verify override skipped: {missing} ({_who()})")
        return
    use_registry = _inside_load_plugins()
    if who == "launcher":
        _piece("choices", cfg)
        return
    _piece("defrag", cfg, use_registry=use_registry)
    _piece("verify", cfg)


def _inside_load_plugins() -> bool:
    """True when SGLang's ``load_plugins()`` is calling us, so ``HookRegistry.apply_hooks()`` follows."""
    module = sys.modules.get(HOOK_REGISTRY)
    source = getattr(module, "_current_plugin_source", None)
    if source is None:
        return False
    try:
        return source.get() is not None
    except Exception:
        return False


def _piece(name: str, cfg: Config, *, use_registry: bool = False) -> None:
    """Install one piece (choices, defrag, verify) once per process; a missing target logs ``skipped``."""
    if name in _installed:
        return
    _installed.add(name)
    try:
        if name == "choices":
            _install_choices()
        elif name == "defrag":
            if not cfg.defrag:
                log(f"[kdtree] Tier-0 defrag off: KDTREE_DEFRAG_SORT is not 1 ({_who()})")
                return
            from kdtree_ext import defrag

            defrag.install(use_registry=use_registry)
        elif name == "verify":
            _install_verify(cfg)
    except _Missing as exc:
        label = {"defrag": "Tier-0 defrag", "verify": "verify override"}.get(name, "attention backend choice")
        log(f"[kdtree] {label} skipped: {exc} ({_who()})")


# ----------------------------------------------------------------------------------------------- verify

def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise _Missing(f"cannot import {name} ({type(exc).__name__}: {exc})") from None


def _install_choices() -> str:
    """Add ``kdtree`` to the ``--attention-backend`` choices (idempotent); returns the module used."""
    last = "no module"
    for name in CHOICES_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            last = f"{name}: {type(exc).__name__}: {exc}"
            continue
        add = getattr(module, "add_attention_backend_choices", None)
        if add is None:
            last = f"{name} has no add_attention_backend_choices"
            continue
        current = getattr(module, "ATTENTION_BACKEND_CHOICES", None)
        if current is None or BACKEND_NAME not in current:
            add([BACKEND_NAME])
        return name
    raise _Missing(f"no --attention-backend choices to extend ({last})")


def make_backend_factory(nsplit: int):
    def create_kdtree_backend(runner):
        """The ``kdtree`` verify-attention backend (speculative decoding), at most KDTREE_NSPLIT splits.

        Builds what ``--attention-backend triton`` would build and wraps it (``kdtree_ext.backend``):
        target-verify forward passes of absorbed-MLA layers run the kdtree split-K kernel
        (``kdtree_ext.mla_verify``); every other mode delegates to SGLang's stock Triton attention backend.
        """
        from kdtree_ext.backend import KdtreeVerifyBackend

        registry = importlib.import_module(ATTENTION_REGISTRY)
        backend = KdtreeVerifyBackend(registry.ATTENTION_BACKENDS[DELEGATE_BACKEND](runner), nsplit)
        log(f"[kdtree] verify backend built: {backend.describe()} hooked={backend.hooked} ({_who()})")
        return backend

    create_kdtree_backend.kdtree_nsplit = nsplit
    return create_kdtree_backend


def _install_verify(cfg: Config) -> None:
    from kdtree_ext.backend import KERNEL

    choices_module = _install_choices()
    registry = _import(ATTENTION_REGISTRY)
    register_backend = getattr(registry, "register_attention_backend", None)
    backends = getattr(registry, "ATTENTION_BACKENDS", None)
    if register_backend is None or not isinstance(backends, dict):
        raise _Missing(f"{ATTENTION_REGISTRY} has no register_attention_backend/ATTENTION_BACKENDS")
    if DELEGATE_BACKEND not in backends:
        raise _Missing(f"SGLang has no {DELEGATE_BACKEND!r} attention backend to delegate to")
    existing = backends.get(BACKEND_NAME)
    if getattr(existing, "kdtree_nsplit", None) is None:
        register_backend(BACKEND_NAME)(make_backend_factory(cfg.nsplit))
    if getattr(backends.get(BACKEND_NAME), "kdtree_nsplit", None) != cfg.nsplit:
        raise _Missing(f"registering attention backend {BACKEND_NAME!r} did not take")
    log(f"{VERIFY_OVERRIDE} nsplit={cfg.nsplit} kernel={KERNEL}: attention backend {BACKEND_NAME!r} registered "
        f"(choices in {choices_module}); target-verify MLA attention runs the {KERNEL} Triton kernel, every "
        f"other mode delegates to SGLang's {DELEGATE_BACKEND!r} backend ({_who()})")


# ----------------------------------------------------------------------------------------------- fallback

def fire_fallback(module_name: str) -> None:
    """Called by the sitecustomize post-import hooks once ``module_name`` has been imported."""
    setup = _setup("sitecustomize")
    if setup is None:
        return
    cfg, who = setup
    if module_name in CHOICES_MODULES:
        _piece("choices", cfg)
    elif who != "worker":
        return
    elif module_name == ALLOCATOR_PACKAGE:
        _piece("defrag", cfg, use_registry=False)
    elif module_name == ATTENTION_REGISTRY:
        _piece("verify", cfg)
