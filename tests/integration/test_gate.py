"""The health gate and rollback against real sandbox hosts: every fault the reference server can fake.

Each test is its own service on the session fleet (see tests/conftest.py). Failures that need a previous
release to roll back to push a healthy release first; gate timeouts are short wherever a failure is expected,
except where the point is that the gate fails fast regardless of its timeout.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from kdeploy.flows import fleet
from kdeploy.flows.options import Options
from kdeploy_lab.demo import PLUGIN_LOADED
from kdeploy_lab.refserver import READY_MESSAGE
from tests.conftest import TEST_MARKER, Deployment

GATE_PHASES = ["unit", "ready", "completion", "workers"]
# The unit settings the conftest's demo service uses; `set_service(unit=...)` replaces the whole mapping.
UNIT = {"timeout_start_sec": 120, "timeout_stop_sec": 20, "restart_sec": 2}


def gate(timeout: float, **extra: object) -> dict:
    """A whole gate mapping (set_service replaces it): 8 workers, fast polling, the test plugin's marker."""
    return {"workers": 8, "poll_interval": 0.25, "markers": [TEST_MARKER], "timeout": timeout, **extra}


def phase(host: dict, name: str) -> dict:
    found = [p for p in host["phases"] if p["name"] == name]
    assert found, f"no {name!r} phase in {[p['name'] for p in host['phases']]}"
    return found[-1]


def failed_phase(host: dict) -> dict:
    failed = [p for p in host["phases"] if not p["ok"]]
    assert failed, f"no failed phase: {host['phases']}"
    return failed[0]


def sha(dep: Deployment, path: str, host: str = "h1") -> str:
    return dep.sh(host, f"sha256sum < {path}").split()[0]


def assert_unit_of(dep: Deployment, release: str, host: str = "h1") -> None:
    """The installed unit is byte for byte the one recorded with ``release``."""
    installed = sha(dep, dep.unit_path, host)
    assert installed == sha(dep, f"{dep.service_dir}/releases/{release}/.kdeploy/unit.service", host)


def push_good(dep: Deployment, capsys: pytest.CaptureFixture[str]) -> str:
    code, doc = dep.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert doc["hosts"][0]["result"] == "deployed"
    return doc["hosts"][0]["release"]


def assert_rolled_back(dep: Deployment, code: int, doc: dict, previous: str) -> dict:
    """Exit 4, result rolled_back, and the host really is on ``previous`` again, healthy."""
    host = doc["hosts"][0]
    assert code == 4, doc
    assert host["result"] == "rolled_back"
    assert host["release"] == previous
    rollback = phase(host, "rollback")
    assert rollback["ok"] and f"back on {previous}" in rollback["detail"], rollback
    assert dep.current() == previous
    assert_unit_of(dep, previous)
    assert dep.show("h1", "ActiveState") == "active"
    return host


def marker_lines(dep: Deployment, match: str, host: str = "h1") -> int:
    out = dep.sh(host, f"journalctl --no-pager {match} -o cat | grep -cF '{TEST_MARKER}' || true")
    return int(out.strip() or 0)


def test_healthy_push_passes_all_four_phases_and_verify_counts_workers(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    host = doc["hosts"][0]
    assert host["result"] == "deployed"
    gates = [p for p in host["phases"] if p["name"] in GATE_PHASES]
    assert [p["name"] for p in gates] == GATE_PHASES
    for p in gates:
        assert p["ok"] and p["detail"], p
    assert "active/running" in phase(host, "unit")["detail"]
    assert "200" in phase(host, "ready")["detail"]
    assert "Paris" in phase(host, "completion")["detail"]
    assert "x 8 workers" in phase(host, "workers")["detail"]

    code, doc = deployment.json(capsys, "verify", "test", "--workers", "8")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert doc["hosts"][0]["result"] == "healthy"
    assert doc["hosts"][0]["release"] == host["release"]

    code, doc = deployment.json(capsys, "verify", "test", "--workers", "7")
    assert code == 4, doc
    host = doc["hosts"][0]
    assert host["result"] == "unhealthy"
    workers = failed_phase(host)
    assert workers["name"] == "workers"
    assert "8/7" in workers["detail"]


def test_gate_reaches_a_service_bound_to_an_address_of_the_host(deployment: Deployment,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Bound to the host's own (non-loopback) address, the server is not on 127.0.0.1: the gate dials that
    address through SSH, and passes well within its timeout."""
    address = deployment.load().hosts["h1"].address
    deployment.edit(lambda doc: doc["defaults"]["service"]["sglang"].update(host=address))
    deployment.set_service(gate=gate(30))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert phase(doc["hosts"][0], "ready")["seconds"] < 20
    assert f"{address}:{deployment.port}" in deployment.sh("h1", f"ss -Hltn 'sport = :{deployment.port}'")
    code, doc = deployment.json(capsys, "verify", "test")
    assert code == 0 and doc["hosts"][0]["result"] == "healthy", doc


def test_non_ascii_marker_is_counted_in_every_worker(deployment: Deployment,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """journald keeps the marker as UTF-8 and journalctl's JSON writes it so: the gate must find it there."""
    marker = '[kdeploy-testplugin] geladen ✓ Größe "日本"'
    deployment.set_service(env={"KDEPLOY_TESTPLUGIN_MARKER": marker}, gate=gate(30, markers=[marker]))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert phase(doc["hosts"][0], "workers")["detail"] == "1 markers x 8 workers"


def test_exit_at_start_fails_fast_and_rolls_back(deployment: Deployment,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_EXIT_AT_START": "3"}, gate=gate(120))
    started = time.monotonic()
    code, doc = deployment.json(capsys, "push", "test")
    took = time.monotonic() - started
    host = assert_rolled_back(deployment, code, doc, previous)
    failed = failed_phase(host)
    assert failed["name"] in ("unit", "ready"), failed
    assert failed["seconds"] < 15, f"the gate waited {failed['seconds']}s for a process that exited at once"
    assert took < 60
    # the last journal lines of the failed run come with the report
    assert any("REFSERVER_EXIT_AT_START=3" in line for line in host["log"]), host.get("log")
    code, doc = deployment.json(capsys, "verify", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert doc["hosts"][0]["result"] == "healthy"
    assert doc["hosts"][0]["release"] == previous


def test_crash_loop_is_detected_and_rolled_back(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_DIE_RANK": "2"}, unit={**UNIT, "restart_sec": 1}, gate=gate(30))
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, previous)
    failed = failed_phase(host)
    assert failed["name"] in ("unit", "ready"), failed
    assert "crash loop" in failed["detail"] or "died" in failed["detail"], failed
    assert failed["seconds"] < 20


def test_main_process_killed_while_loading_is_reported_at_once(deployment: Deployment,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_SLOW_START": "30"}, gate=gate(90))
    marks: dict[str, float] = {}

    def watchers() -> str:
        return deployment.sh("h1", "pgrep -fc '[w]hile \\[ -d /proc/' || true").strip()

    def kill_main() -> None:
        time.sleep(1.5)  # well inside `ready`, past its first once-a-second unit read
        marks["watchers"] = watchers()
        marks["killed"] = time.time()
        deployment.sh("h1", f"systemctl kill -s KILL --kill-whom=main {deployment.service}")

    def listener(host: str, name: str, status: str) -> None:
        if (name, status) == ("ready", "start"):
            threading.Thread(target=kill_main, daemon=True).start()
        if (name, status) == ("ready", "fail"):
            marks["reported"] = time.time()

    report = fleet.push(deployment.load(), "test", Options(), listener=listener)
    host = report.hosts[0]
    assert host.result == "rolled_back" and host.release == previous, report.as_json()
    assert "service died while starting" in host.error
    latency = marks["reported"] - marks["killed"]
    print(f"main process killed -> gate failed in {latency:.3f}s (poll interval 0.25s)")
    assert 0 < latency < 2.0
    # the exit watchers on the host end with the deploy's connection (within their 0.1 s sleep)
    time.sleep(0.5)
    assert (marks["watchers"], watchers()) == ("1", "0")


def test_slow_start_passes_and_readiness_is_noticed_at_once(deployment: Deployment) -> None:
    deployment.set_service(env={"REFSERVER_SLOW_START": "6"}, gate=gate(90))
    marks: dict[str, float] = {}

    def listener(host: str, name: str, status: str) -> None:
        if (name, status) == ("ready", "ok"):
            marks["ready"] = time.time()

    report = fleet.push(deployment.load(), "test", Options(), listener=listener)
    host = report.hosts[0]
    assert report.exit_code == 0, report.as_json()
    assert host.result == "deployed"
    ready = next(p for p in host.phases if p.name == "ready")
    assert ready.seconds >= 5  # it really waited through the slow start, within the gate timeout
    invocation = deployment.show("h1", "InvocationID")
    out = deployment.sh("h1", f"journalctl --no-pager _SYSTEMD_INVOCATION_ID={invocation} -o json")
    stamps = [int(rec["__REALTIME_TIMESTAMP"]) / 1e6 for rec in map(json.loads, out.splitlines())
              if READY_MESSAGE in str(rec.get("MESSAGE", ""))]
    assert len(stamps) == 1, out[-2000:]
    latency = marks["ready"] - stamps[0]
    print(f"readiness noticed {latency:.3f}s after the server logged it (poll interval 0.25s)")
    assert 0 <= latency < 2.5


def test_wrong_answer_fails_completion_and_rolls_back(deployment: Deployment,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_WRONG_ANSWER": "1"}, gate=gate(30))
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, previous)
    failed = failed_phase(host)
    assert failed["name"] == "completion"
    assert "Lyon" in failed["detail"]
    assert "/\\bParis\\b/" in failed["detail"]  # the pattern it did not match
    assert "does not match" in failed["detail"]


def test_nondeterministic_answer_fails_completion(deployment: Deployment,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_NONDETERMINISTIC": "1"}, gate=gate(30))
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, previous)
    failed = failed_phase(host)
    assert failed["name"] == "completion"
    assert "not deterministic" in failed["detail"]


def test_worker_without_the_extension_fails_workers_phase(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    previous = push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_NO_PLUGINS_RANK": "5"}, gate=gate(5))  # waited out
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, previous)
    failed = failed_phase(host)
    assert failed["name"] == "workers"
    assert "7/8" in failed["detail"] and "TP5" in failed["detail"], failed


def test_markers_of_an_earlier_invocation_are_not_counted(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    push_good(deployment, capsys)
    deployment.set_service(env={"REFSERVER_NO_PLUGINS_RANK": "3"}, gate=gate(5))  # waited out
    code, doc = deployment.json(capsys, "push", "test", "--no-verify")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert doc["hosts"][0]["result"] == "deployed"
    code, doc = deployment.json(capsys, "verify", "test")
    assert code == 4, doc
    host = doc["hosts"][0]
    assert host["result"] == "unhealthy"
    failed = failed_phase(host)
    assert failed["name"] == "workers"
    assert "7/8" in failed["detail"] and "TP3" in failed["detail"], failed
    # the trap was there: the unit's journal holds the earlier run's 8 markers as well as this run's 7
    assert marker_lines(deployment, f"-u {deployment.service}") >= 15
    invocation = deployment.show("h1", "InvocationID")
    assert marker_lines(deployment, f"_SYSTEMD_INVOCATION_ID={invocation}") == 7


def test_rollback_command_restores_older_releases(deployment: Deployment,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    older = push_good(deployment, capsys)
    (deployment.payload / "bump.txt").write_text("2\n")
    newer = push_good(deployment, capsys)
    assert newer != older and deployment.current() == newer

    code, doc = deployment.json(capsys, "rollback", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    host = doc["hosts"][0]
    assert host["result"] == "restored" and host["release"] == older
    assert all(phase(host, name)["ok"] for name in GATE_PHASES)
    assert deployment.current() == older
    assert_unit_of(deployment, older)
    assert deployment.show("h1", "ActiveState") == "active"

    events: list[tuple[str, str, str]] = []  # through the library: its listener hears "done" once, at the end
    report = fleet.rollback(deployment.load(), "test", Options(to_release=newer),
                            listener=lambda *event: events.append(event))
    assert report.exit_code == 0, [(h.error, h.phases) for h in report.hosts]
    assert report.hosts[0].result == "restored" and report.hosts[0].release == newer
    assert [e for e in events if e[1] == "done"] == [("h1", "done", "restored")]
    assert deployment.current() == newer
    assert_unit_of(deployment, newer)

    invocation = deployment.show("h1", "InvocationID")
    code, doc = deployment.json(capsys, "rollback", "test", "--to", "nope")
    assert code != 0, doc
    host = doc["hosts"][0]
    assert not host["ok"]
    assert "'nope'" in host["error"] and older in host["error"] and newer in host["error"], host["error"]
    assert deployment.current() == newer
    assert deployment.show("h1", "InvocationID") == invocation
    assert deployment.show("h1", "ActiveState") == "active"


def test_verify_changes_nothing(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    push_good(deployment, capsys)

    def snapshot() -> tuple[str, str, str]:
        files = deployment.sh("h1", f"find {deployment.service_dir} -printf '%p %i %s %T@\\n' | sort")
        unit = sha(deployment, deployment.unit_path)
        return files, unit, deployment.show("h1", "InvocationID")

    before = snapshot()
    code, doc = deployment.json(capsys, "verify", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert doc["hosts"][0]["result"] == "healthy"
    assert snapshot() == before


def test_first_deploy_failing_the_gate_stops_the_service(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(env={"REFSERVER_WRONG_ANSWER": "1"}, gate=gate(30))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 5, doc
    host = doc["hosts"][0]
    assert host["result"] == "rollback_failed"
    assert failed_phase(host)["name"] == "completion"
    rollback = phase(host, "rollback")
    assert not rollback["ok"]
    assert "nothing to roll back to" in rollback["detail"] and "stopped" in rollback["detail"], rollback
    deadline = time.monotonic() + 30
    while deployment.show("h1", "ActiveState") not in ("inactive", "failed") and time.monotonic() < deadline:
        time.sleep(0.25)
    assert deployment.show("h1", "ActiveState") == "inactive"
    assert deployment.show("h1", "UnitFileState") == "disabled"


def _kdtree_payload(dep: Deployment, **env: str) -> None:
    """The real kdtree payload (its kdeploy-gate.json) on the small venv, where SGLang is missing: every worker
    still logs its config line and ``plugin loaded``, which the inventory then names as its one marker."""
    payload = dep.payload.parent / "kdtree"
    shutil.copytree(Path(__file__).resolve().parents[2] / "kernels" / "kdtree", payload,
                    ignore=shutil.ignore_patterns("__pycache__"))
    dep.set_service(payload=str(payload), env=env,
                    gate={"workers": 8, "poll_interval": 0.25, "markers": [PLUGIN_LOADED], "timeout": 60})


def test_workers_must_run_the_intended_flags_and_release(deployment: Deployment,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _kdtree_payload(deployment, KDTREE_DEFRAG_SORT="1", KDTREE_NSPLIT="32")
    first = push_good(deployment, capsys)
    code, doc = deployment.json(capsys, "verify", "test")
    assert code == 0, doc
    workers = phase(doc["hosts"][0], "workers")
    assert workers["detail"] == "2 markers x 8 workers, config verify=on defrag=1 nsplit=32", workers

    deployment.set_service(env={"KDTREE_DEFRAG_SORT": "0", "KDTREE_NSPLIT": "32"})
    second = push_good(deployment, capsys)
    assert second != first
    # TP3 loads the first release's copy of the extension (a worker left from an earlier run): named, rolled back.
    deployment.set_service(env={"KDTREE_DEFRAG_SORT": "0", "KDTREE_NSPLIT": "32",
                                "REFSERVER_PYTHONPATH_RANK": f"3:{deployment.service_dir}/releases/{first}"})
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, second)
    detail = failed_phase(host)["detail"]
    assert failed_phase(host)["name"] == "workers"
    assert "TP3 pid" in detail and f"release={first} (want " in detail, detail
    assert "TP2" not in detail


def test_a_flag_value_the_payload_does_not_accept_is_invalid_input(deployment: Deployment,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _kdtree_payload(deployment, KDTREE_DEFRAG_SORT="maybe")
    capsys.readouterr()
    assert deployment.kdeploy("push", "test") == 2
    assert "KDTREE_DEFRAG_SORT='maybe': expected one of" in capsys.readouterr().err
    assert deployment.sh("h1", f"ls {deployment.service_dir} 2>&1", check=False).endswith(
        "No such file or directory\n")  # nothing touched


def test_parity_records_first_passes_within_tolerance_and_rolls_back_a_gross_logit_change(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: the first deploy records the golden set's answers; a run whose logits move slightly passes;
    one whose logits move grossly still answers "Paris" but fails the parity phase and is rolled back;
    ``verify --parity`` compares on demand; a model change needs --accept-parity-change."""
    record = "{dir}/releases/{release}/.kdeploy/parity.json"
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    host = doc["hosts"][0]
    first = host["release"]
    assert "first deploy" in phase(host, "parity-baseline")["detail"]
    assert phase(host, "parity")["ok"] and "recorded 1 prompts x 8 tokens" in phase(host, "parity")["detail"]
    kept = json.loads(deployment.sh("h1", "cat " + record.format(dir=deployment.service_dir, release=first)))
    assert kept["release"] == first and kept["samples"][0]["tokens"][0] == " Paris."

    deployment.set_service(env={"REFSERVER_LOGIT_NOISE": "0.01"})
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    host = doc["hosts"][0]
    second = host["release"]
    assert phase(host, "parity-baseline")["detail"].startswith(f"record of {first}")
    numbers = phase(host, "parity")["data"]
    assert numbers["positions"] == 6 and 0 < numbers["max_gap"] <= 0.02 and numbers["reference"] == first

    code, doc = deployment.json(capsys, "verify", "test", "--parity")
    assert code == 0 and doc["hosts"][0]["result"] == "healthy", doc
    assert phase(doc["hosts"][0], "parity")["data"]["reference"] == second

    deployment.set_service(env={"REFSERVER_LOGIT_NOISE": "2"})
    code, doc = deployment.json(capsys, "push", "test")
    host = assert_rolled_back(deployment, code, doc, second)
    assert "Paris" in phase(host, "completion")["detail"]  # the text alone would have passed
    failed = failed_phase(host)
    assert failed["name"] == "parity", failed
    assert failed["detail"].startswith("parity: 'The capital of France is': position ")
    assert "before," in failed["detail"] and "> tolerance 0.1" in failed["detail"]
    assert failed["data"]["gap"] > 0.1 and failed["data"]["token_before"] == failed["data"]["token_now"]
    assert phase(host, "rollback parity")["ok"]  # the release it went back to matches its own record

    deployment.sh("h1", "rm " + record.format(dir=deployment.service_dir, release=second))
    code, doc = deployment.json(capsys, "verify", "test", "--parity")
    assert code == 4 and doc["hosts"][0]["result"] == "unhealthy", doc
    assert failed_phase(doc["hosts"][0])["detail"].startswith(f"parity: no parity record to compare with: {second}")

    deployment.edit(lambda doc: doc["defaults"]["service"]["sglang"].update(served_model_name="other-model"))
    deployment.set_service(env={})
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 7, doc
    assert "served model changes from" in doc["hosts"][0]["error"]
    assert "--accept-parity-change" in doc["hosts"][0]["error"] and deployment.current() == second
    code, doc = deployment.json(capsys, "push", "test", "--accept-parity-change")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert "model changed from" in phase(doc["hosts"][0], "parity-baseline")["detail"]
