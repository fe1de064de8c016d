"""The reference server in the CPU SGLang venv builds a real KV allocator in each worker, as ModelRunner does:
with the kdtree payload and KDTREE_DEFRAG_SORT=1 it ends with need_sort=True, and each worker logs both
markers once. Without sglang (Debian's python) the workers log that they skipped the allocator."""

from __future__ import annotations

import re
import socket
import subprocess
import time

from tests.sglang.conftest import DEBIAN_PYTHON, REPO, run_python

READY = "The server is fired up and ready to roll!"
ALLOCATOR_RE = re.compile(r"\[\S+ \S+ TP(\d)\] KV allocator TokenToKVPoolAllocator need_sort=(True|False)$")
SKIPPED_RE = re.compile(r"\[\S+ \S+ TP(\d)\] KV allocator skipped: sglang not importable")
ON = {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ready(python: str, env: dict[str, str], tp: int = 2, timeout: float = 240) -> list[str]:
    """Start the refserver, wait for readiness, SIGTERM it; its log lines."""
    argv = [str(REPO / "kdeploy" / "lab" / "refserver.py"), "--model-path", "/models/m", "--tp-size", str(tp),
            "--port", str(_free_port()), "--attention-backend", "kdtree"]
    script = ("import subprocess, sys, time, signal\n"
              f"p = subprocess.Popen([sys.executable, *{argv!r}], stdout=subprocess.PIPE, text=True)\n"
              "lines = []\n"
              f"deadline = time.monotonic() + {timeout}\n"
              "for line in p.stdout:\n"
              "    lines.append(line.rstrip('\\n'))\n"
              f"    if {READY!r} in line or time.monotonic() > deadline:\n"
              "        break\n"
              "p.send_signal(signal.SIGTERM)\n"
              "rest = p.communicate(timeout=30)[0]\n"
              "print('\\n'.join(lines + rest.splitlines()))\n")
    run = run_python(python, ["-c", script], env, timeout=timeout + 60)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()


def test_refserver_workers_build_a_real_allocator(sglang_python: str):
    """(need_sort=False without the flag is covered by test_extension's defrag-off and control runs.)"""
    start = time.monotonic()
    lines = serve_until_ready(sglang_python, ON)
    assert READY in "\n".join(lines), "\n".join(lines)
    found = {int(m.group(1)): m.group(2) for m in map(ALLOCATOR_RE.search, lines) if m}
    assert found == {0: "True", 1: "True"}, "\n".join(lines)
    defrag = [line for line in lines if "[kdtree] defrag Tier-0" in line]
    verify = [line for line in lines if "[kdtree] installed verify override" in line]
    assert len(defrag) == 2 and len(verify) == 2
    assert sorted(line.split("rank=")[1][0] for line in defrag + verify) == ["0", "0", "1", "1"]
    print(f"tp=2 refserver ready in the SGLang venv after {time.monotonic() - start:.1f}s")


def test_refserver_without_sglang_skips_the_allocator():
    lines = serve_until_ready(DEBIAN_PYTHON, ON)
    assert READY in "\n".join(lines)
    assert sorted(int(m.group(1)) for m in map(SKIPPED_RE.search, lines) if m) == [0, 1]
    assert not any("[kdtree] defrag Tier-0" in line or "[kdtree] installed verify override" in line
                   for line in lines)
    assert len([line for line in lines if "[kdtree] Tier-0 defrag skipped: sglang not importable" in line]) == 2


def test_refserver_stays_stdlib_only_at_import():
    code = ("import sys; sys.path.insert(0, 'kdeploy/lab'); import refserver; "
            "heavy = [m for m in ('torch', 'sglang', 'numpy') if m in sys.modules]; print(heavy)")
    out = subprocess.run([DEBIAN_PYTHON, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
