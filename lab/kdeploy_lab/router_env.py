"""The real SGLang router (``sglang-router==0.3.2``, a Rust binary in a wheel) in a cached venv, and a way to
run it for tests and benchmarks.

Built once with Debian's ``/usr/bin/python3`` (as the SGLang venv, :mod:`kdeploy_lab.sglang_env`), rebuilt
only when the marker's package set changes; an exclusive ``flock`` next to it keeps two builds apart.
``python -m kdeploy_lab.router_env`` builds it ahead of time and prints its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kdeploy.core.errors import KdeployError

ENV_PATH = "KDEPLOY_ROUTER_VENV"
DEFAULT_PATH = Path("/var/cache/kdeploy/router-venv")
SYSTEM_PYTHON = Path("/usr/bin/python3")
PACKAGE = "sglang-router==0.3.2"
MARKER = "kdeploy-router-env.json"


class RouterEnvError(KdeployError):
    """The router venv could not be built or the router did not start."""


def venv_path() -> Path:
    return Path(os.environ.get(ENV_PATH) or DEFAULT_PATH)


def ensure_venv(path: Path | None = None) -> Path:
    """The venv's python, built if missing or built from another package set."""
    path = path or venv_path()
    python = path / "bin" / "python"
    want = {"package": PACKAGE, "python": str(SYSTEM_PYTHON)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError):
            if json.loads((path / MARKER).read_text()) == want and python.exists():
                return python
        shutil.rmtree(path, ignore_errors=True)
        for argv in ([str(SYSTEM_PYTHON), "-m", "venv", str(path)],
                     [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", PACKAGE]):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
            if done.returncode:
                shutil.rmtree(path, ignore_errors=True)
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise RouterEnvError(f"building the router venv failed: {' '.join(argv[:4])}: {tail}")
        (path / MARKER).write_text(json.dumps(want))
    return python


def router_argv(python: Path, host: str, port: int, workers: list[str], *, prometheus_port: int,
                retries: bool = True, policy: str = "round_robin", health_interval: int = 60,
                health_failures: int = 3, api_key: str | None = None, pd: bool = False) -> list[str]:
    """The router's command line: ``round_robin`` so a fixed prompt reaches every worker (``cache_aware``, its
    default, sends identical prompts to one); its Prometheus exporter on ``prometheus_port`` (default 29000:
    two routers on one machine would collide, and the second one panics). ``pd``: PD mode
    (``--pd-disaggregation``), where ``--worker-urls`` is ignored: it starts empty and servers join through its
    API with their role."""
    argv = [str(python), "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
            "--policy", policy, "--health-check-interval-secs", str(health_interval),
            "--health-failure-threshold", str(health_failures)]
    if pd:
        argv.append("--pd-disaggregation")
    elif workers:
        argv += ["--worker-urls", *workers]
    if not retries:
        argv.append("--disable-retries")
    if api_key:
        argv += ["--api-key", api_key]
    return argv


@dataclass
class LocalRouter:
    """A router process on this machine (tests, benchmarks); ``stop`` always reaps it."""

    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def running(argv: list[str], url: str, log: Path, *, api_key: str | None = None,
            timeout: float = 60.0) -> Iterator[LocalRouter]:
    """Start the router, wait until its API answers, yield it; stop it on the way out, whatever happened."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router = LocalRouter(proc, url, log)
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/workers", headers=headers, timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RouterEnvError(f"the router did not start: {log.read_text()[-500:]}")
            time.sleep(0.2)
        yield router
    finally:
        router.stop()


if __name__ == "__main__":
    print(ensure_venv())
