"""One command's session with one host: connect, take the deploy lock and read the state under it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kdeploy.core import release
from kdeploy.core import secrets as secret
from kdeploy.core.gatespec import GateSpec, gate_spec, load_payload_gate
from kdeploy.core.inventory import HostConfig, Inventory
from kdeploy.core.layout import service_dir
from kdeploy.core.report import Cancelled, HostResult
from kdeploy.core.state import HostState, parse_state, state_script
from kdeploy.flows.options import Reach
from kdeploy.host import lock
from kdeploy.ssh import sshconfig
from kdeploy.ssh.remote import Remote


def open_remote(inventory: Inventory, host: HostConfig, reach: Reach) -> Remote:
    return Remote.connect(host, sshconfig.target_for(inventory, host, reach.ssh_config),
                          accept_new_host_keys=reach.accept_new_host_keys)


def connect(inventory: Inventory, host: HostConfig, result: HostResult, reach: Reach) -> Remote:
    """``open_remote`` as the host's ``connect`` phase."""
    with result.phase("connect") as phase:
        remote = open_remote(inventory, host, reach)
        phase.detail = remote.describe()
    return remote


def lock_and_read(remote: Remote, host: HostConfig, wait: float, *, command: str, with_history: bool = False,
                  with_files: bool = False, first: str = "") -> tuple[lock.HeldLock, HostState]:
    """Take the deploy lock (recording ``command``) and read the host's state under it, in one round trip
    (``first`` runs before the read, under the lock; ``with_history``, ``with_files``: see ``state_script``)."""
    then = "\n".join(c for c in (first, state_script(host, with_history=with_history, with_files=with_files)) if c)
    held = lock.acquire(remote, service_dir(host.service), wait=wait, then=then, command=command,
                        timeout=host.service.lock_timeout)
    return held, parse_state(held.output)


def raise_if_cancelled(cancel: threading.Event) -> None:
    """Ctrl-C was pressed: stop before the next change."""
    if cancel.is_set():
        raise Cancelled("interrupted")


@dataclass
class Wanted:
    """What a host should run (unit, payload, gate, secrets), computed once on the controller before any host
    is touched."""

    unit_text: str
    payload: release.Payload
    spec: GateSpec  # what this push's gate checks; stored with the release it stages
    secrets: secret.Secrets | None = None  # what the environment file must hold (None: not kdeploy's)

    def masked_secrets(self) -> dict[str, str]:
        return self.secrets.masked() if self.secrets else {}


def inventory_spec(inventory: Inventory, host: HostConfig, workers: int | None, timeout: float | None) -> GateSpec:
    """The gate the inventory asks for now (with --workers/--timeout), for runs that have no stored one."""
    return gate_spec(host.service, load_payload_gate(inventory.payload_dir(host)), workers=workers, timeout=timeout,
                     place=inventory.server_of(host.name).place(host.name))


def overridden(spec: GateSpec, workers: int | None, timeout: float | None) -> GateSpec:
    """A stored spec with this command's --workers (the server's total)/--timeout, where given."""
    spec = spec.with_workers(workers)
    return spec.model_copy(update={"timeout": timeout}) if timeout else spec
