"""push against real sandbox hosts: releases, delta sync, unit install, restart, no-op."""

from __future__ import annotations

import pytest

from tests.conftest import Deployment


def test_first_push_deploys_and_gates_eight_workers(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, doc
    host = doc["hosts"][0]
    assert host["result"] == "deployed"
    assert [p["name"] for p in host["phases"]] == [
        "connect", "preflight", "stage", "parity-baseline", "activate", "restart", "unit", "ready", "completion",
        "parity", "workers", "confirm"]
    assert all(p["ok"] for p in host["phases"])
    release = host["release"]
    d = deployment.service_dir
    # confirmed: no revert timer or pending switch is left behind
    timer = f"kdeploy-revert-{deployment.service}"
    assert deployment.sh("h1", f"systemctl list-units --all --no-legend '{timer}*'").strip() == ""
    assert deployment.sh("h1", f"ls {d}/pending 2>&1", check=False).endswith("No such file or directory\n")
    assert deployment.link() == f"releases/{release}"
    assert deployment.show("h1", "ActiveState") == "active"
    assert deployment.show("h1", "UnitFileState") == "enabled"
    # the unit's PYTHONPATH points at `current`, and 8 distinct worker PIDs logged the plugin marker
    env = deployment.show("h1", "Environment")
    assert f"PYTHONPATH={d}/current" in env
    invocation = deployment.show("h1", "InvocationID")
    pids = deployment.sh("h1", f"journalctl _SYSTEMD_INVOCATION_ID={invocation} -o cat | "
                               f"grep -F '[kdeploy-testplugin] loaded' | sed 's/.*pid=//' | sort -u").split()
    main_pid = deployment.show("h1", "MainPID")
    assert len(pids) == 8 and main_pid not in pids
    assert deployment.sh("h1", f"sha256sum < {deployment.unit_path}").split()[0] == \
        deployment.sh("h1", f"sha256sum < {d}/current/.kdeploy/unit.service").split()[0]


def test_noop_push_uploads_nothing_and_keeps_the_invocation(deployment: Deployment,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    before = deployment.show("h1", "InvocationID")
    releases = deployment.sh("h1", f"ls {deployment.service_dir}/releases")
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 0 and host["result"] == "unchanged"
    assert "nothing changed" in host["phases"][-1]["detail"]
    assert not any(p["name"] in ("activate", "restart") for p in host["phases"])
    assert deployment.show("h1", "InvocationID") == before
    assert deployment.sh("h1", f"ls {deployment.service_dir}/releases") == releases
    # --force-restart restarts anyway
    code, doc = deployment.json(capsys, "push", "test", "--force-restart")
    assert code == 0 and doc["hosts"][0]["result"] == "deployed"
    assert deployment.show("h1", "InvocationID") != before


def test_payload_change_ships_only_the_delta(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    (deployment.payload / "extra").mkdir()
    (deployment.payload / "extra" / "keep.txt").write_text("unchanged\n")
    (deployment.payload / "extra" / "gone.txt").write_text("to be removed\n")
    (deployment.payload / "extra" / "edit.txt").write_text("v1\n")
    code, first = deployment.json(capsys, "push", "test")
    assert code == 0
    old_release = first["hosts"][0]["release"]
    before = deployment.show("h1", "InvocationID")
    (deployment.payload / "extra" / "gone.txt").unlink()
    (deployment.payload / "extra" / "edit.txt").write_text("v2\n")
    (deployment.payload / "extra" / "new.txt").write_text("new\n")
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 0 and host["result"] == "deployed"
    new_release = host["release"]
    assert new_release != old_release
    stage = next(p for p in host["phases"] if p["name"] == "stage")
    assert "+1 ~1 -1" in stage["detail"]
    assert not any("daemon-reload" in p["detail"] for p in host["phases"])
    assert deployment.show("h1", "InvocationID") != before
    r = f"{deployment.service_dir}/releases"
    assert deployment.sh("h1", f"cat {r}/{new_release}/extra/edit.txt") == "v2\n"
    assert deployment.sh("h1", f"cat {r}/{old_release}/extra/edit.txt") == "v1\n"
    assert deployment.sh("h1", f"test -e {r}/{new_release}/extra/gone.txt && echo yes || echo no").strip() == "no"
    inodes = deployment.sh("h1", f"stat -c %i {r}/{old_release}/extra/keep.txt {r}/{new_release}/extra/keep.txt")
    old_inode, new_inode = inodes.split()
    assert old_inode == new_inode  # unchanged files are hard links, not copies


def test_unit_only_change_reloads_and_restarts(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    before = deployment.show("h1", "InvocationID")
    deployment.set_service(env={"KDTREE_DEFRAG_SORT": "1", "ODD_VALUE": 'a "quoted" 100% $HOME'})
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 0, doc
    activate = next(p for p in host["phases"] if p["name"] == "activate")
    assert "daemon-reload" in activate["detail"]
    assert "+0 ~0 -0" in next(p for p in host["phases"] if p["name"] == "stage")["detail"]
    assert deployment.show("h1", "InvocationID") != before
    from kdeploy.core.systemd import parse_environment

    env = parse_environment(deployment.show("h1", "Environment"))
    assert env["KDTREE_DEFRAG_SORT"] == "1"
    assert env["ODD_VALUE"] == 'a "quoted" 100% $HOME'  # systemd read back exactly what the inventory says


def test_slow_stop_does_not_fail_the_push(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    deployment.set_service(env={"REFSERVER_IGNORE_SIGTERM": "1"},
                           unit={"timeout_start_sec": 120, "timeout_stop_sec": 8, "restart_sec": 2})
    assert deployment.kdeploy("push", "test") == 0
    (deployment.payload / "bump.txt").write_text("1\n")
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 0 and host["result"] == "deployed", doc
    restart = next(p for p in host["phases"] if p["name"] == "restart")
    assert restart["seconds"] >= 7  # it really waited out the SIGTERM-ignoring stop
    assert "stop" in restart["detail"]


def test_release_pruning_keeps_k(deployment: Deployment) -> None:
    deployment.set_service(keep_releases=2)
    for i in range(4):
        (deployment.payload / "rev.txt").write_text(f"{i}\n")
        assert deployment.kdeploy("push", "test", "--no-verify") == 0
    releases = deployment.sh("h1", f"ls {deployment.service_dir}/releases").split()
    assert len(releases) == 2
    assert deployment.link() == f"releases/{max(releases)}"


def test_history_records_each_push(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    assert deployment.kdeploy("push", "test") == 0
    code, doc = deployment.json(capsys, "history", "test")
    assert code == 0
    records = doc["hosts"][0]["history"]
    assert [r["result"] for r in records] == ["deployed", "unchanged"]
    for rec in records:
        assert {"time", "user", "controller", "release", "payload_hash", "unit_hash", "result", "duration"} <= set(rec)


def test_percent_in_unit_values_arrives_intact(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """systemd expands %-specifiers on every unit line: what it reads back must be what the inventory says."""
    root = f"/srv/kdeploy/{deployment.service}/100%n"
    deployment.sh("h1", "install -m 600 /dev/null '/etc/kdeploy-%i.env'")  # preflight wants it there, root's, 0600
    deployment.set_service(remote_root=root, environment_file="/etc/kdeploy-%i.env")
    deployment.edit(lambda doc: doc["defaults"]["service"]["unit"].update(description='GPU 100% %n "q"'))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, doc["hosts"][0]["error"]
    assert deployment.show("h1", "Description") == 'GPU 100% %n "q"'
    assert deployment.show("h1", "WorkingDirectory") == f"{root}/{deployment.service}"
    assert deployment.show("h1", "EnvironmentFiles") == "/etc/kdeploy-%i.env (ignore_errors=yes)"
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0 and doc["hosts"][0]["result"] == "unchanged", doc


def test_payload_modes_arrive_normalised_and_a_mode_change_ships(deployment: Deployment,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (deployment.payload / "private.py").write_text("X = 1\n")
    (deployment.payload / "private.py").chmod(0o600)
    (deployment.payload / "tool.sh").write_text("#!/bin/sh\n")
    (deployment.payload / "tool.sh").chmod(0o700)
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, doc
    current = f"{deployment.service_dir}/current"

    def modes() -> str:
        return deployment.sh("h1", f"cd {current} && stat -c '%a %n' private.py tool.sh kdeploy_testplugin/__init__.py")

    assert modes() == "644 private.py\n755 tool.sh\n644 kdeploy_testplugin/__init__.py\n"

    (deployment.payload / "private.py").chmod(0o744)  # a mode-only change ships
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 0 and host["result"] == "deployed", doc
    assert "+0 ~1 -0" in next(p for p in host["phases"] if p["name"] == "stage")["detail"]
    assert modes() == "755 private.py\n755 tool.sh\n644 kdeploy_testplugin/__init__.py\n"

    # a release staged before modes were recorded: every file ships once more, then the host is in sync
    deployment.sh("h1", f"rm {current}/.kdeploy/modes")
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, doc
    files = len(deployment.sh("h1", f"cat {current}/.kdeploy/files").split())
    assert f"+0 ~{files} -0 =0" in next(p for p in doc["hosts"][0]["phases"] if p["name"] == "stage")["detail"]
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0 and doc["hosts"][0]["result"] == "unchanged", doc

    (deployment.payload / "tool.sh").chmod(0o4755)   # refused before any host is contacted
    code = deployment.kdeploy("push", "test")
    assert code == 2
    assert "tool.sh: mode 4755: setuid, setgid and world-writable files are refused" in capsys.readouterr().err
