"""Which serving server of the other role a prefill or decode server is gated through, and its connection."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kdeploy.core.errors import KdeployError
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.flows.options import Reach
from kdeploy.flows.session import open_remote
from kdeploy.host.pair import Pairing

if TYPE_CHECKING:
    from kdeploy.host.router import RouterClient

OTHER = {"prefill": "decode", "decode": "prefill"}


def partners(inventory: Inventory, host: HostConfig, serving: set[str] | None) -> list[str]:
    """The heads of the servers ``host``'s server can be gated through: the other role, behind the same router
    (``serving``: the worker URLs its router lists healthy with that role; None: no router to ask)."""
    other = OTHER[host.service.role]
    url = host.router.url if host.router else None
    heads = {inventory.server_of(name).head for name in inventory.hosts}
    return [h for h in inventory.hosts if h in heads and inventory.hosts[h].service.role == other
            and (inventory.hosts[h].router.url if inventory.hosts[h].router else None) == url
            and (serving is None or str(inventory.hosts[h].worker_url).rstrip("/") in serving)]


def bootstrap_host(prefill: HostConfig) -> str:
    """Where a decode server reaches the prefill's bootstrap server: the host of the URL the router knows the
    prefill by (the router sends exactly that as ``bootstrap_host``), else its address."""
    if prefill.worker_url is not None:
        return urlsplit(prefill.worker_url).hostname or prefill.address
    return prefill.address


@contextmanager
def pair_for(inventory: Inventory, host: HostConfig, client: RouterClient | None,
             reach: Reach) -> Iterator[Pairing | None]:
    """The pairing of ``host``'s server (its head) for a gate, open while the gate runs; None for a unified
    server. With no serving partner (behind a router: none it lists healthy with the other role) the server is
    gated alone, and its pair is proven by the gate of the first server of the other role after it."""
    role = host.service.role
    if role == "unified":
        yield None
        return
    serving = None
    if client is not None:
        serving = {w.url for w in client.workers() if w.healthy and w.type == OTHER[role]}
    found = partners(inventory, host, serving)
    from kdeploy.ssh.tunnel import ServiceHttp

    for name in found:
        partner = inventory.hosts[name]
        prefill = host if role == "prefill" else partner
        pd = prefill.service.sglang.disaggregation
        assert pd is not None and pd.bootstrap_port is not None
        try:
            remote = open_remote(inventory, partner, reach)
        except KdeployError:  # a partner that cannot be reached is no partner: the next one
            continue
        try:
            with ServiceHttp(remote, partner.service.sglang.host, partner.service.sglang.port, timeout=10.0) as http:
                if serving is None and http.status(partner.service.gate.ready_path) != 200:
                    continue  # without a router to ask: the first partner that answers its readiness path
                yield Pairing(partner.name, http, role, bootstrap_host(prefill), pd.bootstrap_port)
                return
        finally:
            remote.close()
    yield Pairing.alone(role)  # the fleet's first deploy: nothing of the other role serves yet
