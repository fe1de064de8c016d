"""`kdeploy sandbox up --nodes-per-server K`: the inventory of servers that span hosts, written without booting any
(a sandbox state dir with only its meta.json is enough for write_inventory)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kdeploy_lab import sandbox_router
from kdeploy_lab.demo import demo_service, light_service
from kdeploy_lab.sandbox import RENDEZVOUS_PORT, Sandbox, SandboxError


def _box(root: Path, hosts: int, **meta: object) -> Sandbox:
    """A sandbox that looks up (its meta.json) with ``hosts`` hosts; nothing runs."""
    (root / "8").mkdir(parents=True)
    (root / "8" / "meta.json").write_text(json.dumps({"hosts": hosts, "instance": 8, "sglang": None, **meta}))
    return Sandbox(root, instance=8)


def _write(box: Sandbox, path: Path, service: dict, nodes_per_server: int = 1) -> tuple[str, dict]:
    box.write_inventory(path, service, nodes_per_server)
    text = path.read_text()
    return text, YAML(typ="safe").load(text)


def test_two_nodes_per_server_groups_the_hosts_in_order_and_doubles_tp(tmp_path: Path) -> None:
    box = _box(tmp_path, 4)
    service = light_service()
    before = copy.deepcopy(service)
    text, doc = _write(box, tmp_path / "inv.yaml", service, 2)
    assert doc["servers"] == {"s1": {"nodes": ["h1", "h2"], "rendezvous_port": RENDEZVOUS_PORT},
                              "s2": {"nodes": ["h3", "h4"], "rendezvous_port": RENDEZVOUS_PORT}}
    assert RENDEZVOUS_PORT == 29500
    assert "nodes: [h1, h2]" in text and "nodes: [h3, h4]" in text
    assert doc["defaults"]["service"]["sglang"]["tp"] == 2
    assert doc["defaults"]["service"]["gate"]["workers"] == 2  # the server's: one per node, as a one-host server
    assert service == before  # the caller's service is not changed
    assert doc["groups"] == {"sandbox": {"hosts": ["h1", "h2", "h3", "h4"]}}
    # everything but tp and the new section is what one-node servers get
    _, single = _write(box, tmp_path / "single.yaml", service)
    assert "servers" not in single and single["defaults"]["service"]["sglang"]["tp"] == 1
    doc["defaults"]["service"]["sglang"]["tp"] = 1
    doc["defaults"]["service"]["gate"]["workers"] = 1
    del doc["servers"]
    assert doc == single


def test_the_demo_service_spans_tp8_per_node(tmp_path: Path) -> None:
    _, doc = _write(_box(tmp_path, 3), tmp_path / "inv.yaml", demo_service(sglang=False), 3)
    assert doc["servers"] == {"s1": {"nodes": ["h1", "h2", "h3"], "rendezvous_port": RENDEZVOUS_PORT}}
    assert doc["defaults"]["service"]["sglang"]["tp"] == 24
    assert doc["defaults"]["service"]["gate"]["workers"] == 24  # the server's: 8 on each node


def test_one_node_per_server_is_the_inventory_of_before(tmp_path: Path) -> None:
    box = _box(tmp_path, 2)
    box.write_inventory(tmp_path / "default.yaml", light_service())
    box.write_inventory(tmp_path / "one.yaml", light_service(), nodes_per_server=1)
    assert (tmp_path / "default.yaml").read_bytes() == (tmp_path / "one.yaml").read_bytes()
    assert "servers" not in (tmp_path / "one.yaml").read_text()


def test_the_bastion_is_no_node(tmp_path: Path) -> None:
    _, doc = _write(_box(tmp_path, 3, bastion=3), tmp_path / "inv.yaml", light_service(), 2)
    assert doc["servers"] == {"s1": {"nodes": ["h1", "h2"], "rendezvous_port": RENDEZVOUS_PORT}}


@pytest.mark.parametrize(("hosts", "nodes", "message"), [
    (3, 2, r"^3 sandbox hosts do not split into servers of 2 nodes"),
    (2, 0, r"^nodes per server must be a positive integer, got 0$"),
    (2, True, r"^nodes per server must be a positive integer, got True$"),
])
def test_hosts_that_do_not_split_are_refused(tmp_path: Path, hosts: int, nodes: int, message: str) -> None:
    with pytest.raises(SandboxError, match=message) as err:
        _box(tmp_path, hosts).write_inventory(tmp_path / "inv.yaml", light_service(), nodes)
    assert err.value.exit_code == 2
    assert not (tmp_path / "inv.yaml").exists()


def test_with_the_router_the_router_host_is_no_node(tmp_path: Path) -> None:
    box = _box(tmp_path, 5)
    router_host = box.hosts()[-1]
    path = tmp_path / "inv.yaml"
    sandbox_router.write_inventory(box, path, light_service(), router_host, "http://10.213.8.15:30080", 2)
    text = path.read_text()
    doc = YAML(typ="safe").load(text)
    assert doc["servers"] == {"s1": {"nodes": ["h1", "h2"], "rendezvous_port": RENDEZVOUS_PORT},
                              "s2": {"nodes": ["h3", "h4"], "rendezvous_port": RENDEZVOUS_PORT}}
    assert "nodes: [h1, h2]" in text
    assert "h5" not in doc["hosts"] and doc["groups"]["sandbox"]["hosts"] == ["h1", "h2", "h3", "h4"]
    sglang = doc["defaults"]["service"]["sglang"]
    assert (sglang["tp"], sglang["host"], sglang["extra_args"]) == (2, "0.0.0.0", ["--enable-metrics"])
    assert doc["defaults"]["router"] == {"url": "http://10.213.8.15:30080", "drain_timeout": 120}
    # one node per server: the router inventory of before
    sandbox_router.write_inventory(box, tmp_path / "one.yaml", light_service(), router_host, "http://x:1")
    assert "servers" not in (tmp_path / "one.yaml").read_text()


@pytest.mark.parametrize(("hosts", "nodes", "prefill", "decode"), [
    (4, 1, ["h1", "h2"], ["h3", "h4"]),
    (3, 1, ["h1", "h2"], ["h3"]),
    (6, 2, ["h1", "h2", "h3", "h4"], ["h5", "h6"]),  # 3 servers of 2 nodes: 2 prefill, 1 decode
])
def test_pd_splits_the_servers_into_prefill_and_decode_behind_a_pd_router(tmp_path: Path, hosts: int, nodes: int,
                                                                          prefill: list[str],
                                                                          decode: list[str]) -> None:
    from kdeploy.core import inventory

    box = _box(tmp_path, hosts + 1)
    path = tmp_path / "inv.yaml"
    router_host = box.hosts()[-1]
    sandbox_router.write_inventory(box, path, light_service(), router_host, "http://10.213.8.99:30080", nodes,
                                   pd=True)
    doc = YAML(typ="safe").load(path.read_text())
    assert doc["defaults"]["router"]["mode"] == "pd"
    assert doc["groups"]["prefill"]["hosts"] == prefill and doc["groups"]["decode"]["hosts"] == decode
    loaded = inventory.load(path)  # a PD fleet kdeploy accepts: both roles, a PD router, a bootstrap port
    assert {h.service.role for h in loaded.hosts.values()} == {"prefill", "decode"}
    assert loaded.hosts[prefill[0]].service.sglang.disaggregation.bootstrap_port == sandbox_router.BOOTSTRAP_PORT


def test_pd_needs_two_servers(tmp_path: Path) -> None:
    box = _box(tmp_path, 3)
    with pytest.raises(SandboxError, match="--pd needs two servers at least"):
        sandbox_router.write_inventory(box, tmp_path / "inv.yaml", light_service(), box.hosts()[-1],
                                       "http://10.213.8.99:30080", 2, pd=True)
