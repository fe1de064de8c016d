"""Prefill/decode roles in the inventory: the flags each role's unit gets, and the fleets `check` refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdeploy.core import render
from tests.unit.inventories import load, refused

BASE = """\
defaults:
  service:
    name: sglang
    python: /opt/venv/bin/python
    sglang: {model_path: /models/dsv3, tp: 8}
  router: {url: 'http://10.0.0.100:30000', mode: pd}
groups:
  prefill:
    hosts: [p0, p1]
    service:
      sglang:
        disaggregation: {mode: prefill, bootstrap_port: 8998, ib_device: mlx5_0}
  decode:
    hosts: [d0]
    service:
      sglang:
        disaggregation: {mode: decode}
hosts:
  p0: {address: 10.0.0.1}
  p1: {address: 10.0.0.2}
  d0: {address: 10.0.0.3}
"""




def test_each_role_gets_its_disaggregation_flags(tmp_path: Path) -> None:
    inv = load(tmp_path, BASE)
    assert {h: inv.hosts[h].service.role for h in inv.hosts} == {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    prefill = " ".join(render.launch_argv(inv.hosts["p0"].service))
    assert ("--disaggregation-mode prefill --disaggregation-transfer-backend mooncake "
            "--disaggregation-bootstrap-port 8998 --disaggregation-ib-device mlx5_0") in prefill
    decode = render.launch_argv(inv.hosts["d0"].service)
    assert decode[-4:] == ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    unified = BASE.replace("  router: {url: 'http://10.0.0.100:30000', mode: pd}\n", "")
    unified = re.sub(r"groups:.*?hosts:\n", "hosts:\n", unified, flags=re.DOTALL)
    assert "--disaggregation" not in " ".join(render.launch_argv(load(tmp_path, unified).hosts["p0"].service))


@pytest.mark.parametrize(("change", "error"), [
    # a PD fleet without decode servers
    (lambda t: t.replace("disaggregation: {mode: decode}", "disaggregation: {mode: prefill, bootstrap_port: 9000}"),
     r"a prefill/decode fleet behind http://10\.0\.0\.100:30000 without a decode server \(p0, p1, d0\)"),
    # a prefill server without its bootstrap port
    (lambda t: t.replace("mode: prefill, bootstrap_port: 8998, ", "mode: prefill, "),
     r"groups\.prefill\.service\.sglang\.disaggregation: a prefill server needs bootstrap_port"),
    # SGLang's prefill refuses the fake transfer backend
    (lambda t: t.replace("ib_device: mlx5_0", "transfer_backend: fake"),
     r"transfer_backend fake: SGLang's prefill server does not support it"),
    # the bootstrap port on the server's own port
    (lambda t: t.replace("bootstrap_port: 8998", "bootstrap_port: 30000"),
     r"bootstrap_port 30000 is the server's own sglang\.port"),
    # the router is not in PD mode
    (lambda t: t.replace(", mode: pd}", "}"),
     r":6: defaults\.router: p0: a prefill server behind router http://10\.0\.0\.100:30000: it is not in PD mode"),
    # a unified server behind a PD router
    (lambda t: t.replace("  d0: {address: 10.0.0.3}", "  d0: {address: 10.0.0.3}\n  u0: {address: 10.0.0.4}"),
     r"u0: a unified server behind router http://10\.0\.0\.100:30000: it is in PD mode"),
    (lambda t: t.replace("mode: decode", "mode: both"), r"invalid value 'both': expected one of 'prefill' or 'decode'"),
])
def test_prefill_decode_fleets_the_inventory_refuses(tmp_path: Path, change, error: str) -> None:  # type: ignore[no-untyped-def]
    message = refused(tmp_path, change(BASE))
    assert re.search(error, message), message


def test_servers_without_a_router_form_one_fleet(tmp_path: Path) -> None:
    no_router = BASE.replace("  router: {url: 'http://10.0.0.100:30000', mode: pd}\n", "")
    assert load(tmp_path, no_router).hosts["d0"].service.role == "decode"
    only_prefill = no_router.replace("disaggregation: {mode: decode}", "{}")
    assert "a prefill/decode fleet without a decode server" in refused(tmp_path, only_prefill)


def test_a_pd_server_registers_with_its_role_and_counts_as_in_only_so(tmp_path: Path) -> None:
    from kdeploy.host.router import Worker, registration

    inv = load(tmp_path, BASE)
    prefill, decode = inv.hosts["p0"], inv.hosts["d0"]
    body = registration(prefill)
    assert body == {"url": "http://10.0.0.1:30000", "worker_type": "prefill", "bootstrap_port": 8998}
    assert registration(decode) == {"url": "http://10.0.0.3:30000", "worker_type": "decode"}
    assert Worker("1", "http://10.0.0.1:30000", True, 0, "prefill", 8998).registered_as(body)
    assert not Worker("1", "http://10.0.0.1:30000", True, 0, "regular", None).registered_as(body)
    assert not Worker("1", "http://10.0.0.1:30000", True, 0, "prefill", 9000).registered_as(body)


class _Http:
    """A server's HTTP as the gate sees it: records what it was sent, answers what it is told."""

    def __init__(self, answer: tuple[int | None, str]) -> None:
        self.answer, self.sent = answer, []

    def status(self, path: str) -> int:
        return 200

    def post_json(self, path: str, body: dict, *, timeout: float) -> tuple[int | None, str]:
        self.sent.append(body)
        return self.answer


def test_a_pd_servers_gate_goes_through_its_pair_as_the_router_sends_requests() -> None:
    from kdeploy.host.pair import PairedHttp, Pairing

    decode, prefill = _Http((200, '{"choices": [{"text": " Paris."}]}')), _Http((200, '{"choices": [{"text": " P"}]}'))
    paired = PairedHttp(decode, Pairing("pf-a0", prefill, "decode", "10.1.0.10", 8998))  # type: ignore[arg-type]
    assert paired.post_json("/v1/completions", {"prompt": "The capital of France is"}, timeout=5) == decode.answer
    assert decode.sent == prefill.sent  # the same body to both, as the router does
    body = decode.sent[0]
    assert (body["bootstrap_host"], body["bootstrap_port"]) == ("10.1.0.10", 8998)
    assert 0 <= body["bootstrap_room"] < 2**63
    paired.post_json("/v1/completions", {"prompt": "x"}, timeout=5)
    assert decode.sent[1]["bootstrap_room"] != body["bootstrap_room"]  # a room per request

    broken = _Http((500, "Prefill bootstrap failed"))
    status, text = PairedHttp(decode, Pairing("pf-a0", broken, "decode", "10.1.0.10", 8998)).post_json(  # type: ignore[arg-type]
        "/v1/completions", {"prompt": "x"}, timeout=5)
    assert (status, text) == (500, "prefill pf-a0 answered 500: Prefill bootstrap failed")

    handshake = _Http((500, "Decode handshake failed for request rank=0"))  # the server under test is a prefill
    status, text = PairedHttp(prefill, Pairing("dc-a", handshake, "prefill", "10.1.0.10", 8998)).post_json(  # type: ignore[arg-type]
        "/v1/completions", {"prompt": "x"}, timeout=5)
    assert (status, text) == (500, "decode dc-a answered 500: Decode handshake failed for request rank=0")


def test_a_pd_server_is_gated_through_a_server_of_the_other_role_behind_its_router(tmp_path: Path) -> None:
    from kdeploy.flows.pairing import bootstrap_host, partners

    inv = load(tmp_path, BASE)
    assert partners(inv, inv.hosts["p0"], None) == ["d0"]
    assert partners(inv, inv.hosts["d0"], None) == ["p0", "p1"]
    assert partners(inv, inv.hosts["d0"], {"http://10.0.0.2:30000"}) == ["p1"]  # the router lists p1 serving
    assert partners(inv, inv.hosts["d0"], set()) == []
    assert bootstrap_host(inv.hosts["p1"]) == "10.0.0.2"


def test_a_pd_canary_is_compared_with_servers_of_its_own_role(tmp_path: Path) -> None:
    from kdeploy.flows.canary import baseline_of

    inv = load(tmp_path, BASE)
    assert baseline_of(inv, ["p0"], ["d0", "p1"]) == (["p1"], None)
    baseline, why = baseline_of(inv, ["d0"], ["p0", "p1"])
    assert baseline == [] and why is not None and why.startswith("no baseline")
    baseline, why = baseline_of(inv, ["p0", "d0"], ["p1"])
    assert baseline == [] and why is not None and "a canary of servers of several roles (decode, prefill)" in why


def test_reports_name_each_hosts_role_and_server(tmp_path: Path) -> None:
    from kdeploy.cli import progress, schema

    text = BASE + "servers:\n  pf:\n    nodes: [p0, p1]\n    rendezvous_port: 20000\n"
    inv = load(tmp_path, text.replace("sglang: {model_path: /models/dsv3, tp: 8}",
                                       "sglang: {model_path: /models/dsv3, tp: 8, host: 0.0.0.0}"))
    follower, decode = inv.result("p1").finish("deployed"), inv.result("d0").finish("deployed")
    assert progress.host_name(follower) == "p1 (pf node 1, prefill)" and progress.host_name(decode) == "d0 (decode)"
    doc = follower.as_json()
    assert doc["role"] == "prefill" and doc["server"] == {"name": "pf", "node_rank": 1, "nodes": ["p0", "p1"]}
    schema.HostDoc.model_validate(doc)
    assert "role" not in load(tmp_path, BASE.replace("  router: {url: 'http://10.0.0.100:30000', mode: pd}\n", "")
                               .replace("disaggregation: {mode: prefill, bootstrap_port: 8998, ib_device: mlx5_0}",
                                        "{}").replace("disaggregation: {mode: decode}", "{}")).result("p0").as_json()


def test_a_side_that_fails_ends_the_pair_without_waiting_for_its_peer() -> None:
    """A decode that cannot fetch the KV answers 500 while its prefill waits for it (SGLang: up to 300 s): the
    gate's pair request ends with the decode's answer, the prefill left waiting is not waited for."""
    import threading

    from kdeploy.host.pair import PairedHttp, Pairing

    release = threading.Event()

    class _Waiting(_Http):
        def post_json(self, path: str, body: dict, *, timeout: float) -> tuple[int | None, str]:
            release.wait(30)
            return 200, "{}"

    failing = _Http((500, "Decode handshake failed for request rank=0"))
    paired = PairedHttp(failing, Pairing("pf-a0", _Waiting((200, "")), "decode", "10.1.0.10", 8998))  # type: ignore[arg-type]
    try:
        assert paired.post_json("/v1/completions", {"prompt": "x"}, timeout=60) == failing.answer
        assert not release.is_set()  # answered while the prefill still waited
    finally:
        release.set()
