"""kdeploy/settings.py and fleet.apply_edit without hosts: checks before writing, the file lock, the undo.

Rollouts are replaced by fakes that end hosts as a real rollout would (and edit the file meanwhile, as a
person would), so what is tested is the inventory file and what is handed to the hosts' pushes.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest

from kdeploy import cli, fleet
from kdeploy.deploy import Options
from kdeploy.inventory import Inventory
from kdeploy.report import HostResult, Report

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


# --- the inventory's edit lock ------------------------------------------------------------------------


def lock_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def hold(path: Path) -> int:
    """Take the inventory's lock the way any other kdeploy process would: flock on ``.<name>.lock``."""
    fd = os.open(lock_file(path), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_second_edit_of_a_locked_inventory_fails_at_once_with_exit_6(path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fd = hold(path)
    try:
        code, err = run(path, capsys, "set-env", "A=1", "--no-apply")
    finally:
        os.close(fd)
    assert code == 6
    assert len(err) == 1 and "being edited by" in err[0] and "--lock-wait" in err[0], err
    assert path.read_text() == INVENTORY
    code, _ = run(path, capsys, "set-env", "A=1", "--no-apply")  # free again
    assert code == 0 and "A: '1'" in path.read_text()


def test_lock_wait_waits_for_the_other_edit_then_edits_the_file_as_it_left_it(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fd = hold(path)

    def other_edit_finishes() -> None:
        time.sleep(0.5)
        path.write_text(path.read_text().replace('KDTREE_NSPLIT: "64"', 'KDTREE_NSPLIT: "32"'))
        os.close(fd)

    thread = threading.Thread(target=other_edit_finishes)
    started = time.monotonic()
    thread.start()
    code, err = run(path, capsys, "set-env", "A=1", "--no-apply", "--lock-wait", "10")
    thread.join()
    assert code == 0, err
    assert time.monotonic() - started >= 0.5
    assert 'KDTREE_NSPLIT: "32"' in path.read_text() and "A: '1'" in path.read_text()  # read after the wait


def test_the_lock_is_held_through_the_rollout_and_names_its_holder(path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def rollout(inv: Inventory, names: list[str], local: dict, opts: Options, **_: object) -> Report:
        fd = os.open(lock_file(path), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(lock_file(path).read_text())
        return Report("push", [HostResult(n).finish("deployed") for n in names])

    monkeypatch.setattr(fleet, "rollout", rollout)
    code, err = run(path, capsys, "set-env", "A=1")
    assert code == 0, err
    holder = json.loads(seen[0])
    assert holder["command"] == "kdeploy set-env" and holder["pid"] == os.getpid()
    assert lock_file(path).read_text() == ""  # let go, and no stale holder left in it
