"""A host's membership in its SGLang router during a command that restarts it: drained, then admitted again.

httpx (router, tunnel) is imported only when a host has a router: commands without one do not pay for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kdeploy.core.errors import KdeployError
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.report import HostResult, Result
from kdeploy.flows.options import Reach
from kdeploy.flows.session import raise_if_cancelled
from kdeploy.flows.switch import Outcome
from kdeploy.ssh.remote import Remote

if TYPE_CHECKING:
    from kdeploy.host.router import Membership, RouterClient
    from kdeploy.ssh.tunnel import ServiceHttp


def drain(remote: Remote, host: HostConfig, result: HostResult, client: RouterClient,
          cancel: threading.Event) -> None:
    """Take the host's worker out of the router, then wait (up to ``drain_timeout``) until SGLang's gauges show
    no request running or queued, so the restart cuts none off."""
    from kdeploy.host.router import POLL, api_key, arm_readmit_step, readmit_after
    from kdeploy.ssh.tunnel import ServiceHttp

    assert host.router is not None and host.worker_url is not None
    with result.phase("drain") as phase:
        key = api_key(host.router)
        remote.ask(arm_readmit_step(host, key is not None), stdin=key.encode() if key else None)
        was_in = client.remove(host.worker_url, cancel=lambda: raise_if_cancelled(cancel))
        result.router = "out"
        phase.detail = f"{host.worker_url} removed from the router" if was_in else f"{host.worker_url} was not in"
        phase.detail += f"; the host re-admits itself after {readmit_after(host):.0f}s unless kdeploy decides first"
        deadline = time.monotonic() + host.router.drain_timeout
        with ServiceHttp(remote, host.service.sglang.host, host.service.sglang.port) as http:
            while True:
                raise_if_cancelled(cancel)
                left = _in_flight(http)
                if left is None:
                    phase.detail += "; no /metrics (--enable-metrics): SGLang's SIGTERM drain finishes them"
                    return
                if left == 0:
                    phase.detail += "; no request in flight"
                    return
                if time.monotonic() > deadline:
                    phase.detail += f"; {left} request(s) still in flight after {host.router.drain_timeout:g}s"
                    return
                time.sleep(POLL)


def _in_flight(http: ServiceHttp) -> int | None:
    import httpx

    from kdeploy.host.router import in_flight

    try:
        response = http.client.get("/metrics")
    except httpx.HTTPError:
        return None
    return in_flight(response.text) if response.status_code == 200 else None


def admit(host: HostConfig, result: HostResult, client: RouterClient) -> None:
    """Register the host's worker again and wait until the router lists it healthy (Ctrl-C does not stop it:
    the host serves again, it must not stay out)."""
    from kdeploy.host.router import registration

    assert host.worker_url is not None
    with result.phase("admit") as phase:
        client.add(host.worker_url, body=registration(host))
        result.router = "in"
        phase.detail = f"{host.worker_url} healthy in the router"


def admit_serving(host: HostConfig, result: HostResult, client: RouterClient) -> None:
    """``admit`` a host that serves; when the router does not take it, the host ends ``failed`` (if it had
    ended well) and says it is out."""
    try:
        admit(host, result, client)
    except KdeployError as exc:
        result.finish(Result.FAILED if result.ok else result.result,
                      f"{result.error + '; ' if result.error else ''}left OUT of the router: {exc}")


def behind_router(remote: Remote, host: HostConfig, result: HostResult, client: RouterClient | None,
                  cancel: threading.Event, restart: Callable[[], Outcome]) -> None:
    """``restart`` (switch, restart, gate, maybe roll back) with the host out of the router: drained first,
    admitted only when it ended serving (deployed, or rolled back and its rollback gated). A host that needs
    a person stays out, and says so."""
    if client is None:
        restart()
        return
    from kdeploy.host.router import disarm_readmit_step

    drain(remote, host, result, client, cancel)
    if restart().serving:
        admit_serving(host, result, client)
    else:
        result.log.append(f"left OUT of the router: fix the host, then `kdeploy router admit {host.name}`")
    try:  # decided: in, or out on purpose (a failed host stays out): the host's own re-admit is not needed
        remote.ask(disarm_readmit_step(host))
    except KdeployError as exc:
        result.log.append(f"could not cancel the host's re-admit timer ({exc}): it re-admits the host itself "
                          "if it serves a confirmed release then")


def router_phase(inventory: Inventory, host: HostConfig, result: HostResult, reach: Reach) -> Membership:
    """Phase ``router``: is the host registered in its router, and healthy there? Sets ``result.router``."""
    from kdeploy.host import router as routing

    assert host.router is not None
    with result.phase("router") as phase, routing.connect(
            inventory, host.router, accept_new_host_keys=reach.accept_new_host_keys, ssh_config=reach.ssh_config
    ) as client:
        member = routing.membership(client, host)
        result.router = "in" if member.member else "out"
        phase.detail = member.describe()
        return member
