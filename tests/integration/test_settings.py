"""set-env, set and status against sandbox hosts: the inventory is the source of truth."""

from __future__ import annotations

import itertools
import re
import time

import pytest

from kdeploy.cli import app as cli
from tests.conftest import Deployment


def _with_comment(dep: Deployment) -> None:
    comment = "# fleet-wide settings: edit with kdeploy set-env\n"
    dep.path.write_text(dep.path.read_text().replace("defaults:\n", comment + "defaults:\n", 1))


@pytest.mark.hosts(2)
def test_set_env_on_one_host_restarts_only_that_host(deployment: Deployment,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    _with_comment(deployment)
    h1, h2 = (deployment.show(h, "InvocationID") for h in ("h1", "h2"))
    code, doc = deployment.json(capsys, "set-env", "KDTREE_DEFRAG_SORT=1", "--target", "h2")
    assert code == 0, doc
    assert doc["inventory"]["rolled_out_to"] == ["h2"] and doc["inventory"]["level"] == "hosts.h2"
    assert [h["host"] for h in doc["hosts"]] == ["h2"] and doc["hosts"][0]["result"] == "deployed"
    assert deployment.show("h1", "InvocationID") == h1
    assert deployment.show("h2", "InvocationID") != h2
    assert "KDTREE_DEFRAG_SORT=1" in deployment.show("h2", "Environment")
    assert "KDTREE_DEFRAG_SORT" not in deployment.show("h1", "Environment")
    # the host's history names the command (found by the fault campaign: it held the inventory diff's last line)
    assert deployment.history("h2")[-1]["command"].startswith("kdeploy set-env KDTREE_DEFRAG_SORT=1 "), \
        deployment.history("h2")[-1]
    text = deployment.path.read_text()
    assert "# fleet-wide settings: edit with kdeploy set-env" in text  # comments survive the edit
    assert deployment.load().hosts["h2"].service.env == {"KDTREE_DEFRAG_SORT": "1"}
    # --unset takes it away again, at the same level, and rolls that out
    code, doc = deployment.json(capsys, "set-env", "--unset", "KDTREE_DEFRAG_SORT", "--target", "h2")
    assert code == 0 and doc["inventory"]["rolled_out_to"] == ["h2"]
    assert "KDTREE_DEFRAG_SORT" not in deployment.show("h2", "Environment")
    assert deployment.load().hosts["h2"].service.env == {}


def test_invalid_value_changes_nothing(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    before = deployment.path.read_bytes()
    for args in (["set-env", "BAD NAME=1"], ["set-env", "X=a\nb"], ["set", "hicache.ratio=0"],
                 ["set", "hicache.write_policy=write_sometimes"], ["set", "hicache.ration=2"],
                 ["set-env", "--unset", "NOT_THERE"], ["set-env", "A=1", "--target", "nohost"],
                 ["set", "payload=missing"]):  # valid YAML and settings, but no push could scan it
        capsys.readouterr()
        code = cli.main([*args, "--inventory", str(deployment.path)])
        err = capsys.readouterr().err
        assert code == 2, args
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert deployment.path.read_bytes() == before
    assert "did you mean 'ratio'" in cli_error(deployment, capsys, ["set", "hicache.ration=2"])


def cli_error(dep: Deployment, capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    capsys.readouterr()
    cli.main([*args, "--inventory", str(dep.path)])
    return capsys.readouterr().err


def test_failed_rollout_reverts_the_inventory_and_the_host(deployment: Deployment,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(gate={"workers": 8, "poll_interval": 0.25, "markers": ["[kdeploy-testplugin] loaded"],
                                 "timeout": 20})
    assert deployment.kdeploy("push", "test") == 0
    release = deployment.link()
    before = deployment.path.read_bytes()
    code, doc = deployment.json(capsys, "set-env", "REFSERVER_WRONG_ANSWER=1")
    assert code == 4, doc
    assert doc["inventory"]["reverted"] is True
    assert doc["hosts"][0]["result"] == "rolled_back"
    assert deployment.path.read_bytes() == before  # inventory and host agree again
    assert deployment.link() == release
    assert "REFSERVER_WRONG_ANSWER" not in deployment.show("h1", "Environment")
    assert deployment.kdeploy("verify", "test") == 0


@pytest.mark.hosts(3)
def test_ctrl_c_mid_rollout_puts_the_inventory_and_every_host_back_on_the_old_config(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(env={"REFSERVER_SLOW_START": "3"})  # each gate waits: Ctrl-C lands in h2's batch
    assert deployment.kdeploy("push", "test") == 0
    before = deployment.path.read_bytes()
    unit = deployment.unit_path
    units = {h: deployment.sh(h, f"cat {unit}") for h in deployment.hosts}
    h2_before = deployment.show("h2", "InvocationID")
    run = deployment.interrupt("set-env", "KDTREE_DEFRAG_SORT=1", "--parallel", "1",  # once h1's batch is
                               when=lambda: deployment.show("h2", "InvocationID") != h2_before,  # deployed and h2's
                               what="h2's restart")                                            # has begun
    doc = run.doc
    results = {h: r["result"] for h, r in run.hosts.items()}
    assert run.code == doc["exit_code"] == 130, run.err
    assert results == {"h1": "deployed", "h2": "deployed", "h3": "interrupted"}  # h2's batch finished, gated
    assert doc["inventory"]["reverted"] is True and doc["inventory"]["conflicts"] == []
    assert doc["inventory"]["restored_hosts"] == {"h1": "deployed", "h2": "deployed"}
    assert deployment.path.read_bytes() == before
    for host in deployment.hosts:  # every host runs the old config again, and says so
        assert deployment.sh(host, f"cat {unit}") == units[host]
        assert "KDTREE_DEFRAG_SORT" not in deployment.show(host, "Environment")
    code, status = deployment.json(capsys, "status", "test")
    assert code == 0 and {h["host"]: h["status"]["drift"] for h in status["hosts"]} == {h: [] for h in units}


def test_set_hicache_ratio_changes_exactly_the_execstart_flag(deployment: Deployment,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(hicache={"enabled": True, "ratio": 2.0, "write_policy": "write_through",
                                    "device_kv_gb_per_rank": 0.1})  # so the host-RAM preflight check fits
    assert deployment.kdeploy("push", "test") == 0
    unit = deployment.unit_path
    old = deployment.sh("h1", f"cat {unit}").splitlines()
    code, doc = deployment.json(capsys, "set", "hicache.ratio=4.0")
    assert code == 0, doc
    new = deployment.sh("h1", f"cat {unit}").splitlines()
    changed = [(a, b) for a, b in zip(old, new, strict=True) if a != b]
    assert len(changed) == 1
    before_line, after_line = changed[0]
    assert before_line.startswith("ExecStart=") and "--hicache-ratio 2.0" in before_line
    assert after_line == before_line.replace("--hicache-ratio 2.0", "--hicache-ratio 4.0")
    assert deployment.load().hosts["h1"].service.hicache.ratio == 4.0


def test_status_shows_env_last_deploy_and_hand_edits_as_drift_and_push_repairs_them(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(env={"KDTREE_NSPLIT": "64"})
    assert deployment.kdeploy("push", "test") == 0
    code, doc = deployment.json(capsys, "status", "test")
    st = doc["hosts"][0]["status"]
    assert code == 0 and st["drift"] == [] and st["active"] == "active"
    assert st["env"] == {"KDTREE_NSPLIT": "64"}
    assert st["last_deploy"]["result"] == "deployed"
    # someone edits the unit and a payload file by hand on the host
    unit = deployment.unit_path
    deployment.sh("h1", f"sed -i 's/KDTREE_NSPLIT=64/KDTREE_NSPLIT=32/' {unit} && systemctl daemon-reload && "
                        f"echo '# hotfix' >> {deployment.service_dir}/current/kdeploy_testplugin/__init__.py")
    code, doc = deployment.json(capsys, "status", "test")
    drift = doc["hosts"][0]["status"]["drift"]
    assert "unit differs from the inventory" in drift
    assert any("kdeploy_testplugin/__init__.py" in d for d in drift)
    assert doc["hosts"][0]["status"]["env"] == {"KDTREE_NSPLIT": "32"}  # read from the live unit
    # plan says why; push uploads the edited file again (not a hard link to it) and the host is in line
    sdir, plugin = deployment.service_dir, "kdeploy_testplugin/__init__.py"
    code, doc = deployment.json(capsys, "plan", "test")
    plan = doc["hosts"][0]["plan"]
    assert code == 0 and plan["restart"] and plan["change"] == [plugin]
    assert f"release files edited on the host: {plugin}" in plan["reasons"]
    assert _push_repairs(deployment, capsys, plugin) == "deployed"
    assert _push_repairs(deployment, capsys, plugin) == "unchanged"
    # the current release's directory deleted by hand: staged again in full
    deployment.sh("h1", f"rm -rf {sdir}/$(readlink {sdir}/current)")
    code, doc = deployment.json(capsys, "plan", "test")
    assert any(r.endswith("is gone from the host") for r in doc["hosts"][0]["plan"]["reasons"]), doc
    assert _push_repairs(deployment, capsys, plugin) == "deployed"


def _push_repairs(deployment: Deployment, capsys: pytest.CaptureFixture[str], plugin: str) -> str:
    """Push; the host must end on the payload's file with no drift left. The push's result."""
    code, doc = deployment.json(capsys, "push", "test")
    result = doc["hosts"][0]["result"]
    assert code == 0, doc
    assert deployment.sh("h1", f"cat {deployment.service_dir}/current/{plugin}") == \
        (deployment.payload / plugin).read_text()
    code, doc = deployment.json(capsys, "status", "test")
    assert code == 0 and doc["hosts"][0]["status"]["drift"] == [] and doc["hosts"][0]["status"]["active"] == "active"
    return result


def _restarts(dep: Deployment, host: str, since: float) -> tuple[float, float]:
    """(when systemd began stopping the service, when it had started it again) after ``since``, from the host's
    journal: systemd's own job lines, with their timestamps."""
    out = dep.sh(host, f"journalctl -u {dep.service} -o short-unix --no-pager --since @{int(since) - 1}")
    stamps: dict[str, float] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[2].startswith("systemd[") and words[3] in ("Stopping", "Started") \
                and float(words[0]) >= since:
            stamps.setdefault(words[3], float(words[0]))
    assert set(stamps) == {"Stopping", "Started"}, out
    return stamps["Stopping"], stamps["Started"]


@pytest.mark.hosts(3)
def test_set_env_with_a_canary_and_batches_of_one_restarts_one_host_at_a_time(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """The rollout policy push has, on set-env (issue 28): checked from the hosts' journals, each host is stopped
    only once the one before it has started again (and passed its gate). -v shows each SSH step."""
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    since = time.time()
    capsys.readouterr()
    assert deployment.kdeploy("set-env", "X=1", "--canary", "1", "--batch", "1", "-v") == 0
    err = capsys.readouterr().err
    windows = [_restarts(deployment, host, since) for host in ("h1", "h2", "h3")]
    for (_, started), (stopping, _) in itertools.pairwise(windows):
        assert stopping >= started, windows  # the next host waited for the previous one
    assert all(stopping < started for stopping, started in windows)
    assert re.search(r"^kdeploy: ssh h2: .+ -> exit 0 in \d+\.\d\ds$", err, re.MULTILINE), err
    assert "X=1" in deployment.show("h3", "Environment")
    # a canary larger than the hosts: refused before any change, naming the option
    assert deployment.kdeploy("set-env", "X=2", "--canary", "4") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "kdeploy: --canary 4: only 3 hosts selected"
    assert "X=1" in deployment.show("h1", "Environment") and deployment.load().hosts["h1"].service.env == {"X": "1"}
