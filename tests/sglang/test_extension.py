"""The kdtree extension (kernels/kdtree) loaded by the REAL sglang==0.5.23 on CPU.

Each test is one subprocess of the cached SGLang venv's python running tests/sglang/harness.py: a launcher
that starts its "TP workers" with multiprocessing spawn, where SGLang's own ``load_plugins()`` finds the
extension through the bare dist-info on PYTHONPATH.
"""

from __future__ import annotations

import pytest

from tests.sglang.conftest import DEBIAN_PYTHON, Run, run_harness

DEFRAG = "[kdtree] defrag Tier-0"
VERIFY = "[kdtree] installed verify override"
LOADED = "[kdtree] plugin loaded"
ALL_MARKERS = (DEFRAG, VERIFY, LOADED)
ON = {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"}


def ascending_contiguous(values: list[int]) -> bool:
    return values == list(range(values[0], values[0] + len(values)))


def assert_defragmented(scenario: dict) -> None:
    tok, paged = scenario["token"], scenario["paged"]
    assert tok["need_sort"] is True and paged["need_sort"] is True
    assert tok["first"] == list(range(1, 13))
    assert tok["next"] == [3, 4, 5, 6, 7, 8]                 # the freed hole, in order
    assert paged["next"] == list(range(12, 36))              # pages 3..8, token slots 12..35
    assert ascending_contiguous(tok["next"]) and ascending_contiguous(paged["next"])


def assert_stock(scenario: dict) -> None:
    tok, paged = scenario["token"], scenario["paged"]
    assert tok["need_sort"] is False and paged["need_sort"] is False
    assert tok["next"] == [13, 14, 15, 16, 7, 8]             # never-used slots, then frees in free order
    assert not ascending_contiguous(tok["next"])
    assert [i // 4 for i in paged["next"][::4]] == [8, 6, 4, 5, 3, 7]   # freed pages reused LIFO: scattered
    assert not ascending_contiguous(paged["next"])


def by_pid(run: Run, text: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for pid in run.pids_with(text):
        counts[pid] = counts.get(pid, 0) + 1
    return counts


@pytest.fixture(scope="module")
def plugin_run(sglang_python: str) -> Run:
    """Launcher + two TP workers + one helper process titled like SGLang's detokenizer, flags on."""
    run = run_harness(sglang_python, {"launcher_plugins": True, "control": True,
                                      "workers": [{}, {}, {"title": "sglang::detokenizer", "scenario": False}]},
                      ON)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_load_plugins_installs_defrag_and_verify_override_in_every_worker(plugin_run: Run):
    workers = plugin_run.result["workers"][:2]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and all(w["exitcode"] == 0 for w in workers)
    for marker in ALL_MARKERS:                     # once per worker process, from the workers only
        assert by_pid(plugin_run, marker) == {pid: 1 for pid in pids}, (marker, plugin_run.stdout)
    for w in workers:
        assert_defragmented(w["scenario"])
        attention = w["attention"]
        assert attention["registered"] and attention["choices"] == 1
        assert attention["delegated"] == {"made_by": "triton", "runner": "RUNNER", "nsplit": 64}
        assert "delegates to sglang's stock triton attention backend" in " ".join(attention["doc"].lower().split())
        assert any(t.endswith("TokenToKVPoolAllocator.__init__") for t in w["patched"])   # via HookRegistry
    assert "nsplit=64" in next(line for line in plugin_run.stdout.splitlines() if VERIFY in line)
    assert "via sitecustomize" not in plugin_run.stdout        # the fallback stays out when the loader exists


def test_launcher_and_helper_processes_log_no_marker(plugin_run: Run):
    launcher = plugin_run.result["launcher_pid"]
    helper = plugin_run.result["workers"][2]["pid"]
    assert plugin_run.result["workers"][2]["exitcode"] == 0
    for pid in (launcher, helper):
        assert not any(pid in plugin_run.pids_with(m) for m in ALL_MARKERS)
    assert len(plugin_run.pids_with("[kdtree] loaded in the launcher")) == 1
    assert plugin_run.result["launcher_choices"] == 1          # `--attention-backend kdtree` parses there
    assert not [line for line in plugin_run.kdtree_lines() if f"pid={helper}" in line]


def test_without_the_flag_the_allocators_stay_fragmented(plugin_run: Run):
    assert_stock(plugin_run.result["control"])     # the launcher: kdtree installs no defrag there


def test_defrag_off_leaves_need_sort_alone_but_installs_the_verify_override(sglang_python: str):
    run = run_harness(sglang_python, {"workers": [{}]}, {**ON, "KDTREE_DEFRAG_SORT": "0"})
    assert run.returncode == 0, run.stdout + run.stderr
    worker = run.result["workers"][0]
    assert_stock(worker["scenario"])
    assert worker["attention"]["registered"]
    assert not run.pids_with(DEFRAG) and run.pids_with(VERIFY) == [worker["pid"]]
    assert "Tier-0 defrag off" in run.stdout


def test_verify_off_installs_nothing(sglang_python: str):
    run = run_harness(sglang_python, {"launcher_plugins": True, "workers": [{}]}, {**ON, "KDTREE_VERIFY": "off"})
    assert run.returncode == 0, run.stdout + run.stderr
    worker = run.result["workers"][0]
    assert_stock(worker["scenario"])
    assert worker["attention"] == {"choices": 0, "registered": False}
    assert run.result["launcher_choices"] == 0
    assert not any(run.pids_with(m) for m in ALL_MARKERS)
    assert not [t for t in worker["patched"] if "allocator" in t]
    assert len(run.pids_with("[kdtree] disabled by KDTREE_VERIFY=off")) == 2     # launcher + worker


@pytest.mark.parametrize(("nsplit", "where"), [("abc", "launcher"), ("48", "worker")])
def test_bad_nsplit_fails_at_start_with_one_line(sglang_python: str, nsplit: str, where: str):
    options = {"launcher_plugins": where == "launcher", "workers": [{}]}
    run = run_harness(sglang_python, options, {**ON, "KDTREE_NSPLIT": nsplit})
    fatal = [line for line in run.stdout.splitlines() if "[kdtree] FATAL" in line]
    assert len(fatal) == 1, run.stdout
    assert f"KDTREE_NSPLIT='{nsplit}' is not a power of two in 1..1024" in fatal[0]
    assert not any(run.pids_with(m) for m in ALL_MARKERS)
    if where == "launcher":        # the launcher loads plugins first: it exits before any worker starts
        assert run.returncode == 1 and not run.result
        assert "Traceback" not in run.stderr
    else:                          # load_plugins() swallows Exception, not kdtree's ConfigError (SystemExit)
        assert run.returncode == 0
        assert run.result["workers"][0]["exitcode"] == 1 and "scenario" not in run.result["workers"][0]


def test_sitecustomize_fallback_installs_once_without_the_plugin_loader(sglang_python: str):
    """KDTREE_LOADER=sitecustomize: post-import hooks install everything as SGLang's modules get imported;
    a later load_plugins() (which also calls the entry point) does not install anything twice."""
    options = {"workers": [{"import_targets": True, "then_load_plugins": True}]}
    run = run_harness(sglang_python, options, {**ON, "KDTREE_LOADER": "sitecustomize"})
    assert run.returncode == 0, run.stdout + run.stderr
    worker = run.result["workers"][0]
    assert_defragmented(worker["scenario"])
    assert worker["attention"]["registered"] and worker["attention"]["choices"] == 1
    for marker in ALL_MARKERS:
        assert run.pids_with(marker) == [worker["pid"]], run.stdout
    assert "via sitecustomize" in run.stdout and "wrapped __init__" in run.stdout
    assert worker["patched"] == []     # the entry point ran too, but found everything installed: no HookRegistry


def test_without_sglang_the_extension_logs_skipped_lines_and_no_marker():
    run = run_harness(DEBIAN_PYTHON, {"workers": [{"entry_point": True, "scenario": False}] * 2}, ON)
    assert run.returncode == 0, run.stdout + run.stderr
    pids = {w["pid"] for w in run.result["workers"]}
    assert by_pid(run, "[kdtree] Tier-0 defrag skipped: sglang not importable") == {p: 1 for p in pids}
    assert by_pid(run, "[kdtree] verify override skipped: sglang not importable") == {p: 1 for p in pids}
    assert not run.pids_with(DEFRAG) and not run.pids_with(VERIFY)
    assert by_pid(run, LOADED) == {p: 1 for p in pids}
