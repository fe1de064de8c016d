"""The inventory's hooks around a real push on three sandbox hosts: a failing pre_deploy stops the run before
any host is touched, a refusing pre_host leaves its host untouched, post_host sees every host's result,
post_rollout runs once with the summary and can run kdeploy itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from tests.conftest import Deployment

PRE_HOST = ('echo "pre_host $KDEPLOY_HOST batch $KDEPLOY_BATCH"; '
            'if [ "$KDEPLOY_HOST" = h2 ]; then echo "h2 is in maintenance" >&2; exit 3; fi')
POST_HOST = ('echo "$KDEPLOY_COMMAND $KDEPLOY_RESULT pre=$KDEPLOY_PRE_HOST release=$KDEPLOY_RELEASE '
             'previous=$KDEPLOY_PREVIOUS_RELEASE" > "seen/$KDEPLOY_HOST"')
POST_ROLLOUT = 'echo "$KDEPLOY_EXIT_CODE|$KDEPLOY_FAILED|$KDEPLOY_RESULTS" >> seen/rollout'


@pytest.mark.hosts(3)
def test_a_refusing_pre_host_skips_its_host_and_post_hooks_see_every_result(
        deployment: Deployment, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `kdeploy` in hooks
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    old = {h: deployment.current(h) for h in deployment.hosts}  # release ids differ per host (their time)
    before = {h: deployment.state(h) for h in deployment.hosts}
    h2_before = before["h2"]
    seen = deployment.path.parent / "seen"  # hooks run in the inventory's directory
    seen.mkdir()
    (deployment.payload / "rev.txt").write_text("2")

    # A failing pre_deploy: the whole run stops before any host is contacted.
    deployment.edit(lambda doc: doc["defaults"].update(
        hooks={"pre_deploy": 'echo "change freeze for $KDEPLOY_HOSTS"; exit 1', "timeout": 20}))
    code, doc = deployment.json(capsys, "push", "test", "--no-verify")
    assert code == 7 and doc["exit_code"] == 7
    assert [(h["result"], h["phases"], h["error"]) for h in doc["hosts"]] == [
        ("preflight_refused", [], "pre_deploy hook refused the run (exit 1: change freeze for h1 h2 h3); "
                                  "no host touched")] * 3
    assert [(r["name"], r["ok"]) for r in doc["pre_deploy"]] == [("pre_deploy", False)]
    assert {h: deployment.state(h) for h in deployment.hosts} == before  # nothing staged, nothing restarted

    deployment.edit(lambda doc: doc["defaults"].update(
        hooks={"pre_deploy": "true", "pre_host": PRE_HOST, "post_host": POST_HOST, "post_rollout": POST_ROLLOUT,
               "timeout": 20}))

    capsys.readouterr()
    code = cli.main(["push", "test", "--no-verify", "--batch", "1", "--inventory", str(deployment.path), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)  # hook output never reaches stdout

    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 7 and doc["exit_code"] == 7
    assert {h: r["result"] for h, r in hosts.items()} == {"h1": "deployed", "h2": "preflight_refused",
                                                           "h3": "deployed"}
    new = {h: hosts[h]["release"] for h in ("h1", "h3")}
    assert new["h1"] != old["h1"] and new["h3"] != old["h3"]
    refused = hosts["h2"]
    assert refused["error"] == "pre_host hook refused the host (exit 3: h2 is in maintenance); host untouched"
    assert refused["release"] == old["h2"]
    pre = next(p for p in refused["phases"] if p["name"] == "pre_host")
    assert (pre["ok"], pre["detail"]) == (False, "exit 3: h2 is in maintenance")
    assert not any(p["name"] in ("activate", "restart") for p in refused["phases"])
    assert deployment.state("h2") == h2_before  # same release, staged one removed, same run

    names = [p["name"] for p in hosts["h1"]["phases"]]
    assert names.index("pre_host") < names.index("activate") < names.index("post_host")
    for h in ("h1", "h3"):
        assert (seen / h).read_text() == f"push deployed pre=ok release={new[h]} previous={old[h]}\n"
    assert (seen / "h2").read_text() == f"push preflight_refused pre=failed release={old['h2']} previous={old['h2']}\n"
    assert (seen / "rollout").read_text() == "7|h2|h1=deployed h2=preflight_refused h3=deployed\n"
    assert [(r["name"], r["ok"]) for r in doc["post_rollout"]] == [("post_rollout", True)]
    # Hook output went to stderr, labelled by host and hook; batches numbered from 1 (--batch 1).
    assert "h1 pre_host: pre_host h1 batch 1" in err and "h3 pre_host: pre_host h3 batch 3" in err
    assert "h2 pre_host: h2 is in maintenance" in err

    # rollback runs the same hooks: h1 goes back, its pre_host told the target before the switch. Its
    # post_rollout runs kdeploy itself, from a directory with no inventory: the hook's variables lead it to
    # the same inventory and never break it (KDEPLOY_SERVICE held the service name: exit 2).
    deployment.edit(lambda doc: doc["defaults"]["hooks"].update(
        post_rollout=f"{POST_ROLLOUT} && cd / && kdeploy status all --json > \"$OLDPWD/seen/status.json\""))
    assert deployment.kdeploy("rollback", "h1") == 0
    assert deployment.current("h1") == old["h1"]
    assert (seen / "h1").read_text() == f"rollback restored pre=ok release={old['h1']} previous={new['h1']}\n"
    assert (seen / "rollout").read_text().splitlines()[1] == "0||h1=restored"
    status = json.loads((seen / "status.json").read_text())
    assert (status["exit_code"], [h["host"] for h in status["hosts"]]) == (0, ["h1", "h2", "h3"])
    assert status["hosts"][0]["release"] == old["h1"]
    assert "h1 pre_host: pre_host h1 batch 1\n" in capsys.readouterr().err  # a rollback has batches too


@pytest.mark.hosts(2)
def test_a_staged_release_removed_before_its_turn_is_staged_again(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """More hosts than --parallel: each lets go after staging and resumes at its turn. h1's pre_host removes
    the release staged on h2 meanwhile (as a cleanup of someone's would): h2 sees it at its resume, decides
    again and stages anew instead of switching to a release that is gone."""
    assert deployment.kdeploy("push", "test", "--no-verify") == 0
    d = deployment.service_dir
    remove_h2_staged = (f'ssh -F {deployment.fleet.ssh_config_path} h2 "cd {d}/releases && r=\\$(ls | tail -n 1) && '
                        f'[ \\"\\$r\\" != \\"\\$(basename \\$(readlink ../current))\\" ] && rm -rf -- \\"\\$r\\" && '
                        f'echo removed \\$r"')
    deployment.edit(lambda doc: doc["defaults"].update(
        hooks={"pre_host": f'if [ "$KDEPLOY_HOST" = h1 ]; then {remove_h2_staged}; fi', "timeout": 20}))
    (deployment.payload / "rev.txt").write_text("2")

    code, doc = deployment.json(capsys, "push", "test", "--no-verify", "--parallel", "1")
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert code == 0 and [hosts[h]["result"] for h in ("h1", "h2")] == ["deployed", "deployed"], doc
    phases = [(p["name"], p["detail"]) for p in hosts["h2"]["phases"]]
    names = [n for n, _ in phases]
    assert names.count("stage") == 2 and names.index("stage") < names.index("resume") < names.index("activate")
    resume = dict(phases)["resume"]
    removed = resume.split("staged release ")[1].split(" was removed")[0]
    assert resume == f"lock taken again; staged release {removed} was removed, decided again", resume
    restaged = hosts["h2"]["release"]
    assert restaged != removed
    assert deployment.current("h2") == restaged
    assert removed not in deployment.sh("h2", f"ls {d}/releases").split()
    assert deployment.sh("h2", f"cat {d}/current/rev.txt") == "2"
    assert "resume" in [p["name"] for p in hosts["h1"]["phases"]]   # h1 let go after staging too
