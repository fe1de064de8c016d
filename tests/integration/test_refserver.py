"""The reference server (lab/kdeploy_lab/refserver.py) run locally as subprocesses: workers, plugins, HTTP, faults.

No containers: each test starts ``python -m kdeploy_lab.refserver`` on a free loopback port with the test
plugin (tests/data/testplugin) on PYTHONPATH, and kills whatever is left of it afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from kdeploy.core import analysis
from tests.refserver_proc import (
    DEBIAN_PYTHON,
    FRANCE,
    PLUGIN_DIR,
    PLUGIN_RE,
    READY,
    REPO,
    RefServer,
    alive,
    wait_dead,
)


@pytest.fixture
def start():
    servers: list[RefServer] = []

    def _start(**kwargs) -> RefServer:
        server = RefServer(**kwargs)
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.cleanup()


def test_tp8_workers_load_plugin_and_serve(start):
    srv = start(tp=8, args=("--served-model-name", "k25", "--enable-hierarchical-cache", "--hicache-ratio",
                            "4.0", "--frobnicate", "3", "--enable-foo"))
    statuses = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status, body = srv.request("GET", "/health")
        if status is not None:
            statuses.append(status)
            assert body == b""
        if status == 200:
            break
        time.sleep(0.02)
    assert 503 in statuses, statuses
    assert statuses[-1] == 200
    assert statuses.index(200) > statuses.index(503)
    t_ready, _ = srv.wait_for(READY)
    print(f"tp=8 ready {t_ready - srv.t0:.2f} s after Popen")
    assert t_ready - srv.t0 < 5.0

    log = srv.text()
    assert sum("ignoring unsupported flags: --frobnicate 3 --enable-foo" in line for line in log) == 1
    workers = srv.worker_pids()
    assert sorted(workers) == list(range(8))
    plugin = srv.wait_count(PLUGIN_RE, 8)
    plugin_pids = [int(m[1]) for m in plugin]
    assert len(plugin_pids) == 8 and len(set(plugin_pids)) == 8, plugin_pids  # once per worker process
    assert srv.pid not in plugin_pids  # the launcher loads the plugin too, but markers come from workers
    assert any(f"registered in the launcher pid={srv.pid}" in line for line in log)
    assert set(plugin_pids) == set(workers.values())
    assert srv.pid not in workers.values()
    for rank in range(8):
        for marker in ("Load weight end.", "KV Cache is allocated. #tokens: 159277, K size: 5.21 GB, V size: "
                       "5.21 GB", "Memory pool end.", "Allocating 41.68 GB host memory for hierarchical KV cache."):
            pattern = re.compile(rf"^\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d TP{rank}\] {re.escape(marker)}")
            assert sum(bool(pattern.search(line)) for line in log) == 1, (rank, marker)
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] " + re.escape(READY) + "$",
                    next(line for line in log if READY in line))

    first, second = srv.complete(), srv.complete()
    text = first["choices"][0]["text"]
    assert "Paris" in text and text == " Paris. This is a well-known fact"
    assert second["choices"][0]["text"] == text
    assert first["object"] == "text_completion" and first["model"] == "k25"
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 6
    assert srv.complete(max_tokens=2)["choices"][0]["text"] == " Paris. This"
    other = srv.complete(prompt="Tell me about kernels", max_tokens=5)["choices"][0]["text"]
    assert len(other.split()) == 5 and other == srv.complete("Tell me about kernels", 5)["choices"][0]["text"]

    status, body = srv.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "k25"
    status, body = srv.request("GET", "/server_info")
    assert status == 200 and json.loads(body)["tp_size"] == 8 and json.loads(body)["hicache_ratio"] == 4.0
    status, body = srv.request("POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and json.loads(body)["code"] == 400


def test_ipv6_host_as_sglang_takes_it(start):
    """`--host ::` listens on IPv6 and, as on any Linux host with bindv6only=0, on IPv4 too; `::1` on IPv6 only."""
    srv = start(tp=1, args=("--host", "::"))
    srv.wait_for(READY)
    assert srv.request("GET", "/health", host="[::1]")[0] == 200
    assert srv.request("GET", "/health", host="127.0.0.1")[0] == 200
    assert f"listening on http://[::]:{srv.port}" in "\n".join(srv.text())
    only6 = start(tp=1, args=("--host", "::1"))
    only6.wait_for(READY)
    assert only6.request("GET", "/health", host="[::1]")[0] == 200


def test_sigterm_stops_workers_and_exits_zero(start):
    srv = start(tp=8, env={"REFSERVER_SHUTDOWN_POLL": "0.5"})
    srv.wait_for(READY)
    workers = set(srv.worker_pids().values())
    assert len(workers) == 8 and all(alive(p) for p in workers)
    t0 = time.monotonic()
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit(5) == 0
    assert time.monotonic() - t0 < 3.0
    assert wait_dead(workers, 1.0) == set()


def test_exit_at_start(start):
    srv = start(tp=8, env={"REFSERVER_EXIT_AT_START": "7"})
    assert srv.wait_exit(10) == 7
    log = srv.text()
    assert len(log) == 1 and "REFSERVER_EXIT_AT_START" in log[0]
    assert srv.plugin_pids() == [] and srv.worker_pids() == {}


def test_die_rank_fails_the_server(start):
    srv = start(tp=8, env={"REFSERVER_DIE_RANK": "3"})
    rc = srv.wait_exit(15)
    assert rc == 1
    log = srv.text()
    assert any(re.search(r"TP3\b.*died with exit code 1", line) for line in log), log
    assert any("TP3] Load weight end." in line for line in log)
    assert not any(READY in line for line in log)
    assert wait_dead(set(srv.worker_pids().values()), 2.0) == set()


def test_no_plugins_rank_skips_one_worker(start):
    srv = start(tp=8, env={"REFSERVER_NO_PLUGINS_RANK": "3"})
    srv.wait_for(READY)
    workers = srv.worker_pids()
    plugin_pids = set(srv.plugin_pids())
    assert plugin_pids == {pid for rank, pid in workers.items() if rank != 3}, "\n".join(srv.text())
    assert workers[3] not in plugin_pids
    assert any("TP3] Memory pool end." in line for line in srv.text())


def test_wrong_answer(start):
    srv = start(tp=2, env={"REFSERVER_WRONG_ANSWER": "1"})
    srv.wait_for(READY)
    text = srv.complete()["choices"][0]["text"]
    assert "Paris" not in text and text == " Lyon. It is a city"


def test_nondeterministic_and_sampling(start):
    srv = start(tp=2, env={"REFSERVER_NONDETERMINISTIC": "1"})
    srv.wait_for(READY)
    a, b = (srv.complete()["choices"][0]["text"] for _ in range(2))
    assert a != b and "Paris" in a and "Paris" in b


def test_temperature_sampling_varies_without_switch(start):
    srv = start(tp=1)
    srv.wait_for(READY)
    assert any(line.startswith("[") and "] Load weight end." in line and " TP" not in line.split("]")[0]
               for line in srv.text())  # tp=1: no rank tag, like SGLang
    texts = {srv.complete(max_tokens=8, temperature=0.8)["choices"][0]["text"] for _ in range(4)}
    assert len(texts) > 1


def test_slow_start_keeps_health_503(start):
    srv = start(tp=2, env={"REFSERVER_SLOW_START": "2"})
    t_up, _ = srv.wait_for("All 2 scheduler(s) ready")
    status, body = srv.request("POST", "/v1/completions", {"prompt": FRANCE, "max_tokens": 8, "temperature": 0})
    assert status == 503, body
    first_200 = None
    while time.monotonic() - t_up < 6:
        status, _ = srv.request("GET", "/health")
        if status == 200:
            first_200 = time.monotonic()
            break
        assert status == 503
        time.sleep(0.05)
    assert first_200 is not None
    assert 1.8 <= first_200 - t_up <= 3.5, first_200 - t_up
    assert "Paris" in srv.complete()["choices"][0]["text"]


def test_ignore_sigterm_then_workers_follow_a_killed_parent(start):
    srv = start(tp=2, env={"REFSERVER_IGNORE_SIGTERM": "1"})
    srv.wait_for(READY)
    workers = set(srv.worker_pids().values())
    os.kill(srv.pid, signal.SIGTERM)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)  # systemd signals the whole cgroup
    time.sleep(1.0)
    assert srv.proc.poll() is None
    assert all(alive(p) for p in workers)
    assert srv.request("GET", "/health")[0] == 200
    os.kill(srv.pid, signal.SIGKILL)  # only the parent: the workers must notice and leave
    assert srv.wait_exit(5) == -signal.SIGKILL
    assert wait_dead(workers, 3.0) == set()


def test_bad_flag_value_exits_2_with_one_line(start):
    srv = start(tp=2, args=("--mem-fraction-static", "lots"))
    assert srv.wait_exit(10) == 2
    log = srv.text()
    assert len(log) == 1 and "error" in log[0] and "--mem-fraction-static" in log[0], log


def test_standalone_copy_under_debian_python(start, tmp_path):
    """As deployed: the file alone as kdeploy_refserver.py, no kdeploy package, `-m kdeploy_refserver`
    (spawn children re-import it as __mp_main__), sitecustomize on PYTHONPATH runs in every worker."""
    python = DEBIAN_PYTHON if os.access(DEBIAN_PYTHON, os.X_OK) else sys.executable
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(REPO / "lab" / "kdeploy_lab" / "refserver.py", app / "kdeploy_refserver.py")
    (app / "sitecustomize.py").write_text(
        "import os, sys\nsys.stdout.write(f'[sitecustomize] pid={os.getpid()}\\n'); sys.stdout.flush()\n")
    srv = start(tp=2, python=python, module="kdeploy_refserver", cwd=tmp_path, pythonpath=(app, PLUGIN_DIR),
                env={"REFSERVER_SHUTDOWN_POLL": "0.5"})  # SGLang's 5 s watchdog period would eat the wait below
    srv.wait_for(READY)
    workers = set(srv.worker_pids().values())
    assert len(workers) == 2
    assert set(srv.plugin_pids()) == workers
    site_pids = {int(m[1]) for m in map(re.compile(r"^\[sitecustomize\] pid=(\d+)$").search, srv.text()) if m}
    assert workers | {srv.pid} <= site_pids
    assert "Paris" in srv.complete()["choices"][0]["text"]
    os.kill(srv.pid, signal.SIGTERM)
    assert srv.wait_exit(5) == 0
    assert wait_dead(workers, 1.0) == set()


def _stream_lines(srv: RefServer, path: str, body: dict, opened: threading.Event | None = None) -> list[str]:
    """The ``data:`` payloads of a streamed request, read as they come."""
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=20) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        if opened is not None:
            opened.set()
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def _gauges(srv: RefServer) -> dict[str, float]:
    status, body = srv.request("GET", "/metrics")
    assert status == 200
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines() if line and not line.startswith("#")}


def _samples(srv: RefServer, name: str) -> dict[str, float]:
    """Every sample of metric ``name``: labels text -> value."""
    status, body = srv.request("GET", "/metrics")
    assert status == 200
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines() if line.startswith(name + "{")}


def test_streams_paced_tokens_and_counts_them_in_metrics(start):
    srv = start(tp=1, env={"REFSERVER_TOKEN_DELAY": "0.05"}, args=("--enable-metrics",))
    srv.wait_for(READY)
    assert _gauges(srv)["sglang:num_running_reqs"] == 0
    seen: dict[str, float] = {}
    opened = threading.Event()
    watcher = threading.Thread(target=lambda: (opened.wait(5), time.sleep(0.3), seen.update(_gauges(srv))))
    watcher.start()
    t0 = time.monotonic()
    events = _stream_lines(srv, "/v1/completions", {"prompt": "a story", "max_tokens": 20, "stream": True,
                                                    "temperature": 0}, opened)
    took = time.monotonic() - t0
    watcher.join()
    assert seen["sglang:num_running_reqs"] == 1 and seen["sglang:num_queue_reqs"] == 0
    assert events[-1] == "[DONE]" and len(events) == 22
    assert 0.9 <= took < 4, took  # 20 tokens at 50 ms
    chunks = [json.loads(e) for e in _stream_lines(srv, "/v1/completions", {
        "prompt": FRANCE, "max_tokens": 20, "stream": True, "temperature": 0})[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " Paris. This is a well-known fact"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[0]["choices"][0]["finish_reason"] is None
    native = _stream_lines(srv, "/generate", {"text": FRANCE, "stream": True,
                                              "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert [json.loads(e)["text"] for e in native[:-1]] == [" Paris.", " Paris. This", " Paris. This is"]
    t0 = time.monotonic()
    assert srv.complete(max_tokens=4)["choices"][0]["text"] == " Paris. This is a"
    assert time.monotonic() - t0 >= 0.2  # non-streamed requests are paced too
    assert _gauges(srv)["sglang:num_running_reqs"] == 0
    assert sum(_samples(srv, "sglang:num_requests_total").values()) == 4


def test_sigterm_drains_in_flight_requests_like_sglang(start):
    """SIGTERM: /health 503 at once, a stream in flight runs to its end, then exit 0 (SGLang 0.5.23)."""
    srv = start(tp=2, env={"REFSERVER_TOKEN_DELAY": "0.05", "REFSERVER_SHUTDOWN_POLL": "0.5"})
    srv.wait_for(READY)
    opened = threading.Event()
    got: list[list[str]] = []
    client = threading.Thread(target=lambda: got.append(_stream_lines(
        srv, "/v1/completions", {"prompt": "a long story", "max_tokens": 40, "stream": True}, opened)))
    client.start()
    assert opened.wait(5)
    os.kill(srv.pid, signal.SIGTERM)
    srv.wait_for("Draining requests")
    assert srv.request("GET", "/health")[0] == 503
    assert srv.request("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})[0] == 200
    assert srv.wait_exit(10) == 0
    client.join(5)
    assert len(got) == 1 and got[0][-1] == "[DONE]" and len(got[0]) == 42, got
    assert any("Remaining number of requests 1." in line for line in srv.text())


def test_logprobs_metrics_and_serving_faults(start):
    """Issue 29: ``logprobs: k`` in SGLang's shape, deterministic and moved by REFSERVER_LOGIT_NOISE (the text
    stays); SGLang's histograms and counters with its labels; REFSERVER_LATENCY and REFSERVER_ERROR_RATE."""
    srv = start(tp=1, env={"REFSERVER_LOGIT_NOISE": "2", "REFSERVER_LATENCY": "0.3", "REFSERVER_ERROR_RATE": "0.25"},
                args=("--enable-metrics", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"))
    clean = start(tp=1)
    srv.wait_for(READY)
    clean.wait_for(READY)
    body = {"prompt": FRANCE, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    status, raw = clean.request("POST", "/v1/completions", body)
    assert status == 200
    logprobs = json.loads(raw)["choices"][0]["logprobs"]
    assert sorted(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert logprobs["tokens"] == [" Paris.", " This", " is"] and logprobs["text_offset"] == [-1, -1, -1]
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]
    assert all(top[t] == lp and max(top.values()) == lp and lp < 0 for t, lp, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True))
    assert json.loads(clean.request("POST", "/v1/completions", body)[1])["choices"][0]["logprobs"] == logprobs
    assert clean.request("POST", "/v1/completions", {**body, "logprobs": 99})[0] == 400

    answers = []
    for _ in range(4):  # error rate 1/4: exactly one of four requests fails
        t0 = time.monotonic()
        answers.append(srv.request("POST", "/v1/completions", body))
        if answers[-1][0] == 200:
            assert time.monotonic() - t0 >= 0.3  # REFSERVER_LATENCY before the first token
    assert sorted(code for code, _ in answers) == [200, 200, 200, 500]
    noisy = next(json.loads(raw)["choices"][0] for code, raw in answers if code == 200)
    assert noisy["text"] == " Paris. This is"  # the greedy text survives a gross perturbation...
    gaps = [abs(a - b) for a, b in zip(noisy["logprobs"]["token_logprobs"], logprobs["token_logprobs"], strict=True)]
    assert max(gaps) > 0.1  # ...its logprobs do not

    labels = '{model_name="/models/test-model",engine_type="unified",is_streaming="false"}'
    assert _samples(srv, "sglang:num_requests_total")[labels] == 3
    assert _samples(srv, "sglang:generation_tokens_total")[labels] == 9
    assert _samples(srv, "sglang:num_aborted_requests_total") == {
        '{model_name="/models/test-model",engine_type="unified"}': 1}
    ttft = _samples(srv, "sglang:time_to_first_token_seconds_bucket")
    assert ttft[labels[:-1] + ',le="0.2"}'] == 0 and ttft[labels[:-1] + ',le="0.4"}'] == 3
    assert ttft[labels[:-1] + ',le="+Inf"}'] == 3
    assert sum(_samples(srv, "sglang:inter_token_latency_seconds_count").values()) == 6
    assert list(_samples(srv, "sglang:spec_accept_length").values()) == [pytest.approx(3.4)]
    assert list(_samples(srv, "sglang:gen_throughput")) == [
        '{model_name="/models/test-model",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"}']
    window = analysis.window({}, analysis.parse(srv.request("GET", "/metrics")[1].decode()))
    assert (window.requests, window.errors, window.generated) == (3, 1, 9)
    assert 0.2 < window.ttft.quantile(0.99) <= 0.4 and window.accept_length == pytest.approx(3.4)
