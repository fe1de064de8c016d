"""Runs ON THE HOST (python3, standard library only), from the re-admit timer a rollout arms at drain: once the
service answers its health path and no switch is unconfirmed (no ``pending``: the release it runs is a
confirmed one), register its worker with the router again, unless the router already lists it.

argv: service dir, health URL, router URL (as the host reaches it), worker URL, seconds to keep trying, and
optionally the registration as JSON (a prefill or decode server's ``worker_type`` and bootstrap port). The
router's API key, when it has one, is in ``<service dir>/.readmit.key`` (root only), removed when done.
Prints one line of what it did; exits 0 once the worker is listed, 1 when it gave up (the host stays out).
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

POLL = 2.0
PENDING = "pending"  # kdeploy.core.layout.PENDING
KEY = ".readmit.key"  # kdeploy.core.layout.READMIT_KEY
ARM = ".readmit.sh"  # kdeploy.core.layout.READMIT_ARM


def call(url: str, key: str | None, body: dict | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, str(exc)


def listed(router: str, worker: str, key: str | None, wanted: dict) -> bool:
    """Listed with the role (and bootstrap port) it must have."""
    status, body = call(f"{router}/workers", key)
    if status != 200:
        return False
    try:
        return any(str(w["url"]).rstrip("/") == worker.rstrip("/")
                   and (w.get("worker_type") or "regular") == wanted.get("worker_type", "regular")
                   and w.get("bootstrap_port") == wanted.get("bootstrap_port")
                   for w in json.loads(body)["workers"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def ready(service_dir: str, health: str) -> bool:
    return not os.path.exists(os.path.join(service_dir, PENDING)) and call(health, None)[0] == 200


def main(service_dir: str, health: str, router: str, worker: str, seconds: str, registration: str = "") -> int:
    key_file = os.path.join(service_dir, KEY)
    try:
        with open(key_file) as fh:
            key: str | None = fh.read().strip() or None
    except OSError:
        key = None
    deadline = time.monotonic() + float(seconds)
    try:
        while not ready(service_dir, health):
            if time.monotonic() > deadline:
                print(f"kdeploy-readmit: {worker} not healthy on a confirmed release within {seconds}s: left out")
                return 1
            time.sleep(POLL)
        wanted = json.loads(registration) if registration else {"url": worker}
        posted = False
        while not listed(router, worker, key, wanted):
            if not posted:
                status, body = call(f"{router}/workers", key, wanted)
                print(f"kdeploy-readmit: the controller did not admit {worker}: registering it with {router} "
                      f"(HTTP {status or body})")
                posted = True
            if time.monotonic() > deadline:
                print(f"kdeploy-readmit: {router} does not list {worker}: left out")
                return 1
            time.sleep(POLL)
        print(f"kdeploy-readmit: {worker} is in the router {router}")
        return 0
    finally:  # ran: a reboot must not arm it again (the boot guard would, from ARM)
        for done in (key_file, os.path.join(service_dir, ARM)):
            if os.path.exists(done):
                os.remove(done)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
