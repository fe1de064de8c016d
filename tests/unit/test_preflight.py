"""The preflight's verdict (kdeploy/flows/preflight.py): every check with its numbers, passing ones too."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdeploy.core import probe
from kdeploy.core.errors import PreflightRefused
from kdeploy.core.inventory import load
from kdeploy.flows import preflight

REPO = Path(__file__).resolve().parents[2]
PASSING = [probe.Check("sglang", "pass", "SGLang 0.5.23: compatible"),
           probe.Check("disk", "pass", "needs 67.1 MB, /opt/kdeploy has 41.2 GB free: ok"),
           probe.Check("gpus", "warn", "nvidia-smi not found: cannot count GPUs (tp=8 needs 8)"),
           probe.Check("port", "pass", "port 30000 free")]


def test_passing_checks_show_their_numbers_in_the_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    host = next(iter(load(REPO / "inventory.yaml").hosts.values()))
    monkeypatch.setattr(preflight, "preflight_checks", lambda *a: PASSING)
    assert preflight.preflight_verdict(host, "", 0) == (
        "preflight sglang pass: SGLang 0.5.23: compatible; "
        "disk pass: needs 67.1 MB, /opt/kdeploy has 41.2 GB free: ok; "
        "gpus warn: nvidia-smi not found: cannot count GPUs (tp=8 needs 8); port pass: port 30000 free")


def test_a_failing_check_refuses_the_host_naming_only_the_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    host = next(iter(load(REPO / "inventory.yaml").hosts.values()))
    monkeypatch.setattr(preflight, "preflight_checks",
                        lambda *a: [*PASSING, probe.Check("hicache", "fail", "ratio 4.0 needs 344 GB, host has 96 GB")])
    with pytest.raises(PreflightRefused) as refused:
        preflight.preflight_verdict(host, "", 0)
    assert str(refused.value) == f"{host.name}: preflight refused: hicache: ratio 4.0 needs 344 GB, host has 96 GB"
