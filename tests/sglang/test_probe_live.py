"""kdeploy/core/probe.py's probe command run for real: the CPU SGLang venv's python and Debian's python3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kdeploy.core import probe
from tests.sglang.conftest import DEBIAN_PYTHON


def _probe(python: str) -> probe.ProbeReport:
    proc = subprocess.run(["sh", "-c", probe.probe_command(python)], capture_output=True, text=True, timeout=60,
                          check=False)
    return probe.parse_probe(proc.stdout, proc.stderr, proc.returncode)


def test_probe_finds_sglang_0_5_23_compatible(sglang_python: str):
    report = _probe(sglang_python)
    assert report.compatible, report.summary()
    assert report.version == "0.5.23" and report.loader == "plugin" and len(report.allocators) >= 2


def test_probe_without_sglang():
    report = _probe(DEBIAN_PYTHON)
    assert report.ok and not report.compatible
    assert report.summary() == f"sglang not installed for {DEBIAN_PYTHON}"


def test_probe_keeps_what_it_read_until_sglang_changes(tmp_path: Path):
    """A pretend SGLang on the path: the cache answers while its files stay, a changed file is read again."""
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "plugins").mkdir(parents=True)
    (pkg / "version.py").write_text('__version__ = "0.5.23"\n')
    hooks = pkg / "srt" / "plugins" / "hook_registry.py"
    hooks.write_text("class Other:\n    pass\n")
    cache = tmp_path / "svc" / probe.CACHE

    def run() -> dict:
        proc = subprocess.run([sys.executable, "-c", probe.PROBE_CODE, str(cache)], capture_output=True, text=True,
                              timeout=60, check=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
        return probe.parse_probe(proc.stdout).raw

    assert run()["hook_registry"] is False and not cache.exists()        # no service directory yet: not kept
    cache.parent.mkdir()
    assert run()["hook_registry"] is False and json.loads(cache.read_text())["found"]["hook_registry"] is False
    saved = json.loads(cache.read_text())
    saved["found"]["version"] = "from the cache"
    cache.write_text(json.dumps(saved))
    assert run()["version"] == "from the cache"
    hooks.write_text('class HookRegistry:\n    def around(self):\n        return "around"\n')
    again = run()
    assert again["hook_registry"] is True and again["version"] == "0.5.23"
    assert json.loads(cache.read_text())["found"] == {k: again[k] for k in saved["found"]}
    assert sorted(p.name for p in cache.parent.iterdir()) == [probe.CACHE]    # no temp file left
