"""Canary analysis (issue 29) on sandbox hosts behind the real SGLang router, with traffic sent through the router
during the window: a slower canary and one that fails 1% of its requests are rolled back and the other hosts
keep their release; a good canary (set-env) is promoted and the rollout goes on; no router refuses (exit 7).

Each generated token takes 0.14 s, so a request's time to first token is about 0.14 s, inside SGLang's TTFT
bucket (0.1, 0.2]: +50% (REFSERVER_LATENCY=0.07, 0.21 s) lands in the next bucket, (0.2, 0.4], where a p99
estimated from buckets can see it (docs/gate.md, Canary analysis: a move inside one bucket is not seen).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kdeploy_lab.traffic import Traffic
from tests.conftest import Deployment
from tests.integration.test_router import Routed, behind_router

TOKEN_DELAY = 0.14


@pytest.fixture
def analysed(deployment: Deployment, tmp_path: Path) -> Iterator[Routed]:
    with behind_router(deployment, tmp_path, token_delay=TOKEN_DELAY) as routed:
        yield routed


def _analysis(host: dict) -> dict:
    return next(p for p in host["phases"] if p["name"] == "analysis")


def _canary_fault(dep: Deployment, rev: str, env: dict[str, str]) -> None:
    """A new payload for every host, and on h1 (the canary) a fault in its environment as well."""
    (dep.payload / "rev.txt").write_text(rev)
    dep.edit(lambda doc: doc["hosts"]["h1"].update(service={"env": env}))


@pytest.mark.hosts(3)
def test_a_slower_canary_is_rolled_back_by_the_analysis_and_the_rest_keep_their_release(analysed: Routed,
                                                                                         capsys) -> None:
    dep = analysed.dep
    before = {h: dep.link(h) for h in dep.hosts}
    _canary_fault(dep, "slow", {"REFSERVER_LATENCY": "0.07"})  # +50% time to first token
    dep.edit(lambda doc: doc["defaults"]["service"].update(gate={**doc["defaults"]["service"]["gate"],
                                                                 "analysis": {"interval": 1}}))
    with Traffic(analysed.url, threads=8, tokens=2):
        code, doc = dep.json(capsys, "push", "test", "--canary", "1", "--batch", "1", "--analysis", "5s")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 4, doc
    assert hosts["h1"]["result"] == "rolled_back" and hosts["h1"]["router"] == "in", hosts["h1"]
    phase = _analysis(hosts["h1"])
    data = phase["data"]
    assert not phase["ok"] and data["decision"] == "rolled_back" and data["failed"]["metric"] == "p99_ttft_seconds"
    assert data["failed"]["canary"] > 1.2 * data["failed"]["baseline"], data["failed"]
    assert data["canary"] == ["h1"] and data["baseline"] == ["h2", "h3"] and len(data["series"]) >= 4
    assert phase["detail"].startswith("FAILED: p99_ttft_seconds: canary ")
    names = [p["name"] for p in hosts["h1"]["phases"]]
    assert names.index("analysis") < names.index("rollback drain") < names.index("rollback restart") \
        < names.index("rollback admit"), names
    for name in ("h2", "h3"):
        assert hosts[name]["result"] == "skipped" and "the canary analysis failed" in hosts[name]["error"]
    assert {h: dep.link(h) for h in dep.hosts} == before  # the canary back, the others never moved
    last = dep.history("h1")[-1]  # the way back's line: on the release it ran before, whose gate passed again
    assert (last["result"], last["release"], last["gated"]) == ("restored", *[dep.current("h1")] * 2), last
    assert "REFSERVER_LATENCY" not in dep.show("h1", "Environment")
    assert analysed.workers() == {analysed.worker_url(h): True for h in dep.hosts}


@pytest.mark.hosts(3)
def test_a_canary_failing_one_percent_of_its_requests_is_rolled_back_and_the_edit_reverted(analysed: Routed,
                                                                                           capsys) -> None:
    """Through set-env: the flag that makes the server fail reaches the canary alone, the analysis rolls it back
    and the inventory edit is reverted. The reference server fails exactly every 100th request at 1%: a window
    with at least 100 canary requests sees one (min_requests: 100 makes a shorter one undecided, which a
    required analysis also rolls back)."""
    dep = analysed.dep
    before = {h: dep.link(h) for h in dep.hosts}
    dep.edit(lambda doc: doc["defaults"]["service"].update(gate={**doc["defaults"]["service"]["gate"],
                                                                 "analysis": {"interval": 1, "min_requests": 100}}))
    edited = dep.path.read_text()
    with Traffic(analysed.url, threads=12, tokens=1) as traffic:
        code, doc = dep.json(capsys, "set-env", "REFSERVER_ERROR_RATE=0.01", "--canary", "1", "--batch", "1",
                             "--analysis", "8s")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 4, doc
    data = _analysis(hosts["h1"])["data"]
    assert data["failed"]["metric"] == "error_rate", data
    assert 0.001 < data["failed"]["canary"] <= 0.01 and data["failed"]["baseline"] == 0
    assert hosts["h1"]["result"] == "rolled_back" and {hosts[h]["result"] for h in ("h2", "h3")} == {"skipped"}
    assert {h: dep.link(h) for h in dep.hosts} == before
    assert doc["inventory"]["reverted"] and dep.path.read_text() == edited
    assert all("REFSERVER_ERROR_RATE" not in dep.show(h, "Environment") for h in dep.hosts)
    assert 500 not in traffic.codes  # the router retried the canary's failures on another worker


@pytest.mark.hosts(3)
def test_a_good_canary_is_promoted_and_the_rollout_goes_on(analysed: Routed, capsys) -> None:
    """Through set-env, which takes --analysis as push does: its rollout is push's."""
    dep = analysed.dep
    before = {h: dep.link(h) for h in dep.hosts}
    dep.edit(lambda doc: doc["defaults"]["service"].update(gate={**doc["defaults"]["service"]["gate"],
                                                                 "analysis": {"interval": 1}}))
    with Traffic(analysed.url, threads=8, tokens=2):
        code, doc = dep.json(capsys, "set-env", "KDEPLOY_CANARY_OK=1", "--canary", "1", "--batch", "1",
                             "--analysis", "4s")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 0, doc
    assert {h["result"] for h in doc["hosts"]} == {"deployed"} and not doc["inventory"]["reverted"]
    phase = _analysis(hosts["h1"])
    assert phase["ok"] and phase["data"]["decision"] == "promoted" and phase["data"]["required"], phase
    assert phase["data"]["checks"] and all(c["ok"] for c in phase["data"]["checks"])
    assert all(dep.link(h) != before[h] and "KDEPLOY_CANARY_OK=1" in dep.show(h, "Environment")
               for h in dep.hosts)
    assert not any(p["name"] == "analysis" for h in ("h2", "h3") for p in hosts[h]["phases"])


@pytest.mark.hosts(3)
def test_ctrl_c_inside_the_window_leaves_the_canary_gated_and_the_rest_untouched(analysed: Routed,
                                                                                 capsys) -> None:
    """The canary was gated and admitted before its window opened: an interrupt there keeps it (not analysed,
    said so), the hosts after it are never restarted and keep no staged release, every lock is let go, and the
    next push finishes the rollout."""
    dep = analysed.dep
    before = {h: dep.state(h) for h in ("h2", "h3")}
    h1_before = dep.link("h1")
    (dep.payload / "rev.txt").write_text("interrupted-window")
    with Traffic(analysed.url, threads=4, tokens=1):
        run = dep.interrupt("push", "test", "--canary", "1", "--batch", "1", "--analysis", "60s",
                            when=lambda: dep.link("h1") != h1_before
                            and analysed.workers().get(analysed.worker_url("h1")),
                            what="h1 switched and admitted", settle=3)  # then inside the 60 s window
    hosts = run.hosts
    assert run.code == run.doc["exit_code"] == 130, run.err
    h1 = hosts["h1"]
    assert h1["result"] == "deployed" and h1["router"] == "in", h1
    phase = _analysis(h1)
    assert not phase["ok"] and phase["detail"] == "interrupted during the window: not analysed", phase
    assert phase["data"]["decision"] == "interrupted" and phase["data"]["canary"] == ["h1"], phase
    assert dep.link("h1") != h1_before and dep.history("h1")[-1]["result"] == "deployed"
    for name in ("h2", "h3"):
        assert hosts[name]["result"] == "interrupted", hosts[name]
        assert dep.state(name) == before[name]  # never restarted, no staged release left
    assert all(dep.sh(h, f"ls {dep.service_dir}/lock.json 2>&1", check=False).endswith(
        "No such file or directory\n") for h in dep.hosts)
    assert analysed.workers() == {analysed.worker_url(h): True for h in dep.hosts}
    code, doc = dep.json(capsys, "push", "test", "--batch", "1")
    assert code == 0 and {h["host"]: h["result"] for h in doc["hosts"]} == {
        "h1": "unchanged", "h2": "deployed", "h3": "deployed"}, doc


@pytest.mark.hosts(2)
def test_without_a_router_a_required_analysis_is_refused_and_one_from_the_inventory_is_not_pretended(
        deployment: Deployment, capsys) -> None:
    dep = deployment
    assert dep.kdeploy("push", "test") == 0
    before = {h: (dep.link(h), dep.show(h, "InvocationID")) for h in dep.hosts}
    (dep.payload / "rev.txt").write_text("unrouted")
    capsys.readouterr()
    assert dep.kdeploy("push", "test", "--canary", "1", "--analysis", "3s") == 7
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "hosts=2, preflight_refused=2; exit code 7", lines
    assert all("canary analysis impossible: h1: no router in the inventory (" in line for line in lines[:-1]), lines
    assert {h: (dep.link(h), dep.show(h, "InvocationID")) for h in dep.hosts} == before  # nothing touched
    dep.edit(lambda doc: doc["defaults"]["service"].update(gate={**doc["defaults"]["service"]["gate"],
                                                                 "analysis": {"duration": 3}}))
    code, doc = dep.json(capsys, "push", "test", "--canary", "1")
    assert code == 0 and {h["result"] for h in doc["hosts"]} == {"deployed"}, doc
    h1 = doc["hosts"][0]
    phase = _analysis(h1)
    assert phase["detail"].startswith("NOT ANALYSED: h1: no router") and phase["data"]["decision"] == "not_analysed"
    assert any(line.startswith("warning: canary analysis not done") for line in h1["log"])
