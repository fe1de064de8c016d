"""What a push leaves behind on a host is decided by the state it ended in (kdeploy/flows/push.py), not by its
result string. The host is not contacted: the lock holder's last command is what these check."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from kdeploy.core import release
from kdeploy.core.inventory import load
from kdeploy.core.layout import service_dir
from kdeploy.core.report import HostResult
from kdeploy.core.state import parse_state
from kdeploy.flows.options import Options
from kdeploy.flows.push import Decided, HostPush, Refused, Staged, Switched, Withdrawn

REPO = Path(__file__).resolve().parents[2]
CAPTURED = REPO / "tests/data/captured/state_pending.txt"
NEW = "20991231T000000.000Z-abcdef12"


class HeldLock:
    """The lock holder: keeps the command it is given to run as its last act."""

    def __init__(self) -> None:
        self.finish: str | None = None

    def release(self, command: str = "") -> bool:
        self.finish = command
        return True


@pytest.fixture
def push() -> HostPush:
    inventory = load(REPO / "inventory.yaml")
    host = inventory.hosts["ct200"]
    wanted = SimpleNamespace(payload=SimpleNamespace(manifest={"a.py": "0" * 64}), unit_text="[Unit]\n", secrets=None)
    step = HostPush(inventory, host, wanted, Options(), HostResult("ct200"), threading.Event())
    step.remote = SimpleNamespace(close=lambda: None)
    step.held = HeldLock()
    return step


def _staged(staged: str | None = NEW) -> Staged:
    state = parse_state(CAPTURED.read_text())
    return Staged(state, SimpleNamespace(secrets_changed=False), staged or str(state.current), staged)


def _end(step: HostPush) -> str | None:
    held = step.held
    step.close()
    return held.finish


def test_a_host_stopped_before_its_turn_has_its_staged_release_removed_and_no_history(push: HostPush) -> None:
    push.at = _staged()
    push.skip("not restarted: the canary failed")
    assert isinstance(push.at, Withdrawn) and push.result.result == "skipped"
    assert _end(push) == release.prune_command(service_dir(push.host.service), [NEW])
    assert push.result.release == push.at.staged.state.current


def test_a_restart_alone_stopped_before_its_turn_leaves_nothing(push: HostPush) -> None:
    push.at = _staged(None)
    push.result.finish("preflight_refused", "pre_host hook refused the host")  # the hook ended it: no turn
    assert _end(push) == "" and isinstance(push.at, Withdrawn)


def test_a_host_refused_in_preflight_is_left_as_it_was(push: HostPush) -> None:
    push.at = Refused(_staged().state)
    push.result.finish("preflight_refused", "disk full")
    assert _end(push) == ""


def test_a_turn_that_failed_before_the_switch_records_history_and_keeps_its_release(push: HostPush) -> None:
    push.at, push.turn = _staged(), True
    push.skip("too late")  # its turn came: no longer skipped
    push.result.finish("failed", "could not drain")
    finish = _end(push)
    assert isinstance(push.at, Staged) and "history.jsonl" in finish and NEW not in finish


def test_a_switched_host_records_its_history_line(push: HostPush) -> None:
    staged = _staged()
    push.at, push.turn = Switched(staged, SimpleNamespace(token="t")), True
    push.result.attempted = NEW
    push.result.finish("deployed")
    finish = _end(push)
    assert '"result":"deployed"' in finish.replace(": ", ":") and "history.jsonl" in finish


def test_a_host_decided_but_interrupted_during_its_upload_records_history(push: HostPush) -> None:
    staged = _staged()
    push.at = Decided(staged.state, staged.decision)
    push.result.finish("interrupted", "interrupted while uploading")
    assert "history.jsonl" in _end(push)
