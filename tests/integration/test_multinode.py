"""A server that spans hosts (SGLang's multi-node mode) on sandbox hosts: h1 (head) + h2 (follower), tp 16.

The reference server really rendezvouses over TCP between the two hosts; a follower restarted alone breaks
its group, so every test here checks that both nodes move, stop, start and go back together.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kdeploy.core import provisional
from kdeploy_lab import router_env
from kdeploy_lab.traffic import Traffic
from tests.conftest import TEST_MARKER, Deployment
from tests.integration.test_router import _free_port

pytestmark = pytest.mark.hosts(2)
NODES = ("h1", "h2")


@pytest.fixture
def server(deployment: Deployment) -> Deployment:
    """h1 and h2 as one server ``s1`` of 16 workers, 8 on each node."""
    def spanning(doc: dict) -> None:
        doc["servers"] = {"s1": {"nodes": list(NODES), "rendezvous_port": deployment.port + 1000}}
        service = doc["defaults"]["service"]
        service["sglang"]["tp"] = 16
        service["gate"] = {"workers": 16, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60,
                           "revert_after": 30}
    deployment.edit(spanning)
    return deployment


def _journal(dep: Deployment, host: str, since: str) -> list[tuple[float, str]]:
    """The service's journal lines on ``host`` since ``since`` (``@epoch``), as (time, message)."""
    out = dep.sh(host, f"journalctl -u {dep.service} --since {since} -o short-unix --no-pager", check=False)
    lines = []
    for line in out.splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            lines.append((float(stamp), rest))
        except ValueError:
            continue
    return lines


def _first(lines: list[tuple[float, str]], text: str) -> float:
    return next(t for t, message in lines if text in message)


def _releases(dep: Deployment) -> dict[str, str]:
    return {h: dep.current(h) for h in NODES}


def _wait_none_pending(dep: Deployment, what: str, within: float = 150) -> None:
    """Until no node has a switch pending (each went back by itself or was confirmed); ``what`` if one never does
    (``within=0``: none has one now)."""
    deadline = time.monotonic() + within
    while any(dep.sh(h, f"test -e {dep.service_dir}/pending && echo p", check=False).strip() for h in NODES):
        assert time.monotonic() < deadline, what
        time.sleep(1)


def _invocations(dep: Deployment) -> dict[str, str]:
    return {h: dep.show(h, "InvocationID") for h in NODES}


_KILLED_AFTER = """
import os, signal, sys
from kdeploy.core import inventory
from kdeploy.flows import fleet
from kdeploy.flows.options import Options
path, host, phase = sys.argv[1:]
def listener(h, p, status):
    if (h, p, status) == (host, phase, "ok"):
        os.kill(os.getpid(), signal.SIGKILL)
fleet.push(inventory.load(path), "s1", Options(), listener=listener)
"""


def _push_killed_after(dep: Deployment, host: str, phase: str) -> None:
    """``push s1`` in a controller of its own that SIGKILLs itself as ``host`` ends ``phase``: between two
    steps, where no signal sent from outside can land reliably."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER, str(dep.path), host, phase], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_push_verify_set_env_rollback_move_the_whole_server(server: Deployment,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = server.json(capsys, "push", "s1")
    assert code == 0, doc
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert {h: r["result"] for h, r in hosts.items()} == {"h1": "deployed", "h2": "deployed"}
    unit = {h: server.sh(h, f"cat {server.unit_path}") for h in NODES}
    assert "--nnodes 2 --node-rank 0 --dist-init-addr" in unit["h1"]
    assert "--nnodes 2 --node-rank 1 --dist-init-addr" in unit["h2"]
    # the head's gate answered HTTP; the follower's proof is its unit and its own 8 ranks' markers
    phases = {h: [p["name"] for p in r["phases"]] for h, r in hosts.items()}
    assert "completion" in phases["h1"] and "completion" not in phases["h2"] and "ready" not in phases["h2"]
    workers = {h: next(p for p in r["phases"] if p["name"] == "workers")["detail"] for h, r in hosts.items()}
    assert all("x 8 workers" in w for w in workers.values()), workers
    first = _releases(server)

    assert server.kdeploy("verify", "s1", "--workers", "16") == 0
    assert server.kdeploy("verify", "h2", "--workers", "16") == 0  # read-only: one node may be selected
    assert server.kdeploy("push", "h2") == 2  # a restart of part of a server is refused

    since = f"@{time.time():.3f}"
    assert server.kdeploy("set-env", "KDTREE_DEFRAG_SORT=1") == 0
    second = _releases(server)
    assert all(second[h] != first[h] for h in NODES), (first, second)
    # SGLang's order: the head stops first; its shutdown broadcast ends the follower's run
    head, follower = _journal(server, "h1", since), _journal(server, "h2", since)
    head_stop = _first(head, "Stopping")
    assert head_stop <= _first(follower, "Stopping"), (head, follower)
    assert any("Shutdown received from the head" in m for _, m in follower), follower

    code, doc = server.json(capsys, "rollback", "s1")
    assert code == 0, doc
    assert {h["host"]: h["result"] for h in doc["hosts"]} == {"h1": "restored", "h2": "restored"}
    assert _releases(server) == first
    assert server.kdeploy("verify", "s1", "--workers", "16") == 0


def test_a_follower_rank_without_the_plugin_rolls_the_whole_server_back(server: Deployment,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert server.kdeploy("push", "s1") == 0
    before = _releases(server)
    server.set_service(env={"REFSERVER_NO_PLUGINS_RANK": "11"})  # TP11 runs on the follower (TP8..15)
    code, doc = server.json(capsys, "push", "s1")
    assert code == 4, doc
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert {h: r["result"] for h, r in hosts.items()} == {"h1": "rolled_back", "h2": "rolled_back"}, doc
    failed = next(p for p in hosts["h2"]["phases"] if not p["ok"])
    assert failed["name"] == "workers" and "TP11" in failed["detail"], failed
    assert _releases(server) == before
    assert all(server.show(h, "ActiveState") == "active" for h in NODES)
    assert server.kdeploy("verify", "s1") == 0


def test_a_follower_that_cannot_arm_its_revert_changes_nothing_on_any_node(
        server: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Every node arms its revert before any node moves: a follower that cannot (its `.pending.tmp` a directory,
    as a full disk would refuse it) refuses the server's switch, and the head was not even stopped."""
    assert server.kdeploy("push", "s1") == 0
    before, runs = _releases(server), _invocations(server)
    server.sh("h2", f"mkdir {server.service_dir}/.pending.tmp")
    (server.payload / "rev.txt").write_text("2")
    code, doc = server.json(capsys, "push", "s1")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 7, doc
    assert {h: r["result"] for h, r in hosts.items()} == {"h1": "preflight_refused", "h2": "preflight_refused"}, doc
    assert "h2: switching to" in hosts["h1"]["error"] and "host unchanged" in hosts["h1"]["error"], hosts["h1"]
    assert [p["name"] for p in hosts["h1"]["phases"] if p["name"] in ("arm", "activate")] == ["arm"], hosts["h1"]
    assert _releases(server) == before and _invocations(server) == runs
    _wait_none_pending(server, "a node was left armed", within=0)
    server.sh("h2", f"rmdir {server.service_dir}/.pending.tmp")
    assert server.kdeploy("push", "s1") == 0 and all(_releases(server)[h] != before[h] for h in NODES)


def test_a_follower_that_cannot_arm_on_the_way_back_still_goes_back_with_its_head(
        server: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the fault campaign (seed 1, iteration 124: h5's disk filled as the server switched): the way back
    asked a follower that could no longer write its revert to arm it, which it refused. The rollback failed
    (exit 5) with both nodes stopped. The follower's way back now goes on without a revert: it is going to the
    release it already ran. Here the server's new release fails its gate (TP11, on h2, lacks the plugin) and
    h2's `.pending.tmp` becomes a directory once h2 has switched."""
    assert server.kdeploy("push", "s1") == 0
    before = _releases(server)
    server.set_service(env={"REFSERVER_NO_PLUGINS_RANK": "11"})
    switched = threading.Event()

    def fill_h2_once_switched() -> None:
        deadline = time.monotonic() + 60
        while server.current("h2") == before["h2"]:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        server.sh("h2", f"mkdir {server.service_dir}/.pending.tmp")
        switched.set()

    filler = threading.Thread(target=fill_h2_once_switched)
    filler.start()
    try:
        code, doc = server.json(capsys, "push", "s1")
    finally:
        filler.join()
    assert switched.is_set()
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 4 and {h: r["result"] for h, r in hosts.items()} == {"h1": "rolled_back", "h2": "rolled_back"}, doc
    assert "its revert could not be armed" in " ".join(hosts["h2"]["log"]), hosts["h2"]
    confirm = next(p for p in hosts["h2"]["phases"] if p["name"] == "rollback confirm")
    assert confirm["ok"] and confirm["detail"].endswith("no revert was armed"), confirm
    assert _releases(server) == before
    assert all(server.show(h, "ActiveState") == "active" for h in NODES)
    assert server.kdeploy("verify", "s1", "--workers", "16") == 0
    _wait_none_pending(server, "a node was left armed to move it later", within=0)


def test_a_controller_killed_between_the_nodes_activations_leaves_the_server_serving(server: Deployment) -> None:
    """Found by the fault campaign (seed 1, iteration 186: `set` + SIGKILL as s4 switched): each node armed its
    revert in its own activation, so a controller killed after the head's left the follower, whose run the
    head's stop had ended, with nothing to start it; the head went back alone and the server stayed down. Every
    node is now armed first, and a node that never moved is started by its revert if its run ended. The
    controller kills itself right after h1's `arm` (h2's may or may not have landed: nothing moved, nothing
    restarts), then right after h1's `activate` (h1 moved and stopped, h2 did not)."""
    server.edit(lambda doc: doc["defaults"]["service"]["gate"].update(revert_after=12))  # no gate to wait for
    assert server.kdeploy("push", "s1") == 0
    before, runs = _releases(server), _invocations(server)
    (server.payload / "rev.txt").write_text("2")
    _push_killed_after(server, "h1", "arm")
    _wait_none_pending(server, "the armed nodes never ended their reverts")
    assert _releases(server) == before and _invocations(server) == runs  # untouched: no node was restarted
    assert server.history("h1")[-1]["error"].endswith(f"the host had not moved from {before['h1']}")

    _push_killed_after(server, "h1", "activate")
    assert server.current("h1") != before["h1"] and server.current("h2") == before["h2"]
    _wait_none_pending(server, "the nodes never went back by themselves")
    assert _releases(server) == before
    deadline = time.monotonic() + 60
    while not all(server.show(h, "ActiveState") == "active" for h in NODES):
        assert time.monotonic() < deadline, {h: server.show(h, "ActiveState") for h in NODES}
        time.sleep(0.5)
    assert server.kdeploy("verify", "s1", "--workers", "16") == 0
    records = {h: server.history(h)[-1] for h in NODES}
    assert "went back to" in records["h1"]["error"] and "had not moved" in records["h2"]["error"], records


def test_controller_killed_after_the_switch_leaves_both_nodes_on_one_release(
        server: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    assert server.kdeploy("push", "s1") == 0
    before = _releases(server)
    server.set_service(env={"REFSERVER_SLOW_START": "20"})
    invocation = server.show("h2", "InvocationID")
    server.interrupt("push", "s1", when=lambda: server.show("h2", "InvocationID") != invocation,  # the follower
                     what="h2's restart", wait=60, sig=signal.SIGKILL)                       # switches after the head
    assert all(_releases(server)[h] != before[h] for h in NODES)
    _wait_none_pending(server, "the nodes never went back by themselves")
    assert _releases(server) == before
    timer = provisional.timer_unit(server.service)
    for host in NODES:
        assert server.sh(host, f"systemctl list-units --all --no-legend '{timer}.timer'").strip() == ""
        assert [r for r in server.history(host) if r.get("result") == "reverted"], server.history(host)
    server.set_service(env={})
    assert server.kdeploy("push", "s1") == 0
    assert server.kdeploy("verify", "s1") == 0


def test_a_follower_reset_before_the_confirm_leaves_both_nodes_on_the_last_confirmed_release(
        server: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """h2 is power-cycled while the server's gate waits (a slow start): its boot guard puts its last confirmed
    release back before the service starts, and the head, which lost its peer, goes back too, through the
    live controller or by itself at the deadline."""
    assert server.kdeploy("push", "s1") == 0
    before = _releases(server)
    server.set_service(env={"REFSERVER_SLOW_START": "20"})
    invocation = server.show("h2", "InvocationID")
    stopped = server.interrupt("push", "s1", when=lambda: server.show("h2", "InvocationID") != invocation,
                               what="h2's restart", wait=60, reset="h2")
    assert stopped.code in (3, 4), stopped.doc  # rolled back by the controller, or left to the hosts' deadline
    _wait_none_pending(server, "a node never went back")
    assert _releases(server) == before
    server.set_service(env={})
    assert server.kdeploy("push", "s1") == 0
    assert server.kdeploy("verify", "s1", "--workers", "16") == 0


@pytest.mark.hosts(4)
def test_two_servers_of_two_nodes_behind_the_router_lose_no_request(deployment: Deployment, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """s1 = h1+h2, s2 = h3+h4, behind the real sglang-router (which knows each server by its head) under the
    traffic client: a push and a rollback with --batch 1 take one server out at a time and lose no request."""
    def spanning(doc: dict) -> None:
        doc["servers"] = {"s1": {"nodes": ["h1", "h2"], "rendezvous_port": deployment.port + 1000},
                          "s2": {"nodes": ["h3", "h4"], "rendezvous_port": deployment.port + 1000}}
        service = doc["defaults"]["service"]
        service["sglang"].update(tp=16, host="0.0.0.0", extra_args=["--enable-metrics"])
        service["env"] = {"REFSERVER_TOKEN_DELAY": "0.02", "REFSERVER_SHUTDOWN_POLL": "1"}
        service["gate"] = {"workers": 16, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60}
    deployment.edit(spanning)
    assert deployment.kdeploy("push", "test") == 0
    gateway = deployment.fleet.gateway
    port = _free_port()
    url = f"http://{gateway}:{port}"
    heads = [f"http://{deployment.load().hosts[h].address}:{deployment.port}" for h in ("h1", "h3")]
    argv = router_env.router_argv(router_env.ensure_venv(), gateway, port, heads, health_interval=1,
                                  health_failures=1, prometheus_port=_free_port())
    with router_env.running(argv, url, tmp_path / "router.log"):
        deployment.edit(lambda doc: doc["defaults"].update(router={"url": url, "drain_timeout": 30}))
        seen: list[int] = []
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                body = httpx.get(f"{url}/workers", timeout=5).json()
                seen.append(sum(1 for w in body["workers"] if w["is_healthy"]))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            with Traffic(url, threads=4, tokens=8) as traffic:
                (deployment.payload / "rev.txt").write_text("2")
                code, doc = deployment.json(capsys, "push", "test", "--batch", "1")
                assert code == 0, doc
                assert {h["host"]: h.get("router") for h in doc["hosts"]} == {
                    "h1": "in", "h2": None, "h3": "in", "h4": None}, doc
                code, doc = deployment.json(capsys, "rollback", "test", "--batch", "1")
                assert code == 0, doc
                time.sleep(1)
        finally:
            watching.set()
            watcher.join(5)
        assert set(traffic.codes) == {200} and traffic.codes[200] > 50, traffic.codes
        assert min(seen) >= 1 and max(seen) == 2, seen  # one server out at a time, never none
        # the router knows a server by its head: verify asks it about heads only (found by the fault campaign:
        # a follower read "OUT of the router", and verify of a healthy server exited 4)
        code, doc = deployment.json(capsys, "verify", "test")
        assert code == 0, doc
        assert {h["host"]: h.get("router") for h in doc["hosts"]} == {"h1": "in", "h2": None, "h3": "in", "h4": None}
