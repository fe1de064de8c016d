"""The real ``sglang==0.5.23`` package on CPU: a session fixture builds (once, then cached) the SGLang venv
with ``kdeploy_lab.sglang_env.ensure_venv()``; tests run their checks as subprocesses of that venv's python.

``KDEPLOY_SKIP_SGLANG=1`` skips these tests (e.g. on a machine that cannot reach PyPI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = REPO / "kernels" / "kdtree"
HARNESS = Path(__file__).with_name("harness.py")
DEBIAN_PYTHON = "/usr/bin/python3"
PID_RE = re.compile(r"\bpid=(\d+)")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    result: dict = field(default_factory=dict)

    def kdtree_lines(self) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith("[kdtree]")]

    def pids_with(self, text: str) -> list[int]:
        """The pid of every line containing text (one entry per line)."""
        return [int(m.group(1)) for line in self.stdout.splitlines() if text in line
                for m in [PID_RE.search(line)] if m]


def run_python(python: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> Run:
    """Run python with the payload on PYTHONPATH and a clean KDTREE_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KDTREE_", "SGLANG_", "PYTHON"))}
    base.update({"PYTHONPATH": str(PAYLOAD), "PYTHONUNBUFFERED": "1"})
    base.update(env or {})
    proc = subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout, env=base,
                          cwd=str(HARNESS.parent), check=False)
    run = Run(proc.returncode, proc.stdout, proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            run.result = json.loads(line[len("RESULT "):])
    return run


def run_harness(python: str, options: dict, env: dict[str, str] | None = None) -> Run:
    return run_python(python, [str(HARNESS), json.dumps(options)], env)
