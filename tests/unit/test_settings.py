"""kdeploy/flows/settings.py and fleet.apply_edit without hosts: checks before writing, the file lock, the undo.

Rollouts are replaced by fakes that end hosts as a real rollout would (and edit the file meanwhile, as a
person would), so what is tested is the inventory file and what is handed to the hosts' pushes.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kdeploy.cli import app as cli
from kdeploy.core import inventory
from kdeploy.core.inventory import Inventory
from kdeploy.core.report import HostResult, Report
from kdeploy.flows import fleet, settings
from kdeploy.flows.options import Options

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

    def check_lock() -> None:
        fd = os.open(lock_file(path), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(lock_file(path).read_text())

    fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "deployed"}, check_lock)
    code, err = run(path, capsys, "set-env", "A=1")
    assert code == 0, err
    holder = json.loads(seen[0])
    assert holder["command"] == "kdeploy set-env" and holder["pid"] == os.getpid()
    assert lock_file(path).read_text() == ""  # let go, and no stale holder left in it


# --- a failed rollout undoes the edit, and only the edit ----------------------------------------------


def fake_rollouts(monkeypatch: pytest.MonkeyPatch, results: dict[str, str],
                  during: Callable[[], None] = lambda: None) -> list[tuple[list[str], threading.Event]]:
    """Replace the rollout: the edit's ends each host with ``results`` after running ``during``; a second
    one (the old config pushed back) deploys. Returns each call's hosts and cancel state."""
    calls: list[tuple[list[str], threading.Event]] = []

    def rollout(inv: Inventory, names: list[str], local: dict, opts: Options, *, cancel: threading.Event,
                **_: object) -> Report:
        calls.append((list(names), cancel))
        if len(calls) > 1:
            return Report("push", [HostResult(n, release=f"old-{n}").finish("deployed") for n in names])
        during()
        return Report("push", [HostResult(n, release=f"new-{n}").finish(results[n]) for n in names])

    monkeypatch.setattr(fleet, "rollout", rollout)
    return calls


def edit_json(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """(exit code, the JSON document's ``inventory`` facts); stderr names every key left unreverted."""
    capsys.readouterr()
    code = cli.main([*args, "--inventory", str(path), "--json"])
    out, err = capsys.readouterr()
    facts = json.loads(out)["inventory"]
    assert "Traceback" not in err
    assert all(conflict in err for conflict in facts.get("conflicts", [])), err
    return code, facts


def hand_edit(text: str) -> str:
    """What someone changes by hand while kdeploy rolls out its edit: another key, a comment, a new key."""
    return (text.replace('KDTREE_NSPLIT: "64"', 'KDTREE_NSPLIT: "32"   # tuned by hand')
            .replace("    address: 192.0.2.2\n", "    address: 192.0.2.2\n    port: 2222\n"))


@pytest.mark.parametrize("args", [["set-env", "A=1"], ["set-env", "--unset", "KDTREE_VERIFY"],
                                  ["set", "sglang.mem_fraction_static=0.8", "--target", "h1"],
                                  ["set-env", "A=1", "--target", "pair"]],
                         ids=["add", "unset", "new-mappings", "short-group"])
def test_a_failed_rollout_undoes_only_its_own_keys(path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    """The revert is the inverse edit on the file as it is then: what others changed meanwhile survives, and
    where nobody did, the file is byte-for-byte what it was (comments, order, mappings the edit created)."""
    fake_rollouts(monkeypatch, {"h1": "rolled_back", "h2": "rolled_back"},
                  lambda: path.write_text(hand_edit(path.read_text())))
    code, facts = edit_json(path, capsys, *args)
    assert code == 4
    assert path.read_text() == hand_edit(INVENTORY)
    assert facts["reverted"] is True and facts["conflicts"] == []


def test_a_key_someone_else_changed_meanwhile_is_left_as_they_set_it(path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def someone_sets_it_too() -> None:
        path.write_text(path.read_text().replace('KDTREE_NSPLIT: "16"', 'KDTREE_NSPLIT: "128"'))

    calls = fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "rolled_back"}, someone_sets_it_too)
    code, facts = edit_json(path, capsys, "set-env", "KDTREE_NSPLIT=16", "KDTREE_VERIFY=off")
    assert code == 4
    assert path.read_text() == INVENTORY.replace('KDTREE_NSPLIT: "64"', 'KDTREE_NSPLIT: "128"')  # VERIFY undone
    assert facts["reverted"] is True
    assert facts["conflicts"] == ["defaults.service.env.KDTREE_NSPLIT: changed meanwhile to '128' (kdeploy set "
                                  "'16'); left as it is"]
    assert [names for names, _ in calls] == [["h1", "h2"], ["h1"]]  # h1 still goes back to the old config


def test_a_hand_edit_during_the_checks_is_not_overwritten(path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    check = fleet.check_edit

    def check_while_someone_edits(edit: object) -> dict:
        path.write_text(hand_edit(path.read_text()))
        return check(edit)

    monkeypatch.setattr(fleet, "check_edit", check_while_someone_edits)
    code, err = run(path, capsys, "set-env", "A=1", "--no-apply")
    assert code == 6
    assert "changed by someone else" in err[-1] and "not written" in err[-1], err  # after the diff it meant to write
    assert path.read_text() == hand_edit(INVENTORY)


def test_undo_keeps_a_key_removed_meanwhile_and_skips_one_already_back(path: Path) -> None:
    edit = settings.set_env(path, {"KDTREE_NSPLIT": "16", "KDTREE_VERIFY": "off", "A": "1"}, [])
    now = (edit.after.replace('      KDTREE_NSPLIT: "16"\n', "")  # someone removed it
           .replace('KDTREE_VERIFY: "off"  #', 'KDTREE_VERIFY: "on"   #'))  # someone put it back already
    doc = inventory.parse_yaml(now, path)
    undone, kept = settings.undo(doc, edit.changes)
    assert undone == 1  # only A, which is still as the edit left it
    assert kept == ["defaults.service.env.KDTREE_NSPLIT: removed meanwhile (kdeploy set '16'); left as it is"]
    out = io.StringIO()
    YAML().dump(doc, out)
    assert out.getvalue() == INVENTORY.replace('      KDTREE_NSPLIT: "64"\n', "")


def test_after_ctrl_c_the_old_config_goes_back_with_a_cancel_state_of_its_own(
        path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C stops the rollout (h1 took the new config, h2 never started); putting h1 back must not be
    stopped by that same Ctrl-C, or h1 keeps a config the reverted inventory no longer has."""
    calls = fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "interrupted"},
                          lambda: calls[0][1].set())  # Ctrl-C once h1's batch is done
    code, facts = edit_json(path, capsys, "set-env", "A=1", "--parallel", "1")
    assert code == 130
    assert path.read_text() == INVENTORY and facts["reverted"] is True
    (first, cancelled), (back, restore) = calls
    assert first == ["h1", "h2"] and cancelled.is_set()
    assert back == ["h1"] and not restore.is_set()
    assert facts["restored_hosts"] == {"h1": "deployed"}


def test_a_host_put_back_reports_the_release_it_runs_after_the_command(
        path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the new config's release it ran for a moment (the push of the old config replaced it)."""
    calls = fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "interrupted"}, lambda: calls[0][1].set())
    capsys.readouterr()
    assert cli.main(["set-env", "A=1", "--parallel", "1", "--inventory", str(path), "--json"]) == 130
    hosts = {h["host"]: h for h in json.loads(capsys.readouterr().out)["hosts"]}
    assert hosts["h1"]["release"] == "old-h1" and hosts["h1"]["restored"] == "deployed"


def test_an_edit_leaves_long_lines_as_they_are(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ruamel folds plain scalars past 80 columns; an edit must not reformat lines it did not change."""
    long = "    python: /opt/" + "very-long-directory-name/" * 4 + "bin/python3\n"
    path.write_text(INVENTORY.replace("    python: /usr/bin/python3\n", long))
    code, _ = run(path, capsys, "set-env", "A=1", "--no-apply")
    assert code == 0
    assert long in path.read_text()


def test_an_old_config_that_cannot_be_pushed_back_any_more_ends_rollback_failed(
        path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The old payload is gone by the time it is needed. That is not exit 2 ("invalid input, nothing was
    touched"): h1 runs a config the reverted inventory no longer has, so it needs a person (exit 5)."""
    old, new = tmp_path / "old-payload", tmp_path / "new-payload"
    for copy in (old, new):
        shutil.copytree(REPO / "tests/data/testplugin", copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = INVENTORY.replace(f"{REPO}/tests/data/testplugin", str(old))
    path.write_text(text)
    calls = fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "rolled_back"}, lambda: shutil.rmtree(old))
    capsys.readouterr()
    code = cli.main(["set", f"payload={new}", "--inventory", str(path), "--json"])
    out, err = capsys.readouterr()
    hosts = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert code == 5, err
    assert hosts["h1"]["result"] == "rollback_failed"
    assert hosts["h1"]["error"] == f"put back to the old config failed: {old}: payload directory not found"
    assert path.read_text() == text and len(calls) == 1


def test_a_file_that_cannot_be_read_any_more_is_not_reverted_and_says_why(
        path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    broken = "defaults: [half written\n"
    calls = fake_rollouts(monkeypatch, {"h1": "deployed", "h2": "rolled_back"}, lambda: path.write_text(broken))
    code, facts = edit_json(path, capsys, "set-env", "A=1")
    assert code == 4
    assert path.read_text() == broken  # theirs, not overwritten
    assert facts["reverted"] is False
    assert facts["conflicts"] == [f"the edit could not be reverted: {path}:2: invalid YAML: "
                                  "expected ',' or ']', but got '<stream end>'"]
    assert [names for names, _ in calls] == [["h1", "h2"], ["h1"]]  # the hosts still go back


def test_a_revert_nobody_raced_puts_back_the_exact_text(path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Layouts a round trip cannot keep (here a value on the line after its key, as ruamel itself folds long
    ones) come back too when nobody touched the file during the rollout."""
    folded = INVENTORY.replace("    python: /usr/bin/python3\n", "    python:\n      /usr/bin/python3\n")
    path.write_text(folded)
    fake_rollouts(monkeypatch, {"h1": "rolled_back", "h2": "rolled_back"})
    code, facts = edit_json(path, capsys, "set-env", "A=1")
    assert code == 4 and facts["reverted"] is True
    assert path.read_text() == folded


def test_a_revert_keeps_crlf_line_ends(path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The inverse edit on a CRLF file someone changed meanwhile writes CRLF too."""
    def crlf(text: str) -> bytes:
        return text.replace("\n", "\r\n").encode()

    path.write_bytes(crlf(INVENTORY))
    fake_rollouts(monkeypatch, {"h1": "rolled_back", "h2": "rolled_back"},
                  lambda: path.write_bytes(crlf(hand_edit(path.read_bytes().decode().replace("\r\n", "\n")))))
    code, facts = edit_json(path, capsys, "set-env", "A=1")
    assert code == 4 and facts["reverted"] is True and facts["conflicts"] == []
    assert path.read_bytes() == crlf(hand_edit(INVENTORY))


@pytest.mark.parametrize("routed", [True, False], ids=["router", "no-router"])
def test_behind_a_router_the_rollout_and_the_way_back_take_one_host_at_a_time(
        path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, routed: bool) -> None:
    """Without --batch, the default (--parallel hosts at once) would take every worker out of the router, which
    its preflight refuses: the rollout and the push back of the old config decide alike."""
    if routed:
        path.write_text(INVENTORY.replace("groups:", "  router:\n    url: http://192.0.2.9:30080\ngroups:"))
    batches: list[str | None] = []

    def rollout(inv: Inventory, names: list[str], local: dict, opts: Options, **_: object) -> Report:
        batches.append(fleet.rollout_policy(inv, names, opts.policy).batch)
        ends = {"h1": "deployed", "h2": "rolled_back"} if len(batches) == 1 else {}
        return Report("push", [HostResult(n).finish(ends.get(n, "deployed")) for n in names])

    monkeypatch.setattr(fleet, "rollout", rollout)
    code, facts = edit_json(path, capsys, "set-env", "A=1")
    assert code == 4 and facts["restored_hosts"] == {"h1": "deployed"}
    assert batches == (["1", "1"] if routed else [None, None])
    code, _ = edit_json(path, capsys, "set-env", "B=1", "--batch", "2")
    assert batches[2:] == ["2"]  # a --batch given is kept


# --- an edit changes its own level only, even through YAML anchors, aliases and merge keys ------------------

ANCHORED = f"""\
defaults:
  service:
    name: svc
    template: {REPO}/templates/sglang.service.j2
    payload: {REPO}/tests/data/testplugin
    python: /usr/bin/python3
    sglang: {{model_path: /models/m}}
    env: &common
      A: "1"
groups:
  g:
    hosts: [h1]
    service:
      env: *common
hosts:
  h1: {{address: 192.0.2.1}}
  h2: {{address: 192.0.2.2}}
"""

# defaults.service is taken into g's service by a merge key; h1 is in g, h2 is not
MERGED = (ANCHORED.replace("  service:\n    name: svc", "  service: &base\n    name: svc")
          .replace('    env: &common\n      A: "1"', '    env: {A: "1"}')
          .replace("    service:\n      env: *common", "    service:\n      <<: *base\n      keep_releases: 3"))


def envs(path: Path) -> dict[str, dict[str, str]]:
    inv = inventory.load(path)
    return {name: dict(host.service.env) for name, host in inv.hosts.items()}


@pytest.mark.parametrize(("args", "expected"), [
    (["A=2", "--target", "g"], {"h1": {"A": "2"}, "h2": {"A": "1"}}),
    (["--unset", "A", "--target", "g"], {"h1": {"A": "1"}, "h2": {"A": "1"}}),  # h1 then has the default's
    (["A=2"], {"h1": {"A": "1"}, "h2": {"A": "2"}}),  # the anchor's owner: the alias keeps the old value
    (["--unset", "A"], {"h1": {"A": "1"}, "h2": {}}),
], ids=["alias-set", "alias-unset", "owner-set", "owner-unset"])
def test_an_edit_through_a_yaml_alias_changes_its_own_level_only(path: Path, capsys: pytest.CaptureFixture[str],
                                                                 args: list[str],
                                                                 expected: dict[str, dict[str, str]]) -> None:
    """ruamel gives an alias the very mapping of its anchor: an edit there used to change every place."""
    path.write_text(ANCHORED)
    code, err = run(path, capsys, "set-env", *args, "--no-apply")
    assert code == 0, err
    assert envs(path) == expected
    assert "env: {}" not in path.read_text()


@pytest.mark.parametrize(("args", "h1"), [
    (["set-env", "A=2", "--target", "g"], {"env": {"A": "2"}, "port": 30000}),
    (["set", "sglang.port=31000", "--target", "g"], {"env": {"A": "1"}, "port": 31000}),
    (["set-env", "--unset", "A", "--target", "g"], {"env": {"A": "1"}, "port": 30000}),
], ids=["set-env", "set", "unset"])
def test_an_edit_of_what_a_merge_key_takes_in_changes_its_own_level_only(
        path: Path, capsys: pytest.CaptureFixture[str], args: list[str], h1: dict) -> None:
    path.write_text(MERGED)
    code, err = run(path, capsys, *args, "--no-apply")
    assert code == 0, err
    text = path.read_text()
    assert text.split("groups:")[0] == MERGED.split("groups:")[0]  # defaults as they were
    assert "      <<: *base\n      keep_releases: 3\n" in text
    hosts = inventory.load(path).hosts
    assert {"env": dict(hosts["h1"].service.env), "port": hosts["h1"].service.sglang.port} == h1
    assert dict(hosts["h2"].service.env) == {"A": "1"} and hosts["h2"].service.sglang.port == 30000


# --- a value is written only if it reads back as given ---------------------------------------------------


@pytest.mark.parametrize(("args", "reason"), [
    (["set-env", "X=a\u0085b", "--target", "h2"], "X: contains the line separator U+0085"),
    (["set-env", "X=a\u2028b"], "X: contains the line separator U+2028"),
    (["set-env", "X=a\tb"], "X: contains a newline or control character"),
    (["set-env", "1X=a"], "'1X' is not a valid environment variable name"),
    (["set", "sglang.model_path=/m\u0085x", "--target", "h1"],
     "hosts.h1.service.sglang.model_path: '/m\\x85x' would not read back from the YAML file as given (it would "
     "read '/m x')"),
], ids=["nel", "line-separator", "tab", "name", "set-nel"])
def test_a_value_yaml_would_change_is_refused_and_nothing_written(path: Path, capsys: pytest.CaptureFixture[str],
                                                                  args: list[str], reason: str) -> None:
    """ruamel writes U+0085 into a quoted string, where YAML reads it back as a space: the check of the
    written file alone passed "a b" and wrote it, exit 0."""
    before = path.read_bytes()
    code, err = run(path, capsys, *args, "--no-apply")
    assert code == 2
    assert len(err) == 1 and reason in err[0], err
    assert path.read_bytes() == before


def test_set_takes_a_value_that_is_no_number_or_bool_as_its_exact_text(path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run(path, capsys, "set", "sglang.model_path=/models/a #b", "sglang.port=31000", "--no-apply")
    assert code == 0
    sglang = inventory.load(path).hosts["h1"].service.sglang
    assert (sglang.model_path, sglang.port) == ("/models/a #b", 31000)


# --- the file's layout: only the edited lines change ------------------------------------------------------

LAYOUT = f"""\
# fleet inventory
defaults:
  service:
    name: svc   # the unit
    template: {REPO}/templates/sglang.service.j2
    payload: {REPO}/tests/data/testplugin       # a comment further right
    python: /usr/bin/python3
    sglang: &sglang
      model_path: /models/m
    env:
      KDTREE_VERIFY: "on"   # checked at load
      KDTREE_NSPLIT: "64"
groups:
  pair:
    hosts:
    - h1
    - h2    # both
hosts:
  h1:
    address: 192.0.2.1
  h2: {{address: 192.0.2.2}}
"""


def four_spaces(text: str) -> str:
    return "".join(" " * (len(line) - len(line.lstrip(" "))) + line for line in text.splitlines(keepends=True))


LAYOUTS = {
    "2-space": LAYOUT,
    "2-space, indented list": LAYOUT.replace("    - h", "      - h"),
    "4-space": four_spaces(LAYOUT),
    "4-space, indented list": four_spaces(LAYOUT).replace("        - h", "            - h"),
    "4-space, dash then 3 spaces": four_spaces(LAYOUT).replace("        - h", "        -   h"),
    "2-space, CRLF": LAYOUT.replace("\n", "\r\n"),
    # what a dump would rewrite (spaces, trailing blanks, ~) stays on the lines the edit does not touch
    "2-space, odd spacing": LAYOUT.replace("{address: 192.0.2.2}", "{ address: 192.0.2.2 }  ")
    .replace("python: /usr", "python:   /usr").replace("\n    sglang:", "\n    environment_file: ~\n    sglang:"),
    "4-space, indented list, CRLF": four_spaces(LAYOUT).replace("        - h", "            - h").replace("\n", "\r\n"),
}


@pytest.mark.parametrize(("args", "old", "new"), [
    (["set-env", "KDTREE_NSPLIT=16"], ['KDTREE_NSPLIT: "64"'], ['KDTREE_NSPLIT: "16"']),
    (["set-env", "A=1"], ['KDTREE_NSPLIT: "64"'], ['KDTREE_NSPLIT: "64"', "A: '1'"]),
], ids=["change", "add"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_edit_changes_only_its_own_lines_in_any_layout(path: Path, capsys: pytest.CaptureFixture[str], layout: str,
                                                          args: list[str], old: list[str], new: list[str]) -> None:
    """Indentation (mappings, lists, dashes), comment columns, unused anchors and CRLF line ends stay as they
    are; the printed diff is the one key."""
    text = LAYOUTS[layout]
    path.write_bytes(text.encode())
    eol = "\r\n" if "\r\n" in text else "\n"
    indent = text.split("KDTREE_NSPLIT")[0].rsplit("\n", 1)[1]
    capsys.readouterr()
    assert cli.main([*args, "--no-apply", "--inventory", str(path)]) == 0
    diff = capsys.readouterr().err
    lines = "".join(f"{indent}{line}{eol}" for line in old), "".join(f"{indent}{line}{eol}" for line in new)
    assert path.read_bytes() == text.replace(*lines).encode()
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    assert changed == [f"-{indent}{line}" for line in old if line not in new] + \
        [f"+{indent}{line}" for line in new if line not in old]


def test_an_edit_inside_a_mapping_indented_otherwise_than_the_first_writes_a_file_that_reads_back(
        path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The new lines follow the first nested mapping's indent; where they cannot go between the file's own
    lines, the whole file is written as ruamel lays it out."""
    path.write_text(INVENTORY.replace("  h1:\n    address: 192.0.2.1\n", "  h1:\n        address: 192.0.2.1\n"))
    code, _ = run(path, capsys, "set", "sglang.port=31000", "--target", "h1", "--no-apply")
    assert code == 0
    assert path.read_text() == INVENTORY.replace(
        "    address: 192.0.2.1\n", "    address: 192.0.2.1\n    service:\n      sglang:\n        port: 31000\n")


def test_the_library_takes_the_inventory_path_as_a_string(path: Path) -> None:
    """As ``inventory.load`` does (docs/library-api.md's example passes a str)."""
    with settings.locked(str(path), 0, "library"):
        edit = settings.set_env(str(path), {"A": "1"}, [])
        assert edit.changed and edit.path == path
        assert settings.set_values(str(path), {"hicache.ratio": "4.0"}).changed
