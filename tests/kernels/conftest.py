"""The kdtree verify kernel's tests. CPU: scripts run under Triton's interpreter (``TRITON_INTERPRET=1``) with
the cached CPU SGLang venv's python (torch + triton + the real sglang 0.5.23), built once by
``kdeploy_lab.sglang_env`` (the ``sglang_python`` fixture of tests/conftest.py); ``KDEPLOY_SKIP_SGLANG=1``
skips them. GPU: see test_mla_verify_gpu.py (skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = REPO / "kernels" / "kdtree"
HERE = Path(__file__).resolve().parent


@dataclass
class Script:
    returncode: int
    stdout: str
    stderr: str
    cases: list[dict] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def run_script(python: str, name: str, *args: str, timeout: float = 600) -> Script:
    """Run tests/kernels/<name> under the Triton interpreter, payload on PYTHONPATH, clean KDTREE_* env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDTREE_", "SGLANG_", "PYTHON", "TRITON_"))}
    env.update({"PYTHONPATH": str(PAYLOAD), "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1",
                "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([python, str(HERE / name), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(HERE), check=False)
    run = Script(proc.returncode, proc.stdout, proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            run.cases.append(json.loads(line[5:]))
        elif line.startswith("RESULT "):
            run.result = json.loads(line[7:])
    return run
