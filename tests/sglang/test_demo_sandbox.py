"""The sandbox demo with the real SGLang venv: a host boots with the cached CPU SGLang venv bound read-only at
/opt/kdeploy-sandbox/sglang, the demo service runs the reference server with it, and the push's gate counts
the two real kdtree markers (Tier-0 defrag, verify override) from each TP worker (2 here, 8 in the demo)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy_lab.demo import demo_service
from kdeploy_lab.sandbox import SGLANG_HOST_VENV, Sandbox, SandboxError
from tests.conftest import fast_drain


@pytest.fixture(scope="module")
def sglang_box(sglang_python: str) -> Iterator[Sandbox]:
    """One host on instance 7 (the session fleet takes the first free of 0-6, test_sandbox.py 8 and 9)."""
    box = Sandbox(instance=7, sglang=True)
    try:
        box.check_requirements()
    except SandboxError as exc:
        pytest.skip(str(exc))
    if box.hosts():
        pytest.fail("sandbox instance 7 is in use: another test run? (`kdeploy sandbox down --instance 7`)")
    box.up(1)
    try:
        fast_drain(box)
        yield box
    finally:
        box.down()


def test_demo_gate_counts_the_real_markers(sglang_box: Sandbox, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]):
    assert sglang_box.sglang_venv() is not None
    service = demo_service()
    assert service["python"] == f"{SGLANG_HOST_VENV}/bin/python" and "markers" not in service["gate"]
    service["sglang"]["tp"] = service["gate"]["workers"] = 2     # the demo's 8 workers take ~3x longer here
    inv = tmp_path / "inventory.yaml"
    sglang_box.write_inventory(inv, service)
    capsys.readouterr()
    code = cli.main(["push", "all", "--inventory", str(inv), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    workers = next(p for p in report["hosts"][0]["phases"] if p["name"] == "workers")
    assert workers["detail"] == "3 markers x 2 workers, config verify=on defrag=1 nsplit=64"
    journal = sglang_box.exec("h1", ["sh", "-c", "journalctl -u sglang-demo -o cat --no-pager"]).stdout
    assert journal.count("KV allocator TokenToKVPoolAllocator need_sort=True") == 2

    # The gate follows the flags: turning defrag off no longer demands its marker, and back on does again.
    for flags, detail in ((["KDTREE_DEFRAG_SORT=0"], "2 markers x 2 workers, config verify=on defrag=0 nsplit=64"),
                          (["KDTREE_DEFRAG_SORT=1"], "3 markers x 2 workers, config verify=on defrag=1 nsplit=64"),
                          (["KDTREE_VERIFY=off"], "1 markers x 2 workers, config verify=off defrag=1 nsplit=64")):
        code = cli.main(["set-env", *flags, "--inventory", str(inv), "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0, report
        workers = next(p for p in report["hosts"][0]["phases"] if p["name"] == "workers")
        assert workers["detail"] == detail, (flags, workers)


def test_a_service_on_the_sglang_venv_needs_a_sandbox_that_has_it(tmp_path: Path):
    """Pure: a sandbox state without the SGLang venv refuses an inventory whose service needs it."""
    state = tmp_path / "9"
    state.mkdir()
    (state / "meta.json").write_text(json.dumps({"hosts": 1, "instance": 9, "sglang": None}))
    box = Sandbox(root=tmp_path, instance=9)
    assert box.sglang_venv() is None
    with pytest.raises(SandboxError, match="has no SGLang venv"):
        box.write_inventory(tmp_path / "inv.yaml", demo_service(sglang=True))
    box.write_inventory(tmp_path / "inv.yaml", demo_service(sglang=False))
    assert "/opt/kdeploy-sandbox/venv/bin/python" in (tmp_path / "inv.yaml").read_text()


def test_probe_command_on_a_host_with_sglang(sglang_box: Sandbox, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]):
    inv = tmp_path / "inventory.yaml"
    sglang_box.write_inventory(inv, demo_service())
    capsys.readouterr()
    code = cli.main(["probe", "all", "--inventory", str(inv), "--json"])
    host = json.loads(capsys.readouterr().out)["hosts"][0]
    assert code == 0 and host["result"] == "ok", host
    assert host["probe"]["compatible"] is True and host["probe"]["version"] == "0.5.23"
    assert host["probe"]["loader"] == "plugin"
