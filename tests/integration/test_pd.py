"""A prefill/decode fleet on sandbox hosts behind the real sglang-router 0.3.2 in PD mode: h1, h2 prefill and
h3, h4 decode reference servers with a real bootstrap handshake over TCP, under the project's traffic client.

Each test checks, from the router's own ``/workers`` while it runs, that no role is ever empty, and that the
clients lost no request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kdeploy_lab import router_env
from kdeploy_lab.traffic import Traffic
from tests.conftest import TEST_MARKER, Deployment
from tests.integration.test_router import _free_port

pytestmark = pytest.mark.hosts(4)
PREFILL, DECODE = ("h1", "h2"), ("h3", "h4")
BOOTSTRAP = 8998


@dataclass
class Fleet:
    dep: Deployment
    url: str
    seen: list[dict[str, int]] = field(default_factory=list)  # healthy workers per role, as the router listed them

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def roles(self) -> dict[str, int]:
        out = {"prefill": 0, "decode": 0}
        for w in self.workers():
            if w["is_healthy"] and w["worker_type"] in out:
                out[w["worker_type"]] += 1
        return out

    @contextmanager
    def watched(self) -> Iterator[None]:
        """The router's /workers read every 0.1 s meanwhile (into ``seen``)."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                self.seen.append(self.roles())
                time.sleep(0.1)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)

    def releases(self) -> dict[str, str]:
        return {h: self.dep.current(h) for h in (*PREFILL, *DECODE)}


@pytest.fixture
def pd(deployment: Deployment, tmp_path: Path) -> Iterator[Fleet]:
    """Two prefill and two decode servers, first deployed without a router, then registered by role in a PD
    router started here (the hosts reach it at this machine's bridge address)."""
    def roles(doc: dict) -> None:
        service = doc["defaults"]["service"]
        service["sglang"].update(host="0.0.0.0", extra_args=["--enable-metrics"])
        service["env"] = {"REFSERVER_TOKEN_DELAY": "0.02", "REFSERVER_SHUTDOWN_POLL": "1"}
        service["gate"] = {"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": 60}
        doc["groups"] = {
            "test": {"hosts": [*PREFILL, *DECODE]},
            "prefill": {"hosts": list(PREFILL), "service": {"sglang": {"disaggregation": {
                "mode": "prefill", "bootstrap_port": BOOTSTRAP}}}},
            "decode": {"hosts": list(DECODE), "service": {"sglang": {"disaggregation": {"mode": "decode"}}}}}
    deployment.edit(roles)
    assert deployment.kdeploy("push", "test") == 0  # the first deploy: each server alone, then through pairs
    gateway = deployment.fleet.gateway
    port = _free_port()
    url = f"http://{gateway}:{port}"
    argv = router_env.router_argv(router_env.ensure_venv(), gateway, port, [], health_interval=1,
                                  health_failures=1, prometheus_port=_free_port(), pd=True)
    with router_env.running(argv, url, tmp_path / "router.log"):
        deployment.edit(lambda doc: doc["defaults"].update(router={"url": url, "drain_timeout": 30, "mode": "pd"}))
        assert deployment.kdeploy("router", "admit", "test") == 0
        fleet = Fleet(deployment, url)
        assert fleet.roles() == {"prefill": 2, "decode": 2}
        yield fleet


def test_push_set_env_on_decode_and_rollback_lose_no_request_and_never_empty_a_role(
        pd: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    dep = pd.dep
    listed = {w["url"]: (w["worker_type"], w.get("bootstrap_port")) for w in pd.workers()}
    hosts = dep.load().hosts
    assert listed[hosts["h1"].worker_url] == ("prefill", BOOTSTRAP) and listed[hosts["h3"].worker_url] == ("decode",
                                                                                                          None)
    with pd.watched(), Traffic(pd.url, threads=4, tokens=8) as traffic:
        (dep.payload / "rev.txt").write_text("2")
        code, doc = dep.json(capsys, "push", "test", "--batch", "1")
        assert code == 0, doc
        completion = {h["host"]: next(p["detail"] for p in h["phases"] if p["name"] == "completion")
                      for h in doc["hosts"]}
        assert all("through a pair with" in d for d in completion.values()), completion
        assert {h["host"]: h["router"] for h in doc["hosts"]} == dict.fromkeys([*PREFILL, *DECODE], "in")
        before = pd.releases()

        code, doc = dep.json(capsys, "set-env", "KDTREE_DEFRAG_SORT=1", "--target", "decode")
        assert code == 0, doc
        assert sorted(h["host"] for h in doc["hosts"]) == list(DECODE)  # the decode role only
        after = pd.releases()
        assert [h for h in after if after[h] != before[h]] == list(DECODE)

        code, doc = dep.json(capsys, "rollback", "decode")
        assert code == 0, doc
        assert pd.releases() == before
        time.sleep(1)
    assert set(traffic.codes) == {200} and traffic.codes[200] > 50, traffic.codes
    assert pd.seen and min(s["prefill"] for s in pd.seen) >= 1 and min(s["decode"] for s in pd.seen) >= 1, pd.seen
    assert min(s["prefill"] for s in pd.seen) == 1 and min(s["decode"] for s in pd.seen) == 1  # one out at a time


def test_a_plan_that_empties_a_role_is_refused_and_a_bad_decode_or_prefill_is_rolled_back_alone(
        pd: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    """Three faults on one fleet: a batch that would take both prefill servers out is refused before anything
    changes (exit 7); a decode whose kernel perturbs logits is caught by parity through its pair, and a prefill
    whose bootstrap port never answers fails its gate (exit 4 each), each rolled back, the rest untouched."""
    dep = pd.dep
    before = pd.releases()
    (dep.payload / "rev.txt").write_text("3")
    code, doc = dep.json(capsys, "push", "test", "--batch", "3")  # roles take turns: p, d, p: no prefill left
    assert code == 7, doc
    assert "only 2 healthy prefill server(s) in the router: a batch of 2 would leave none serving" in \
        doc["hosts"][0]["error"], doc["hosts"][0]
    assert pd.releases() == before
    (dep.payload / "rev.txt").unlink()

    code, doc = dep.json(capsys, "set-env", "REFSERVER_LOGIT_NOISE=1.5", "--target", "h4")
    assert code == 4, doc
    h4 = next(h for h in doc["hosts"] if h["host"] == "h4")
    failed = next(p for p in h4["phases"] if not p["ok"])
    assert h4["result"] == "rolled_back" and failed["name"] == "parity", h4
    assert pd.releases() == before  # h4 back, the rest never touched
    assert pd.roles() == {"prefill": 2, "decode": 2}

    code, doc = dep.json(capsys, "set-env", "REFSERVER_BOOTSTRAP_DOWN=1", "--target", "h1")
    assert code == 4, doc
    h1 = next(h for h in doc["hosts"] if h["host"] == "h1")
    failed = next(p for p in h1["phases"] if not p["ok"])
    assert h1["result"] == "rolled_back" and failed["name"] == "completion", h1
    assert "Decode handshake failed" in failed["detail"], failed
    assert pd.releases() == before
    assert pd.roles() == {"prefill": 2, "decode": 2}


def test_sandbox_pd_router_and_a_first_push_register_each_server_with_its_role(
        deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sandbox up --pd`'s pieces on the fleet's last host: the router as a unit there in PD mode, an inventory
    whose first half of servers are prefill and the rest decode, and a first push that gates each server (the
    first alone, the next through a pair) and registers it with its role."""
    import json

    from ruamel.yaml import YAML

    from kdeploy_lab import sandbox_router

    box = deployment.fleet
    router_host = box.hosts()[-1]
    url = sandbox_router.install(box, router_host, pd=True)
    try:
        path = tmp_path / "pd.yaml"
        service = YAML().load(deployment.path.read_text())["defaults"]["service"]
        sandbox_router.write_inventory(box, path, json.loads(json.dumps(service)), router_host, url, pd=True)
        doc = YAML().load(path.read_text())
        names = [h.name for h in box.hosts()[:-1]]
        half = (len(names) + 1) // 2
        assert doc["defaults"]["router"] == {"url": url, "drain_timeout": 120, "mode": "pd"}
        assert doc["groups"]["prefill"]["hosts"] == names[:half] and doc["groups"]["decode"]["hosts"] == names[half:]
        assert doc["groups"]["prefill"]["service"]["sglang"]["disaggregation"] == {
            "mode": "prefill", "bootstrap_port": sandbox_router.BOOTSTRAP_PORT}
        doc["hosts"] = {h: v for h, v in doc["hosts"].items() if h in {"h1", "h5"}}  # one prefill, one decode
        doc["groups"] = {"test": {"hosts": ["h1", "h5"]},
                         "prefill": {**doc["groups"]["prefill"], "hosts": ["h1"]},
                         "decode": {**doc["groups"]["decode"], "hosts": ["h5"]}}
        with path.open("w") as fh:
            YAML().dump(doc, fh)
        routed = Deployment(box, path, deployment.payload, deployment.service, ["h1", "h5"], deployment.port)
        try:
            code, out = routed.json(capsys, "push", "test", "--router-add-missing")
            assert code == 0, out
            completion = {h["host"]: next(p["detail"] for p in h["phases"] if p["name"] == "completion")
                          for h in out["hosts"]}
            assert "answered alone through SGLang's fake bootstrap host" in completion["h1"], completion
            assert completion["h5"].endswith("through a pair with h1"), completion
            listed = {w["url"]: (w["worker_type"], w.get("bootstrap_port"), w["is_healthy"])
                      for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]}
            hosts = routed.load().hosts
            assert listed == {hosts["h1"].worker_url: ("prefill", sandbox_router.BOOTSTRAP_PORT, True),
                              hosts["h5"].worker_url: ("decode", None, True)}
            answer = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                                "max_tokens": 4, "temperature": 0}, timeout=30)
            assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"]
        finally:
            for host in ("h5",):  # h1 is the deployment's own: its fixture cleans it
                box.exec(host, ["sh", "-c", f"systemctl disable --now {deployment.service} 2>/dev/null; "
                                            f"rm -rf /etc/systemd/system/{deployment.service}.service "
                                            f"/srv/kdeploy/{deployment.service}"], check=False)
    finally:
        box.exec(router_host.name, ["sh", "-c", f"systemctl disable --now {sandbox_router.UNIT}; rm -f "
                                                f"/etc/systemd/system/{sandbox_router.UNIT}.service; "
                                                f"rm -rf {sandbox_router.HOST_DIR}"], check=False)
