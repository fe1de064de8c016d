"""Rollouts behind the real SGLang router (sglang-router 0.3.2, run on this machine) over sandbox hosts:
drain waits for requests in flight, a failed gate keeps the host out until its rollback passed, the preflight
refuses when another worker is unhealthy, ``router admit|drain`` by hand, Ctrl-C mid-drain, a controller
SIGKILLed mid-drain, and a set-env rollout whose drain_timeout runs out.

Each host's reference server binds 0.0.0.0 with ``--enable-metrics`` and paced tokens, so the router (on the
controller) reaches it at the host's sandbox address and requests stay in flight for seconds.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from ruamel.yaml import YAML

from kdeploy_lab import router_env
from tests.conftest import Deployment

TOKEN_DELAY = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Routed:
    def __init__(self, dep: Deployment, url: str) -> None:
        self.dep, self.url = dep, url

    def workers(self) -> dict[str, bool]:
        """Worker URL -> healthy, as the router lists them."""
        body = httpx.get(f"{self.url}/workers", timeout=5).json()
        return {w["url"]: w["is_healthy"] for w in body["workers"]}

    def worker_url(self, host: str) -> str:
        return f"http://{self.dep.load().hosts[host].address}:{self.dep.port}"

    def wait(self, predicate, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.workers()):
            assert time.monotonic() < deadline, f"router never showed {what}: {self.workers()}"
            time.sleep(0.2)


def _stream(url: str, tokens: int, out: list, started: threading.Event) -> None:
    """One streamed completion; appends (status, events, ended with [DONE])."""
    body = {"model": "m", "prompt": "a long story", "max_tokens": tokens, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            started.set()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        out.append((resp.status_code, len(events), bool(events) and events[-1] == "[DONE]"))
    except httpx.HTTPError as exc:
        started.set()
        out.append((type(exc).__name__, len(events), False))


@pytest.fixture
def routed(deployment: Deployment, tmp_path: Path) -> Iterator[Routed]:
    """The deployment's hosts serving on 0.0.0.0, all registered in a real router started here."""
    with behind_router(deployment, tmp_path) as r:
        yield r


@contextmanager
def behind_router(deployment: Deployment, tmp_path: Path, token_delay: float = TOKEN_DELAY) -> Iterator[Routed]:
    """``routed``'s set-up, with each generated token taking ``token_delay`` seconds (tests/integration/test_canary)."""
    deployment.edit(lambda doc: doc["defaults"]["service"].update(
        env={"REFSERVER_TOKEN_DELAY": str(token_delay), "REFSERVER_SHUTDOWN_POLL": "1"}))
    deployment.edit(lambda doc: doc["defaults"]["service"]["sglang"].update(
        host="0.0.0.0", extra_args=["--enable-metrics"]))
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    port = _free_port()
    gateway = deployment.fleet.gateway  # this machine on the hosts' bridge: the hosts reach the router too
    url = f"http://{gateway}:{port}"
    workers = [f"http://{deployment.load().hosts[h].address}:{deployment.port}" for h in deployment.hosts]
    argv = router_env.router_argv(router_env.ensure_venv(), gateway, port, workers, health_interval=1,
                                  health_failures=1, prometheus_port=_free_port())
    with router_env.running(argv, url, tmp_path / "router.log"):
        deployment.edit(lambda doc: doc["defaults"].update(router={"url": url, "drain_timeout": 30}))
        r = Routed(deployment, url)
        r.wait(lambda w: len(w) == len(workers) and all(w.values()), "every worker healthy")
        yield r


def _phases(host: dict) -> list[str]:
    return [p["name"] for p in host["phases"]]


@pytest.mark.hosts(2)
def test_drain_waits_for_a_stream_in_flight_and_admits_after_the_gate(routed: Routed, capsys) -> None:
    dep = routed.dep
    (dep.payload / "rev.txt").write_text("2")
    out: list = []
    started = threading.Event()
    h1 = routed.worker_url("h1")
    client = threading.Thread(target=_stream, args=(h1, 50, out, started))  # 5 s on h1, which goes first
    client.start()
    assert started.wait(10)
    code, doc = dep.json(capsys, "push", "test", "--batch", "1")
    client.join(30)
    assert code == 0, doc
    hosts = {h["host"]: h for h in doc["hosts"]}
    for name in ("h1", "h2"):
        assert hosts[name]["result"] == "deployed" and hosts[name]["router"] == "in"
        names = _phases(hosts[name])
        assert names.index("drain") < names.index("activate") < names.index("restart") < names.index("admit")
    drain = next(p for p in hosts["h1"]["phases"] if p["name"] == "drain")
    assert "no request in flight" in drain["detail"] and drain["seconds"] >= 2, drain
    assert out == [(200, 52, True)], out  # 50 tokens + the final chunk + [DONE]: nothing cut off
    assert all(routed.workers().values()) and len(routed.workers()) == 2


@pytest.mark.hosts(2)
def test_failed_gate_keeps_the_host_out_until_its_rollback_passed(routed: Routed, capsys) -> None:
    dep = routed.dep
    (dep.payload / "rev.txt").write_text("5")
    dep.edit(lambda doc: doc["hosts"]["h2"].update(service={"env": {"REFSERVER_WRONG_ANSWER": "1"}}))
    seen: list[tuple[str, bool]] = []

    def watch(host: str, phase: str, status: str) -> None:
        if host == "h2" and status == "start" and phase in ("rollback", "rollback restart", "admit"):
            seen.append((phase, routed.worker_url("h2") in routed.workers()))

    from kdeploy.core.policy import Policy
    from kdeploy.flows import fleet
    from kdeploy.flows.options import Options

    report = fleet.push(dep.load(), "test", Options(policy=Policy(batch="1")), listener=watch)
    hosts = {h.host: h for h in report.hosts}
    assert hosts["h1"].result == "deployed" and hosts["h2"].result == "rolled_back", hosts["h2"].error
    assert report.exit_code == 4
    assert seen == [("rollback", False), ("rollback restart", False), ("admit", False)], seen
    assert hosts["h2"].router == "in" and hosts["h2"].phases[-1].name == "admit"
    assert routed.workers() == {routed.worker_url("h1"): True, routed.worker_url("h2"): True}


@pytest.mark.hosts(3)
def test_preflight_refuses_when_another_worker_is_unhealthy(routed: Routed, capsys) -> None:
    dep = routed.dep
    dep.sh("h3", f"systemctl stop {dep.service}")
    routed.wait(lambda w: w.get(routed.worker_url("h3")) is False, "h3 unhealthy")
    (dep.payload / "rev.txt").write_text("3")
    before = {h: dep.show(h, "InvocationID") for h in ("h1", "h2")}
    code, doc = dep.json(capsys, "push", "h1,h2", "--batch", "1")
    assert code == 7, doc
    assert {h["result"] for h in doc["hosts"]} == {"preflight_refused"}
    assert "unhealthy worker(s) " + routed.worker_url("h3") in doc["hosts"][0]["error"]
    assert {h: dep.show(h, "InvocationID") for h in ("h1", "h2")} == before  # nothing touched


@pytest.mark.hosts(2)
def test_router_drain_and_admit_by_hand_and_status_shows_membership(routed: Routed, capsys) -> None:
    dep = routed.dep
    code, doc = dep.json(capsys, "router", "drain", "h1")
    assert code == 0 and doc["hosts"][0]["router"] == "out"
    assert routed.worker_url("h1") not in routed.workers()
    code, doc = dep.json(capsys, "router", "drain", "h1")  # again: says what the router lists instead
    assert code == 0 and doc["hosts"][0]["phases"][-1]["detail"] == (
        f"{routed.worker_url('h1')} was not in the router (it lists: {routed.worker_url('h2')}; "
        "check router.worker_url)")
    code, doc = dep.json(capsys, "status", "test")
    assert {h["host"]: h.get("router") for h in doc["hosts"]} == {"h1": "out", "h2": "in"}
    capsys.readouterr()
    assert dep.kdeploy("status", "test") == 0
    table = capsys.readouterr().err
    assert "router" in table and "OUT" in table and "in" in table
    code, doc = dep.json(capsys, "verify", "h1")
    assert code == 4 and doc["hosts"][0]["result"] == "unhealthy" and "OUT of the router" in doc["hosts"][0]["error"]
    code, doc = dep.json(capsys, "router", "admit", "h1")
    assert code == 0 and doc["hosts"][0]["router"] == "in"
    assert routed.workers() == {routed.worker_url("h1"): True, routed.worker_url("h2"): True}
    code, doc = dep.json(capsys, "verify", "test")
    assert code == 0 and all("router" in _phases(h) for h in doc["hosts"])
    # --router-add-missing registers a host the push leaves unchanged, too (it has no turn of its own)
    assert dep.kdeploy("push", "test", "--batch", "1") == 0  # every host current, whatever came before
    code, doc = dep.json(capsys, "push", "test", "--batch", "1")  # no turn for either: membership as read
    assert code == 0 and {h["host"]: (h["result"], h["router"]) for h in doc["hosts"]} == {
        "h1": ("unchanged", "in"), "h2": ("unchanged", "in")}
    assert dep.json(capsys, "router", "drain", "h1")[0] == 0
    code, doc = dep.json(capsys, "push", "h1", "--router-add-missing")
    assert code == 0 and (doc["hosts"][0]["result"], doc["hosts"][0]["router"]) == ("unchanged", "in"), doc
    assert routed.workers() == {routed.worker_url("h1"): True, routed.worker_url("h2"): True}


@pytest.mark.hosts(2)
def test_ctrl_c_mid_drain_reports_the_host_out_and_admit_fixes_it(routed: Routed) -> None:
    dep = routed.dep
    (dep.payload / "rev.txt").write_text("4")
    out: list = []
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(routed.worker_url("h1"), 80, out, started))  # 8 s on h1
    client.start()
    assert started.wait(10)
    h1_before = dep.show("h1", "InvocationID")
    run = dep.interrupt("push", "test", "--batch", "1", when=lambda: routed.worker_url("h1") not in routed.workers(),
                        what="h1's drain", settle=0.5)
    client.join(30)
    hosts, err = run.hosts, run.err
    assert run.code == 130, err
    assert hosts["h1"]["result"] == "interrupted" and hosts["h1"]["router"] == "out", hosts["h1"]
    assert "OUT of its router" in err
    assert routed.worker_url("h1") not in routed.workers()            # truthful: it really is out
    assert dep.show("h1", "InvocationID") == h1_before                # and was never restarted
    assert out == [(200, 82, True)]
    assert dep.kdeploy("router", "admit", "h1") == 0
    assert routed.workers()[routed.worker_url("h1")] is True


def _push_killed_once_out(routed: Routed, worker: str) -> float:
    """A push of a changed payload, SIGKILLed as soon as the router no longer lists ``worker``; when."""
    dep = routed.dep
    (dep.payload / "rev.txt").write_text("9")
    stopped = dep.interrupt("push", "test", "--batch", "1", when=lambda: worker not in routed.workers(),
                            what="the host drained", wait=60, sig=signal.SIGKILL)
    return time.monotonic() - stopped.seconds


@pytest.mark.hosts(2)
def test_a_controller_killed_after_the_drain_leaves_the_host_to_re_admit_itself(routed: Routed) -> None:
    """The drain armed the host's re-admit first: with nobody left to admit it, the host registers itself
    again once its deadline passed and it serves a confirmed release. The push is killed as soon as h1 is out
    (before or after its switch, whichever came first): an unconfirmed switch is reverted by the host at
    ``revert_after`` first, so it re-admits on its confirmed release either way."""
    dep = routed.dep
    dep.edit(lambda doc: doc["defaults"]["router"].update(readmit_after=8))
    dep.edit(lambda doc: doc["defaults"]["service"]["gate"].update(revert_after=10))
    h1 = routed.worker_url("h1")
    killed = _push_killed_once_out(routed, h1)
    assert h1 not in routed.workers()
    routed.wait(lambda w: w.get(h1) is True, "h1 back and healthy", timeout=10 + 50)
    assert time.monotonic() - killed >= 7  # by the host at its deadline, not by anything earlier
    assert dep.sh("h1", f"ls {dep.service_dir}/pending 2>&1", check=False).endswith("No such file or directory\n")
    unit = f"kdeploy-readmit-{dep.service}.service"
    deadline = time.monotonic() + 15
    while dep.sh("h1", f"systemctl is-active {unit}", check=False).strip() == "active":  # sees it listed, ends
        assert time.monotonic() < deadline, "the re-admit never ended"
        time.sleep(0.2)
    journal = dep.sh("h1", f"journalctl -u {unit} -o cat --no-pager")
    assert f"the controller did not admit {h1}: registering it with {routed.url}" in journal, journal
    assert dep.sh("h1", f"ls {dep.service_dir}/.readmit.key 2>&1", check=False).endswith("No such file or directory\n")


@pytest.mark.hosts(2)
def test_a_host_reset_after_the_drain_re_admits_itself_after_its_boot(routed: Routed) -> None:
    """Found by the fault campaign (a reset during the gate): the re-admit was a transient timer, and a reboot
    ended it, so a drained host that came back on its confirmed release stayed out of its router for good. The
    boot guard now arms it again from ``.readmit.sh`` (kept until the re-admit ran). The push is killed once h1
    is out (its new release starts slowly, so it stays out), then h1 is hard-reset."""
    dep = routed.dep
    dep.edit(lambda doc: doc["defaults"]["router"].update(readmit_after=8))
    dep.edit(lambda doc: doc["defaults"]["service"]["gate"].update(revert_after=10))
    dep.edit(lambda doc: doc["defaults"]["service"]["env"].update(REFSERVER_SLOW_START="20"))
    h1 = routed.worker_url("h1")
    _push_killed_once_out(routed, h1)
    assert dep.sh("h1", f"test -f {dep.service_dir}/.readmit.sh && echo kept").strip() == "kept"
    dep.fleet.reboot("h1")  # every transient timer (the revert's, the re-admit's) is gone with it
    routed.wait(lambda w: w.get(h1) is True, "h1 back and healthy", timeout=10 + 60)
    unit = f"kdeploy-readmit-{dep.service}.service"
    deadline = time.monotonic() + 15
    while dep.sh("h1", f"systemctl is-active {unit}", check=False).strip() == "active":
        assert time.monotonic() < deadline, "the re-admit never ended"
        time.sleep(0.2)
    journal = dep.sh("h1", f"journalctl -b -u {unit} -o cat --no-pager")
    assert f"registering it with {routed.url}" in journal, journal  # this boot's re-admit did it
    assert dep.sh("h1", f"ls {dep.service_dir}/.readmit.sh 2>&1", check=False).endswith("No such file or directory\n")
    assert dep.kdeploy("verify", "test") == 0


@pytest.mark.hosts(2)
def test_a_host_reset_during_its_gate_is_not_left_for_a_person(routed: Routed) -> None:
    """Found by the fault campaign: h1 reset while its gate ran made the gate fail, and the way back, which could
    not reach h1, ended `rollback_failed` (exit 5: a person needed) and disarmed nothing. A lost link on the way
    back is now a lost link: the controller reconnects (or leaves h1 to go back by itself), and h1, back on its
    confirmed release at boot, re-admits itself."""
    dep = routed.dep
    dep.edit(lambda doc: doc["defaults"]["router"].update(readmit_after=8))
    dep.edit(lambda doc: doc["defaults"]["service"]["gate"].update(revert_after=15))
    dep.edit(lambda doc: doc["defaults"]["service"]["env"].update(REFSERVER_SLOW_START="5"))
    old, h1 = dep.current("h1"), routed.worker_url("h1")
    invocation = dep.show("h1", "InvocationID")
    (dep.payload / "rev.txt").write_text("9")
    stopped = dep.interrupt("push", "test", "--batch", "1", when=lambda: dep.show("h1", "InvocationID") != invocation,
                            what="h1's restart on the new release", wait=60, reset="h1")  # its gate waits
    h1_result = stopped.hosts["h1"]
    assert stopped.code in (3, 4) and h1_result["result"] in ("unreachable", "rolled_back"), h1_result
    routed.wait(lambda w: w.get(h1) is True, "h1 back and healthy", timeout=15 + 60)
    assert dep.current("h1") == old
    assert dep.kdeploy("verify", "test") == 0


@pytest.mark.hosts(2)
def test_push_and_rollback_go_one_host_at_a_time_through_the_router(routed: Routed, capsys) -> None:
    dep = routed.dep
    (dep.payload / "rev.txt").write_text("6")
    code, doc = dep.json(capsys, "push", "test", "--batch", "2")  # both hosts at once would leave none serving
    assert code == 7 and "a batch of 2 would leave none serving" in doc["hosts"][0]["error"]
    code, doc = dep.json(capsys, "push", "test")  # without --batch, behind a router: one host at a time
    assert code == 0 and all(_phases(h)[-1] == "admit" for h in doc["hosts"]), doc
    code, doc = dep.json(capsys, "rollback", "test")
    assert code == 0, doc
    hosts = {h["host"]: h for h in doc["hosts"]}
    for name in ("h1", "h2"):
        assert hosts[name]["result"] == "restored" and hosts[name]["router"] == "in"
        assert _phases(hosts[name])[2] == "drain" and _phases(hosts[name])[-1] == "admit"
    assert routed.workers() == {routed.worker_url("h1"): True, routed.worker_url("h2"): True}


@pytest.mark.hosts(2)
def test_sandbox_router_unit_and_first_push_registers_every_host(deployment: Deployment, tmp_path: Path,
                                                                 capsys) -> None:
    """`sandbox up --router`'s pieces on the fleet's last host: the router as a unit there, an inventory
    without that host and with `router:`, and a first push that registers every host."""
    from kdeploy_lab import sandbox_router

    box = deployment.fleet
    router_host = box.hosts()[-1]
    url = sandbox_router.install(box, router_host)
    try:
        assert box.exec(router_host.name, ["systemctl", "is-active", sandbox_router.UNIT]).stdout.strip() == "active"
        path = tmp_path / "routed.yaml"
        service = YAML().load(deployment.path.read_text())["defaults"]["service"]
        sandbox_router.write_inventory(box, path, json.loads(json.dumps(service)), router_host, url)
        doc = YAML().load(path.read_text())
        assert router_host.name not in doc["hosts"] and doc["defaults"]["router"]["url"] == url
        assert doc["defaults"]["service"]["sglang"]["host"] == "0.0.0.0"
        only = {"h1", "h2"}
        doc["hosts"] = {h: v for h, v in doc["hosts"].items() if h in only}
        doc["groups"] = {"test": {"hosts": sorted(only)}}
        with path.open("w") as fh:
            YAML().dump(doc, fh)
        routed = Deployment(box, path, deployment.payload, deployment.service, deployment.hosts, deployment.port)
        code, out = routed.json(capsys, "push", "test", "--batch", "1")
        assert code == 7 and "not registered in the router" in out["hosts"][0]["error"]
        code, out = routed.json(capsys, "push", "test", "--batch", "1", "--router-add-missing")
        assert code == 0, out
        assert {h["host"]: h["router"] for h in out["hosts"]} == {"h1": "in", "h2": "in"}
        listed = {w["url"]: w["is_healthy"] for w in httpx.get(f"{url}/workers").json()["workers"]}
        assert listed == {f"http://{h.address}:{deployment.port}": True for h in box.hosts()[:2]}
        # via: the same router reached over kdeploy's SSH connection to its host, at its loopback
        doc = YAML().load(path.read_text())
        doc["hosts"][router_host.name] = {"address": router_host.address}
        doc["defaults"]["router"] = {"url": f"http://127.0.0.1:{sandbox_router.PORT}", "via": router_host.name}
        with path.open("w") as fh:
            YAML().dump(doc, fh)
        code, out = routed.json(capsys, "router", "drain", "h1")
        assert code == 0 and out["hosts"][0]["router"] == "out"
        code, out = routed.json(capsys, "status", "test")
        assert {h["host"]: h["router"] for h in out["hosts"]} == {"h1": "out", "h2": "in"}
        code, out = routed.json(capsys, "router", "admit", "h1")
        assert code == 0 and out["hosts"][0]["router"] == "in"
    finally:
        box.exec(router_host.name, ["sh", "-c", f"systemctl disable --now {sandbox_router.UNIT}; rm -f "
                                                f"/etc/systemd/system/{sandbox_router.UNIT}.service; "
                                                f"rm -rf {sandbox_router.HOST_DIR}"], check=False)


@pytest.mark.hosts(2)
def test_killed_controller_leaves_the_host_out_and_set_env_restarts_after_the_drain_timeout(routed: Routed,
                                                                                           capsys) -> None:
    """A `kdeploy push` SIGKILLed mid-drain: the host stays out (not restarted), status says so, `router admit`
    puts it back. Then set-env behind the router (one host at a time, as it has no --batch) with a 1 s
    drain_timeout: h1's stream outlives it, the restart goes ahead anyway and the drain phase says so; the
    server's SIGTERM drain still finishes the stream."""
    dep = routed.dep
    h1 = routed.worker_url("h1")
    out: list = []
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(h1, 60, out, started))  # 6 s on h1
    client.start()
    assert started.wait(10)
    h1_before = dep.show("h1", "InvocationID")
    _push_killed_once_out(routed, h1)
    assert h1 not in routed.workers() and dep.show("h1", "InvocationID") == h1_before
    code, doc = dep.json(capsys, "status", "test")
    assert {h["host"]: h["router"] for h in doc["hosts"]} == {"h1": "out", "h2": "in"}, doc
    code, doc = dep.json(capsys, "router", "admit", "h1")
    assert code == 0 and doc["hosts"][0]["router"] == "in", doc
    assert routed.workers() == {h1: True, routed.worker_url("h2"): True}
    client.join(30)
    assert out == [(200, 62, True)], out

    dep.edit(lambda doc: doc["defaults"]["router"].update(drain_timeout=1))
    out.clear()
    started.clear()
    client = threading.Thread(target=_stream, args=(h1, 80, out, started))  # 8 s on h1, which goes first
    client.start()
    assert started.wait(10)
    code, doc = dep.json(capsys, "set-env", "KDEPLOY_ROUTED=1")
    client.join(30)
    assert code == 0, doc
    hosts = {h["host"]: h for h in doc["hosts"]}
    for name in ("h1", "h2"):
        assert hosts[name]["result"] == "deployed" and hosts[name]["router"] == "in", hosts[name]
        names = _phases(hosts[name])
        assert names.index("drain") < names.index("restart") < names.index("workers") < names.index("admit"), names
        assert "KDEPLOY_ROUTED=1" in dep.show(name, "Environment")
    drain = next(p for p in hosts["h1"]["phases"] if p["name"] == "drain")
    assert drain["ok"] and "1 request(s) still in flight after 1s" in drain["detail"], drain
    assert drain["seconds"] >= 1, drain
    assert "no request in flight" in next(p for p in hosts["h2"]["phases"] if p["name"] == "drain")["detail"]
    assert dep.show("h1", "InvocationID") != h1_before
    assert out == [(200, 82, True)], out  # SIGTERM: SGLang serves what is in flight, then exits
    assert routed.workers() == {h1: True, routed.worker_url("h2"): True}
