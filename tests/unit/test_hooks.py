"""kdeploy/flows/hooks.py and the inventory's ``hooks:``: layered settings, the KDEPLOY_* variables, and the
executor (exit codes, output, timeout and Ctrl-C killing the whole process group) with real /bin/sh."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kdeploy.core.errors import InvalidInput
from kdeploy.core.inventory import Inventory, load, parse
from kdeploy.core.report import HostResult, Report
from kdeploy.flows import fleet, hooks
from kdeploy.ssh.remote import Remote

REPO = Path(__file__).resolve().parents[2]


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
        "KDEPLOY_INVENTORY_FILE": str(tmp_path / "inventory.yaml"),
        "KDEPLOY_HOST": "a", "KDEPLOY_ADDRESS": "10.0.0.1", "KDEPLOY_SERVICE_NAME": "svc",
        "KDEPLOY_SERVICE_PORT": "30000",
        "KDEPLOY_WORKER_URL": "", "KDEPLOY_RELEASE": "r2", "KDEPLOY_PREVIOUS_RELEASE": "r1", "KDEPLOY_BATCH": "2",
        "KDEPLOY_PRE_HOST": "", "KDEPLOY_RESULT": "", "KDEPLOY_EXIT_CODE": "", "KDEPLOY_ERROR": "",
    }
    assert set(before) == {*hooks.HOST_VARS, "KDEPLOY_INVENTORY"}  # no KDEPLOY_SERVICE: not an Ansible inventory
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
                                "KDEPLOY_EXIT_CODE", "KDEPLOY_SERVICE_NAME")} == {
        "KDEPLOY_COMMAND": "set-env", "KDEPLOY_HOSTS": "a b", "KDEPLOY_FAILED": "b",
        "KDEPLOY_RESULTS": "a=deployed b=preflight_refused", "KDEPLOY_EXIT_CODE": "7", "KDEPLOY_SERVICE_NAME": "svc"}
    assert "KDEPLOY_SERVICE" not in env


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


def test_an_ansible_inventory_gives_hooks_the_clis_own_inventory_and_service_file(tmp_path: Path) -> None:
    inv = replace(_inventory(tmp_path), path=tmp_path / "service.yaml", source=tmp_path / "hosts.ini")
    env = hooks.host_env(inv, inv.hosts["a"], hook="pre_host", command="push")
    assert (env["KDEPLOY_INVENTORY"], env["KDEPLOY_SERVICE"], env["KDEPLOY_SERVICE_NAME"]) == (
        str(tmp_path / "hosts.ini"), str(tmp_path / "service.yaml"), "svc")


def test_kdeploy_run_inside_a_hook_acts_on_the_hooks_inventory(tmp_path: Path) -> None:
    """The variables a hook gets never break a kdeploy it runs: `kdeploy render $KDEPLOY_HOSTS` exited 2
    when KDEPLOY_SERVICE (the CLI's --service default) held the service's name."""
    inv = load(REPO / "inventory.yaml")
    report = Report("push", [HostResult(n).finish("deployed") for n in inv.hosts])
    env = {**hooks.base_env(os.environ, inv), **hooks.rollout_env(inv, report, list(inv.hosts))}
    lines: list[str] = []
    render = f'"{sys.executable}" -m kdeploy render "$(echo $KDEPLOY_HOSTS | tr " " ,)"'
    out = hooks.execute(f'{render} | grep -c "^ExecStart="', env, cwd=str(tmp_path), timeout=60,
                        stop=threading.Event(), label="post_rollout", echo=lines.append)
    assert out.ok, lines
    assert lines == [f"post_rollout: {len(inv.hosts)}"]


def test_pre_deploy_runs_once_per_distinct_command_and_the_first_failure_ends_it(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, defaults={"hooks": {"pre_deploy": 'echo "go $KDEPLOY_COMMAND $KDEPLOY_HOSTS"'}},
                     b={"hooks": {"pre_deploy": 'echo "b is frozen: $KDEPLOY_HOSTS"; exit 4'}})
    lines: list[str] = []
    runs, failed = hooks.pre_deploy(inv, "set-env", ["a", "b"], threading.Event(), echo=lines.append,
                                    environ={"PATH": os.environ["PATH"]})
    assert lines == ["pre_deploy: go set-env a", "pre_deploy: b is frozen: b"]
    assert [(r["name"], r["ok"], r["detail"]) for r in runs] == [
        ("pre_deploy", True, "exit 0: go set-env a"), ("pre_deploy", False, "exit 4: b is frozen: b")]
    assert failed is not None and failed.detail == "exit 4: b is frozen: b"
    results = [HostResult("a"), HostResult("b")]
    hooks.refuse_run(results, failed)
    assert {(r.result, r.exit_code, r.error) for r in results} == {
        ("preflight_refused", 7, "pre_deploy hook refused the run (exit 4: b is frozen: b); no host touched")}
    assert hooks.pre_deploy(inv, "push", ["a"], threading.Event(), echo=lines.append,
                            environ={"PATH": os.environ["PATH"]})[1] is None


def test_a_failing_pre_deploy_stops_the_push_before_any_host_is_contacted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ssh(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host was contacted")

    monkeypatch.setattr(Remote, "connect", no_ssh)
    text = (REPO / "inventory.yaml").read_text().replace(
        "defaults:\n", "defaults:\n  hooks:\n    pre_deploy: echo change freeze; exit 1\n"
                       "    post_rollout: echo \"after $KDEPLOY_EXIT_CODE\"\n", 1)
    (tmp_path / "inventory.yaml").write_text(text)
    for sub in ("kernels", "templates"):
        (tmp_path / sub).symlink_to(REPO / sub)
    lines: list[str] = []
    monkeypatch.setattr(hooks, "to_stderr", lines.append)
    monkeypatch.setattr(hooks.pre_deploy, "__defaults__", (lines.append, None))
    monkeypatch.setattr(hooks.post_rollout, "__defaults__", (lines.append, None))
    report = fleet.push(load(tmp_path / "inventory.yaml"), "all")
    assert report.exit_code == 7
    assert [(h.result, h.phases, h.error) for h in report.hosts] == [
        ("preflight_refused", [], "pre_deploy hook refused the run (exit 1: change freeze); no host touched")] * 2
    assert report.extra["pre_deploy"][0]["detail"] == "exit 1: change freeze"
    assert lines == ["pre_deploy: change freeze", "post_rollout: after 7"]
