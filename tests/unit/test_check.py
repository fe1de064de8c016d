"""``kdeploy check``: a missing payload, an unset secret, a template error, a unit systemd rejects and a
missing hook script, each found with its file:line, without a single SSH connection (Remote.connect fails
the test; the hosts' addresses are unroutable anyway)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.cli import schema
from kdeploy.flows import check
from kdeploy.ssh.remote import Remote

REPO = Path(__file__).resolve().parents[2]

INVENTORY = """\
defaults:
  service:
    name: svc
    python: /opt/venv/bin/python
    environment_file: /etc/svc.env
    payload: kdtree
    sglang:
      model_path: /models/m
    secrets:
      env: [KD_CHECK_TOKEN]
hosts:
  good:
    address: 192.0.2.1
  nopayload:
    address: 192.0.2.2
    service:
      payload: kernels/missing
  badtemplate:
    address: 192.0.2.3
    service:
      template: templates/bad.service.j2
  badunit:
    address: 192.0.2.4
    service:
      template: templates/restart.service.j2
    hooks:
      pre_host: ./hooks/lb-out.sh --host "$KDEPLOY_HOST"
"""


@pytest.fixture(autouse=True)
def _no_ssh(monkeypatch: pytest.MonkeyPatch) -> None:
    def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("kdeploy check opened an SSH connection")

    monkeypatch.setattr(Remote, "connect", connect)


@pytest.fixture
def inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kdtree").symlink_to(REPO / "kernels" / "kdtree")
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    good = (REPO / "templates" / "sglang.service.j2").read_text()
    (tmp_path / "templates" / "bad.service.j2").write_text("[Unit]\nDescription={{ description }}\n"
                                                           "Documentation={{ service.nope.url }}\n")
    (tmp_path / "templates" / "restart.service.j2").write_text(good.replace("Restart=on-failure",
                                                                            "Restart=sometimes"))
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY)
    monkeypatch.setenv("OTHER_SECRET", "hunter2-value")
    return path


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code = cli.main(["check", *args, "--json"])
    out, err = capsys.readouterr()
    schema.ReportDoc.model_validate(json.loads(out))  # every field described in the report's schema
    return code, json.loads(out), err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_check_finds_every_problem_with_its_file_and_line(inventory: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KD_CHECK_TOKEN", raising=False)
    code, doc, err = _check(capsys, "all", "-i", str(inventory))
    assert (code, doc["command"], doc["exit_code"]) == (2, "check", 2)
    found = {h["host"]: h["check"]["findings"] for h in doc["hosts"]}
    unset = f"{inventory}:10: defaults.service.secrets.env: secret KD_CHECK_TOKEN: environment variable " \
            "KD_CHECK_TOKEN is not set on the controller"
    assert found["good"] == [unset]
    assert found["nopayload"] == [
        f"{inventory}:17: hosts.nopayload.service.payload: {inventory.parent}/kernels/missing: payload directory "
        "not found", unset]
    assert found["badtemplate"] == [
        f"{inventory.parent}/templates/bad.service.j2:3: unit template for badtemplate: "
        "'kdeploy.core.inventory.Service object' has no attribute 'nope'", unset]
    template = inventory.parent / "templates" / "restart.service.j2"
    assert found["badunit"][0].startswith(f"{template}: unit rendered for badunit, line ")
    assert "(Restart=sometimes): systemd-analyze verify: Failed to parse service restart specifier" in \
        found["badunit"][0]
    assert found["badunit"][2:] == [f"{inventory}:27: hosts.badunit.hooks.pre_host: {inventory.parent}/hooks/"
                                    "lb-out.sh: not found"]
    assert all(h["result"] == "invalid" and h["error"] == found[h["host"]][0] for h in doc["hosts"])
    # On stderr: each finding once, with its hosts; never a secret's value.
    assert f"{unset} [good nopayload badtemplate badunit]" in err.splitlines()
    assert "hunter2" not in err + json.dumps(doc)


def test_check_passes_a_sound_inventory_and_narrows_to_target_and_limit(
        inventory: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KD_CHECK_TOKEN", "s3cret-value")
    code, doc, err = _check(capsys, "all", "-i", str(inventory), "--limit", "good,nopayload", "--limit", "good")
    assert (code, [h["host"] for h in doc["hosts"]], doc["hosts"][0]["check"]["findings"]) == (0, ["good"], [])
    assert "s3cret" not in err + json.dumps(doc)
    code, doc, _ = _check(capsys, "nopayload", "-i", str(inventory))
    assert code == 2 and len(doc["hosts"][0]["check"]["findings"]) == 1
    (inventory.parent / "templates" / "bad.service.j2").unlink()
    code, doc, _ = _check(capsys, "badtemplate", "-i", str(inventory))
    assert (code, doc["hosts"][0]["check"]["findings"]) == (2, [
        f"{inventory}:21: hosts.badtemplate.service.template: {inventory.parent}/templates/bad.service.j2: unit "
        "template not found"])


def test_an_inventory_that_does_not_load_is_one_line_and_exit_2(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text("hosts:\n  a:\n    address: 192.0.2.1\n    servce: {}\n")
    assert cli.main(["check", "-i", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"kdeploy: {path}:4: hosts.a.servce: unknown key (did you mean 'service'?)\n"


@pytest.mark.parametrize(("output", "found"), [
    ("/tmp/x/a.service:6: Failed to parse service restart specifier, ignoring: sometimes\n",
     [(6, "Failed to parse service restart specifier, ignoring: sometimes")]),
    ("a.service: Command /opt/venv/bin/python is not executable: No such file or directory\n", []),
    ("a.service: Service has no ExecStart=, ExecStop=, or SuccessAction=. Refusing.\n",
     [(0, "Service has no ExecStart=, ExecStop=, or SuccessAction=. Refusing.")]),
])
def test_systemd_analyze_output_is_parsed_and_what_only_hosts_have_is_ignored(output: str, found: list) -> None:
    assert check.parse_verify(output) == found


def test_hook_scripts_are_judged_only_when_the_hook_names_one(tmp_path: Path) -> None:
    script = tmp_path / "hooks" / "ok.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    assert check.hook_script("./hooks/ok.sh", tmp_path) == f"{script}: not executable (chmod +x it, or start the " \
                                                           "hook with `sh ./hooks/ok.sh`)"
    script.chmod(0o755)
    assert check.hook_script("./hooks/ok.sh a b", tmp_path) is None
    assert check.hook_script('curl -fsS "$URL"', tmp_path) is None
    assert check.hook_script('[ "$X" != ok ] || ./hooks/x.sh', tmp_path) is None
    assert check.hook_script("$HOME/bin/x", tmp_path) is None


def test_an_ansible_inventory_s_findings_point_at_its_own_files(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KD_T", raising=False)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "kdtree").symlink_to(REPO / "kernels" / "kdtree")
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    hosts = tmp_path / "hosts.yml"
    hosts.write_text("all:\n  children:\n    gpu:\n      hosts:\n        h1: {ansible_host: 192.0.2.1}\n"
                     "        h2:\n          ansible_host: 192.0.2.2\n          kdeploy_service: {payload: nope}\n")
    service = tmp_path / "service.yaml"
    service.write_text("service:\n  name: svc\n  python: /opt/venv/bin/python\n  environment_file: /etc/svc.env\n"
                       "  sglang:\n    model_path: /m\n  secrets:\n    env: [KD_T]\n")
    code, doc, _ = _check(capsys, "all", "-i", str(hosts), "--service", str(service))
    assert code == 2
    assert {h["host"]: h["check"]["findings"] for h in doc["hosts"]} == {
        "h1": [f"{service}:8: service.secrets.env: secret KD_T: environment variable KD_T is not set on the "
               "controller"],
        "h2": [f"{hosts}:6: h2: kdeploy_service.payload: {tmp_path}/kernels/nope: payload directory not found",
               f"{service}:8: service.secrets.env: secret KD_T: environment variable KD_T is not set on the "
               "controller"]}
