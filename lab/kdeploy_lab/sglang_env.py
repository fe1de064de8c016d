"""The CPU SGLang venv: the real ``sglang==0.5.23`` package importable without a GPU, built once and cached.

It is built with Debian's ``/usr/bin/python3`` (the only interpreter the sandbox hosts see) and holds
``torch==2.13.0`` (the CPU wheel pip finds on this machine's disk), ``sglang==0.5.23`` without its
dependencies, and only the dependencies needed to import what the kdtree extension touches: the allocators
(``sglang.srt.mem_cache.allocator`` and all its submodules), the plugin loader and ``HookRegistry``
(``sglang.srt.plugins``), the ``--attention-backend`` choices (``sglang.srt.arg_groups.choices``) and the
attention-backend registry (``sglang.srt.layers.attention.attention_registry``). Each of
:data:`DEPENDENCIES` was measured to be needed for that (blocking any one of them breaks one of those
imports).

The attention registry imports SGLang's model-config registry, which imports torchvision at module level
in multimodal helpers. PyPI's torchvision is built against CUDA torch and does not import beside the CPU
torch wheel ("operator torchvision::nms does not exist"), so the venv gets a small *import shim* named
``torchvision`` instead (no dist-info, so transformers considers torchvision absent); using anything from
it raises RuntimeError. Nothing the tests exercise uses torchvision.

``ensure_venv()`` is idempotent: a marker file in the venv records the exact package set and interpreter
it was built from, and the venv is rebuilt only when that set changes. An exclusive ``flock`` next to
the venv keeps two processes from building at once (the second waits, then finds the venv ready).

Run ``python -m kdeploy_lab.sglang_env`` to build it ahead of time (prints the path and the build's numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kdeploy.core.errors import KdeployError

ENV_PATH = "KDEPLOY_SGLANG_VENV"
DEFAULT_PATH = Path("/var/cache/kdeploy/sglang-venv")
SYSTEM_PYTHON = Path("/usr/bin/python3")
MARKER = "kdeploy-sglang-env.json"
SGLANG = "sglang==0.5.23"
TORCH = "torch==2.13.0"
# Imported at module level on the way to the four modules above; pins where SGLang 0.5.23 pins them.
DEPENDENCIES = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "triton", "packaging", "pillow", "starlette",
    "msgspec", "pydantic", "pyzmq", "tqdm", "IPython", "aiohttp",
    # only for the attention registry (it imports sglang.srt.configs, which imports transformers models)
    "transformers==5.19.0", "dill", "sentencepiece==0.2.1",
    # only for the allocator submodules beyond token/paged (swa, hisparse, unified_*): so that every allocator
    # class with a need_sort parameter is importable and hooked
    "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0", "gguf",
)
SHIM_VERSION = "1"
MIN_PIP = (22, 3)          # pip --python
BUILD_TIMEOUT = 1800.0     # seconds per pip step
CHECK_IMPORTS = ("sglang.srt.mem_cache.allocator", "sglang.srt.mem_cache.allocator.swa", "sglang.srt.plugins",
                 "sglang.srt.plugins.hook_registry", "sglang.srt.arg_groups.choices",
                 "sglang.srt.layers.attention.attention_registry")

_TORCHVISION_SHIM = '''\
"""Import shim for torchvision, written by kdeploy_lab.sglang_env into its CPU SGLang venv (not torchvision).

PyPI's torchvision is built against CUDA torch and fails to import beside the CPU torch wheel; SGLang 0.5.23
imports it at module level in multimodal helpers that its model-config registry (and so its attention
registry) pulls in. This shim only satisfies those imports: using anything from it raises RuntimeError.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kdeploy.shim"
_WHY = "torchvision is an import shim in this CPU SGLang venv (kdeploy_lab.sglang_env): it cannot be used"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_WHY)


def _placeholder(name):
    return _Meta(name, (_Placeholder,), {})


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr
sys.meta_path.append(_Finder())
'''


class SglangEnvError(KdeployError):
    """The SGLang venv cannot be built (one line: what failed and why)."""


def default_path() -> Path:
    """Where the venv lives: ``$KDEPLOY_SGLANG_VENV`` or /var/cache/kdeploy/sglang-venv."""
    return Path(os.environ.get(ENV_PATH) or DEFAULT_PATH)


def venv_python(path: Path | None = None) -> Path:
    return Path(path or default_path()) / "bin" / "python"


def spec(python: Path = SYSTEM_PYTHON) -> dict:
    """What a venv is built from; a venv whose marker records anything else is rebuilt."""
    return {"python": str(python), "python_version": _python_version(python), "torch": TORCH, "sglang": SGLANG,
            "dependencies": list(DEPENDENCIES), "torchvision_shim": SHIM_VERSION}


def info(path: Path | None = None) -> dict | None:
    """The marker of a built venv (spec, build seconds, size, package versions), or None."""
    try:
        data = json.loads((Path(path or default_path()) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_ready(path: Path | None = None, python: Path = SYSTEM_PYTHON) -> bool:
    """Built from the current package set (no build, no lock)."""
    path = Path(path or default_path())
    data = info(path)
    return bool(data and venv_python(path).exists() and data.get("spec") == spec(python))


def ensure_venv(path: Path | None = None, *, python: Path = SYSTEM_PYTHON,
                log: Callable[[str], None] | None = None) -> Path:
    """Return the path of a ready venv, building it first when missing or built from another package set."""
    path = Path(path or default_path()).absolute()
    if is_ready(path, python):
        return path
    if not python.exists():
        raise SglangEnvError(f"cannot build the SGLang venv: {python} not found (apt-get install python3 python3-venv)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SglangEnvError(f"cannot build the SGLang venv at {path}: {exc}") from None
    with _lock(path.with_name(f".{path.name}.lock")):
        if is_ready(path, python):     # another process built it while we waited
            return path
        _build(path, python, log or (lambda _msg: None))
    return path


# ---------------------------------------------------------------------------------------------------


def _python_version(python: Path) -> str:
    try:
        out = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except OSError:
        return ""
    return out


@contextlib.contextmanager
def _lock(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and "is ignored: it is neither a file nor a directory" not in line]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:300]


def _run(argv: list[str], what: str, path: Path) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SglangEnvError(f"cannot build the SGLang venv at {path}: {what}: {argv[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise SglangEnvError(f"cannot build the SGLang venv at {path}: {what} timed out after "
                             f"{BUILD_TIMEOUT:.0f}s") from None
    if proc.returncode != 0:
        raise SglangEnvError(f"cannot build the SGLang venv at {path}: {what} failed: "
                             f"{_tail(proc.stderr) if proc.stderr.strip() else _tail(proc.stdout)}")
    return proc.stdout


def _pip_version(python: str) -> tuple[int, ...] | None:
    try:
        proc = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, timeout=60,
                              check=False)
    except OSError:
        return None
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) < 2:
        return None
    try:
        return tuple(int(x) for x in words[1].split(".")[:2])
    except ValueError:
        return None


def _pip_runner(python: Path) -> list[str] | None:
    """A pip that can install into another interpreter's venv (``--python``), or None."""
    for candidate in dict.fromkeys((sys.executable, str(python))):
        version = _pip_version(candidate)
        if version is not None and version >= MIN_PIP:
            return [candidate, "-m", "pip"]
    return None


def _has_ensurepip(python: Path) -> bool:
    try:
        return subprocess.run([str(python), "-c", "import ensurepip"], capture_output=True, timeout=30,
                              check=False).returncode == 0
    except OSError:
        return False


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _build(path: Path, python: Path, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    log(f"building the SGLang venv at {path} ({SGLANG}, {TORCH}; takes a few minutes, once)")
    if path.exists() or path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            raise SglangEnvError(f"cannot build the SGLang venv at {path}: cannot remove the old one")
    runner = _pip_runner(python)
    if runner is not None:
        _run([str(python), "-m", "venv", "--without-pip", str(path)], "python3 -m venv", path)
        pip = [*runner, "--python", str(venv_python(path))]
    elif _has_ensurepip(python):
        _run([str(python), "-m", "venv", str(path)], "python3 -m venv", path)
        pip = [str(venv_python(path)), "-m", "pip"]
    else:
        raise SglangEnvError(f"cannot build the SGLang venv at {path}: no pip >= {MIN_PIP[0]}.{MIN_PIP[1]} "
                             f"and no ensurepip for {python}: apt-get install python3-venv python3-pip")
    quiet = ["--disable-pip-version-check", "--no-input", "-q"]
    with tempfile.NamedTemporaryFile("w", prefix="kdeploy-sglang-", suffix=".txt") as pins:
        pins.write(f"{TORCH}\n")   # no dependency may swap the CPU torch for a CUDA build
        pins.flush()
        _run([*pip, "install", *quiet, "-c", pins.name, TORCH, *DEPENDENCIES], f"pip install {TORCH} + deps", path)
        _run([*pip, "install", *quiet, "--no-deps", SGLANG], f"pip install --no-deps {SGLANG}", path)
    purelib = _run([str(venv_python(path)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   "locating site-packages", path).strip()
    shim = Path(purelib) / "torchvision"
    if not shim.exists():             # nothing pulled in a real torchvision: satisfy SGLang's imports
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text(_TORCHVISION_SHIM)
    _run([str(venv_python(path)), "-c", "; ".join(f"import {m}" for m in CHECK_IMPORTS)],
         "importing SGLang's allocators, plugin loader and attention registry", path)
    freeze = _run([*pip, "list", "--format=freeze", "--disable-pip-version-check"], "pip list", path).split()
    marker = {"spec": spec(python), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "build_seconds": round(time.monotonic() - started, 1), "size_bytes": _dir_size(path),
              "packages": freeze}
    tmp = path / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, path / MARKER)      # written last: a venv without it is incomplete and rebuilt
    log(f"built the SGLang venv at {path} in {marker['build_seconds']:.0f}s, "
        f"{marker['size_bytes'] / 1e9:.2f} GB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdeploy_lab.sglang_env", description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=None, help=f"venv path (default ${ENV_PATH} or {DEFAULT_PATH})")
    parser.add_argument("--check", action="store_true", help="only report whether it is built (exit 1 if not)")
    args = parser.parse_args(argv)
    path = Path(args.path or default_path()).absolute()
    if args.check:
        ready = is_ready(path)
        print(f"{path}: {'ready' if ready else 'not built'}")
        return 0 if ready else 1
    try:
        ensure_venv(path, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except SglangEnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = info(path) or {}
    print(f"{path} (built {data.get('built_at')} in {data.get('build_seconds')}s, "
          f"{(data.get('size_bytes') or 0) / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
