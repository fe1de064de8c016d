"""kdeploy/hooks.py and the inventory's ``hooks:``: layered settings, the KDEPLOY_* variables, and the
executor (exit codes, output, timeout and Ctrl-C killing the whole process group) with real /bin/sh."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kdeploy import hooks
from kdeploy.errors import InvalidInput
from kdeploy.inventory import Inventory, parse
from kdeploy.report import HostResult, Report


def _inventory(tmp_path: Path, **levels: dict) -> Inventory:
    raw = {
        "defaults": {"service": {"name": "svc", "python": "/usr/bin/python3", "sglang": {"model_path": "/m"}},
                     **levels.get("defaults", {})},
        "groups": {"canary": {"hosts": ["a"], **levels.get("group", {})}},
        "hosts": {"a": {"address": "10.0.0.1", **levels.get("a", {})},
                  "b": {"address": "10.0.0.2", **levels.get("b", {})}},
    }
    return parse(raw, tmp_path / "inventory.yaml")


def test_hooks_merge_key_by_key_across_levels_and_null_turns_one_off(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"pre_host": "lb out", "post_rollout": "notify", "timeout": 5}},
                     group={"hooks": {"post_host": "lb in"}}, a={"hooks": {"pre_host": None}})
    a, b = inv.hosts["a"].hooks, inv.hosts["b"].hooks
    assert (a.pre_host, a.post_host, a.post_rollout, a.timeout) == (None, "lb in", "notify", 5)
    assert (b.pre_host, b.post_host, b.post_rollout, b.timeout) == ("lb out", None, "notify", 5)


def test_no_hooks_by_default(tmp_path: Path) -> None:
    h = _inventory(tmp_path).hosts["a"].hooks
    assert (h.pre_host, h.post_host, h.post_rollout, h.timeout) == (None, None, None, 60)


@pytest.mark.parametrize(("hooks_value", "message"), [
    ({"pre_host": "  "}, "hosts.a.hooks.pre_host: is empty"),
    ({"timeout": 0}, "hosts.a.hooks.timeout: Input should be greater than 0"),
    ({"pre_hosts": "x"}, "hosts.a.hooks.pre_hosts: unknown key (did you mean 'pre_host'?)"),
])
def test_bad_hooks_are_one_line_errors_naming_the_key(tmp_path: Path, hooks_value: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        _inventory(tmp_path, a={"hooks": hooks_value})


def test_host_env_before_and_after(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    host = inv.hosts["a"]
    before = hooks.host_env(inv, host, hook="pre_host", command="push", release="r2", previous="r1", batch=2)
    assert before == {
        "KDEPLOY_HOOK": "pre_host", "KDEPLOY_COMMAND": "push", "KDEPLOY_INVENTORY": str(tmp_path / "inventory.yaml"),
        "KDEPLOY_HOST": "a", "KDEPLOY_ADDRESS": "10.0.0.1", "KDEPLOY_SERVICE": "svc", "KDEPLOY_SERVICE_PORT": "30000",
        "KDEPLOY_WORKER_URL": "", "KDEPLOY_RELEASE": "r2", "KDEPLOY_PREVIOUS_RELEASE": "r1", "KDEPLOY_BATCH": "2",
        "KDEPLOY_PRE_HOST": "", "KDEPLOY_RESULT": "", "KDEPLOY_EXIT_CODE": "", "KDEPLOY_ERROR": "",
    }
    assert set(before) == set(hooks.HOST_VARS)
    result = HostResult("a", release="r1").finish("rolled_back", "gate failed:\n  no Paris")
    after = hooks.host_env(inv, host, hook="post_host", command="push", previous="r1", batch=2, pre_host="ok",
                           result=result)
    assert {k: after[k] for k in ("KDEPLOY_RELEASE", "KDEPLOY_RESULT", "KDEPLOY_EXIT_CODE", "KDEPLOY_ERROR",
                                  "KDEPLOY_PRE_HOST")} == {
        "KDEPLOY_RELEASE": "r1", "KDEPLOY_RESULT": "rolled_back", "KDEPLOY_EXIT_CODE": "4",
        "KDEPLOY_ERROR": "gate failed: no Paris", "KDEPLOY_PRE_HOST": "ok"}


def test_rollout_env_summarises_the_hosts_of_the_hook(tmp_path: Path) -> None:
    inv = _inventory(tmp_path)
    report = Report("set-env", [HostResult("a").finish("deployed"), HostResult("b").finish("preflight_refused", "x")])
    env = hooks.rollout_env(inv, report, ["a", "b"])
    assert {k: env[k] for k in ("KDEPLOY_COMMAND", "KDEPLOY_HOSTS", "KDEPLOY_FAILED", "KDEPLOY_RESULTS",
                                "KDEPLOY_EXIT_CODE", "KDEPLOY_SERVICE")} == {
        "KDEPLOY_COMMAND": "set-env", "KDEPLOY_HOSTS": "a b", "KDEPLOY_FAILED": "b",
        "KDEPLOY_RESULTS": "a=deployed b=preflight_refused", "KDEPLOY_EXIT_CODE": "7", "KDEPLOY_SERVICE": "svc"}


def test_hooks_never_get_the_inventorys_secrets_nor_stale_hook_variables(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, a={"router": {"url": "http://10.0.0.9:30080", "api_key_env": "ROUTER_KEY"}},
                     b={"service": {"environment_file": "/etc/svc.env", "secrets": {"env": ["HF_TOKEN"]}}})
    env = hooks.base_env({"PATH": "/bin", "ROUTER_KEY": "s3cret", "HF_TOKEN": "hf_x", "KDEPLOY_RESULT": "deployed",
                          "KDEPLOY_INVENTORY": "/x", "CHAT_WEBHOOK": "https://hook"}, inv)
    assert env == {"PATH": "/bin", "CHAT_WEBHOOK": "https://hook"}


def _run(command: str, tmp_path: Path, timeout: float = 10, stop: threading.Event | None = None,
         lines: list[str] | None = None) -> hooks.Outcome:
    return hooks.execute(command, {"PATH": os.environ["PATH"], "NAME": "a"}, cwd=str(tmp_path), timeout=timeout,
                         stop=stop or threading.Event(), label="a pre_host",
                         echo=(lines if lines is not None else []).append)


def test_exit_status_output_and_working_directory(tmp_path: Path) -> None:
    lines: list[str] = []
    ok = _run('echo "hello $NAME"; pwd > where', tmp_path, lines=lines)
    assert ok == hooks.Outcome(True, "exit 0: hello a")
    assert lines == ["a pre_host: hello a"]
    assert (tmp_path / "where").read_text().strip() == str(tmp_path)
    bad = _run('echo first; echo "maintenance window" >&2; exit 3', tmp_path)
    assert bad == hooks.Outcome(False, "exit 3: maintenance window")
    assert _run("kill -9 $$", tmp_path) == hooks.Outcome(False, "killed by signal 9")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    started = time.monotonic()
    out = _run("sleep 30 & echo $! > child; echo waiting; wait", tmp_path, timeout=0.5)
    assert out == hooks.Outcome(False, "timed out after 0.5s: waiting")
    assert time.monotonic() - started < 10
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_stop_interrupts_a_running_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "KILL_GRACE", 0.2)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    out = _run("trap '' TERM; echo busy; sleep 30", tmp_path, stop=stop)  # ignores SIGTERM: SIGKILL follows
    assert out == hooks.Outcome(False, "interrupted: busy", interrupted=True)


def test_a_failing_pre_host_refuses_the_host_and_post_host_runs_once(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"pre_host": "echo no >&2; exit 1",
                                                   "post_host": 'echo "$KDEPLOY_RESULT $KDEPLOY_PRE_HOST" >> post'}})
    runner = hooks.Runner(inv, "push", threading.Event(), echo=lambda line: None, environ=os.environ)
    result = HostResult("a")
    assert not runner.pre_host(inv.hosts["a"], result, "r2", "r1", 1)
    assert (result.result, result.exit_code, result.release) == ("preflight_refused", 7, "r1")
    assert result.error == "pre_host hook refused the host (exit 1: no); host untouched"
    runner.post_host(inv.hosts["a"], result)
    runner.post_host(inv.hosts["a"], result)
    assert (tmp_path / "post").read_text() == "preflight_refused failed\n"
    assert [(p.name, p.ok) for p in result.phases] == [("pre_host", False), ("post_host", True)]


def test_a_failing_post_host_is_a_failed_phase_and_the_result_stands(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"post_host": "exit 2"}})
    runner = hooks.Runner(inv, "push", threading.Event(), echo=lambda line: None, environ=os.environ)
    result = HostResult("b")
    assert runner.pre_host(inv.hosts["b"], result, "r2", "r1", 1)  # no pre_host: no phase
    result.finish("deployed")
    runner.post_host(inv.hosts["b"], result)
    assert (result.result, result.ok) == ("deployed", True)
    assert [(p.name, p.ok, p.detail) for p in result.phases] == [("post_host", False, "exit 2")]


def test_post_rollout_runs_once_per_distinct_command(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"post_rollout": 'echo "all $KDEPLOY_HOSTS" >> log'}},
                     a={"hooks": {"post_rollout": 'echo "own $KDEPLOY_HOSTS"; exit 1'}})
    report = Report("push", [HostResult("a").finish("deployed"), HostResult("b").finish("unchanged")])
    lines: list[str] = []
    hooks.post_rollout(inv, report, echo=lines.append, environ=os.environ)
    assert (tmp_path / "log").read_text() == "all b\n"
    assert [(r["name"], r["ok"], r["detail"]) for r in report.extra["post_rollout"]] == [
        ("post_rollout", False, "exit 1: own a"), ("post_rollout", True, "exit 0")]
    assert lines == ["post_rollout: own a", "kdeploy: post_rollout hook failed: exit 1: own a"]
    assert report.exit_code == 0


def test_ctrl_c_during_pre_host_ends_the_host_interrupted_and_post_host_still_runs(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"pre_host": "sleep 30", "post_host": "echo $KDEPLOY_RESULT > post"}})
    cancel = threading.Event()
    runner = hooks.Runner(inv, "push", cancel, echo=lambda line: None, environ=os.environ)
    result = HostResult("a")
    threading.Timer(0.2, cancel.set).start()
    assert not runner.pre_host(inv.hosts["a"], result, "r2", "r1", 1)
    assert (result.result, result.exit_code) == ("interrupted", 130)
    runner.post_host(inv.hosts["a"], result)
    assert (tmp_path / "post").read_text() == "interrupted\n"
