"""The service the sandbox deploys: the example SGLang service with the reference server in its place."""

from __future__ import annotations

from pathlib import Path

from kdeploy import markers
from kdeploy.sandbox import HOST_VENV

REFSERVER_MODULE = "kdeploy_refserver"


def project_dir() -> Path:
    """Where ``templates/`` and ``kernels/`` live: the source tree kdeploy runs from, else the cwd."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "templates").is_dir() else Path.cwd()


def demo_service(project: Path | None = None, **overrides: object) -> dict:
    project = project or project_dir()
    service: dict = {
        "name": "sglang-demo",
        "template": str(project / "templates" / "sglang.service.j2"),
        "python": f"{HOST_VENV}/bin/python",
        "module": REFSERVER_MODULE,
        "payload": str(project / "kernels" / "kdtree"),
        "remote_root": "/srv/kdeploy",
        "env": {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"},
        "sglang": {"model_path": "/models/Kimi-K2.6", "served_model_name": "kimi-k2.6", "tp": 8,
                   "attention_backend": "kdtree"},
        "unit": {"timeout_start_sec": 120, "timeout_stop_sec": 20, "restart_sec": 2},
        # Until the sandbox hosts carry the real SGLang package, the kdtree markers honestly read "skipped";
        # the demo gate counts the per-worker "plugin loaded" marker instead.
        "gate": {"workers": 8, "poll_interval": 0.25, "markers": [markers.PLUGIN_LOADED]},
    }
    service.update(overrides)
    return service
