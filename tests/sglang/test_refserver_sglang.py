"""The reference server in the CPU SGLang venv builds a real KV allocator in each worker, as ModelRunner does:
with the kdtree payload and KDTREE_DEFRAG_SORT=1 it ends with need_sort=True, and each worker logs both
markers once. Without sglang (Debian's python) the workers log that they skipped the allocator."""

from __future__ import annotations

import ast
import re
import socket
import subprocess
import time
from pathlib import Path

from kdeploy.core import analysis
from kdeploy.host import parity
from kdeploy_lab import refserver
from tests.sglang.conftest import DEBIAN_PYTHON, REPO, run_python

READY = "The server is fired up and ready to roll!"
ALLOCATOR_RE = re.compile(r"\[\S+ \S+ TP(\d)\] KV allocator TokenToKVPoolAllocator need_sort=(True|False)$")
SKIPPED_RE = re.compile(r"\[\S+ \S+ TP(\d)\] KV allocator skipped: sglang not importable")
ON = {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ready(python: str, env: dict[str, str], tp: int = 2, timeout: float = 240) -> list[str]:
    """Start the refserver, wait for readiness, SIGTERM it; its log lines."""
    argv = [str(REPO / "lab" / "kdeploy_lab" / "refserver.py"), "--model-path", "/models/m", "--tp-size", str(tp),
            "--port", str(_free_port()), "--attention-backend", "kdtree"]
    script = ("import subprocess, sys, time, signal\n"
              f"p = subprocess.Popen([sys.executable, *{argv!r}], stdout=subprocess.PIPE, text=True)\n"
              "lines = []\n"
              f"deadline = time.monotonic() + {timeout}\n"
              "for line in p.stdout:\n"
              "    lines.append(line.rstrip('\\n'))\n"
              f"    if {READY!r} in line or time.monotonic() > deadline:\n"
              "        break\n"
              "p.send_signal(signal.SIGTERM)\n"
              "rest = p.communicate(timeout=30)[0]\n"
              "print('\\n'.join(lines + rest.splitlines()))\n")
    run = run_python(python, ["-c", script], env, timeout=timeout + 60)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()


def test_refserver_workers_build_a_real_allocator(sglang_python: str):
    """(need_sort=False without the flag is covered by test_extension's defrag-off and control runs.)"""
    start = time.monotonic()
    lines = serve_until_ready(sglang_python, ON)
    assert READY in "\n".join(lines), "\n".join(lines)
    found = {int(m.group(1)): m.group(2) for m in map(ALLOCATOR_RE.search, lines) if m}
    assert found == {0: "True", 1: "True"}, "\n".join(lines)
    defrag = [line for line in lines if "[kdtree] defrag Tier-0" in line]
    verify = [line for line in lines if "[kdtree] installed verify override" in line]
    assert len(defrag) == 2 and len(verify) == 2
    assert sorted(line.split("rank=")[1][0] for line in defrag + verify) == ["0", "0", "1", "1"]
    print(f"tp=2 refserver ready in the SGLang venv after {time.monotonic() - start:.1f}s")


def test_refserver_without_sglang_skips_the_allocator():
    lines = serve_until_ready(DEBIAN_PYTHON, ON)
    assert READY in "\n".join(lines)
    assert sorted(int(m.group(1)) for m in map(SKIPPED_RE.search, lines) if m) == [0, 1]
    assert not any("[kdtree] defrag Tier-0" in line or "[kdtree] installed verify override" in line
                   for line in lines)
    assert len([line for line in lines if "[kdtree] Tier-0 defrag skipped: sglang not importable" in line]) == 2


def test_refserver_stays_stdlib_only_at_import():
    code = ("import sys; sys.path.insert(0, 'lab/kdeploy_lab'); import refserver; "
            "heavy = [m for m in ('torch', 'sglang', 'numpy') if m in sys.modules]; print(heavy)")
    out = subprocess.run([DEBIAN_PYTHON, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def _sglang_source(python: str, relative: str) -> str:
    """A source file of the venv's sglang package, found without importing it."""
    code = "import importlib.util; print(importlib.util.find_spec('sglang').submodule_search_locations[0])"
    root = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return (Path(root) / relative).read_text()


def _class_fields(source: str, name: str) -> list[str]:
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)
    return [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)]


def _histogram_buckets(source: str, name: str) -> tuple[float, ...]:
    """The literal ``buckets=[...]`` of the ``Histogram(name=name, ...)`` call."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(kw.get("name"), ast.Constant) and kw["name"].value == name:
                return tuple(float(ast.literal_eval(e)) for e in kw["buckets"].elts)
    raise AssertionError(f"no histogram {name} in the source")


def _list_literal(source: str, variable: str) -> tuple[float, ...]:
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == variable and isinstance(node.value, ast.List)):
            return tuple(float(ast.literal_eval(e)) for e in node.value.elts)
    raise AssertionError(f"no list {variable} in the source")


def test_logprobs_shape_and_metric_families_are_sglangs(sglang_python: str):
    """Issue 29: what the parity phase and canary analysis read from the reference server is what SGLang
    0.5.23 itself defines: the completions ``LogProbs`` fields, the ``logprobs: int`` request field, and the
    metric names and bucket bounds of its metrics collector."""
    protocol = _sglang_source(sglang_python, "srt/entrypoints/openai/protocol.py")
    assert sorted(_class_fields(protocol, "LogProbs")) == sorted(
        refserver.token_logprobs("The capital of France is", ["Paris."], 2))
    request = _class_fields(protocol, "CompletionRequest")
    assert set(parity.request_body("m", "p", parity.ParitySpec(
        prompts=["p"], max_tokens=8, top_logprobs=5, match_tokens=8, logprob_tolerance=0.1))) <= set(request)
    collector = _sglang_source(sglang_python, "srt/observability/metrics_collector.py")
    names = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', collector))
    exported = {analysis.TTFT, analysis.ITL, analysis.E2E, analysis.REQUESTS, analysis.ABORTED, analysis.GENERATED,
                analysis.ACCEPT_LENGTH, "sglang:queue_time_seconds", "sglang:prompt_tokens_total",
                "sglang:gen_throughput", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                "sglang:spec_accept_rate", "sglang:spec_verify_calls_total"}
    assert exported <= names, exported - names
    assert _list_literal(collector, "bucket_time_to_first_token") == refserver.TTFT_BUCKETS
    assert _list_literal(collector, "bucket_inter_token_latency") == refserver.ITL_BUCKETS
    assert _list_literal(collector, "bucket_e2e_request_latency") == refserver.E2E_BUCKETS
    assert _histogram_buckets(collector, "sglang:queue_time_seconds") == refserver.QUEUE_BUCKETS


def _str_list(source: str, variable: str) -> tuple[str, ...]:
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == variable and isinstance(node.value, ast.List)):
            return tuple(ast.literal_eval(e) for e in node.value.elts)
    raise AssertionError(f"no list {variable} in the source")


def test_pd_names_and_messages_are_sglangs(sglang_python: str):
    """Issue 41: the prefill/decode modes' choices, fake bootstrap host, gauges and error messages are SGLang
    0.5.23's (read from its source; a real pair cannot run here: no mooncake or nixl in the CPU venv)."""
    choices = _sglang_source(sglang_python, "srt/arg_groups/choices.py")
    assert _str_list(choices, "DISAGG_TRANSFER_BACKEND_CHOICES") == refserver._TRANSFER_BACKENDS
    fields = _sglang_source(sglang_python, "srt/arg_groups/fields/disagg.py")
    assert re.search(r"disaggregation_bootstrap_port: A\[\s*int, [^]]*\] = " + str(refserver.BOOTSTRAP_PORT), fields)
    utils = _sglang_source(sglang_python, "srt/disaggregation/utils.py")
    assert f'FAKE_BOOTSTRAP_HOST = "{refserver.FAKE_BOOTSTRAP_HOST}"' in utils
    hook = _sglang_source(sglang_python, "srt/arg_groups/pd_disaggregation_hook.py")
    assert "Prefill server does not support 'fake' as the transfer backend" in hook
    decode = _sglang_source(sglang_python, "srt/disaggregation/decode.py")
    assert ('f"Decode handshake failed for request rank={self.tp_rank} {decode_req.req.rid=} '
            '{decode_req.req.bootstrap_room=}"') in decode
    prefill = _sglang_source(sglang_python, "srt/disaggregation/prefill.py")
    assert 'f"Prefill bootstrap failed for request rank={get_parallel().tp_rank} "' in prefill
    scheduler = _sglang_source(sglang_python, "srt/managers/scheduler.py")
    assert 'f"bootstrap room id. {req.rid=}"' in scheduler
    collector = _sglang_source(sglang_python, "srt/observability/metrics_collector.py")
    names = set(re.findall(r'name="(sglang:[a-z0-9_]+)"', collector))
    pd = {"sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
          "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
          "sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total"}
    assert pd <= names, pd - names
    source = (REPO / "lab" / "kdeploy_lab" / "refserver.py").read_text()
    assert all(f'"{name}"' in source for name in pd)
