"""Servers that span hosts in the inventory: what `servers:` accepts, refuses (file:line) and renders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdeploy.core import inventory, render
from kdeploy.core.errors import InvalidInput
from kdeploy.core.gatespec import gate_spec
from kdeploy.flows.session import overridden
from tests.unit.inventories import load, refused

BASE = """\
defaults:
  service:
    name: sglang
    python: /opt/venv/bin/python
    sglang: {model_path: /models/dsv3, tp: 16}
hosts:
  a0: {address: 10.0.0.1}
  a1: {address: 10.0.0.2}
  b0: {address: 10.0.0.3}
  b1: {address: 10.0.0.4}
"""
SERVERS = """\
servers:
  dsv3:
    nodes: [a0, a1]
    rendezvous_port: 20000
"""




def test_a_server_is_its_nodes_in_rank_order_and_a_plain_host_its_own_server(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE + SERVERS)
    dsv3 = inv.server_of("a1")
    assert (dsv3.name, dsv3.nodes, dsv3.head, dsv3.spans) == ("dsv3", ("a0", "a1"), "a0", True)
    assert dsv3.dist_init_addr == "10.0.0.1:20000"
    assert [s.name for s in inv.servers(inv.resolve("all"))] == ["dsv3", "b0", "b1"]
    alone = inv.server_of("b0")
    assert (alone.nodes, alone.spans, alone.place("b0").nnodes) == (("b0",), False, 1)
    assert inv.resolve("dsv3") == ["a0", "a1"]  # TARGET names servers too
    assert inv.resolve("dsv3:!a1") == ["a0"]


def test_the_unit_of_each_node_carries_its_rank_and_the_rendezvous(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE + SERVERS)
    argv = {h: render.launch_argv(inv.hosts[h].service, inv.server_of(h).place(h)) for h in inv.hosts}
    assert argv["a0"][-6:] == ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:20000"]
    assert argv["a1"][-6:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:20000"]
    assert "--nnodes" not in argv["b0"]
    assert "--tp-size 16" in " ".join(argv["a1"])  # the server's total
    unit = render.render_unit(inv, inv.hosts["a1"])
    assert "--node-rank 1 --dist-init-addr 10.0.0.1:20000" in unit


def test_an_ipv6_rendezvous_is_bracketed(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE + SERVERS + "    rendezvous_address: 'fd00::1'\n")
    assert inv.server_of("a0").dist_init_addr == "[fd00::1]:20000"


def test_each_node_is_gated_on_its_own_ranks_and_only_the_head_on_http(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE + SERVERS)
    head, follower, alone = (gate_spec(inv.hosts[h].service, None, place=inv.server_of(h).place(h))
                             for h in ("a0", "a1", "b0"))
    assert (head.workers, head.serves, follower.workers, follower.serves) == (8, True, 8, False)
    assert (alone.workers, alone.serves) == (16, True)
    assert overridden(follower, 32, None).workers == 16  # --workers counts the server's
    with pytest.raises(InvalidInput, match="--workers 15 is not divisible by the server's 2 nodes"):
        overridden(follower, 15, None)


def test_a_restart_of_part_of_a_server_is_refused_naming_it(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE + SERVERS)
    assert inv.whole(["a0", "a1", "b0"], "push") == ["a0", "a1", "b0"]
    with pytest.raises(InvalidInput, match=r"push: TARGET selects a1 of server dsv3 \(nodes a0, a1\)"):
        inv.whole(inv.resolve("a1,b0"), "push")


@pytest.mark.parametrize(("extra", "error"), [
    ("servers:\n  dsv3:\n    nodes: [a0, a1]\n", r":12: servers\.dsv3: rendezvous_port is required"),
    ("servers:\n  dsv3:\n    nodes: [a0, zz]\n    rendezvous_port: 20000\n",
     r":13: servers\.dsv3\.nodes: unknown host 'zz'"),
    ("servers:\n  x:\n    nodes: [a0, a1]\n    rendezvous_port: 20000\n  y:\n    nodes: [a1, b0]\n"
     "    rendezvous_port: 20001\n", r":16: servers\.y\.nodes: a1 is a node of server x already"),
    ("servers:\n  x:\n    nodes: [a0, a1]\n    rendezvous_port: 20000\n  y:\n    nodes: [b0, b1]\n"
     "    rendezvous_port: 20000\n    rendezvous_address: 10.0.0.1\n",
     r":17: servers\.y\.rendezvous_port: 10\.0\.0\.1:20000 is the rendezvous of server x too"),
    ("servers:\n  x:\n    nodes: [a0, a1]\n    rendezvous_port: 30000\n",
     r":14: servers\.x\.rendezvous_port: 30000 is the head's service\.sglang\.port"),
    ("servers:\n  a0:\n    nodes: [a0, a1]\n    rendezvous_port: 20000\n", r"server cannot be named like a host"),
    ("servers:\n  x:\n    nodes: []\n    rendezvous_port: 20000\n", r"servers\.x\.nodes: .*at least 1 item"),
    ("servers:\n  x:\n    nodes: [a0, a1]\n    rendezvous_prot: 20000\n",
     r"servers\.x\.rendezvous_prot: unknown key \(did you mean 'rendezvous_port'\?\)"),
    ("servers:\n  x:\n    nodes: [a0, a1, b0]\n    rendezvous_port: 20000\n",
     r"servers\.x\.nodes: service\.sglang\.tp 16 is not divisible by 3 nodes"),
])
def test_servers_the_inventory_refuses(tmp_path: Path, extra: str, error: str) -> None:
    message = refused(tmp_path, BASE + extra)  # `servers:` is line 11
    assert len(message.splitlines()) == 1
    assert re.search(error, message), message


def test_nodes_that_differ_where_they_must_agree_arerefused(tmp_path: Path) -> None:
    text = BASE.replace("  a1: {address: 10.0.0.2}", "  a1: {address: 10.0.0.2, service: {env: {X: '1'}}}")
    message = refused(tmp_path, text + SERVERS)
    assert "servers.dsv3.nodes: a1 differs from the head a0 in service.env" in message
    model = BASE.replace("  a1: {address: 10.0.0.2}",
                         "  a1: {address: 10.0.0.2, service: {sglang: {model_path: /models/other}}}")
    assert "in service.sglang" in refused(tmp_path, model + SERVERS)
    # the bind address is each node's own
    bind = BASE.replace("  a1: {address: 10.0.0.2}", "  a1: {address: 10.0.0.2, service: {sglang: {host: 0.0.0.0}}}")
    assert load(tmp_path, bind + SERVERS).server_of("a1").spans


def test_a_followers_marker_wait_ends_with_its_heads_grace_or_a_peers_failure() -> None:
    from kdeploy.core.report import PhaseFailed
    from kdeploy.host.gate import MARKER_GRACE, Peers

    peers = Peers()
    assert peers.marker_deadline(1000.0) == 1000.0  # the head is not ready yet: the gate's own deadline
    peers.ready_at = 10.0
    assert peers.marker_deadline(1000.0) == 10.0 + MARKER_GRACE
    assert peers.marker_deadline(12.0) == 12.0
    peers.failed.set()
    with pytest.raises(PhaseFailed, match="another node of the server failed its gate"):
        peers.marker_deadline(1000.0)


def test_on_each_runs_every_node_to_its_end_and_raises_a_lost_link_before_a_failed_phase() -> None:
    import threading
    from types import SimpleNamespace

    from kdeploy.core.errors import Unreachable
    from kdeploy.core.report import PhaseFailed
    from kdeploy.flows.switch import on_each

    nodes = [SimpleNamespace(host=SimpleNamespace(name=n)) for n in ("a0", "a1", "a2")]
    ran: list[str] = []
    lock = threading.Lock()

    def step(node):  # type: ignore[no-untyped-def]
        with lock:
            ran.append(node.host.name)
        if node.host.name == "a0":
            raise PhaseFailed("markers missing")
        if node.host.name == "a2":
            raise Unreachable("a2: connection lost")
        return node.host.name

    with pytest.raises(Unreachable):
        on_each(nodes, step)  # type: ignore[arg-type]
    assert sorted(ran) == ["a0", "a1", "a2"]
    with pytest.raises(PhaseFailed, match=r"^a0: markers missing$"):
        on_each(nodes[:2], step)  # type: ignore[arg-type]
    assert on_each(nodes[1:2], step) == ["a1"]  # type: ignore[arg-type]


def test_the_example_inventories_of_docs_topologies_load_and_render(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "topologies.md").read_text()
    examples = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    assert len(examples) == 2
    dsv3, pd = (load(tmp_path, example) for example in examples)
    assert [s.nodes for s in dsv3.spanning.values()] == [("gpu-a0", "gpu-a1"), ("gpu-b0", "gpu-b1")]
    assert "--node-rank 1 --dist-init-addr 10.1.0.10:20000" in " ".join(
        render.launch_argv(dsv3.hosts["gpu-a1"].service, dsv3.server_of("gpu-a1").place("gpu-a1")))
    assert {h: pd.hosts[h].service.role for h in pd.hosts} == {
        "pf-a0": "prefill", "pf-a1": "prefill", "pf-b": "prefill", "dc-a": "decode", "dc-b": "decode"}
    assert pd.server_of("pf-a1").head == "pf-a0"


def test_an_ansible_inventorys_servers_live_in_the_service_file(tmp_path: Path) -> None:
    (tmp_path / "hosts.ini").write_text("[gpu]\na0 ansible_host=10.0.0.1\na1 ansible_host=10.0.0.2\nb0\n")
    service = ("service:\n  name: sglang\n  python: /opt/venv/bin/python\n"
               "  sglang: {model_path: /models/dsv3, tp: 16}\n"
               "servers:\n  dsv3:\n    nodes: [a0, a1]\n    rendezvous_port: 20000\n")
    (tmp_path / "service.yaml").write_text(service)
    inv = inventory.load(tmp_path / "hosts.ini", tmp_path / "service.yaml")
    assert inv.server_of("a1").dist_init_addr == "10.0.0.1:20000" and inv.resolve("dsv3") == ["a0", "a1"]
    (tmp_path / "service.yaml").write_text(service.replace("[a0, a1]", "[a0, zz]"))
    with pytest.raises(InvalidInput, match=r"service\.yaml:7: servers\.dsv3\.nodes: unknown host 'zz'"):
        inventory.load(tmp_path / "hosts.ini", tmp_path / "service.yaml")


def test_every_restarting_command_takes_whole_servers_and_counts_servers(tmp_path: Path) -> None:
    """``check_rollout`` is what push, rollback and set-env/set call first: a set-env whose --limit leaves
    part of a server (the hosts it changes, limited) is refused as a push of part of it is, and a canary counts
    servers, not hosts."""
    from kdeploy.core.policy import Policy
    from kdeploy.flows.fleet import check_rollout

    inv = load(tmp_path, BASE + SERVERS)
    check_rollout(inv, ["a0", "a1", "b0"], "push", Policy(canary=2))
    with pytest.raises(InvalidInput, match=r"^set-env: TARGET selects a1 of server dsv3 \(nodes a0, a1\)"):
        check_rollout(inv, ["a1"], "set-env", Policy())
    with pytest.raises(InvalidInput, match=r"--canary 2: only 1 host selected"):
        check_rollout(inv, ["a0", "a1"], "push", Policy(canary=2))
