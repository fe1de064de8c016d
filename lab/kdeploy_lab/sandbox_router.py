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
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kdeploy_lab import router_env
from kdeploy_lab.sandbox import Sandbox, SandboxError, SandboxHost, edit_inventory, span_servers

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
            timeout: float = 60.0, pd: bool = False) -> str:
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
                                  prometheus_port=PROMETHEUS_PORT, retries=retries, pd=pd)
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


def write_inventory(box: Sandbox, path: Path, service: dict[str, Any], router_host: SandboxHost, url: str,
                    nodes_per_server: int = 1, pd: bool = False) -> None:
    """The sandbox inventory without the router host, with a ``router:`` section for it; ``nodes_per_server``
    as in :meth:`Sandbox.write_inventory`, over the hosts without the router's; ``pd``: the first half of the
    servers prefill, the rest decode (groups ``prefill`` and ``decode``), behind the router in PD mode."""
    box.write_inventory(path, routed_service(service))

    def without_router_host(doc: dict) -> None:
        del doc["hosts"][router_host.name]
        doc["groups"]["sandbox"]["hosts"].remove(router_host.name)
        doc["defaults"]["router"] = {"url": url, "drain_timeout": 120, **({"mode": "pd"} if pd else {})}
        span_servers(doc, nodes_per_server)
        if pd:
            split_roles(doc, nodes_per_server)

    edit_inventory(path, without_router_host)


BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port


def split_roles(doc: dict, nodes_per_server: int) -> None:
    """The first half of the inventory's servers (in host order, ``nodes_per_server`` hosts each) become prefill
    servers, the rest decode servers: groups ``prefill`` and ``decode`` carrying the role."""
    names = list(doc["groups"]["sandbox"]["hosts"])
    servers = len(names) // nodes_per_server
    if servers < 2:
        raise SandboxError(f"--pd needs two servers at least (one prefill, one decode); {len(names)} host(s) of "
                           f"{nodes_per_server} node(s) per server make {servers}")
    half = (servers + 1) // 2 * nodes_per_server
    roles = {"prefill": {"mode": "prefill", "bootstrap_port": BOOTSTRAP_PORT}, "decode": {"mode": "decode"}}
    for role, members in (("prefill", names[:half]), ("decode", names[half:])):
        doc["groups"][role] = {"hosts": members, "service": {"sglang": {"disaggregation": roles[role]}}}


def wait_healthy(url: str, count: int, timeout: float = 60.0) -> None:
    """Until the router at ``url`` lists ``count`` workers, all healthy."""
    deadline = time.monotonic() + timeout
    while not (len(w := httpx.get(f"{url}/workers", timeout=5).json()["workers"]) == count
               and all(x["is_healthy"] for x in w)):
        if time.monotonic() > deadline:
            raise SandboxError(f"the router at {url} never listed {count} healthy workers: {w}")
        time.sleep(0.2)


def set_router(path: Path, router: dict[str, Any] | None) -> None:
    """The inventory's ``router:`` section set to ``router``, or removed."""
    edit_inventory(path, lambda doc: doc["defaults"].update(router=router) if router
                   else doc["defaults"].pop("router", None))


@dataclass
class BenchFleet:
    """What :func:`bench_fleet` brought up: ``hosts`` serve the deployed service, ``router_host`` is left for the
    router; ``inventory`` has no ``router:`` section yet; a new ``payload/rev.txt`` makes the next push a real
    change."""

    box: Sandbox
    router_host: SandboxHost
    hosts: list[SandboxHost]
    inventory: Path
    payload: Path
    service: dict[str, Any]

    def worker_urls(self, port: int) -> tuple[str, ...]:
        return tuple(f"http://{h.address}:{port}" for h in self.hosts)


@contextmanager
def bench_fleet(count: int, *, port: int, env: dict[str, str], gate: dict[str, Any],
                instance: int = 6) -> Iterator[BenchFleet]:
    """``count`` light sandbox hosts and one more for the router (sandbox ``instance``), the tests' plugin as the
    payload, first deployed without a router (that push starts the servers the router is then given); always
    torn down. For the benchmarks that roll changes behind the real router (bench/rollout.py, analysis.py)."""
    from kdeploy.core import inventory
    from kdeploy.flows import fleet
    from kdeploy.flows.options import Options
    from kdeploy_lab.demo import demo_service, project_dir

    box = Sandbox(instance=instance, sglang=False)
    box.check_requirements()
    if box.hosts():
        raise SandboxError(f"sandbox instance {instance} is in use: `kdeploy sandbox down --instance {instance}` first")
    tmp = Path(tempfile.mkdtemp(prefix="kdeploy-bench-"))
    try:
        router_host = box.up(count + 1)[-1]
        payload = tmp / "payload"
        shutil.copytree(project_dir() / "tests" / "data" / "testplugin", payload,
                        ignore=shutil.ignore_patterns("__pycache__"))
        service = demo_service(project_dir(), sglang=False, name="kdbench", payload=str(payload))
        service["sglang"] = {**service["sglang"], "port": port, "tp": 1}
        service["gate"] = {"workers": 1, "poll_interval": 0.25, "markers": ["[kdeploy-testplugin] loaded"],
                           "timeout": 60, **gate}
        service["env"] = env
        path = tmp / "inventory.yaml"
        write_inventory(box, path, service, router_host, f"http://{router_host.address}:{PORT}")
        set_router(path, None)
        first = fleet.push(inventory.load(path), "all", Options(verify=False))
        if not first.ok:
            raise SandboxError(f"the first deploy failed: {first.as_json()}")
        yield BenchFleet(box, router_host, [h for h in box.hosts() if h.name != router_host.name], path, payload,
                         service)
    finally:
        box.down()
        shutil.rmtree(tmp, ignore_errors=True)
