"""The reference server's prefill and decode modes (issue 41 item 5), run locally on 127.0.0.1.

No containers: each server is ``python -m kdeploy_lab.refserver --disaggregation-mode prefill|decode`` in a process
group of its own, killed whole at teardown. A pair request is what the router sends: the same body, with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added, to a prefill and a decode at once. The decode
fetches the room's KV from the prefill's bootstrap server (``GET /route``, then ``GET /kv?room=R``) over TCP.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kdeploy_lab import refserver, router_env
from tests.refserver_proc import FRANCE, READY, RefServer, free_port

PARIS = " Paris. This is a well-known fact"
HANDSHAKE = "Decode handshake failed for request rank=0 "
FAST = {"REFSERVER_HANDSHAKE_TIMEOUT": "3", "REFSERVER_SHUTDOWN_POLL": "0.2"}
Start = Callable[..., RefServer]


@pytest.fixture
def start() -> Iterator[Start]:
    """``start(mode, tp=1, env=None, args=())``: a ready prefill or decode server (``server.bootstrap``: the
    bootstrap port a prefill was given)."""
    servers: list[RefServer] = []

    def _start(mode: str, tp: int = 1, env: dict | None = None, args: tuple = (), wait: bool = True) -> RefServer:
        bootstrap = free_port()
        server = RefServer(tp=tp, env={**FAST, **(env or {})},
                           args=("--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(bootstrap),
                                 "--enable-metrics", *args))
        server.bootstrap = bootstrap  # type: ignore[attr-defined]
        servers.append(server)
        if wait:
            server.wait_for(READY)
        return server

    yield _start
    for server in servers:
        server.cleanup()


def _call(port: int, path: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _pair(prefill_port: int, decode_port: int, path: str, body: dict, room: int | None = None,
          bootstrap: tuple[str, int] | None = None, decode_first: float = 0.0) -> tuple[tuple, tuple]:
    """The router's move: the same body with the bootstrap fields to both servers at once (the decode first by
    ``decode_first`` seconds); ((prefill status, body), (decode status, body))."""
    host, port = bootstrap or ("127.0.0.1", None)
    body = {**body, "bootstrap_host": host, "bootstrap_port": port,
            "bootstrap_room": random.randrange(2**63) if room is None else room}
    out: dict[str, tuple] = {}

    def send(role: str, server_port: int) -> None:
        out[role] = _call(server_port, path, body)

    threads = [threading.Thread(target=send, args=("decode", decode_port))]
    threads.append(threading.Thread(target=send, args=("prefill", prefill_port)))
    threads[0].start()
    time.sleep(decode_first)
    threads[1].start()
    for t in threads:
        t.join(60)
    return out["prefill"], out["decode"]


def _completion(max_tokens: int = 8, logprobs: int | None = 2, prompt: str = FRANCE) -> dict:
    body = {"model": "/models/test-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return body if logprobs is None else {**body, "logprobs": logprobs}


def _metrics(port: int) -> dict[str, float]:
    """``name{labels}`` -> value, histogram buckets left out."""
    status, raw = _call(port, "/metrics")
    assert status == 200
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
            if line and not line.startswith("#") and "_bucket{" not in line}


def _series(metrics: dict[str, float], name: str) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(name + "{")}


def test_a_pair_answers_through_the_decode(start: Start) -> None:
    prefill = start("prefill", tp=2)
    decode = start("decode")
    bootstrap = ("127.0.0.1", prefill.bootstrap)

    # The bootstrap server: /health, and the parallel info once both TP ranks registered.
    assert _call(prefill.bootstrap, "/health") == (200, b"OK")
    status, raw = _call(prefill.bootstrap, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                                           "&target_pp_rank=-1")
    info = json.loads(raw)
    assert status == 200 and info["attn_tp_size"] == 2 and info["prefill_http_port"] == prefill.port, info
    assert info["page_size"] == 1 and info["kv_cache_dtype"] == "bfloat16" and info["follow_bootstrap_room"]
    status, raw = _call(prefill.bootstrap, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1"
                                           "&target_pp_rank=0")
    assert status == 200 and json.loads(raw) == {"rank_ip": "127.0.0.1", "rank_port": prefill.bootstrap}
    assert _call(prefill.bootstrap, "/route?prefill_dp_rank=0")[0] == 400

    # What the router reads at registration.
    for server, mode in ((prefill, "prefill"), (decode, "decode")):
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            status, raw = _call(server.port, path)
            assert status == 200 and json.loads(raw)["disaggregation_mode"] == mode, (path, raw)
    server_info = json.loads(_call(prefill.port, "/server_info")[1])
    assert server_info["disaggregation_bootstrap_port"] == prefill.bootstrap
    assert server_info["disaggregation_transfer_backend"] == "mooncake"
    assert server_info["load_balance_method"] == "follow_bootstrap_room"
    assert json.loads(_call(decode.port, "/server_info")[1])["load_balance_method"] == "round_robin"

    # OpenAI completions: the decode's answer is a unified server's, logprobs included; the prefill made 1 token.
    (p_status, p_raw), (d_status, d_raw) = _pair(prefill.port, decode.port, "/v1/completions", _completion(),
                                                 bootstrap=bootstrap)
    assert (p_status, d_status) == (200, 200), (p_raw, d_raw)
    choice = json.loads(d_raw)["choices"][0]
    assert choice["text"] == PARIS
    tokens = refserver._word_tokens(PARIS)
    assert choice["logprobs"] == refserver.token_logprobs(FRANCE, tokens, 2)
    pre = json.loads(p_raw)
    assert pre["choices"][0]["text"] == " Paris." and pre["usage"]["completion_tokens"] == 1

    # Native /generate, the decode asking first (either side may come first), max_new_tokens 3.
    (p_status, p_raw), (d_status, d_raw) = _pair(
        prefill.port, decode.port, "/generate",
        {"text": FRANCE, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        bootstrap=bootstrap, decode_first=0.5)
    assert (p_status, d_status) == (200, 200), (p_raw, d_raw)
    assert json.loads(d_raw)["text"] == " Paris. This is"
    assert json.loads(p_raw)["text"] == " Paris." and json.loads(p_raw)["meta_info"]["completion_tokens"] == 1

    # A streamed pair, and another prompt (pseudo-text): the same as a unified server's.
    other = "Tell me about rivers"
    (p_status, _), (d_status, d_raw) = _pair(prefill.port, decode.port, "/v1/completions",
                                             {**_completion(5, None, other), "stream": True}, bootstrap=bootstrap)
    assert (p_status, d_status) == (200, 200)
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in d_raw.decode().splitlines()
              if line.startswith("data: {")]
    assert "".join(pieces) == refserver.complete_text(other, 5, 0.0, None)

    # Metrics: the role in engine_type; the PD gauges back to 0; no failures counted yet.
    for server, engine in ((prefill, "prefill"), (decode, "decode")):
        metrics = _metrics(server.port)
        requests = _series(metrics, "sglang:num_requests_total")
        assert requests and all(f'engine_type="{engine}"' in k for k in requests), requests
        assert sum(requests.values()) == 3
        for name in ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
                     "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs"):
            assert list(_series(metrics, name).values()) == [0.0], name
            assert f'engine_type="{engine}"' in next(iter(_series(metrics, name)))
        assert not _series(metrics, "sglang:num_bootstrap_failed_reqs_total")
    generated = _series(_metrics(prefill.port), "sglang:generation_tokens_total")
    assert sum(generated.values()) == 3  # one token per request on the prefill


def test_requests_without_a_room_and_the_fake_bootstrap_host(start: Start) -> None:
    prefill = start("prefill")
    decode = start("decode")
    rid = re.compile(r"req\.rid='[0-9a-f]{32}'$")
    no_room = "Invalid request: Disaggregated request received without bootstrap room id. req.rid="
    for server in (prefill, decode):
        status, raw = _call(server.port, "/v1/completions", _completion())
        body = json.loads(raw)
        assert status == 400 and body["type"] == "BadRequest" and body["code"] == 400, raw
        assert body["message"].startswith(no_room) and rid.search(body["message"]), body
        status, raw = _call(server.port, "/generate", {"text": FRANCE, "rid": "r-1"})
        assert (status, json.loads(raw)) == (400, {"error": {"message": no_room + "'r-1'"}})
        # SGLang's own /health trick: the fake bootstrap host 2.2.2.2, no peer contacted.
        status, raw = _call(server.port, "/v1/completions",
                            {**_completion(), "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}, timeout=5)
        assert status == 200, raw
        text = json.loads(raw)["choices"][0]["text"]
        if server is prefill:
            assert text == " Paris."
        else:  # generated from KV that never came: meaningless
            assert len(text.split()) == 8 and "Paris" not in text
        assert _call(server.port, "/health") == (200, b"")


def test_a_decode_whose_bootstrap_is_dead_answers_500(start: Start) -> None:
    decode = start("decode")
    t0 = time.monotonic()
    status, raw = _call(decode.port, "/v1/completions", {**_completion(), "bootstrap_host": "127.0.0.1",
                                                         "bootstrap_port": free_port(), "bootstrap_room": 42})
    elapsed = time.monotonic() - t0
    body = json.loads(raw)
    assert status == 500 and body["type"] == "500" and body["code"] == 500 and body["object"] == "error", raw
    assert body["message"].startswith(HANDSHAKE) and "decode_req.req.bootstrap_room=42 " in body["message"]
    assert "Could not fetch prefill parallel info from 127.0.0.1:" in body["message"]
    assert 1.5 < elapsed < 6, elapsed  # REFSERVER_HANDSHAKE_TIMEOUT=3
    # bootstrap_port null: the decode's own --disaggregation-bootstrap-port (nobody there either).
    status, raw = _call(decode.port, "/generate", {"text": FRANCE, "bootstrap_host": "127.0.0.1",
                                                   "bootstrap_port": None, "bootstrap_room": 43})
    assert status == 500 and f"from 127.0.0.1:{decode.bootstrap} after" in json.loads(raw)["message"]
    failed = _series(_metrics(decode.port), "sglang:num_bootstrap_failed_reqs_total")
    assert list(failed.values()) == [2.0], failed


def test_a_prefill_whose_bootstrap_port_never_answers(start: Start) -> None:
    prefill = start("prefill", env={"REFSERVER_BOOTSTRAP_DOWN": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4"})
    decode = start("decode")
    assert any("REFSERVER_BOOTSTRAP_DOWN=1: the bootstrap server at" in line for line in prefill.text())
    with socket.create_connection(("127.0.0.1", prefill.bootstrap), timeout=2) as sock:  # accepted, then silence
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            sock.recv(1)
    (p_status, p_raw), (d_status, d_raw) = _pair(prefill.port, decode.port, "/v1/completions", _completion(),
                                                 bootstrap=("127.0.0.1", prefill.bootstrap))
    assert d_status == 500 and json.loads(d_raw)["message"].startswith(HANDSHAKE), d_raw
    # The prefill waited for a decode that never came (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    message = json.loads(p_raw)["message"]
    assert p_status == 500 and message.startswith("Prefill bootstrap failed for request rank=0 "), p_raw
    assert "in KVPoll.Bootstrapping" in message
    assert list(_series(_metrics(prefill.port), "sglang:num_bootstrap_failed_reqs_total").values()) == [1.0]


def test_a_prefill_request_waits_for_its_decode(start: Start) -> None:
    """A prefill's request stays in the bootstrap queue (its gauge, not num_running_reqs) until the decode comes."""
    prefill = start("prefill", env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30"})
    decode = start("decode")
    body = {**_completion(), "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap,
            "bootstrap_room": 7}
    result: list[tuple[int, bytes]] = []
    waiter = threading.Thread(target=lambda: result.append(_call(prefill.port, "/v1/completions", body)))
    waiter.start()
    deadline = time.monotonic() + 5
    while True:
        metrics = _metrics(prefill.port)
        if list(_series(metrics, "sglang:num_prefill_bootstrap_queue_reqs").values()) == [1.0]:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert list(_series(metrics, "sglang:num_running_reqs").values()) == [0.0]
    assert not result
    status, raw = _call(decode.port, "/v1/completions", body)
    waiter.join(10)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == PARIS
    assert result and result[0][0] == 200


def test_logit_noise_on_the_decode_shows_through_the_pair(start: Start) -> None:
    prefill = start("prefill")
    noisy = start("decode", env={"REFSERVER_LOGIT_NOISE": "2"})
    (p_status, _), (d_status, d_raw) = _pair(prefill.port, noisy.port, "/v1/completions", _completion(),
                                             bootstrap=("127.0.0.1", prefill.bootstrap))
    assert (p_status, d_status) == (200, 200)
    choice = json.loads(d_raw)["choices"][0]
    assert choice["text"] == PARIS  # below 2.5 the text stays
    clean = refserver.token_logprobs(FRANCE, refserver._word_tokens(PARIS), 2)["token_logprobs"]
    gaps = [abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], clean, strict=True)]
    assert gaps[0] == 0  # position 0 came from the (clean) prefill with the KV
    assert max(gaps[1:]) > 0.1, gaps


def test_a_page_size_mismatch_kills_the_decode(start: Start) -> None:
    prefill = start("prefill")
    decode = start("decode", args=("--page-size", "16"))
    body = {**_completion(), "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap, "bootstrap_room": 1}
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _call(decode.port, "/v1/completions", body, timeout=10)
    assert decode.wait_exit(10) == 1
    assert any("Scheduler hit an exception: RuntimeError: Page size mismatch: prefill server has page_size=1, "
               "but decode server has page_size=16." in line for line in decode.text())


@pytest.mark.parametrize(("argv", "message"), [
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"],
     "Prefill server does not support 'fake' as the transfer backend"),
    (["--disaggregation-transfer-backend", "rdma"], "argument --disaggregation-transfer-backend: invalid choice"),
    (["--disaggregation-bootstrap-port", "70000"], "argument --disaggregation-bootstrap-port: invalid port value"),
    (["--disaggregation-mode", "both"], "argument --disaggregation-mode: invalid choice"),
])
def test_bad_pd_flags_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        refserver.parse_args(["--model-path", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kdeploy_refserver: error: ") and message in err, err


def test_pd_flag_defaults() -> None:
    args, unknown = refserver.parse_args(["--model-path", "m", "--disaggregation-mode", "decode",
                                          "--disaggregation-transfer-backend", "fake",
                                          "--disaggregation-ib-device", "mlx5_0,mlx5_1"])
    assert not unknown
    assert (args.disaggregation_bootstrap_port, args.disaggregation_ib_device) == (8998, "mlx5_0,mlx5_1")
    assert args.load_balance_method == "round_robin"
    args, _ = refserver.parse_args(["--model-path", "m"])
    assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == ("null", "mooncake")


def test_a_two_node_prefill_registers_every_rank_with_the_head(start: Start) -> None:
    """Only the head runs the bootstrap server; the follower registers its ranks there (dist-init-addr host)."""
    dist = f"127.0.0.1:{free_port()}"
    bootstrap = free_port()
    nodes = []
    for rank in (0, 1):
        node = RefServer(tp=4, env=FAST, args=(
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap), "--nnodes", "2",
            "--node-rank", str(rank), "--dist-init-addr", dist, "--dist-timeout", "20"))
        nodes.append(node)
    try:
        head, follower = nodes
        head.wait_for(READY, timeout=20)
        follower.wait_for("Registered TP2..TP3 to the bootstrap server at http://127.0.0.1:")
        assert not any("CommonKVBootstrapServer" in line for line in follower.text())
        status, raw = _call(bootstrap, "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0")
        assert status == 200 and json.loads(raw)["rank_ip"] == "127.0.0.1"
        decode = start("decode")
        (p_status, _), (d_status, d_raw) = _pair(head.port, decode.port, "/v1/completions", _completion(),
                                                 bootstrap=("127.0.0.1", bootstrap))
        assert (p_status, d_status) == (200, 200)
        assert json.loads(d_raw)["choices"][0]["text"] == PARIS
    finally:
        for node in nodes:
            node.cleanup()


def _router_python() -> Path:
    python = router_env.venv_path() / "bin" / "python"
    if not python.exists() or shutil.which(str(python)) is None:
        pytest.skip(f"no router venv at {router_env.venv_path()} (python -m kdeploy_lab.router_env builds it)")
    return router_env.ensure_venv()


def test_the_real_router_in_pd_mode(start: Start, tmp_path: Path) -> None:
    python = _router_python()
    prefill = start("prefill")
    decode = start("decode")
    port = free_port()
    argv = router_env.router_argv(python, "127.0.0.1", port, [], prometheus_port=free_port(), health_interval=2)
    argv += ["--pd-disaggregation", "--prefill", f"http://127.0.0.1:{prefill.port}", str(prefill.bootstrap),
             "--decode", f"http://127.0.0.1:{decode.port}"]
    url = f"http://127.0.0.1:{port}"
    with router_env.running(argv, url, tmp_path / "router.log"):
        deadline = time.monotonic() + 20
        while True:
            listing = json.loads(_call(port, "/workers")[1])
            workers = {w["worker_type"]: w for w in listing["workers"]}
            if set(workers) == {"prefill", "decode"} and all(w["is_healthy"] for w in workers.values()):
                break
            assert time.monotonic() < deadline, listing
            time.sleep(0.2)
        assert workers["prefill"]["url"] == f"http://127.0.0.1:{prefill.port}"
        assert workers["prefill"]["bootstrap_port"] == prefill.bootstrap
        assert "bootstrap_port" not in workers["decode"]
        assert workers["prefill"]["metadata"]["disaggregation_mode"] == "prefill"
        assert workers["decode"]["metadata"]["disaggregation_mode"] == "decode"
        status, raw = _call(port, "/v1/completions", _completion(logprobs=None))
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["text"] == PARIS
    prefill_posts = [line for line in prefill.text() if '"POST /v1/completions HTTP/1.1" 200' in line]
    assert len(prefill_posts) == 1  # the router sent the prefill its half
