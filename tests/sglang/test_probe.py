"""kdeploy/core/probe.py: the probe and preflight parsers and checks, on output captured from real runs.

tests/sglang/data/probe/ holds what the commands printed: the probe with the CPU SGLang venv's python (real
sglang 0.5.23), with Debian's /usr/bin/python3 (no sglang) and with a missing interpreter; the combined
preflight command on a sandbox host running the demo service (port 30000 held by sglang-demo, journal with
its "KV Cache is allocated" line, no nvidia-smi) and for another unit on the same host (their disk sections
captured again on a fresh sandbox host when the check came to measure each place: /srv a bind mount, /etc
the container's overlay).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kdeploy.core import disk, probe
from kdeploy.core.disk import Need
from kdeploy.core.probe import Check, Listener

DATA = Path(__file__).resolve().parent / "data" / "probe"
MIB = 1024**2


def places(service: str) -> tuple[Need, ...]:
    """Where a push of ``service`` writes on the sandbox host (``disk.needs``), for a 50 kB release of 10 entries."""
    d = f"/srv/kdeploy/{service}"
    return (Need("releases", f"{d}/releases", 50_000 + 64 * MIB, 26), Need("service", d, MIB, 16),
            Need("units", "/etc/systemd/system", MIB, 8))


def captured(name: str) -> tuple[str, str, int]:
    return ((DATA / f"{name}.stdout").read_text(), (DATA / f"{name}.stderr").read_text(),
            int((DATA / f"{name}.rc").read_text()))


def test_probe_on_real_sglang_0_5_23():
    report = probe.parse_probe(*captured("sglang_venv"))
    assert report.ok and report.installed and report.compatible
    assert report.version == "0.5.23" and report.python_version == "3.11.2"
    assert report.plugin_loader and report.hook_registry and report.attention_registry and report.triton_backend
    assert report.backend_choices == "sglang.srt.arg_groups.choices"
    assert {"TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator"} <= set(
        report.allocators)
    assert report.loader == "plugin"
    assert report.summary().endswith(": compatible")
    assert report.to_json()["compatible"] is True


def test_probe_without_sglang_says_not_installed():
    report = probe.parse_probe(*captured("debian_python3"))
    assert report.ok and not report.installed and not report.compatible
    assert report.summary() == "sglang not installed for /usr/bin/python3"
    assert report.problems == ("sglang not installed for /usr/bin/python3",)
    assert report.loader == "none"


def test_probe_with_a_missing_interpreter():
    report = probe.parse_probe(*captured("missing_python"))
    assert not report.ok and not report.compatible
    assert report.summary().startswith("probe failed: interpreter not found (")
    assert "/nonexistent/python" in report.summary()


def test_probe_ignores_noise_and_takes_the_last_line():
    stdout = "[kdtree] something\nwarning: foo\n" + captured("sglang_venv")[0]
    assert probe.parse_probe(stdout).compatible
    assert not probe.parse_probe("KDEPLOY_PROBE {not json").ok
    assert probe.parse_probe("", "Traceback ...\nSyntaxError: bad", 1).problems == ("SyntaxError: bad",)


def test_probe_verdict_names_what_is_missing():
    old = ('KDEPLOY_PROBE {"python": "/v/bin/python", "python_version": "3.10.12", "installed": true, '
           '"version": "0.3.0", "plugin_loader": false, "hook_registry": false, "allocators": [], '
           '"attention_registry": false, "triton_backend": false, "backend_choices": null}')
    report = probe.parse_probe(old)
    assert not report.compatible and report.loader == "sitecustomize"
    assert len(report.problems) == 3
    assert "no KV allocator class takes need_sort" in report.summary()


def test_probe_command_is_one_quoted_command():
    cmd = probe.probe_command("/opt/my venv/bin/python")
    argv = shlex.split(cmd)
    assert argv[:5] == ["env", "-u", "PYTHONPATH", "/opt/my venv/bin/python", "-I"]
    assert argv[5] == "-c" and argv[6] == probe.PROBE_CODE


# ----------------------------------------------------------------------------------------------- checks

NVIDIA_SMI_L = """\
GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: GPU-1b5c1b6a-0f0e-4a43-8e2b-0c5c8e1d2f01)
GPU 1: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: GPU-1b5c1b6a-0f0e-4a43-8e2b-0c5c8e1d2f02)
  MIG 1g.24gb     Device  0: (UUID: MIG-0e7b9c1c-1111-2222-3333-444455556666)
"""


def test_gpus():
    assert probe.parse_gpus(NVIDIA_SMI_L) == ["NVIDIA RTX PRO 6000 Blackwell Server Edition"] * 2
    assert probe.check_gpus(NVIDIA_SMI_L, 0, 2).status == "pass"
    check = probe.check_gpus(NVIDIA_SMI_L, 0, 8)
    assert check == Check("gpus", "fail", "tp=8 needs 8 GPUs, host has 2 (NVIDIA RTX PRO 6000 Blackwell Server "
                                          "Edition)")
    assert probe.check_gpus(None, 127, 8).status == "warn"
    assert "nvidia-smi not found" in probe.check_gpus("", 127, 8).detail
    assert probe.check_gpus("NVIDIA-SMI has failed because it couldn't communicate", 9, 8).status == "fail"


def test_hicache_matches_the_field_notes_numbers():
    """Kimi-K2.5 TP8, 10.42 GB device KV per rank, ratio 4.0, 396 GB free: 344 GB needed, 13% headroom."""
    check = probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=396 * 10**9, ratio=4.0,
                                device_kv_gb_per_rank=10.42)
    assert check.status == "pass"
    assert check.detail == ("ratio 4.0 needs 8 x 41.7 GB + 10 GiB = 344 GB, host has 396 GB available: ok "
                            "(device KV 10.42 GB per rank from inventory)")
    tight = probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=370 * 10**9, ratio=4.0,
                                device_kv_gb_per_rank=10.42)
    assert tight.status == "warn" and "less than 10% headroom" in tight.detail


def test_hicache_statuses():
    fits = probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=396 * 10**9, ratio=2.0,
                               device_kv_gb_per_rank=10.42)
    assert fits.status == "pass" and ": ok (" in fits.detail
    too_much = probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=300 * 10**9, ratio=4.0,
                                   device_kv_gb_per_rank=10.42)
    assert too_much.status == "fail" and "Not enough host memory" in too_much.detail
    by_size = probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=396 * 10**9, size_gb=50,
                                  device_kv_gb_per_rank=None)
    assert by_size.status == "fail" and by_size.detail.startswith("--hicache-size 50 GB needs 8 x 50.0 GB")
    assert probe.check_hicache(enabled=False, ranks=8, mem_available_bytes=None).status == "pass"
    assert probe.check_hicache(enabled=True, ranks=8, mem_available_bytes=10**12, ratio=2.0).status == "warn"


def test_port():
    demo = [Listener(145, "python", "/system.slice/sglang-demo.service / /system.slice/sglang-demo.service")]
    assert probe.check_port(30000, "sglang-demo", []).detail == "port 30000 free"
    assert probe.check_port(30000, "sglang-demo", demo).status == "pass"
    other = probe.check_port(30000, "kdt7", demo)
    assert other.status == "fail" and other.detail == "port 30000 held by pid 145 (python), not by kdt7"
    assert probe.check_port(30000, "kdt7", None).status == "warn"


def test_parse_helpers():
    assert probe.parse_kv_cache_gb("x\n[2026 TP3] KV Cache is allocated. #tokens: 159277, K size: 5.21 GB, "
                                   "V size: 5.21 GB\n") == pytest.approx(10.42)
    assert probe.parse_kv_cache_gb("nothing") is None
    assert probe.parse_mem_available("MemTotal: 1 kB\nMemAvailable:   2048 kB\n") == 2 * 1024 * 1024


# ----------------------------------------------------------------------------------------------- round trip

def test_preflight_on_a_sandbox_host_running_the_service():
    out = (DATA / "preflight_sandbox_demo.stdout").read_text()
    pre = probe.parse_preflight(out, unit="sglang-demo", port=30000, tp=8, places=places("sglang-demo"),
                                hicache_enabled=True, hicache_ratio=2.0)
    checks = {c.name: c for c in pre.all_checks()}
    assert checks["sglang"].status == "pass" and "sglang 0.5.23" in checks["sglang"].detail
    assert checks["disk"] == Check("disk", "pass", (
        "releases /srv/kdeploy/sglang-demo/releases, service /srv/kdeploy/sglang-demo (ext4 at /srv): 79.6 GiB, "
        "16.4M inodes free; need 65.0 MiB, 42 inodes | units /etc/systemd/system (overlay at /etc): 79.6 GiB, "
        "16.4M inodes free; need 1.0 MiB, 8 inodes"))
    assert checks["gpus"].status == "warn"                       # no nvidia-smi in the sandbox
    assert checks["port"].status == "pass" and "held by sglang-demo" in checks["port"].detail
    hicache = checks["hicache"]                                  # 10.42 GB per rank from the journal line
    assert "ratio 2.0 needs 8 x 20.8 GB + 10 GiB = 177 GB" in hicache.detail
    assert "from the last run's journal" in hicache.detail and hicache.status == "fail"   # a 24 GB machine
    assert not pre.ok


def test_preflight_for_another_service_on_that_host():
    out = (DATA / "preflight_sandbox_other.stdout").read_text()
    pre = probe.parse_preflight(out, unit="kdtx1", port=30000, tp=1, places=places("kdtx1"),
                                device_kv_gb_per_rank=1.0)
    checks = {c.name: c for c in pre.all_checks()}
    assert checks["sglang"].status == "fail" and "sglang not installed" in checks["sglang"].detail
    assert checks["port"].status == "fail" and "not by kdtx1" in checks["port"].detail
    assert checks["hicache"].detail == "HiCache off"


def test_preflight_sections_survive_a_cut_off_output():
    sections = probe.parse_sections("@@kdeploy meminfo\nMemTotal: 1 kB\n@@kdeploy rc 0\n@@kdeploy port\n123 py /x")
    assert sections["meminfo"].rc == 0 and sections["port"] == probe.Section("123 py /x", None)
    pre = probe.parse_preflight("", unit="u", port=1, tp=1, places=places("u"))
    assert not pre.ok and [c.status for c in pre.checks] == ["warn", "warn", "pass", "warn"]


def test_preflight_command_is_one_command_with_every_section():
    cmd = probe.preflight_command(python="/opt/v/bin/python", unit="sglang-k26", port=30000,
                                  places=places("sglang-k26"))
    for name in ("probe", "disk:releases", "disk:service", "disk:units", "nvidia-smi", "meminfo", "port", "journal"):
        assert f"@@kdeploy {name}\n" in cmd.replace("'; ", "\n")
    assert disk.measure("/srv/kdeploy/sglang-k26/releases") in cmd
    assert "journalctl -u sglang-k26.service -r" in cmd and ":30000$" in cmd
    lean = probe.preflight_command(python="/opt/v/bin/python", unit="sglang-k26", port=30000,
                                   places=(), kv_from_journal=False)
    assert "@@kdeploy journal" not in lean and "journalctl" not in lean
