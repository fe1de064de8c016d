"""``kdeploy sandbox up --router``: the real SGLang router as a systemd unit on one extra sandbox host.

The router venv (:mod:`kdeploy_lab.router_env`, cached) is copied into that host's ``/opt`` (a directory of
this machine bound into the container) and started as ``sglang-router.service`` on ``0.0.0.0:30080``, so
the controller reaches it at the host's sandbox address. The router host is left out of the written
inventory's hosts (nothing is deployed to it); the inventory gets a ``router:`` section pointing at it. The
sandbox servers bind 0.0.0.0 with ``--enable-metrics``, so the router reaches them and a drain can read their
in-flight gauges; the first push registers them (``--router-add-missing``).
"""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from ruamel.yaml import YAML

from kdeploy_lab import router_env
from kdeploy_lab.sandbox import Sandbox, SandboxError, SandboxHost

PORT = 30080
PROMETHEUS_PORT = 29000
HOST_DIR = "/opt/kdeploy-router"
UNIT = "sglang-router"


def unit_text(argv: list[str]) -> str:
    """The router's unit: restarted if it dies; SIGTERM ends it within seconds."""
    return (f"[Unit]\nDescription=SGLang router (kdeploy sandbox)\nAfter=network-online.target\n\n"
            f"[Service]\nExecStart={shlex.join(argv)}\nRestart=on-failure\nRestartSec=1\n"
            f"TimeoutStopSec=15\n\n[Install]\nWantedBy=multi-user.target\n")


def install(box: Sandbox, host: SandboxHost, *, workers: tuple[str, ...] = (), retries: bool = True,
            timeout: float = 60.0) -> str:
    """Copy the router venv into ``host``, (re)start its unit with ``workers`` and ``retries``, wait until its
    API answers; its URL. Called again on the same host, it replaces the running router (the bench)."""
    venv = router_env.ensure_venv().parent.parent  # .../bin/python -> the venv
    dest = box.state_dir / host.name / "opt" / Path(HOST_DIR).name  # the host's /opt is this directory
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["cp", "-a", "--reflink=auto", f"{venv}/.", str(dest)], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise SandboxError(f"copying the router venv into {host.name} failed: {done.stderr.strip()}")
    argv = router_env.router_argv(Path(HOST_DIR) / "bin" / "python", "0.0.0.0", PORT, list(workers),
                                  prometheus_port=PROMETHEUS_PORT, retries=retries)
    box.exec(host.name, ["sh", "-c", f"cat > /etc/systemd/system/{UNIT}.service && systemctl daemon-reload && "
                                     f"systemctl enable {UNIT} && systemctl restart {UNIT}"], input=unit_text(argv))
    url = f"http://{host.address}:{PORT}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/workers", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            log = box.exec(host.name, ["journalctl", "-u", UNIT, "-n", "5", "--no-pager"], check=False).stdout
            raise SandboxError(f"the router on {host.name} did not answer within {timeout:.0f}s: {log.strip()}")
        time.sleep(0.3)


def routed_service(service: dict[str, Any]) -> dict[str, Any]:
    """The service as the router needs it: reachable from the router host, with SGLang's gauges."""
    sglang = dict(service["sglang"])
    sglang["host"] = "0.0.0.0"
    sglang["extra_args"] = [*sglang.get("extra_args", []), "--enable-metrics"]
    return {**service, "sglang": sglang}


def write_inventory(box: Sandbox, path: Path, service: dict[str, Any], router_host: SandboxHost, url: str) -> None:
    """The sandbox inventory without the router host, with a ``router:`` section for it."""
    box.write_inventory(path, routed_service(service))
    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    doc = yaml.load(path.read_text())
    del doc["hosts"][router_host.name]
    members = doc["groups"]["sandbox"]["hosts"]
    members.remove(router_host.name)
    doc["defaults"]["router"] = {"url": url, "drain_timeout": 120}
    with path.open("w") as fh:
        yaml.dump(doc, fh)
