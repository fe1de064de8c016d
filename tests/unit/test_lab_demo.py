"""The light sandbox service (`kdeploy sandbox up --light`): the demo service at tp=1, no SGLang venv."""

from __future__ import annotations

import json
from pathlib import Path

from kdeploy.core.inventory import load
from kdeploy.core.render import launch_argv
from kdeploy_lab.demo import demo_service, light_service
from kdeploy_lab.sandbox import HOST_VENV


def test_light_service_is_the_demo_service_at_tp1_gated_on_one_worker(tmp_path: Path) -> None:
    svc = light_service()
    (tmp_path / "inv.yaml").write_text(json.dumps({"defaults": {"service": svc}, "hosts": {"h1": {"address": "h1"}}}))
    service = load(tmp_path / "inv.yaml").hosts["h1"].service
    argv = launch_argv(service)
    assert argv[0] == f"{HOST_VENV}/bin/python" and argv[argv.index("--tp-size") + 1] == "1"
    assert service.gate.workers == 1
    heavy = demo_service(sglang=False)
    assert {k: v for k, v in svc.items() if k not in ("sglang", "gate")} == \
        {k: v for k, v in heavy.items() if k not in ("sglang", "gate")}
