"""kdeploy/host/router.py's pure parts: the router's /workers answer, SGLang's gauges, the rollout preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdeploy.core.errors import ExitCode, InvalidInput
from kdeploy.core.inventory import Router
from kdeploy.host.router import RouterError, Worker, api_key, in_flight, parse_workers, preflight_verdict

EXAMPLE = Path(__file__).resolve().parents[2] / "inventory.yaml"
# As sglang-router 0.3.2 answers GET /workers (one worker, trimmed metadata).
WORKERS = json.dumps({"workers": [{
    "id": "3799d817-0ea7-489f-bf4f-edfa9da5d969", "url": "http://10.0.0.1:30000", "model_id": "m", "priority": 50,
    "cost": 1.0, "worker_type": "regular", "is_healthy": True, "load": 2, "connection_mode": "HTTP",
    "metadata": {"tp_size": "1"}, "disable_health_check": False}], "total": 1,
    "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 1}})

# As sglang 0.5.23 exposes them (sglang/srt/observability/metrics_collector.py), one TP rank each.
METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"} 1.0
sglang:num_running_reqs_offline_batch{model_name="m"} 9.0
sglang:num_requests_total{model_name="m"} 40.0
"""


def test_parse_workers():
    assert parse_workers(WORKERS) == [Worker("3799d817-0ea7-489f-bf4f-edfa9da5d969", "http://10.0.0.1:30000",
                                             True, 2)]


@pytest.mark.parametrize("text", ["", "[]", '{"workers": [{"url": "x"}]}', '{"total": 0}'])
def test_parse_workers_refuses_unknown_shapes(text):
    with pytest.raises(RouterError) as err:
        parse_workers(text)
    assert err.value.exit_code == ExitCode.UNREACHABLE


def test_in_flight_sums_running_and_queued_only():
    assert in_flight(METRICS) == 4
    assert in_flight(METRICS.replace(" 3.0", " 0.0").replace(" 1.0\n", " 0.0\n")) == 0
    assert in_flight("sglang:num_requests_total 3\n") is None


def test_in_flight_counts_the_queues_of_a_prefill_decode_pair():
    prefill = ('sglang:num_running_reqs{engine_type="prefill",tp_rank="0"} 0.0\n'
               'sglang:num_queue_reqs{engine_type="prefill",tp_rank="0"} 0.0\n'
               'sglang:num_prefill_bootstrap_queue_reqs{engine_type="prefill",tp_rank="0"} 2.0\n'
               'sglang:num_prefill_inflight_queue_reqs{engine_type="prefill",tp_rank="0"} 1.0\n')
    decode = ('sglang:num_running_reqs{engine_type="decode",tp_rank="0"} 1.0\n'
              'sglang:num_decode_prealloc_queue_reqs{engine_type="decode",tp_rank="0"} 1.0\n'
              'sglang:num_decode_transfer_queue_reqs{engine_type="decode",tp_rank="0"} 2.0\n')
    assert (in_flight(prefill), in_flight(decode)) == (3, 4)


def _w(url: str, healthy: bool = True) -> Worker:
    return Worker(url, url, healthy, 0)


def _batches(hosts: str, size: int) -> list[list[str]]:
    return [list(hosts[i:i + size]) for i in range(0, len(hosts), size)]


def test_preflight_verdict():
    workers = [_w("http://a:1"), _w("http://b:1"), _w("http://c:1")]
    assert preflight_verdict(workers, {"a": "http://a:1", "b": "http://b:1"}, _batches("ab", 1), False) is None
    sick = [*workers[:2], _w("http://c:1", False)]
    assert "unhealthy worker(s) http://c:1" in preflight_verdict(sick, {"a": "http://a:1"}, [["a"]], False)
    assert "d not registered" in preflight_verdict(workers, {"d": "http://d:1"}, [["d"]], False)
    assert preflight_verdict(workers, {"d": "http://d:1"}, [["d"]], True) is None
    assert preflight_verdict([], {"a": "http://a:1", "b": "http://b:1"}, _batches("ab", 1), True) is None  # new, empty
    assert "would leave none serving" in preflight_verdict(workers[:1], {"a": "http://a:1"}, [["a"]], False)
    every = {h: f"http://{h}:1" for h in "abc"}
    assert "a batch of 3 would leave none serving" in preflight_verdict(workers, every, _batches("abc", 3), False)
    assert preflight_verdict(workers, every, _batches("abc", 2), False) is None
    assert "would leave 1 serving (router.min_serving 2)" in preflight_verdict(workers, every, _batches("abc", 2),
                                                                               False, min_serving=2)


def test_preflight_keeps_min_serving_of_each_role_in_the_router():
    """2 prefill (p, q) + 2 decode (d, e) servers: batches of one of each keep both roles serving; a batch that
    takes both prefill servers out is refused, naming the role."""
    workers = [Worker(u, u, True, 0, t, 8998 if t == "prefill" else None)
               for u, t in (("http://p:1", "prefill"), ("http://q:1", "prefill"), ("http://d:1", "decode"),
                            ("http://e:1", "decode"))]
    wanted = {h: f"http://{h}:1" for h in "pqde"}
    roles = {"p": "prefill", "q": "prefill", "d": "decode", "e": "decode"}
    assert preflight_verdict(workers, wanted, [["p", "d"], ["q", "e"]], False, roles) is None
    why = preflight_verdict(workers, wanted, [["p", "q"], ["d", "e"]], False, roles)
    assert why == ("only 2 healthy decode server(s) in the router: a batch of 2 would leave none serving "
                   "(router.min_serving 1)")
    alone = {h: wanted[h] for h in "pde"}  # q is gone: p is the only prefill server
    assert "only 1 healthy prefill server(s) in the router: a batch of 1 would leave none serving" in \
        preflight_verdict(workers[:1] + workers[2:], alone, [["p", "d"]], False, roles)


def test_the_roles_take_turns_in_the_rollout_order():
    from kdeploy.flows.fleet import interleaved

    roles = {"p1": "prefill", "p2": "prefill", "p3": "prefill", "d1": "decode", "d2": "decode"}
    assert interleaved(list(roles), roles.__getitem__) == ["p1", "d1", "p2", "d2", "p3"]
    assert interleaved(["a", "b", "c"], lambda h: "unified") == ["a", "b", "c"]


def test_parse_workers_reads_the_role_and_bootstrap_port():
    text = json.dumps({"workers": [
        {"id": "1", "url": "http://p:1/", "is_healthy": True, "load": 0, "worker_type": "prefill",
         "bootstrap_port": 8998},
        {"id": "2", "url": "http://d:1", "is_healthy": False, "worker_type": "decode"},
        {"id": "3", "url": "http://u:1", "is_healthy": True}]})
    assert parse_workers(text) == [Worker("1", "http://p:1", True, 0, "prefill", 8998),
                                   Worker("2", "http://d:1", False, 0, "decode", None),
                                   Worker("3", "http://u:1", True, 0, "regular", None)]


def test_api_key_from_the_environment(monkeypatch):
    router = Router(url="http://r:1", api_key_env="KD_ROUTER_KEY")
    monkeypatch.delenv("KD_ROUTER_KEY", raising=False)
    with pytest.raises(InvalidInput, match="KD_ROUTER_KEY is not set"):
        api_key(router)
    monkeypatch.setenv("KD_ROUTER_KEY", "s3cret")
    assert api_key(router) == "s3cret" and api_key(Router(url="http://r:1")) is None


def test_router_command_without_router_section_is_invalid_input(capsys):
    from kdeploy.cli import app as cli

    code = cli.main(["router", "admit", "ct200", "--inventory", str(EXAMPLE)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.INVALID
    assert err == ["kdeploy: ct200: no router in the inventory (add a router: section)"]


def test_unset_api_key_variable_refuses_before_any_host(tmp_path, capsys, monkeypatch):
    from kdeploy.cli import app as cli

    monkeypatch.delenv("KD_NO_SUCH_KEY", raising=False)
    text = EXAMPLE.read_text().replace("defaults:\n", "defaults:\n  router: {url: 'http://127.0.0.1:9', "
                                                      "api_key_env: KD_NO_SUCH_KEY}\n", 1)
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    code = cli.main(["router", "drain", "ct200", "--inventory", str(path)])
    assert code == ExitCode.INVALID
    assert "KD_NO_SUCH_KEY is not set" in capsys.readouterr().err


def test_the_re_admit_is_armed_with_the_hosts_view_of_the_router_and_cancelled_by_name(tmp_path):
    import shlex

    from kdeploy.core import inventory
    from kdeploy.host.router import arm_readmit_command, disarm_readmit_command, readmit_after

    text = EXAMPLE.read_text().replace("defaults:\n", "defaults:\n  router: {url: 'http://127.0.0.1:9', "
                                                      "url_from_host: 'http://10.0.0.254:9', drain_timeout: 20}\n", 1)
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    host = inventory.load(path).hosts["ct200"]
    sv = host.service
    lines = arm_readmit_command(host, with_key=True).splitlines()
    assert lines[0] == disarm_readmit_command(host)  # an earlier one is replaced, never doubled
    assert lines[1].startswith("(umask 077 && cat > ") and lines[1].endswith("/.readmit.key)")
    # the systemd-run line is kept in .readmit.sh (the boot guard arms it again after a reboot), then run
    kept, run = lines[-2], lines[-1]
    assert kept.startswith("printf '%s\\n' ") and kept.endswith(f" > /opt/kdeploy/{sv.name}/.readmit.sh")
    assert run == f"/bin/sh /opt/kdeploy/{sv.name}/.readmit.sh"
    argv = shlex.split(shlex.split(kept)[2])
    seconds = 20 + sv.unit.timeout_stop_sec + 60 + sv.gate_timeout + 60 + 60  # drain + revert deadline + margin
    assert readmit_after(host) == seconds and f"--on-active={int(seconds)}" in argv
    assert f"--unit=kdeploy-readmit-{sv.name}" in argv
    assert argv[argv.index(sv.python):] == [
        sv.python, "-I", "-u", f"/opt/kdeploy/{sv.name}/.readmit.py", f"/opt/kdeploy/{sv.name}",
        f"http://127.0.0.1:{sv.sglang.port}/health", "http://10.0.0.254:9", host.worker_url, "900",
        json.dumps({"url": host.worker_url}, separators=(",", ":"))]
    assert "cat >" not in arm_readmit_command(host, with_key=False)
    assert f"kdeploy-readmit-{sv.name}.timer" in disarm_readmit_command(host)
    assert f"/opt/kdeploy/{sv.name}/.readmit.sh" in disarm_readmit_command(host)  # no reboot arms it again
