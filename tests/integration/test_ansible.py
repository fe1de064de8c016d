"""An Ansible INI inventory plus a kdeploy service file deploy real sandbox hosts (docs/inventory.md)."""

from __future__ import annotations

import json
import sys

import pytest
from ruamel.yaml import YAML

from kdeploy.cli import app as cli
from tests.conftest import Deployment

# kdeploy settings that the Ansible inventory carries instead of the service file
ANSIBLE_VARS = {"user": "ansible_user", "port": "ansible_port", "identity_file": "ansible_ssh_private_key_file"}


def test_push_and_status_through_an_ansible_inventory(deployment: Deployment, tmp_path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    doc = YAML(typ="safe").load(deployment.path.read_text())
    defaults = doc["defaults"]
    host = deployment.hosts[0]
    variables = [f"ansible_host={doc['hosts'][host]['address']}"]
    variables += [f"{var}={defaults.pop(key)}" for key, var in ANSIBLE_VARS.items() if key in defaults]
    hosts_ini = tmp_path / "hosts.ini"
    hosts_ini.write_text(f"[gpu]\n{host} {' '.join(variables)}\n\n[prod:children]\ngpu\n")
    service = tmp_path / "service.yaml"
    with service.open("w") as fh:
        YAML().dump(defaults, fh)  # the service block and what else kdeploy needs (known_hosts or ssh_config)

    def run(*args: str, target: str = "prod", source: str = str(hosts_ini)) -> tuple[int, dict]:
        capsys.readouterr()
        code = cli.main([*args, target, "-i", source, "--service", str(service), "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, pushed = run("push")
    assert code == 0, pushed
    assert [(h["host"], h["result"]) for h in pushed["hosts"]] == [(host, "deployed")]
    assert deployment.show(host, "ActiveState") == "active"
    code, status = run("status")
    assert code == 0, status
    assert status["hosts"][0]["release"] == pushed["hosts"][0]["release"]

    # The same host from a dynamic inventory script in an inventory directory, selected by a pattern and --limit.
    listing = {"gpu": [host], "prod": {"children": ["gpu"]},
               "_meta": {"hostvars": {host: dict(v.split("=", 1) for v in variables)}}}
    inv = tmp_path / "inventories"
    inv.mkdir()
    (inv / "cloud.py").write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(listing))})\n")
    (inv / "cloud.py").chmod(0o755)
    source = ["-i", str(inv), "--service", str(service), "--limit", f"{host[:-1]}*"]
    capsys.readouterr()
    assert cli.main(["status", "prod:&gpu:!nohost", *source]) == 2  # a typo in an exclusion: refused, no host
    assert capsys.readouterr().err.startswith("kdeploy: target 'nohost': no such host or group")
    code, status = run("status", "--limit", f"{host[:-1]}*", target="prod:&gpu", source=str(inv))
    assert code == 0, status
    assert [(h["host"], h["release"]) for h in status["hosts"]] == [(host, pushed["hosts"][0]["release"])]
