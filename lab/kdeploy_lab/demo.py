"""The service the sandbox deploys: the example SGLang service with the reference server in its place."""

from __future__ import annotations

from pathlib import Path

from kdeploy.core.errors import InvalidInput
from kdeploy_lab import sglang_env
from kdeploy_lab.sandbox import HOST_VENV, SGLANG_HOST_VENV

REFSERVER_MODULE = "kdeploy_refserver"
# What each kdtree worker logs even where SGLang is missing (its other markers then read "skipped").
PLUGIN_LOADED = "[kdtree] plugin loaded"


def project_dir() -> Path:
    """Where ``templates/`` and ``kernels/`` live: the source tree the lab runs from (an editable install),
    else the cwd. Neither (an installed lab run elsewhere) is an error, not an inventory pointing nowhere."""
    for place in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (place / "templates").is_dir() and (place / "kernels").is_dir():
            return place
    raise InvalidInput(f"no kdeploy source tree here ({Path.cwd()} has no templates/ and kernels/): run the lab "
                       "from a kdeploy checkout, whose unit template and kdtree payload the sandbox deploys")


def demo_service(project: Path | None = None, *, sglang: bool | None = None, **overrides: object) -> dict:
    """The demo service. ``sglang``: run the reference server with the sandbox's real SGLang venv
    (:data:`SGLANG_HOST_VENV`), where the kdtree extension really installs its Tier-0 defrag and verify
    override, so the gate counts the default markers. None: when the SGLang venv is built (a sandbox
    brought up with ``Sandbox(sglang=None)`` then binds it) and the payload is kernels/kdtree, whose markers
    need SGLang; another payload (the tests' plugin) gets the small venv, where 8 workers start in ~1 s
    instead of ~20 s (each imports torch and SGLang to build its KV allocator). Without SGLang on the hosts
    the kdtree markers honestly read "skipped" and the gate counts the per-worker "plugin loaded" line."""
    project = project or project_dir()
    kdtree_payload = project / "kernels" / "kdtree"
    if sglang is None:
        payload = Path(str(overrides.get("payload", kdtree_payload)))
        sglang = payload.resolve() == kdtree_payload.resolve() and sglang_env.is_ready()
    gate: dict = {"workers": 8, "poll_interval": 0.25}
    if not sglang:
        gate["markers"] = [PLUGIN_LOADED]
    service: dict = {
        "name": "sglang-demo",
        "template": str(project / "templates" / "sglang.service.j2"),
        "python": f"{SGLANG_HOST_VENV if sglang else HOST_VENV}/bin/python",
        "module": REFSERVER_MODULE,
        "payload": str(kdtree_payload),
        "remote_root": "/srv/kdeploy",
        "env": {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"},
        "sglang": {"model_path": "/models/Kimi-K2.6", "served_model_name": "kimi-k2.6", "tp": 8,
                   "attention_backend": "kdtree"},
        "unit": {"timeout_start_sec": 180 if sglang else 120, "timeout_stop_sec": 20, "restart_sec": 2},
        "gate": gate,
    }
    service.update(overrides)
    return service


def light_service(project: Path | None = None, **overrides: object) -> dict:
    """The demo service made light for fleets of a hundred sandbox hosts on a small machine: the reference
    server at tp=1 from the small host venv (no SGLang or torch import, one worker process), gated on its
    one worker's "plugin loaded" line. Same unit template, payload and gate phases as :func:`demo_service`."""
    service = demo_service(project, sglang=False)
    service["sglang"] = {**service["sglang"], "tp": 1}
    service["gate"] = {**service["gate"], "workers": 1}
    service.update(overrides)
    return service
