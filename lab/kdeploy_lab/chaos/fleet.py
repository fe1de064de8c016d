"""The campaign's own sandbox fleet: 4 servers (3 one-host servers and one that spans 2 nodes) behind the real
sglang-router 0.3.2, the kdtree payload, short deadlines; always torn down.

Each host's ``/srv`` is a tmpfs on this machine's side (``Sandbox.up(srv_mib=)``): the disk-full fault fills it,
never this machine's disk, and a hard reset keeps it as a real disk would.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from kdeploy_lab import sandbox_router
from kdeploy_lab.demo import demo_service, project_dir
from kdeploy_lab.sandbox import RENDEZVOUS_PORT, Sandbox, SandboxError, SandboxHost, edit_inventory

SERVICE = "kdchaos"
PORT = 30000
SPAN = "s4"  # the server of 2 nodes: h4 (head) and h5
SERVERS = {"h1": ("h1",), "h2": ("h2",), "h3": ("h3",), SPAN: ("h4", "h5")}
SRV_MIB = 96
# Short host-side deadlines (docs/chaos.md): a controller killed mid-switch leaves hosts that go back by themselves
# after REVERT_AFTER seconds and re-admit themselves after READMIT_AFTER; the campaign waits for both.
GATE_TIMEOUT = 20
REVERT_AFTER = 30
READMIT_AFTER = 45
DRAIN_TIMEOUT = 10
STOP_TIMEOUT = 5


@dataclass
class Fleet:
    box: Sandbox
    hosts: list[SandboxHost]
    router_host: SandboxHost
    router_url: str
    inventory: Path
    pristine: str  # the inventory's text as written: each iteration starts from it
    payload: Path
    service_dir: str

    def address(self, name: str) -> str:
        return next(h.address for h in self.hosts if h.name == name)

    def heads(self) -> dict[str, str]:
        """Server -> the worker URL the router knows it by (its head's)."""
        return {server: f"http://{self.address(nodes[0])}:{PORT}" for server, nodes in SERVERS.items()}

    def reset_inventory(self) -> None:
        self.inventory.write_text(self.pristine)


def service() -> dict[str, Any]:
    """The demo service (kdtree payload, reference server from the hosts' small venv) at tp 2 per node, with the
    campaign's short deadlines (``write_inventory`` adds what the router needs)."""
    svc = demo_service(project_dir(), sglang=False, name=SERVICE)
    svc["sglang"] = {**svc["sglang"], "port": PORT, "tp": 2}
    svc["gate"] = {**svc["gate"], "workers": 2, "timeout": GATE_TIMEOUT, "revert_after": REVERT_AFTER}
    svc["unit"] = {**svc["unit"], "timeout_stop_sec": STOP_TIMEOUT, "restart_sec": 1}
    svc["env"] = {**svc["env"], "REFSERVER_SHUTDOWN_POLL": "0.5"}
    return svc


def _span(doc: CommentedMap) -> None:
    """h4 and h5 form server s4 (tp 4, gated on 4 workers); the others stay one-host servers."""
    nodes = CommentedSeq(SERVERS[SPAN])
    nodes.fa.set_flow_style()
    doc["servers"] = CommentedMap({SPAN: CommentedMap(nodes=nodes, rendezvous_port=RENDEZVOUS_PORT)})
    doc["groups"]["span"] = {"hosts": list(SERVERS[SPAN]), "service": {"sglang": {"tp": 4}, "gate": {"workers": 4}}}


@contextmanager
def fleet(instance: int | None = None) -> Iterator[Fleet]:
    """Boot the fleet (a free sandbox instance, or ``instance``), deploy once, start the router with the heads;
    tear everything down on the way out, whatever happened."""
    from kdeploy.core import inventory
    from kdeploy.flows import fleet as kfleet
    from kdeploy.flows.options import Options
    from kdeploy_lab.sandbox import free_sandbox

    box = free_sandbox() if instance is None else Sandbox(instance=instance, sglang=False)
    box.check_requirements()
    if box.hosts():
        raise SandboxError(f"sandbox instance {box.instance} is in use: `kdeploy sandbox down --instance "
                           f"{box.instance}` first")
    tmp = Path(tempfile.mkdtemp(prefix="kdeploy-chaos-"))
    try:
        booted = box.up(6, srv_mib=SRV_MIB)
        hosts, router_host = booted[:5], booted[5]
        payload = tmp / "payload"
        shutil.copytree(project_dir() / "kernels" / "kdtree", payload, ignore=shutil.ignore_patterns("__pycache__"))
        path = tmp / "inventory.yaml"
        url = f"http://{router_host.address}:{sandbox_router.PORT}"
        svc = service()
        svc["payload"] = str(payload)
        sandbox_router.write_inventory(box, path, svc, router_host, url)
        edit_inventory(path, _span)
        sandbox_router.set_router(path, None)
        first = kfleet.push(inventory.load(path), "all", Options())
        if not first.ok:
            raise SandboxError(f"the campaign fleet's first deploy failed: {first.as_json()}")
        heads = [f"http://{h.address}:{PORT}" for h in hosts if h.name in {n[0] for n in SERVERS.values()}]
        sandbox_router.install(box, router_host, workers=tuple(heads))
        sandbox_router.set_router(path, {"url": url, "drain_timeout": DRAIN_TIMEOUT, "readmit_after": READMIT_AFTER})
        sandbox_router.wait_healthy(url, len(heads))
        yield Fleet(box, hosts, router_host, url, path, path.read_text(), payload, f"/srv/kdeploy/{SERVICE}")
    finally:
        box.down()
        shutil.rmtree(tmp, ignore_errors=True)
