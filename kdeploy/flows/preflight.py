"""The push's preflight: one round trip of checks on the host, and the verdict that may refuse it (exit 7)."""

from __future__ import annotations

from kdeploy.core import disk, probe
from kdeploy.core.errors import PreflightRefused
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.step import Step


def preflight_step(host: HostConfig) -> Step[str]:
    """The checks' one round trip (its output is read by ``preflight_verdict``, with what the push uploads)."""
    return Step(preflight_command(host), lambda out: out.stdout, 120)


def preflight_command(host: HostConfig) -> str:
    sv = host.service
    return probe.preflight_command(python=sv.python, unit=unit_filename(sv), port=sv.sglang.port,
                                   places=disk.needs(sv), environment_file=sv.environment_file,
                                   probe_cache=f"{service_dir(sv)}/{probe.CACHE}",
                                   kv_from_journal=(sv.hicache.enabled and sv.hicache.size_gb is None
                                                    and sv.hicache.device_kv_gb_per_rank is None))


def preflight_checks(host: HostConfig, output: str, upload_bytes: int, entries: int = 0) -> list[probe.Check]:
    """Every preflight check of one host. A service that does not launch SGLang itself (the sandbox's
    reference server) only gets a warning when SGLang is missing or incompatible."""
    sv = host.service
    hc = sv.hicache
    checks = list(probe.parse_preflight(
        output, unit=unit_filename(sv), port=sv.sglang.port, tp=sv.sglang.tp,
        places=disk.needs(sv, upload_bytes, entries),
        hicache_enabled=hc.enabled, hicache_ratio=hc.ratio, hicache_size_gb=hc.size_gb,
        device_kv_gb_per_rank=hc.device_kv_gb_per_rank, environment_file=sv.environment_file,
        secrets_written=sv.secrets.configured).all_checks())
    if not sv.module.startswith("sglang.") and checks[0].status == "fail":
        checks[0] = probe.Check("sglang", "warn", f"service runs {sv.module}, not SGLang: {checks[0].detail}")
    return checks


def preflight_verdict(host: HostConfig, output: str, upload_bytes: int, entries: int = 0) -> str:
    """Every check with its status and its numbers (``disk pass: ...``), passing ones too: what a push saw is
    in its log; a failing check refuses the host (exit 7) before anything changes."""
    checks = preflight_checks(host, output, upload_bytes, entries)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightRefused(f"{host.name}: preflight refused: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    return "preflight " + "; ".join(f"{c.name} {c.status}: {c.detail}" for c in checks)
