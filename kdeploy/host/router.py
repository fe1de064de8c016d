"""The SGLang router (``sglang-router`` 0.3.2, "SGLang Model Gateway") as a rollout sees it.

Its control API, as the package serves it: ``GET /workers`` lists ``{"workers": [{"id", "url", "is_healthy",
"load", ...}], "total"}``; ``POST /workers {"url"}`` answers 202 and registers the worker in the background
(after its own ``/health`` probe); ``DELETE /workers/{id}`` answers 202 and removes it in the background. With
``--api-key`` every call needs ``Authorization: Bearer KEY``. Because both changes are asynchronous, each
call here waits until ``GET /workers`` shows the result.

The router's ``is_healthy`` lags (health checks every 60 s, 3 failures): it proves a worker was admitted, not
that it serves; the gate proves that. How many requests a drained server still runs comes from SGLang's own
``/metrics`` gauges, read on the host.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kdeploy import onhost
from kdeploy.core import provisional
from kdeploy.core.errors import InvalidInput, KdeployError, Unreachable
from kdeploy.core.inventory import HostConfig, Inventory, Router
from kdeploy.core.layout import READMIT_ARM, READMIT_KEY, service_dir
from kdeploy.core.step import Step
from kdeploy.ssh.tunnel import dial_address

POLL = 0.25
ADMIT_TIMEOUT = 60.0  # registration probes the worker (health, server_info, model_info, tokenizer)
CHANGE_TIMEOUT = 30.0
# sglang/srt/observability: running and queued, plus the queues of a prefill/decode pair, which neither counts (a
# prefill's requests waiting for their decode or handing their KV over, a decode's waiting for or receiving it)
IN_FLIGHT_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
                    "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
                    "sglang:num_decode_transfer_queue_reqs")
READMIT_TRYING = 900  # seconds the host's re-admit keeps waiting for a healthy, confirmed service once it fired
READMIT_MARGIN = 60
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


class RouterError(KdeployError):
    """The router could not be asked or did not do what was asked (the host is left as reported): like a host
    that cannot be reached, exit 3; a router that answers and refuses a rollout is a ``PreflightRefused``."""

    exit_code = Unreachable.exit_code


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    healthy: bool
    load: int
    type: str = "regular"  # the router's worker_type: regular, prefill or decode
    bootstrap_port: int | None = None  # a prefill's, as the router sends it to decode servers

    def registered_as(self, wanted: dict) -> bool:
        """Listed as ``wanted`` (``registration``) says: its role and, for a prefill, its bootstrap port."""
        return (self.type == wanted.get("worker_type", "regular")
                and self.bootstrap_port == wanted.get("bootstrap_port"))


def registration(host: HostConfig) -> dict:
    """What ``POST /workers`` must carry for the host's server: its URL, and behind a router in PD mode its role
    (a prefill with its bootstrap port). sglang-router 0.3.2 registers a body without ``worker_type`` as a
    regular worker, which a PD router never sends a request to (docs/router.md, prefill and decode)."""
    assert host.worker_url is not None and host.router is not None
    body: dict = {"url": host.worker_url}
    pd = host.service.sglang.disaggregation
    if host.router.mode == "pd" and pd is not None:
        body["worker_type"] = pd.mode
        if pd.mode == "prefill":
            body["bootstrap_port"] = pd.bootstrap_port
    return body


def parse_workers(text: str) -> list[Worker]:
    """``GET /workers``'s body; a shape this does not know is a RouterError, not a guess."""
    try:
        items = json.loads(text)["workers"]
        return [Worker(str(w["id"]), str(w["url"]).rstrip("/"), bool(w.get("is_healthy")), int(w.get("load") or 0),
                       str(w.get("worker_type") or "regular"),
                       int(w["bootstrap_port"]) if w.get("bootstrap_port") is not None else None)
                for w in items]
    except (ValueError, KeyError, TypeError) as exc:
        raise RouterError(f"router: unexpected GET /workers answer ({type(exc).__name__}: {exc})") from None


def in_flight(metrics_text: str) -> int | None:
    """Requests still running or queued, summed over SGLang's gauges; None when the gauges are absent."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] in IN_FLIGHT_GAUGES:
            seen = True
            total += float(m["value"])
    return round(total) if seen else None


def api_key(router: Router) -> str | None:
    """The key from the controller's environment; named but unset is invalid input (exit 2)."""
    if router.api_key_env is None:
        return None
    key = os.environ.get(router.api_key_env)
    if not key:
        raise InvalidInput(f"router.api_key_env: {router.api_key_env} is not set in the environment")
    return key


def key_of(router: Router) -> tuple[str, str | None]:
    """Hosts with the same key share one router."""
    return router.url, router.via


class RouterClient:
    """Calls to one router over ``client`` (direct, or an SSH channel of the ``via`` host)."""

    def __init__(self, client: httpx.Client, label: str) -> None:
        self.client = client
        self.label = label

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = self.client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise RouterError(f"router {self.label}: {method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 401:
            raise RouterError(f"router {self.label}: 401 unauthorized (set router.api_key_env)")
        return response

    def workers(self) -> list[Worker]:
        response = self._call("GET", "/workers")
        if response.status_code != 200:
            raise RouterError(f"router {self.label}: GET /workers answered {response.status_code}")
        return parse_workers(response.text)

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.workers() if w.url == url.rstrip("/")), None)

    def remove(self, url: str, cancel: Callable[[], None] = lambda: None) -> bool:
        """Take ``url`` out and wait until the router no longer lists it; False if it was not in."""
        worker = self.find(url)
        if worker is None:
            return False
        response = self._call("DELETE", f"/workers/{worker.id}")
        if response.status_code not in (200, 202, 204):
            raise RouterError(f"router {self.label}: DELETE {url} answered {response.status_code}: "
                              f"{response.text[:200]}")
        self._until(lambda: self.find(url) is None, CHANGE_TIMEOUT, f"{url} still listed", cancel)
        return True

    def add(self, url: str, timeout: float = ADMIT_TIMEOUT, body: dict | None = None) -> Worker:
        """Register ``url`` as ``body`` says (``registration``; default: a regular worker) unless it is listed so,
        and wait until the router lists it healthy. One listed with another role or bootstrap port is taken
        out first: the router keeps a worker's first registration (a second POST is accepted and ignored)."""
        body = body or {"url": url}
        listed = self.find(url)
        if listed is not None and not listed.registered_as(body):
            self.remove(url)
            listed = None
        if listed is None:
            response = self._call("POST", "/workers", body)
            if response.status_code not in (200, 201, 202):
                raise RouterError(f"router {self.label}: POST /workers {url} answered {response.status_code}: "
                                  f"{response.text[:200]}")
        found: list[Worker] = []

        def healthy() -> bool:
            worker = self.find(url)
            found[:] = [worker] if worker else []
            return bool(worker and worker.healthy and worker.registered_as(body))

        self._until(healthy, timeout, f"{url} not listed healthy", lambda: None)
        return found[0]

    def _until(self, done: Callable[[], bool], timeout: float, what: str, cancel: Callable[[], None]) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            cancel()
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.label}: {what} after {timeout:.0f}s")
            time.sleep(POLL)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(inventory: Inventory, router: Router, *, accept_new_host_keys: bool = False,
            ssh_config: str | None = None) -> RouterClient:
    """A client for ``router``: straight to ``url``, or through the SSH connection of its ``via`` host (reached
    as any host is: ``ssh_config`` is the run's ``--ssh-config``)."""
    key = api_key(router)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if router.via is None:
        return RouterClient(httpx.Client(base_url=router.url, headers=headers, timeout=10.0), router.url)
    from kdeploy.ssh import sshconfig, tunnel
    from kdeploy.ssh.remote import Remote

    via = inventory.hosts[router.via]
    remote = Remote.connect(via, sshconfig.target_for(inventory, via, ssh_config),
                            accept_new_host_keys=accept_new_host_keys)
    url = httpx.URL(router.url)
    client = tunnel.channel_client(remote, url.host, url.port or (443 if url.scheme == "https" else 80),
                                   base_url=router.url, headers=headers)
    return _ViaClient(client, f"{router.url} via {router.via}", remote)


class _ViaClient(RouterClient):
    def __init__(self, client: httpx.Client, label: str, remote) -> None:
        super().__init__(client, label)
        self.remote = remote

    def close(self) -> None:
        super().close()
        self.remote.close()


@dataclass(frozen=True)
class Membership:
    """Where a host stands in its router, for the report, ``status`` and ``verify``."""

    worker_url: str
    member: bool
    healthy: bool

    def describe(self) -> str:
        if not self.member:
            return f"OUT of the router ({self.worker_url} not registered)"
        return f"in the router, {'healthy' if self.healthy else 'UNHEALTHY'} ({self.worker_url})"


def membership(client: RouterClient, host: HostConfig, workers: list[Worker] | None = None) -> Membership:
    """In the router means listed as the host's server must be (a PD server with its role); ``workers``: the
    router's list when just read."""
    assert host.worker_url is not None
    url = host.worker_url.rstrip("/")
    worker = next((w for w in workers if w.url == url), None) if workers is not None else client.find(url)
    member = worker is not None and worker.registered_as(registration(host))
    return Membership(host.worker_url, member, bool(member and worker and worker.healthy))


def preflight_verdict(workers: list[Worker], wanted: dict[str, str], batches: list[list[str]], add_missing: bool,
                      roles: dict[str, str] | None = None, min_serving: int = 1) -> str | None:
    """Why a rollout over ``wanted`` (host -> worker URL) behind this router must not start, else None.

    Every worker must be healthy now (a host restarting while another is already failing leaves too few),
    each host to deploy must be registered (unless ``add_missing``), and while any of ``batches`` (the
    rollout's, in host names) is out, ``min_serving`` healthy workers of each role (``roles``: host -> role;
    regular workers all one role) must stay in.
    """
    by_url = {w.url: w for w in workers}
    missing = [h for h, url in wanted.items() if url not in by_url]
    if missing and not add_missing:
        return (f"{', '.join(missing)} not registered in the router (register them, or pass "
                "--router-add-missing)")
    sick = [w.url for w in workers if not w.healthy]
    if sick:
        return f"the router lists unhealthy worker(s) {', '.join(sick)}: fix them before a rollout"
    roles = roles or {}
    listed = {h for h in wanted if h not in missing}
    for role in sorted({roles.get(h, "regular") for h in wanted}):
        kind = "regular" if role == "unified" else role
        healthy = sum(1 for w in workers if w.type == kind)
        out = max((sum(1 for h in batch if h in listed and roles.get(h, "regular") == role) for batch in batches),
                  default=0)
        if out and healthy - out < min_serving:  # an empty router being filled (--router-add-missing) is spared
            what = "worker(s)" if kind == "regular" else f"{kind} server(s)"
            return (f"only {healthy} healthy {what} in the router: a batch of {out} would leave "
                    f"{'none' if healthy - out < 1 else healthy - out} serving (router.min_serving {min_serving})")
    return None


# --- the host's own re-admit (a controller that dies after a drain must not leave capacity out) -------------

def readmit_unit(service_name: str) -> str:
    return "kdeploy-readmit-" + service_name.replace("@", "-at-")


def readmit_after(host: HostConfig) -> float:
    """When the host re-admits itself: after the drain, the restart and gate, and the host's own revert."""
    assert host.router is not None
    sv = host.service
    revert = sv.gate.revert_after or provisional.deadline_seconds(sv.unit.timeout_stop_sec, sv.gate_timeout)
    return host.router.readmit_after or host.router.drain_timeout + revert + READMIT_MARGIN


def arm_readmit_command(host: HostConfig, with_key: bool) -> str:
    """Arm the host's re-admit before the drain (so no drained host is ever without one): a transient timer
    runs ``kdeploy/onhost/readmit.py`` with the service's python after ``readmit_after``. With ``with_key`` the
    router's API key arrives on stdin and is kept root-only until the re-admit ran or was disarmed."""
    assert host.router is not None and host.worker_url is not None
    sv = host.service
    d = service_dir(sv)
    unit = readmit_unit(sv.name)
    health = f"http://{_url_host(dial_address(sv.sglang.host))}:{sv.sglang.port}{sv.gate.ready_path}"
    program = onhost.source("readmit.py")
    argv = ["systemd-run", "--quiet", "--collect", f"--unit={unit}", f"--on-active={max(1, int(readmit_after(host)))}",
            "--timer-property=AccuracySec=1s", f"--description=kdeploy: re-admit {sv.name} to its router",
            sv.python, "-I", "-u", f"{d}/.readmit.py", d, health, host.router.url_from_host or host.router.url,
            host.worker_url, str(READMIT_TRYING), json.dumps(registration(host), separators=(",", ":"))]
    q = shlex.quote(d)
    return "\n".join([
        disarm_readmit_command(host),
        f"(umask 077 && cat > {q}/{READMIT_KEY})" if with_key else ":",
        f"printf '%s\\n' {shlex.quote(program)} > {q}/.readmit.py",
        # kept until the re-admit ran or was disarmed: a transient timer dies with a reboot, the boot guard
        # (kdeploy.core.provisional) arms it again from this file
        f"printf '%s\\n' {shlex.quote(shlex.join(argv))} > {q}/{READMIT_ARM}",
        f"/bin/sh {q}/{READMIT_ARM}",
    ])


def disarm_readmit_command(host: HostConfig) -> str:
    """Cancel the host's re-admit: the controller admitted the host, or decided it stays out."""
    unit = shlex.quote(readmit_unit(host.service.name))
    d = shlex.quote(service_dir(host.service))
    return (f"systemctl stop {unit}.timer {unit}.service 2>/dev/null; "
            f"rm -f {d}/{READMIT_KEY} {d}/{READMIT_ARM}; true")


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def arm_readmit_step(host: HostConfig, with_key: bool) -> Step[None]:
    """``arm_readmit_command`` as a step (the API key, if any, on stdin); a failure ends the drain."""
    return Step(arm_readmit_command(host, with_key), lambda out: None, 30,
                fails="could not arm the host's re-admit, host not drained")


def disarm_readmit_step(host: HostConfig) -> Step[None]:
    return Step(disarm_readmit_command(host), lambda out: None, 30)
