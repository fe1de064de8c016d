"""The reference server (lab/kdeploy_lab/refserver.py) as a local subprocess, for the tests that run it without
containers: a free loopback port, its output read line by line with arrival times, and cleanup that kills its
whole process group (main process and workers)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "tests" / "data" / "testplugin"
PLUGIN_RE = re.compile(r"^\[kdeploy-testplugin\] loaded pid=(\d+)$")
STARTED_RE = re.compile(r"Started scheduler process TP(\d+) pid=(\d+)")
READY = "The server is fired up and ready to roll!"
FRANCE = "The capital of France is"
DEBIAN_PYTHON = "/usr/bin/python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """True while pid runs; a zombie (nobody reaps orphans here) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pids, timeout: float) -> set[int]:
    """Poll until every pid is gone; return the survivors."""
    deadline = time.monotonic() + timeout
    left = set(pids)
    while left and time.monotonic() < deadline:
        left = {p for p in left if alive(p)}
        if left:
            time.sleep(0.02)
    return {p for p in left if alive(p)}


class RefServer:
    def __init__(self, tp: int = 8, env: dict | None = None, args: tuple = (), python: str = sys.executable,
                 module: str = "kdeploy_lab.refserver", cwd: Path = REPO,
                 pythonpath: tuple = (REPO / "lab", PLUGIN_DIR)):
        self.port = free_port()
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith("REFSERVER_") and k != "SGLANG_PLUGINS"}
        full_env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
        full_env.update(env or {})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [python, "-m", module, "--model-path", "/models/test-model", "--tp-size", str(tp),
             "--port", str(self.port), *args],
            cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.pid = self.proc.pid
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def text(self) -> list[str]:
        with self._cond:
            return [line for _, line in self.lines]

    def wait_for(self, pattern: str, timeout: float = 10.0) -> tuple[float, str]:
        """(arrival time, line) of the first line containing pattern; fails on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.lines:
                    if pattern in line:
                        return t, line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} within {timeout} s; log:\n" + "\n".join(
                        line for _, line in self.lines))
                self._cond.wait(min(left, 0.05))

    def wait_count(self, regex: re.Pattern, count: int, timeout: float = 10.0) -> list[re.Match]:
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in map(regex.search, self.text()) if m]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(2)
        return rc

    def worker_pids(self) -> dict[int, int]:
        return {int(m[1]): int(m[2]) for m in map(STARTED_RE.search, self.text()) if m}

    def plugin_pids(self) -> list[int]:
        return [int(m[1]) for m in map(PLUGIN_RE.search, self.text()) if m]

    def request(self, method: str, path: str, body=None, raw: bytes | None = None,
                host: str = "127.0.0.1") -> tuple[int | None, bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"http://{host}:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None, b""

    def complete(self, prompt: str = FRANCE, max_tokens: int = 8, temperature: float = 0) -> dict:
        status, body = self.request("POST", "/v1/completions", {
            "model": "/models/test-model", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature})
        assert status == 200, (status, body)
        return json.loads(body)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(5)
        for pid in self.worker_pids().values():  # workers orphaned by a failed test
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.proc.stdout:
            self.proc.stdout.close()
