"""The fault catalogue's injectors (docs/chaos.md "Faults"): each acts on the fleet out of band (nsenter, the
bridge, signals), never through kdeploy, and :meth:`Injector.heal` undoes whatever is still in effect.

The controller's faults are signals to its process; the release's faults ride in the new release's env
(:data:`kdeploy_lab.chaos.plan.RELEASE_FAULTS`), so they need no injector.
"""

from __future__ import annotations

import signal
import subprocess
import threading

from kdeploy_lab import sandbox_router
from kdeploy_lab.chaos.fleet import Fleet
from kdeploy_lab.chaos.plan import CONTROLLER_FAULTS, Iteration

SIGNALS = {"sigkill": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
FILLER = "/srv/.chaos-fill"  # on the host's /srv tmpfs, beside the service's directory


class Injector:
    """Fires ``it.fault`` once; a held fault (blackhole, disk-full, sshd-stop) is undone ``it.hold`` seconds later
    by a timer, or by :meth:`heal` at the latest."""

    def __init__(self, fleet: Fleet, it: Iteration) -> None:
        self.fleet, self.it = fleet, it
        self.killed_host = False  # a host (or the router) died with requests in flight
        self._held = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def fire(self, controllers: list[subprocess.Popen[str]]) -> None:
        it, box = self.it, self.fleet.box
        if it.fault in CONTROLLER_FAULTS:
            for proc in controllers[:1]:  # two controllers: the first one is hit
                if proc.poll() is None:
                    proc.send_signal(SIGNALS[it.fault])
        elif it.fault == "reset":
            self.killed_host = True
            box.reboot(it.host)
        elif it.fault == "router-restart":
            self.killed_host = True
            box.exec(self.fleet.router_host.name, ["systemctl", "restart", sandbox_router.UNIT])
        elif it.fault in ("blackhole", "disk-full", "sshd-stop"):
            with self._lock:
                self._held = True
                if it.fault == "blackhole":
                    self.killed_host = True
                    box.blackhole(it.host)
                elif it.fault == "disk-full":  # every free block of the host's /srv (fallocate: instant)
                    box.exec(it.host, ["sh", "-c", f"fallocate -l $(( $(stat -f -c '%a*%S' /srv) )) {FILLER} || "
                                                   f"dd if=/dev/zero of={FILLER} bs=1M 2>/dev/null; true"])
                else:
                    box.exec(it.host, ["systemctl", "stop", "ssh.service", "ssh.socket"], check=False)
            self._timer = threading.Timer(it.hold, self.heal)
            self._timer.daemon = True
            self._timer.start()

    def heal(self) -> None:
        """Undo a held fault (idempotent); a reset host is already up again (``reboot`` waits for its sshd)."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if not self._held:
                return
            self._held = False
            it, box = self.it, self.fleet.box
            if it.fault == "blackhole":
                box.heal(it.host)
            elif it.fault == "disk-full":
                box.exec(it.host, ["rm", "-f", FILLER], check=False)
            elif it.fault == "sshd-stop":
                box.exec(it.host, ["systemctl", "start", "ssh.service"], check=False)
