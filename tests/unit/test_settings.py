"""kdeploy/settings.py and fleet.apply_edit without hosts: checks before writing, the file lock, the undo.

Rollouts are replaced by fakes that end hosts as a real rollout would (and edit the file meanwhile, as a
person would), so what is tested is the inventory file and what is handed to the hosts' pushes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kdeploy import cli

REPO = Path(__file__).resolve().parents[2]

# Hosts that are never contacted; template and payload are the repository's, so a push could render and scan.
INVENTORY = f"""\
# fleet inventory: edit with kdeploy set-env / set
defaults:
  service:
    name: svc
    template: {REPO}/templates/sglang.service.j2
    payload: {REPO}/tests/data/testplugin   # the test plugin
    python: /usr/bin/python3
    sglang:
      model_path: /models/m
      port: 30000
    env:
      KDTREE_VERIFY: "on"   # checked at load
      KDTREE_NSPLIT: "64"
groups:
  pair: [h1, h2]
hosts:
  h1:
    address: 192.0.2.1
  h2:
    address: 192.0.2.2
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    out = tmp_path / "inventory.yaml"
    out.write_text(INVENTORY)
    return out


def run(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """The CLI through its real entry point: (exit code, stderr lines)."""
    capsys.readouterr()
    code = cli.main([*args, "--inventory", str(path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.splitlines()


@pytest.mark.parametrize("args", [["set", "payload=missing"], ["set", "payload=missing", "--no-apply"],
                                  ["set", "template=missing.j2", "--target", "h1"]])
def test_a_value_a_push_would_refuse_leaves_the_file_unchanged(path: Path, capsys: pytest.CaptureFixture[str],
                                                             args: list[str]) -> None:
    """Everything a push computes locally (units, payload hashes) is checked before the file is written."""
    before = path.read_bytes()
    code, err = run(path, capsys, *args)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("kdeploy: "), err
    assert "missing" in err[0]
    assert path.read_bytes() == before
