"""service.secrets on a sandbox host: shipped into environment_file (root, 0600, exact), never shown, rotated
with a restart, and put back with the release when a gate fails."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Deployment

TOKEN = "tok-1 'single' \"double\" $HOME \\back `tick` # x"  # every character systemd's quoting cares about


def _service_env(dep: Deployment, name: str) -> str | None:
    """``name`` as the service's main process sees it (what systemd read from the environment file)."""
    pid = dep.show("h1", "MainPID")
    for line in dep.sh("h1", f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines():
        if line.startswith(name + "="):
            return line.split("=", 1)[1]
    return None


def _push(dep: Deployment, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code, doc = dep.json(capsys, *args, "test")
    return code, doc["hosts"][0], json.dumps(doc)


def test_secrets_are_shipped_rotated_and_rolled_back(deployment: Deployment, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = f"/etc/{deployment.service}-secrets.env"
    faults = deployment.path.parent / "faults.env"
    faults.write_text("# refserver fault switches\n")
    monkeypatch.setenv("KDT_TOKEN", TOKEN)
    deployment.set_service(environment_file=path, secrets={"env": ["KDT_TOKEN"], "file": "faults.env"})
    try:
        code, host, raw = _push(deployment, capsys, "plan")
        assert code == 0 and host["plan"]["secrets"] == {"KDT_TOKEN": "***"}, raw
        assert "secrets: changed" in host["plan"]["reasons"] and "tok-1" not in raw

        code, host, raw = _push(deployment, capsys, "push")
        assert code == 0 and host["result"] == "deployed", raw
        assert "tok-1" not in raw and "KDT_TOKEN = ***" in raw
        assert deployment.sh("h1", f"stat -c '%u %a %F' {path}").split() == ["0", "600", "regular", "file"]
        assert _service_env(deployment, "KDT_TOKEN") == TOKEN
        assert "tok-1" not in deployment.sh("h1", f"cat {deployment.unit_path}")
        assert "tok-1" not in deployment.sh("h1", f"grep -r tok-1 {deployment.service_dir} || true")
        code, host, _ = _push(deployment, capsys, "push")
        assert code == 0 and host["result"] == "unchanged"

        monkeypatch.setenv("KDT_TOKEN", "tok-2-rotated")
        code, host, raw = _push(deployment, capsys, "plan")
        assert host["plan"]["restart"] and host["plan"]["reasons"] == ["secrets: changed"], raw
        code, host, raw = _push(deployment, capsys, "push")
        assert code == 0 and host["result"] == "deployed" and "tok-2" not in raw, raw
        assert _service_env(deployment, "KDT_TOKEN") == "tok-2-rotated"
        code, doc = deployment.json(capsys, "history", "test")
        assert doc["hosts"][0]["history"][-1]["secrets"] == "changed"

        # New secrets that break the service: the gate fails, and the rollback puts the old ones back (with the
        # new ones kept, the old release's own gate would fail too: exit 5).
        monkeypatch.setenv("KDT_TOKEN", "tok-3-bad")
        faults.write_text("REFSERVER_WRONG_ANSWER=1\n")
        code, host, raw = _push(deployment, capsys, "push")
        assert code == 4 and host["result"] == "rolled_back", raw
        assert _service_env(deployment, "KDT_TOKEN") == "tok-2-rotated"
        assert _service_env(deployment, "REFSERVER_WRONG_ANSWER") is None
        assert deployment.sh("h1", f"cat {path}") == 'KDT_TOKEN="tok-2-rotated"\n'
        assert deployment.sh("h1", f"stat -c '%u %a' {path}").split() == ["0", "600"]
        assert deployment.sh("h1", f"ls -A {deployment.service_dir} /etc | grep -c 'secrets.prev\\|kdeploy-tmp' "
                                   "|| true").strip() == "0"
        code, host, raw = _push(deployment, capsys, "status")
        assert "secrets: changed" in host["status"]["drift"] and "tok-3" not in raw
    finally:
        deployment.sh("h1", f"rm -f {path}", check=False)
