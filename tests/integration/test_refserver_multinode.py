"""The reference server as a server of two nodes (issue 40 item 4), both run locally on 127.0.0.1.

No containers: each node is ``python -m kdeploy_lab.refserver --nnodes 2 --node-rank R`` in a process group of its
own (main process and workers), killed whole at teardown. tp 4 over 2 nodes: two light workers a node (no torch
or sglang here, so a worker only logs its markers).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from kdeploy_lab import refserver
from tests.refserver_proc import PLUGIN_RE, READY, RefServer, free_port, wait_dead

WORKER_MARKERS = ("Load weight end.", "KV Cache is allocated.", "Memory pool end.")
LOST = "the process group is broken, exiting"
Start = Callable[..., RefServer]


@pytest.fixture
def start() -> Iterator[Start]:
    """Start one node of a two-node server: ``start(rank, dist)`` (a dist-init-addr, HOST:PORT)."""
    nodes: list[RefServer] = []

    def _start(rank: int, dist: str, env: dict | None = None, args: tuple = (), timeout: int = 20) -> RefServer:
        node = RefServer(tp=4, env={"REFSERVER_SHUTDOWN_POLL": "0.2", **(env or {})},
                         args=("--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist,
                               "--dist-timeout", str(timeout), *args))
        nodes.append(node)
        return node

    yield _start
    for node in nodes:
        node.cleanup()


def _dist() -> str:
    return f"127.0.0.1:{free_port()}"


def _group(start: Start) -> tuple[RefServer, RefServer, int]:
    """A formed, ready group: (head, follower, rendezvous port)."""
    dist = _dist()
    head = start(0, dist)
    follower = start(1, dist)
    head.wait_for(READY)
    follower.wait_for("Dummy health check server started")
    return head, follower, int(dist.rsplit(":", 1)[1])


def _tagged(node: RefServer, marker: str) -> set[int]:
    """The TP ranks whose worker logged ``marker``."""
    return {int(m[1]) for m in (re.search(r" TP(\d+)\] " + re.escape(marker), line) for line in node.text()) if m}


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_two_nodes_form_a_group_and_split_the_ranks(start: Start) -> None:
    dist = _dist()
    head = start(0, dist, env={"REFSERVER_SLOW_START": "2"})
    head.wait_for("Rendezvous listening on port")
    assert head.request("GET", "/health")[0] == 503
    assert head.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 503

    follower = start(1, dist)
    follower.wait_for("Dummy health check server started in background thread at 127.0.0.1:")
    # The follower answers health as soon as its own schedulers are up: before the head is ready.
    assert follower.request("GET", "/health")[0] == 200
    assert follower.request("GET", "/health_generate")[0] == 200
    assert head.request("GET", "/health")[0] == 503
    t_joined, _ = head.wait_for("Node 1 joined from 127.0.0.1:")
    t_ready, _ = head.wait_for(READY)
    assert t_ready > t_joined
    log = head.text()
    assert log.index(next(line for line in log if "Node 1 is ready: scheduler(s) TP2..TP3" in line)) < \
        log.index(next(line for line in log if READY in line))

    assert "Paris" in head.complete()["choices"][0]["text"]
    info = json.loads(head.request("GET", "/server_info")[1])
    assert (info["nnodes"], info["node_rank"], info["tp_size"]) == (2, 0, 4)
    # A follower has no API: only the dummy health endpoints.
    assert follower.request("GET", "/v1/models")[0] == 404
    assert follower.request("POST", "/v1/completions", {"prompt": "x"})[0] == 404
    assert not any(READY in line for line in follower.text())

    # Each node runs its own ranks, with the markers a deploy tool greps per node.
    assert set(head.worker_pids()) == {0, 1} and set(follower.worker_pids()) == {2, 3}
    for marker in WORKER_MARKERS:
        assert _tagged(head, marker) == {0, 1}, marker
        assert _tagged(follower, marker) == {2, 3}, marker
    assert len(follower.wait_count(PLUGIN_RE, 2)) == 2  # the plugin loads in every worker of every node


def test_a_killed_follower_makes_the_head_exit_non_zero(start: Start) -> None:
    head, follower, _ = _group(start)
    head_workers = set(head.worker_pids().values())
    t_kill = time.monotonic()
    os.killpg(follower.pid, signal.SIGKILL)  # the node is gone: main process and workers
    assert head.wait_exit(10) == 1
    assert time.monotonic() - t_kill < 3.0
    assert any("ERROR: lost node_rank 1 (127.0.0.1:" in line and f"connection closed; {LOST}" in line
               for line in head.text()), head.text()
    assert wait_dead(head_workers, 3.0) == set()


def test_a_dying_follower_worker_takes_the_group_down(start: Start) -> None:
    dist = _dist()
    head = start(0, dist)
    follower = start(1, dist, env={"REFSERVER_DIE_RANK": "3"})
    assert follower.wait_exit(10) == 1
    follower.wait_for("ERROR: scheduler TP3")
    assert head.wait_exit(10) == 1
    head.wait_for("ERROR: lost node_rank 1 (127.0.0.1:")
    assert not any(READY in line for line in head.text())


def test_silence_counts_as_death_both_ways(start: Start) -> None:
    head, follower, _ = _group(start)
    os.kill(follower.pid, signal.SIGSTOP)  # a hung node: the connection stays open, the heartbeats stop
    try:
        assert head.wait_exit(refserver.HEARTBEAT_TIMEOUT + 5) == 1
        head.wait_for("ERROR: lost node_rank 1 (127.0.0.1:")
        assert any("no heartbeat for" in line for line in head.text())
    finally:
        os.kill(follower.pid, signal.SIGCONT)
    assert follower.wait_exit(5) == 1  # it wakes to a closed connection: the head is gone
    follower.wait_for("ERROR: lost the head (node_rank 0) at 127.0.0.1:")


def test_sigterm_to_the_follower_alone_waits_for_the_head(start: Start) -> None:
    head, follower, _ = _group(start)
    follower_workers = set(follower.worker_pids().values())
    os.kill(follower.pid, signal.SIGTERM)  # KillMode=mixed: the main process only
    follower.wait_for("SIGTERM received on node_rank 1; waiting for the rank-0 ShutdownReq broadcast to stop the "
                      "schedulers.")
    assert follower.request("GET", "/health")[0] == 200
    assert "Paris" in head.complete()["choices"][0]["text"]  # the group still serves
    assert follower.proc.poll() is None

    os.kill(head.pid, signal.SIGTERM)
    assert head.wait_exit(10) == 0
    assert follower.wait_exit(10) == 0
    head_log, follower_log = head.text(), follower.text()
    for line in ("Gracefully exiting... Remaining number of requests 0.", "Sending shutdown to 1 follower node(s)",
                 "Node 1 shut down", "Shutdown complete"):
        assert any(line in x for x in head_log), (line, head_log)
    after = follower_log[next(i for i, x in enumerate(follower_log) if "SIGTERM received on node_rank 1" in x):]
    assert [x.split("] ", 1)[1] for x in after[1:]] == [
        "Shutdown received from the head (node_rank 0): stopping the scheduler(s)", "Shutdown complete"]
    assert wait_dead(follower_workers, 3.0) == set()


def test_a_formed_group_refuses_a_late_join_and_a_restarted_follower(start: Start) -> None:
    head, follower, port = _group(start)
    dist = f"localhost:{port}"  # a hostname as dist-init-addr

    late = start(1, dist)  # a second node 1 while the group runs
    assert late.wait_exit(10) == 1
    late.wait_for(f"ERROR: the rendezvous at {dist} refused node_rank 1: the process group is already formed")
    head.wait_for("Refused node_rank 1 from ")
    assert "Paris" in head.complete()["choices"][0]["text"]  # the group is untouched
    assert head.proc.poll() is None and follower.proc.poll() is None

    os.killpg(follower.pid, signal.SIGKILL)  # node 1 restarted alone: the old member is gone for good
    restarted = start(1, dist, timeout=2)
    assert head.wait_exit(10) == 1
    assert restarted.wait_exit(10) == 1
    assert any(re.search(r"ERROR: (the rendezvous at .* refused node_rank 1|rendezvous at .* timed out|lost the head)",
                         line) for line in restarted.text()), restarted.text()
    assert not any("Started scheduler process" in line for line in restarted.text())


def test_a_group_that_does_not_form_times_out(start: Start) -> None:
    head = start(0, _dist(), timeout=1)
    follower = start(1, _dist(), timeout=1)  # another port: nobody listens there
    assert head.wait_exit(10) == 1
    assert follower.wait_exit(10) == 1
    head.wait_for("timed out after 1 s: 0 of 1 follower node(s) joined")
    follower.wait_for("timed out after 1 s: cannot connect (Connection refused)")
    assert not any("Started scheduler process" in line for line in head.text() + follower.text())


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "2"], "argument --dist-init-addr: required with --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank: 2 is not below --nnodes 2"),
    (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], "--tp-size: 3 is not divisible by --nnodes 2"),
    (["--nnodes", "0"], "argument --nnodes: invalid positive int value: '0'"),
    (["--node-rank", "-1"], "argument --node-rank: invalid non-negative int value: '-1'"),
    (["--dist-init-addr", "::1:5000"], "an IPv6 address must be bracketed ([::1]:5000)"),
    (["--dist-init-addr", "[fe80::zz]:5000"], "not an IPv6 address in brackets"),
    (["--dist-init-addr", "head-node"], "expected HOST:PORT: 'head-node'"),
    (["--dist-init-addr", "head-node:0"], "port must be 1-65535"),
    (["--dist-init-addr", "head node:5000"], "not a hostname or IPv4 address: 'head node'"),
    (["--nnodes", "2", "--tp", "2", "--dp", "2", "--dist-init-addr", "h:1"],
     "multi-node data-parallel replicas are not supported"),
])
def test_bad_multinode_flags_exit_2_with_one_line(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        refserver.parse_args(["--model-path", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kdeploy_refserver: error: ") and message in err, err


@pytest.mark.parametrize(("text", "parsed"), [
    ("10.0.0.2:25000", ("10.0.0.2", 25000)),
    ("[fd00::2]:25000", ("fd00::2", 25000)),
    ("gpu-head.example:25000", ("gpu-head.example", 25000)),
])
def test_dist_init_addr_forms(text: str, parsed: tuple[str, int]) -> None:
    args, _ = refserver.parse_args(["--model-path", "m", "--tp", "16", "--nnodes", "2", "--node-rank", "1",
                                    "--dist-init-addr", text])
    assert args.dist_init_addr == text  # as given, like SGLang's ServerArgs
    assert refserver.parse_dist_init_addr(text) == parsed
