"""kdeploy/probe.py's probe command run for real: the CPU SGLang venv's python and Debian's python3."""

from __future__ import annotations

import subprocess

from kdeploy import probe
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
