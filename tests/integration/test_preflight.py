"""push preflight and probe on sandbox hosts: each refusal exits 7 and leaves the host as it was."""

from __future__ import annotations

import re

import pytest

from kdeploy.core import release
from kdeploy.flows.preflight import preflight_checks, preflight_step
from tests.conftest import Deployment
from tests.integration.test_safety import _connect, _snapshot, small_releases


def _refused(dep: Deployment, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    before = _snapshot(dep)
    code, doc = dep.json(capsys, "push", "test", *args)
    host = doc["hosts"][0]
    assert code == 7 and host["result"] == "preflight_refused", host
    assert _snapshot(dep) == before
    return host["error"]


def test_preflight_passes_and_reports_each_check(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0
    detail = next(p for p in doc["hosts"][0]["phases"] if p["name"] == "preflight")["detail"]
    # the sandbox has no GPUs and its reference server is not SGLang: warnings, not failures
    for check in ("sglang warn: ", "disk pass: releases ", "gpus warn: ", "hicache pass: HiCache off",
                  "port pass: port "):
        assert check in detail, detail  # passing checks too, with their numbers (docs/push.md)
    assert "nvidia-smi" in detail
    # a no-op push does not run them (nor the service's python, nvidia-smi, journalctl)
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0 and doc["hosts"][0]["result"] == "unchanged"
    detail = next(p for p in doc["hosts"][0]["phases"] if p["name"] == "preflight")["detail"]
    assert "lock taken" in detail and "preflight" not in detail and "disk" not in detail, detail


def test_disk_is_measured_where_the_releases_land(deployment: Deployment,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A small filesystem mounted on releases/ refuses the push, though the service directory's has room; on a
    larger one the check passes with each filesystem's numbers, the places on one summed."""
    with small_releases(deployment, "size=32m") as releases:
        error = _refused(deployment, capsys)
        said = f"h1: preflight refused: disk: releases {releases} (tmpfs at {releases}): 32.0 MiB, "
        assert error.startswith(said), error
        assert re.search(r"inodes free; need 64\.0 MiB, \d+ inodes: not enough space$", error), error
        deployment.sh("h1", f"mount -o remount,size=1g {releases}")
        host = deployment.load().hosts["h1"]
        with _connect(deployment) as remote:
            output = remote.ask(preflight_step(host))
        entries = release.entries(release.scan_payload(deployment.payload).files)
        disk = next(c for c in preflight_checks(host, output, 0, entries) if c.name == "disk")
        assert disk.status == "pass", disk
        places = disk.detail.split(" | ")
        assert places[0].startswith(f"releases {releases} (tmpfs at {releases}): 1.0 GiB, "), disk
        assert places[1].startswith(f"service {deployment.service_dir}"), disk   # another filesystem: /srv's
        assert all(re.search(r": [\d.]+ [KMGT]iB, [\d.]+[kM]? inodes free; need [\d.]+ MiB, \d+ inodes$", p)
                   for p in places), disk
        assert deployment.kdeploy("push", "test") == 0


def test_few_inodes_on_releases_refuse_the_push_by_inodes(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Blocks to spare, inodes not: a tmpfs of 256 MiB with 20 inodes (the release needs its files and
    directories, and its metadata)."""
    with small_releases(deployment, "size=256m,nr_inodes=20") as releases:
        error = _refused(deployment, capsys)
        assert re.fullmatch(rf"h1: preflight refused: disk: releases {releases} \(tmpfs at {releases}\): "
                            r"256\.0 MiB, 19 inodes free; need 64\.0 MiB, \d+ inodes: not enough inodes", error), error


def test_port_held_by_another_process_is_refused(deployment: Deployment,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    deployment.set_service(sglang={"model_path": "/models/Kimi-K2.6", "served_model_name": "kimi-k2.6", "tp": 8,
                                   "port": deployment.port + 500})
    deployment.sh("h1", f"systemd-run --unit=squatter-{deployment.service} --quiet "
                        f"/usr/bin/python3 -m http.server {deployment.port + 500} --bind 127.0.0.1; sleep 1")
    try:
        error = _refused(deployment, capsys)
        assert f"port {deployment.port + 500} held by" in error and "python" in error
        # --skip-preflight is the explicit way past it (the gate then fails on the wrong server)
    finally:
        deployment.sh("h1", f"systemctl stop squatter-{deployment.service}", check=False)


def test_hicache_that_does_not_fit_in_host_ram_is_refused(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(hicache={"enabled": True, "ratio": 4.0, "device_kv_gb_per_rank": 4096})
    error = _refused(deployment, capsys)
    assert "hicache: ratio 4.0 needs 8 x" in error and "GiB" in error


def test_hicache_sizes_the_pool_from_the_running_service_journal(deployment: Deployment,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """No device KV size in the inventory: it comes from the running invocation's 'KV Cache is allocated'
    line, read from the journal (not by scanning the unit's whole history)."""
    assert deployment.kdeploy("push", "test") == 0
    logged = deployment.sh("h1", f"journalctl -u {deployment.service} -o cat --no-pager | grep 'KV Cache is allocated'")
    k, v = re.search(r"K size: ([0-9.]+) GB, V size: ([0-9.]+) GB", logged.splitlines()[-1]).groups()
    deployment.set_service(hicache={"enabled": True, "ratio": 400.0})
    error = _refused(deployment, capsys)
    assert f"hicache: ratio 400.0 needs 8 x {400 * (float(k) + float(v)):.1f} GB" in error, error
    assert f"(device KV {float(k) + float(v):g} GB per rank from the last run's journal)" in error, error


def test_sglang_launcher_without_sglang_is_refused(deployment: Deployment,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(module="sglang.launch_server")
    error = _refused(deployment, capsys)
    assert "sglang not installed" in error


def test_skip_preflight_goes_past_a_failing_check(deployment: Deployment,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(hicache={"enabled": True, "ratio": 4.0, "device_kv_gb_per_rank": 4096})
    code, doc = deployment.json(capsys, "push", "test", "--skip-preflight")
    assert code == 0 and doc["hosts"][0]["result"] == "deployed"


def test_probe_without_sglang_says_not_installed(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = deployment.json(capsys, "probe", "test")
    host = doc["hosts"][0]
    assert code == 7 and host["result"] == "incompatible"
    assert host["probe"]["installed"] is False and "sglang not installed" in host["probe"]["summary"]


def test_environment_file_must_exist_be_roots_and_0600(deployment: Deployment,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = f"/etc/{deployment.service}-secrets.env"
    deployment.set_service(environment_file=path)
    try:
        assert "environment_file " + path + " is missing" in _refused(deployment, capsys)
        deployment.sh("h1", f"umask 022; echo HF_TOKEN=x > {path}")
        assert "has mode 0644: others can read its secrets" in _refused(deployment, capsys)
        deployment.sh("h1", f"chmod 0600 {path}; chown 1000 {path}")
        assert "owned by uid 1000, not root" in _refused(deployment, capsys)
        deployment.sh("h1", f"chown 0 {path}")
        code, doc = deployment.json(capsys, "push", "test")
        assert code == 0, doc
        detail = next(p for p in doc["hosts"][0]["phases"] if p["name"] == "preflight")["detail"]
        assert "envfile pass" in detail
    finally:
        deployment.sh("h1", f"rm -f {path}", check=False)
