"""Shared fixtures: one session-scoped sandbox fleet (real systemd, sshd, journald), always torn down.

Each test gets its own service (unique unit name, port and remote directory) on that fleet, so tests do
not see each other's releases, locks or journals; the service is stopped and removed afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kdeploy.cli import app as cli
from kdeploy.core import inventory, layout
from kdeploy_lab import sglang_env
from kdeploy_lab.demo import demo_service, project_dir
from kdeploy_lab.sandbox import Sandbox

FLEET_SIZE = 8
TEST_PLUGIN = Path(__file__).parent / "data" / "testplugin"
TEST_MARKER = "[kdeploy-testplugin] loaded"
_ports = itertools.count(31000)
_names = itertools.count(1)

# A run started in the background by a shell without job control ignores SIGINT, and the kdeploy processes the
# Ctrl-C tests start would inherit that (Python installs no KeyboardInterrupt then): a handler is reset on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The python of the cached CPU venv with the real ``sglang==0.5.23`` (built once, then reused), for tests
    that run the payload or its kernels on SGLang itself. ``KDEPLOY_SKIP_SGLANG=1`` skips them."""
    if os.environ.get("KDEPLOY_SKIP_SGLANG") == "1":
        pytest.skip("KDEPLOY_SKIP_SGLANG=1")
    try:
        path = sglang_env.ensure_venv()
    except sglang_env.SglangEnvError as exc:
        pytest.fail(str(exc))
    return str(sglang_env.venv_python(path))


# The reference server drains on SIGTERM as SGLang does, looking whether requests remain every 5 s since its
# start: each restart of a test's service would wait up to 5 s for that look. The tests' hosts give their services
# a 0.5 s period (the drain's own tests set theirs), in systemd's environment and in system.conf.d for after a
# reboot (/etc is kept).
FAST_DRAIN = "REFSERVER_SHUTDOWN_POLL=0.5"


def fast_drain(box: Sandbox) -> None:
    script = (f"mkdir -p /etc/systemd/system.conf.d && printf '[Manager]\\nDefaultEnvironment={FAST_DRAIN}\\n' "
              f"> /etc/systemd/system.conf.d/50-kdeploy-tests.conf && systemctl set-environment {FAST_DRAIN}")
    for host in box.hosts():
        box.exec(host.name, ["sh", "-c", script])


@pytest.fixture(scope="session")
def fleet() -> Iterator[Sandbox]:
    """The first free sandbox instance (0-6), so two test runs on one machine do not collide."""
    for instance in range(7):
        box = Sandbox(instance=instance, sglang=False)
        box.check_requirements()
        if box.hosts():
            continue
        box.up(FLEET_SIZE)
        break
    else:
        pytest.fail("no free sandbox instance (0-6): run `kdeploy sandbox down` or wait for other test runs")
    try:
        fast_drain(box)
        yield box
    finally:
        box.down()


@dataclass
class Deployment:
    """A test's own service on the fleet, with its inventory file and payload copy."""

    fleet: Sandbox
    path: Path
    payload: Path
    service: str
    hosts: list[str]
    port: int

    def load(self) -> inventory.Inventory:
        return inventory.load(self.path)

    def edit(self, change: Callable[[dict], None]) -> None:
        yaml = YAML()
        doc = yaml.load(self.path.read_text())
        change(doc)
        with self.path.open("w") as fh:
            yaml.dump(doc, fh)

    def set_service(self, **values: object) -> None:
        self.edit(lambda doc: doc["defaults"]["service"].update(values))

    def sh(self, host: str, command: str, check: bool = True) -> str:
        return self.fleet.exec(host, ["sh", "-c", command], check=check).stdout

    def show(self, host: str, prop: str) -> str:
        return self.sh(host, f"systemctl show {self.service} -p {prop} --value").strip()

    @property
    def service_dir(self) -> str:
        return layout.service_dir(self.load().hosts[self.hosts[0]].service)

    # What a host has now, read straight from it (the one place tests spell these paths).
    @property
    def unit_path(self) -> str:
        return f"/etc/systemd/system/{self.service}.service"

    def link(self, host: str = "h1") -> str:
        """Where ``current`` points, as written (``releases/ID``: relative)."""
        return self.sh(host, f"readlink {self.service_dir}/current").strip()

    def current(self, host: str = "h1") -> str:
        """The release ``current`` points at."""
        return self.link(host).removeprefix("releases/")

    def history(self, host: str = "h1") -> list[dict]:
        """The host's history records, oldest first ([] before the first deploy)."""
        out = self.sh(host, f"cat {self.service_dir}/history.jsonl 2>/dev/null", check=False)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def state(self, host: str = "h1") -> tuple[str, str, str]:
        """(current, every entry of releases/ (staging ones too), the unit's InvocationID): what a host that a
        push skips or refuses must keep."""
        return self.link(host), self.sh(host, f"ls -a {self.service_dir}/releases").strip(), \
            self.show(host, "InvocationID")

    def kdeploy(self, *args: str) -> int:
        return cli.main([*args, "--inventory", str(self.path)])

    def json(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
        capsys.readouterr()
        code = cli.main([*args, "--inventory", str(self.path), "--json"])
        captured = capsys.readouterr()
        assert captured.out, f"exit {code}, no JSON on stdout; stderr: {captured.err}"
        return code, json.loads(captured.out)


    def interrupt(self, *args: str, when: Callable[[], object], what: str, sig: signal.Signals = signal.SIGINT,
                  wait: float = 120.0, settle: float = 0.0, reset: str | None = None) -> Stopped:
        """``kdeploy ARGS --json`` in a process of its own (Ctrl-C and SIGKILL reach it as they would a user's
        run), sent ``sig`` once ``when()`` is true (polled; ``what`` names it if that never comes) and ``settle``
        seconds more; what it answered. With ``reset``, that host is power-cycled instead (the run goes on)."""
        proc = subprocess.Popen([sys.executable, "-m", "kdeploy", *args, "--json", "--inventory", str(self.path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + wait
            while not when():
                assert proc.poll() is None and time.monotonic() < deadline, f"{what} never came"
                time.sleep(0.02)
            time.sleep(settle)
            sent = time.monotonic()
            if reset is None:
                proc.send_signal(sig)
            else:
                self.fleet.reboot(reset)
            out, err = proc.communicate(timeout=240)
            return Stopped(proc.returncode, json.loads(out) if out else {}, err, time.monotonic() - sent)
        finally:
            if proc.poll() is None:
                proc.kill()


@dataclass
class Stopped:
    """A kdeploy run stopped by a signal: its exit code, JSON report, stderr, and seconds from signal to exit."""

    code: int
    doc: dict
    err: str
    seconds: float

    @property
    def hosts(self) -> dict[str, dict]:
        return {h["host"]: h for h in self.doc["hosts"]}


@pytest.fixture
def deployment(fleet: Sandbox, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A fresh service on h1 (more hosts with ``@pytest.mark.hosts(n)``)."""
    marker = request.node.get_closest_marker("hosts")
    count = marker.args[0] if marker else 1
    hosts = [h.name for h in fleet.hosts()][:count]
    name = f"kdt{next(_names)}"
    port = next(_ports)
    payload = tmp_path / "payload"
    shutil.copytree(TEST_PLUGIN, payload, ignore=shutil.ignore_patterns("__pycache__"))
    service = demo_service(project_dir(), sglang=False, name=name, payload=str(payload))
    service["sglang"] = {**service["sglang"], "port": port}
    service["gate"] = {"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60}
    service["env"] = {}
    path = tmp_path / "inventory.yaml"
    fleet.write_inventory(path, service)
    dep = Deployment(fleet, path, payload, name, hosts, port)
    def only_these_hosts(doc: dict) -> None:
        for other in [h for h in doc["hosts"] if h not in hosts]:
            del doc["hosts"][other]
        doc["groups"] = {"test": {"hosts": hosts}}

    dep.edit(only_these_hosts)
    try:
        yield dep
    finally:
        for host in hosts:
            fleet.exec(host, ["sh", "-c", f"systemctl disable --now --no-block {name} 2>/dev/null; "
                                          f"systemctl stop kdeploy-readmit-{name}.timer 2>/dev/null; "
                                          f"systemctl kill -s KILL {name} 2>/dev/null; "
                                          f"cd /etc/systemd/system && rm -rf {name}.service {name}.service.wants "
                                          f"kdeploy-boot-guard-{name}.service; "
                                          "systemctl daemon-reload; "
                                          f"systemctl reset-failed {name} 2>/dev/null; rm -rf /srv/kdeploy/{name}"],
                       check=False)


# Tiers by directory: tests here boot sandbox hosts or need the cached SGLang venv; `make test-unit` leaves them out.
SANDBOX_DIRS = ("integration", "sglang")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hosts(n): how many sandbox hosts the deployment spans")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        if item.path.relative_to(root).parts[0] in SANDBOX_DIRS:
            item.add_marker(pytest.mark.sandbox)
