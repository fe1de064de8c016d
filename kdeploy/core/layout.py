"""The on-host layout: every path under a service's directory, named once.

    <remote_root>/<service>/
      current -> releases/<id>          swapped atomically (.current.tmp, then a rename)
      releases/<id>/                    payload files, and .kdeploy/: manifest.sha256, modes, files, unit.service,
                                        unit.sha256, gate.json, parity.json
      releases/.staging-<id>/           a push's upload until it is verified (removed by the next push)
      history.jsonl                     one JSON line per command that changed the host
      .lock, lock.json, .lock.beat      the deploy lock (flock), who holds it, its holder's heartbeat
      pending, .pending.boot            a switch not confirmed yet, and the boot it was armed in
      .revert.sh, .boot-guard.sh        the host's own way back (kdeploy.core.provisional)
      .secrets.prev, .secrets.salt      the last confirmed secrets while a switch is pending; the digest's salt
      .readmit.key                      the router API key of the host's own re-admit (kdeploy.host.router)
      .readmit.sh                       how to arm that re-admit again after a reboot (the boot guard does it)
      .probe.json                       what the probe read from SGLang's sources, while they do not change

Everything there is root's (umask 077) but ``current`` and the releases, which the service reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdeploy.core.inventory import Service

CURRENT = "current"
RELEASES = "releases"
META = ".kdeploy"  # inside a release directory
STAGING = ".staging-"  # releases/.staging-<id>
HISTORY = "history.jsonl"
LOCK = ".lock"
LOCK_RECORD = "lock.json"
LOCK_BEAT = ".lock.beat"
PENDING = "pending"
PENDING_BOOT = ".pending.boot"
REVERT_SCRIPT = ".revert.sh"  # beside pending: systemd would expand $ and % in a command line given to systemd-run
GUARD_SCRIPT = ".boot-guard.sh"
SECRETS_PREVIOUS = ".secrets.prev"
SECRETS_SALT = ".secrets.salt"
READMIT_KEY = ".readmit.key"
READMIT_ARM = ".readmit.sh"
PROBE_CACHE = ".probe.json"
PARITY_RECORD = f"{META}/parity.json"  # inside a release directory
GATE_RECORD = f"{META}/gate.json"  # inside a release directory


def service_dir(service: Service) -> str:
    return f"{service.remote_root.rstrip('/')}/{service.name}"


def current_path(service: Service) -> str:
    return f"{service_dir(service)}/{CURRENT}"


def release_path(service_dir: str, release: str) -> str:
    return f"{service_dir}/{RELEASES}/{release}"
