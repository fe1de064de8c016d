"""kdeploy/core/ansible.py: Ansible inventories read as kdeploy inventories.

The parity tests take the real ``ansible-inventory --list`` (ansible-core, a dev dependency) as the reference
for the hosts, each group's members (children included) and the connection variables kdeploy resolves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ansible._internal._json._profiles._inventory_legacy import Decoder
from ansible.parsing.vault import EncryptedString, VaultHelper

from kdeploy.cli import app as cli
from kdeploy.core import ansible, inventory
from kdeploy.core.errors import InvalidInput
from kdeploy.flows import settings

REPO = Path(__file__).resolve().parents[2]
SERVICE = f"""\
# kdeploy's part of the fleet: what Ansible does not know
known_hosts: /etc/kdeploy/known_hosts
service:
  name: svc
  template: {REPO}/templates/sglang.service.j2
  payload: {REPO}/tests/data/testplugin
  python: /usr/bin/python3
  sglang:
    model_path: /models/m
"""

# Children named before they are defined, ranges with padding, letters and steps, host:port, literal values,
# vars at every level, a host in several groups, ';' comments, hosts before any section.
INI = """\
bastion ansible_host=10.0.0.1 ansible_user=ops
; the GPU fleet
[prod:children]
gpu
edge

[gpu]
gpu[01:03] ansible_user=root
gpu04:2222 ansible_host=10.0.1.4 kdeploy_connect_timeout=5
gpu[10:14:2] ansible_become=true ansible_become_user=svc ansible_become_method=sudo

[gpu:vars]
ansible_ssh_common_args='-o ProxyJump=ops@10.0.0.1:22 -o StrictHostKeyChecking=no'
ansible_ssh_private_key_file=~/.ssh/fleet

[big]
gpu[03:04]
gpu12

[big:vars]
ansible_port=2200
ansible_become=yes

[edge]
edge-[a:c].example.com ansible_port=22 ansible_ssh_extra_args="-J jump@j1"

[all:vars]
ansible_user=deploy
"""

YAML_INVENTORY = """\
all:
  vars:
    ansible_user: deploy
  hosts:
    bastion:
      ansible_host: 10.0.0.1
  children:
    gpu:
      vars:
        ansible_ssh_common_args: -o ProxyJump=bastion
      hosts:
        gpu[01:04]:
        gpu05:2201:
          ansible_host: 10.0.1.5
      children:
        a100:
          vars: {ansible_user: a100user}
          hosts:
            gpu[01:02]:
    zeta:
      vars: {ansible_user: zeta, ansible_port: 2022, ansible_become: true}
      hosts:
        gpu02:
        gpu03: {ansible_port: 2023, ansible_become: false}
edge:
  hosts:
    edge1: {ansible_host: edge1.example.com, ansible_ssh_extra_args: -J jumper}
"""

# Ansible's precedence when groups disagree: deeper groups win, then the name; group_vars/ and host_vars/
# files beside the inventory win over the inventory's own variables at each level.
PRECEDENCE = """\
[parent]
h1
h2
h3

[parent:children]
child

[child]
h1

[aaa]
h1
h2

[zzz]
h2

[parent:vars]
ansible_user=parent
ansible_port=2000

[child:vars]
ansible_user=child

[aaa:vars]
ansible_user=aaa
ansible_port=3000

[zzz:vars]
ansible_user=zzz
"""
VAR_FILES = {
    "group_vars/all.yml": "ansible_port: 2100\n",
    "group_vars/aaa/main.yml": "ansible_port: 3100\n",
    "host_vars/h3": "ansible_host: 192.0.2.3\n",
    "host_vars/h2.yaml": "ansible_user: fromfile\n",
}

CASES = {
    "hosts.ini": (INI, {}),
    "fleet.yml": (YAML_INVENTORY, {}),
    "hosts": ("plain1 ansible_host=192.0.2.10\nplain2\n", {}),  # no sections, no extension
    "precedence.ini": (PRECEDENCE, VAR_FILES),
}


def write(tmp_path: Path, name: str, text: str, files: dict[str, str] | None = None) -> tuple[Path, Path]:
    for rel, content in (files or {}).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    (tmp_path / name).write_text(text)
    (tmp_path / "service.yaml").write_text(SERVICE)
    return tmp_path / name, tmp_path / "service.yaml"


def ansible_inventory(path: Path) -> dict:
    """The real ``ansible-inventory --list`` of ``path``."""
    home = path.parent / ".ansible"
    home.mkdir(exist_ok=True)
    (home / "ansible.cfg").write_text("")  # no user's or system's config changes the reference
    env = {**os.environ, "ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
           "ANSIBLE_INVENTORY_UNPARSED_FAILED": "true", "ANSIBLE_CONFIG": str(home / "ansible.cfg")}
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-inventory")), "-i", str(path), "--list"],
                          capture_output=True, text=True, env=env, cwd=path.parent, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def members(listing: dict, group: str) -> set[str]:
    entry = listing.get(group, {})
    found = set(entry.get("hosts", []))
    for child in entry.get("children", []):
        found |= members(listing, child)
    return found


@pytest.mark.parametrize("name", CASES)
def test_hosts_groups_and_connection_match_ansible_inventory(tmp_path, name):
    text, files = CASES[name]
    path, service = write(tmp_path, name, text, files)
    listing = ansible_inventory(path)
    loaded = inventory.load(path, service)

    hostvars = listing["_meta"]["hostvars"]
    assert set(loaded.hosts) == members(listing, "all")
    groups = {g for g in listing if g not in ("_meta", "all")} | set(listing["all"].get("children", []))
    for group in groups:
        assert set(loaded.groups.get(group, [])) == members(listing, group), group
    assert all(not hosts for g, hosts in loaded.groups.items() if g not in groups)
    for name_, host in loaded.hosts.items():
        hv = hostvars.get(name_, {})
        key = hv.get("ansible_ssh_private_key_file")
        args = " ".join(hv.get(v, "") for v in ("ansible_ssh_common_args", "ansible_ssh_extra_args"))
        jump = re.search(r"(?:-J\s*|ProxyJump=)(\S+)", args)
        assert (host.address, host.port, host.user) == (
            hv.get("ansible_host", name_), int(hv.get("ansible_port", 22)), hv.get("ansible_user", "root")), name_
        assert host.identity_file == (os.path.abspath(os.path.expanduser(key)) if key else None)
        assert host.proxy_jump == (jump.group(1) if jump else None)
        assert host.connect_timeout == hv.get("kdeploy_connect_timeout", 10)
        become = str(hv.get("ansible_become", False)).lower() in ("yes", "true", "1", "on", "y", "t")
        assert (host.become, host.become_user, host.become_method) == (
            become, hv.get("ansible_become_user", "root"), hv.get("ansible_become_method", "sudo")), name_
        assert host.service.name == "svc" and host.known_hosts == "/etc/kdeploy/known_hosts"


def test_the_fleet_reads_as_written(tmp_path):
    """Spot checks of the INI case, so the parity test cannot pass by both sides being empty."""
    loaded = inventory.load(*write(tmp_path, "hosts.ini", INI))
    assert loaded.resolve("prod") == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu10", "gpu12", "gpu14",
                                      "edge-a.example.com", "edge-b.example.com", "edge-c.example.com"]
    assert loaded.resolve("big,ungrouped") == ["bastion", "gpu03", "gpu04", "gpu12"]
    gpu04 = loaded.hosts["gpu04"]
    assert (gpu04.address, gpu04.port, gpu04.user, gpu04.proxy_jump) == ("10.0.1.4", 2222, "deploy",
                                                                         "ops@10.0.0.1:22")
    assert (gpu04.become, gpu04.become_user) == (True, "root")  # [big:vars] ansible_become=yes
    assert (loaded.hosts["gpu10"].become, loaded.hosts["gpu10"].become_user) == (True, "svc")
    assert not loaded.hosts["gpu01"].become
    assert loaded.base_dir == tmp_path  # the service file's template and payload paths are relative to it


def test_service_file_is_the_defaults_level_and_ansible_vars_override(tmp_path):
    ini = ("[gpu]\ng1 kdeploy_service=\"{'sglang': {'tp': 4}}\"\ng2\n"
           "[gpu:vars]\nkdeploy_service={'env': {'A': 'group'}}\nansible_user=ops\n")
    path, service = write(tmp_path, "hosts.ini", ini)
    service.write_text(SERVICE + "user: fromservice\nport: 2022\n")
    loaded = inventory.load(path, service)
    g1, g2 = loaded.hosts["g1"], loaded.hosts["g2"]
    # Ansible replaces a whole dict variable (g1's own kdeploy_service hides the group's); kdeploy then merges
    # the result over the service file key by key.
    assert (g1.service.sglang.tp, g1.service.env, g1.service.sglang.model_path) == (4, {}, "/models/m")
    assert (g2.service.sglang.tp, g2.service.env) == (1, {"A": "group"})
    assert (g2.user, g2.port) == ("ops", 2022)


@pytest.mark.parametrize(("text", "service_extra", "message"), [
    ("[gpu]\ng1 kdeploy_service=\"{'sglang': {'tp': 0}}\"\n", "",
     r"hosts\.ini:2: g1: kdeploy_service\.sglang\.tp: Input should be greater than 0"),
    ("[gpu]\ng1 ansible_port=99999\n", "", r"hosts\.ini:2: g1: ansible_port: Input should be less than 65536"),
    ("g1 kdeploy_bogus=1\n", "", r"hosts\.ini:1: g1: kdeploy_bogus: unknown key"),
    ("g1\n", "  tpp: 2\n", r"service\.yaml:\d+: service\.tpp: unknown key"),
    ("g1 ansible_host='{{ lookup(\"env\", \"X\") }}'\n", "", r"hosts\.ini:1: g1: ansible_host: .* Jinja template"),
    ("g1 ansible_ssh_common_args='-o ProxyCommand=\"ssh -W %h:%p j\"'\n", "", r"ProxyCommand is not supported"),
    ("g1 ansible_connection=local\n", "", r"kdeploy reaches hosts over SSH only"),
    ("[gpu]\ng1 ansible_become=true ansible_become_method=su\n", "",
     r"hosts\.ini:2: g1: ansible_become_method: invalid value 'su': expected one of 'sudo' or 'doas'"),
    ("g1 ansible_become_user='root;id'\n", "", r"hosts\.ini:1: g1: ansible_become_user: .*must be a user name"),
    ("[a:children]\nb\n", "", r"hosts\.ini:2: section \[a:children\] names undefined group 'b'"),
    ("[a:vars]\nx=1\n", "", r"hosts\.ini:1: section \[a:vars\] for undefined group 'a'"),
    ("[a:hostz]\n", "", r"hosts\.ini:1: section \[a:hostz\] has unknown type 'hostz'"),
    ("[a]\ngpu[1:]\n", "", r"hosts\.ini:2: host pattern 'gpu\[1:\]': a range needs an end"),
    ("[a]\ng1 novalue\n", "", r"hosts\.ini:2: expected key=value"),
    ("[a]\ng1\ng2 ansible_host='-oProxyCommand=x'\n", "",
     r"hosts\.ini:3: g2: ansible_host: '-oProxyCommand=x' is no host name, IP address or ssh_config Host alias"),
    ("g1 ansible_host=''\n", "", r"hosts\.ini:1: g1: ansible_host: '' is no host name"),
])
def test_bad_input_is_one_line_with_file_and_line(tmp_path, text, service_extra, message):
    path, service = write(tmp_path, "hosts.ini", text)
    if service_extra:
        service.write_text(SERVICE.replace("  python:", f"{service_extra}  python:"))
    with pytest.raises(InvalidInput, match=message) as err:
        inventory.load(path, service)
    assert "\n" not in str(err.value)


def test_yaml_errors_name_the_host_line(tmp_path):
    text = "gpu:\n  hosts:\n    g1:\n      kdeploy_service: {sglang: {tp: zero}}\n"
    with pytest.raises(InvalidInput, match=r"fleet\.yml:3: g1: kdeploy_service\.sglang\.tp: Input should be"):
        inventory.load(*write(tmp_path, "fleet.yml", text))


def test_cli_takes_service_from_option_or_environment(tmp_path, monkeypatch, capsys):
    path, service = write(tmp_path, "hosts.ini", INI)
    assert cli.main(["render", "gpu01", "-i", str(path)]) == 2
    assert "pass --service FILE" in capsys.readouterr().err
    assert cli.main(["render", "gpu01", "-i", str(path), "--service", str(service)]) == 0
    assert "ExecStart=/usr/bin/python3 -m sglang.launch_server" in capsys.readouterr().out
    monkeypatch.setenv("KDEPLOY_SERVICE", str(service))
    assert cli.main(["render", "edge", "-i", str(path)]) == 0
    assert capsys.readouterr().out.count("# ---- edge-") == 3
    kdeploy_inventory = tmp_path / "inventory.yaml"
    kdeploy_inventory.write_text("hosts:\n  h1: {address: 192.0.2.1}\n")
    assert cli.main(["render", "-i", str(kdeploy_inventory)]) == 2
    assert "goes with an Ansible inventory only" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "ansible"), [
    ("inventory.yaml", "defaults: {}\nhosts:\n  h1: {address: x}\n", False),
    ("inventory.yaml", "hosts:\n  h1: {address: x}\n", False),
    ("inventory.yaml", "host:\n  h1: {address: x}\n", False),  # a typo stays kdeploy's error
    ("inventory.yaml", "all:\n  children:\n    gpu:\n      hosts: {g1: null}\n", True),
    ("inventory.yaml", "gpu:\n  hosts:\n    g1:\n", True),
    ("inventory", "[gpu]\ng1\n", True),
    ("inventory", "g1\ng2\n", True),
    ("inventory.cfg", "g1\n", True),
])
def test_detects_ansible_by_content(tmp_path, name, text, ansible):
    path, service = write(tmp_path, name, text)
    if ansible:
        assert set(inventory.load(path, service).hosts) <= {"g1", "g2"}
    else:
        with pytest.raises(InvalidInput, match=r"kdeploy inventory carries its service|unknown key"):
            inventory.load(path, service)


def test_set_env_edits_the_service_file_and_refuses_a_scope(tmp_path):
    path, service = write(tmp_path, "hosts.ini", INI)
    edit = settings.set_env(path, {"KDTREE_NSPLIT": "64"}, [], None, service)
    assert edit.path == service and edit.level == "defaults"
    assert all(h.service.env == {"KDTREE_NSPLIT": "64"} for h in edit.new.hosts.values())
    assert edit.new.source == edit.old.source == path  # the rollout's hooks pass the same -i on (docs/hooks.md)
    settings.write(edit)
    assert "KDTREE_NSPLIT: '64'" in service.read_text() and path.read_text() == INI
    assert service.read_text().startswith("# kdeploy's part")  # comments survive
    with pytest.raises(InvalidInput, match=r"--target gpu: .* is an Ansible inventory"):
        settings.set_values(path, {"sglang.tp": "2"}, "gpu", service)
    with pytest.raises(InvalidInput, match="pass --service FILE"):
        settings.set_values(path, {"sglang.tp": "2"}, None, None)


def test_cli_set_env_writes_the_service_file_under_its_lock(tmp_path, capsys):
    path, service = write(tmp_path, "hosts.ini", INI)
    assert cli.main(["set-env", "KDTREE_VERIFY=on", "-i", str(path), "--service", str(service), "--no-apply"]) == 0
    assert "KDTREE_VERIFY: on" in service.read_text() and path.read_text() == INI
    assert (tmp_path / ".service.yaml.lock").exists() and not (tmp_path / ".hosts.ini.lock").exists()
    assert cli.main(["set-env", "X=1", "-i", str(path), "--service", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: service file not found (pass --service FILE)" in capsys.readouterr().err


def test_completion_of_target_from_an_ansible_inventory(tmp_path, monkeypatch, capsys):
    path, service = write(tmp_path, "hosts.ini", INI)
    monkeypatch.setenv("_KDEPLOY_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", f"kdeploy push -i {path} --service {service} gpu0")
    monkeypatch.setenv("COMP_CWORD", "6")
    assert cli.main([]) == 0
    assert capsys.readouterr().out.split() == ["gpu01", "gpu02", "gpu03", "gpu04"]


def test_the_ssh_names_win_when_both_are_set_as_in_ansibles_ssh_plugin(tmp_path):
    """The ssh connection plugin lists `ansible_host`, `ansible_ssh_host` (and so on) and its config manager keeps
    the last one set: `ansible h7 -m ping -vvv` connects to 127.0.0.9:2022 as sshu for this file."""
    ini = ("[g]\nh7 ansible_ssh_host=127.0.0.9 ansible_ssh_port=2022 ansible_ssh_user=sshu\n"
           "[g:vars]\nansible_user=grpuser\nansible_host=127.0.0.8\nansible_port=2000\n")
    host = inventory.load(*write(tmp_path, "hosts.ini", ini)).hosts["h7"]
    assert (host.address, host.port, host.user) == ("127.0.0.9", 2022, "sshu")
    yml = "all:\n  hosts:\n    h8: {ansible_host: 127.0.0.7, ansible_ssh_host: null}\n"  # null: unset, as in Ansible
    assert inventory.load(*write(tmp_path, "hosts.yml", yml)).hosts["h8"].address == "127.0.0.7"


def test_yaml_hosts_keep_the_order_they_are_written_in(tmp_path):
    """Ansible's YAML plugin reads a group's children before its hosts; the canary is the first host written."""
    yml = ("all:\n  children:\n    gpu:\n      hosts:\n        a1:\n        a2:\n      children:\n"
           "        sub:\n          hosts:\n            b1:\n")
    assert list(inventory.load(*write(tmp_path, "hosts.yml", yml)).hosts) == ["a1", "a2", "b1"]


# -- dynamic and directory inventories: every kind ansible-inventory reads, kdeploy resolves the same ----------

def ansible_env(home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    (home / "ansible.cfg").write_text("")
    return {"ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
            "ANSIBLE_CONFIG": str(home / "ansible.cfg")}


def ansible_list(source: str, tmp: Path, *extra: str, raw: bool = False) -> Any:
    """``ansible-inventory -i SOURCE --list`` (any source: a directory, a script, a host list), run in an empty
    directory: ansible-inventory also reads the group_vars/ of the current directory, as a playbook's. Read with
    ansible-core's own decoder of that output (an unsafe value is its string, a vaulted one :class:`Vaulted`);
    ``raw``: the text it printed."""
    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {**os.environ, **ansible_env(tmp / ".ansible"), "ANSIBLE_INVENTORY_UNPARSED_FAILED": "true"}
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-inventory")), "-i", source, "--list", *extra],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout if raw else ansible_reads(done.stdout)


def ansible_reads(text: str) -> Any:
    """--list JSON as ansible-core's own decoder of it reads it, its EncryptedString as kdeploy's Vaulted."""
    def vaulted(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: vaulted(v) for k, v in value.items()}
        if isinstance(value, list):
            return [vaulted(v) for v in value]
        if isinstance(value, EncryptedString):
            return ansible.Vaulted(VaultHelper.get_ciphertext(value, with_tags=False))
        return value
    return vaulted(json.loads(text, cls=Decoder))


def read_any(path: Path) -> ansible.AnsibleInventory:
    if ansible.is_source(path):
        return ansible.read_source(path)
    text = path.read_text()
    fmt, _ = ansible.detect(path, text)
    assert fmt is not None
    return ansible.read(path, text, fmt)


def assert_resolves_as_ansible(path: Path, service: Path, listing: dict) -> inventory.Inventory:
    """kdeploy's hosts, each group's hosts and children, and each host's variables are ansible-inventory's."""
    found, loaded = read_any(path), inventory.load(path, service)
    assert loaded.hosts and set(loaded.hosts) == members(listing, "all")
    for group, entry in listing.items():
        if group == "_meta":
            continue
        assert set(found.groups[group].hosts) == set(entry.get("hosts", [])), group
        assert set(found.groups[group].children) == set(entry.get("children", [])), group
        if group != "all":
            assert set(loaded.groups[group]) == members(listing, group), group
    assert all(not g.hosts and not g.children for n, g in found.groups.items() if n not in listing)
    hostvars = listing["_meta"]["hostvars"]
    for host in loaded.hosts:
        assert found.host_vars(host) == hostvars.get(host, {}), host
    return loaded


# 200 hosts in 12 groups: rack01-rack10 (20 hosts each, gpu001 in rack10 too), h100 and a100 over them;
# variables at every level, a group priority, a host in two groups, and a group_vars file beside the script.
SCRIPT_200 = """\
import json, sys
hosts = [f"gpu{n:03d}" for n in range(1, 201)]
groups = {f"rack{r:02d}": {"hosts": hosts[(r - 1) * 20:r * 20], "vars": {"ansible_port": 2200 + r}}
          for r in range(1, 11)}
groups["rack10"]["hosts"].append("gpu001")
groups["h100"] = {"children": [f"rack{r:02d}" for r in range(1, 6)],
                  "vars": {"ansible_user": "h100", "kdeploy_service": {"sglang": {"tp": 8}}}}
groups["a100"] = {"children": [f"rack{r:02d}" for r in range(6, 11)],
                  "vars": {"ansible_user": "a100", "ansible_group_priority": 5}}
groups["all"] = {"vars": {"ansible_ssh_private_key_file": "/keys/fleet", "region": "eu"}}
hostvars = {h: {"ansible_host": f"10.1.{i // 200}.{i % 200 + 1}", "rack_slot": i % 20} for i, h in enumerate(hosts)}
hostvars["gpu007"]["ansible_user"] = "special"
hostvars["gpu150"]["kdeploy_connect_timeout"] = 3
if sys.argv[1:] == ["--list"]:
    print(json.dumps({**groups, "_meta": {"hostvars": hostvars}}))
else:
    print("{}")
"""


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def test_a_dynamic_script_of_200_hosts_resolves_as_ansible_inventory(tmp_path):
    """The done-when of issue 26: hosts, groups and variables of an executable script are ansible-inventory's."""
    path, service = write(tmp_path, "fleet.py", "", {"group_vars/rack03.yml": "ansible_user: rack03\n"})
    script(tmp_path, "fleet.py", SCRIPT_200)
    listing = ansible_list(str(path), tmp_path)
    loaded = assert_resolves_as_ansible(path, service, listing)
    assert len(loaded.hosts) == 200 and len([g for g in loaded.groups if g != "ungrouped"]) == 12
    gpu001, gpu007, gpu041, gpu150 = (loaded.hosts[h] for h in ("gpu001", "gpu007", "gpu041", "gpu150"))
    assert (gpu001.address, gpu001.port, gpu001.user) == ("10.1.0.1", 2210, "a100")  # rack10 > rack01; priority
    assert (gpu007.user, gpu007.service.sglang.tp, gpu001.service.sglang.tp) == ("special", 8, 8)
    assert (gpu041.user, gpu041.port, gpu041.identity_file) == ("rack03", 2203, "/keys/fleet")  # group_vars file
    assert (gpu150.connect_timeout, gpu150.user, gpu150.service.sglang.tp) == (3, "a100", 1)
    assert loaded.resolve("h100:&rack0[4:5]:!gpu07*") == [f"gpu{n:03d}" for n in range(61, 101) if n // 10 != 7]


def test_a_script_without_meta_gives_each_hosts_variables_through_host(tmp_path, monkeypatch):
    body = ("import json, sys\nif sys.argv[1] == '--list':\n"
            "    print(json.dumps({'gpu': ['g1', 'g2'], 'edge': {'hosts': ['e1'], 'vars': {'ansible_port': 2022}}}))\n"
            "else:\n    print(json.dumps({'ansible_host': '192.0.2.' + sys.argv[2][1:]}))\n")
    path, service = write(tmp_path, "old.py", "")
    script(tmp_path, "old.py", body)
    loaded = assert_resolves_as_ansible(path, service, ansible_list(str(path), tmp_path))
    assert [(h.address, h.port) for h in loaded.hosts.values()] == [("192.0.2.1", 22), ("192.0.2.2", 22),
                                                                     ("192.0.2.1", 2022)]
    monkeypatch.chdir(tmp_path)  # `-i old.py`: run from here, not looked up on PATH
    assert list(inventory.load(Path("old.py"), service).hosts) == ["g1", "g2", "e1"]


@pytest.mark.parametrize("export", [False, True])
def test_ansible_inventory_list_json_file(tmp_path, export):
    """A saved ``ansible-inventory --list`` (or ``--list --export``: group variables under the groups) reads as
    Ansible reads the same JSON from a script; without --export, as the inventory it was made from."""
    source, service = write(tmp_path, "precedence.ini", PRECEDENCE, VAR_FILES)
    listing = ansible_list(str(source), tmp_path)
    saved = tmp_path / "saved" / "fleet.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps(ansible_list(str(source), tmp_path, *(["--export"] if export else [])), indent=1))
    cat = script(saved.parent, "cat.py", f"print(open({str(saved)!r}).read())\n")
    assert_resolves_as_ansible(saved, service, ansible_list(str(cat), tmp_path))
    if not export:
        assert_resolves_as_ansible(saved, service, listing)
    assert inventory.load(saved, service).hosts["h2"].user == "fromfile"


def test_an_inventory_directory_reads_as_ansible_reads_it(tmp_path):
    """Files in sorted order (a later one's variables win), subdirectories, a script among them, ignored names
    (hidden, .md, .cfg, .bak, ~), group_vars/ and host_vars/ of the directory."""
    inv = tmp_path / "inv"
    files = {
        "inv/01-hosts.ini": "[gpu]\ng[1:3]\n[gpu:vars]\nansible_user=ini\nansible_port=2000\n",
        "inv/02-more.yml": "all:\n  children:\n    gpu:\n      vars: {ansible_user: yaml}\n      hosts: {g4: }\n"
                           "    edge:\n      hosts: {e1: {ansible_host: 192.0.2.9}}\n",
        "inv/sub/05.ini": "[prod:children]\ngpu\nedge\n[edge:vars]\nansible_port=2222\n",
        "inv/README.md": "[broken\n", "inv/.hidden": "[broken\n", "inv/old.cfg": "[broken\n",
        "inv/hosts.bak": "[broken\n", "inv/hosts~": "[broken\n",
        "inv/group_vars/all.yml": "region: eu\n", "inv/group_vars/gpu/main.yml": "tier: gpu\nansible_port: 2001\n",
        "inv/host_vars/g2.yml": "ansible_user: g2file\n",
    }
    _, service = write(tmp_path, "unused.ini", "", files)
    script(inv, "03-cloud", "import json\nprint(json.dumps({'gpu': {'hosts': ['c1']}, '_meta': {'hostvars': "
                            "{'c1': {'ansible_host': '198.51.100.1'}}}}))\n")
    loaded = assert_resolves_as_ansible(inv, service, ansible_list(str(inv), tmp_path))
    assert list(loaded.hosts) == ["g1", "g2", "g3", "g4", "e1", "c1"]
    assert [(h.user, h.port) for h in loaded.hosts.values()] == [
        ("yaml", 2001), ("g2file", 2001), ("yaml", 2001), ("yaml", 2001), ("root", 2222), ("yaml", 2001)]
    assert loaded.resolve("prod:!gpu") == ["e1"]


@pytest.mark.parametrize(("name", "text"), [
    ("fleet.toml", '[gpu.hosts]\ng1 = { ansible_port = 2201 }\ng2 = {}\n[gpu.vars]\nansible_user = "toml"\n'),
    ("layers.yml", "plugin: ansible.builtin.generator\nhosts:\n  name: '{{ role }}-{{ zone }}'\n  parents:\n"
                   "    - name: '{{ role }}'\nlayers:\n  role: [gpu, cpu]\n  zone: [a, b]\n"),
])
def test_what_only_ansibles_plugins_read_comes_through_ansible_inventory(tmp_path, monkeypatch, name, text):
    path, service = write(tmp_path, name, text)
    for key, value in ansible_env(tmp_path / ".ansible").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    loaded = assert_resolves_as_ansible(path, service, ansible_list(str(path), tmp_path))
    assert len(loaded.hosts) in (2, 4)


def test_a_host_list_comes_through_ansible_inventory(tmp_path, monkeypatch):
    _, service = write(tmp_path, "unused.ini", "")
    for key, value in ansible_env(tmp_path / ".ansible").items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    loaded = inventory.load(Path("h1,10.0.0.2:2202,"), service)
    assert [(h.name, h.address, h.port) for h in loaded.hosts.values()] == [("h1", "h1", 22),
                                                                           ("10.0.0.2", "10.0.0.2", 2202)]


def test_without_ansible_inventory_a_plugin_config_is_refused_by_name(tmp_path, monkeypatch, capsys):
    path, service = write(tmp_path, "aws_ec2.yml", "plugin: amazon.aws.aws_ec2\nregions: [eu-west-1]\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert cli.main(["render", "-i", str(path), "--service", str(service)]) == 2
    assert capsys.readouterr().err == (
        f"kdeploy: {path}: an inventory plugin's config is read by Ansible's inventory plugins: kdeploy runs "
        "`ansible-inventory -i PATH --list` for it, and ansible-inventory is not installed (pip install "
        "ansible-core)\n")


@pytest.mark.parametrize(("body", "message"), [
    ("import sys\nsys.stderr.write('cloud API: 403 Forbidden\\n')\nsys.exit(3)\n",
     r"fleet\.py --list \(inventory script\): exited 3: cloud API: 403 Forbidden"),
    ("print('Traceback? no: hosts')\n", r"fleet\.py --list \(inventory script\): its output is not JSON: "
                                        r"Expecting value \(line 1\)"),
    ("import time\ntime.sleep(60)\n", r"fleet\.py --list \(inventory script\): did not finish within 1 s \(killed"),
    ("print('[1, 2]')\n", r"fleet\.py \(--list output\): an inventory's --list JSON must be an object of groups"),
    ("print('{\"gpu\": {\"hosts\": \"g1\"}}')\n", r"fleet\.py \(--list output\): gpu\.hosts must be a list"),
    ("print('{\"gpu\": [\"g1\"], \"_meta\": {\"hostvars\": []}}')\n", r"_meta\.hostvars must be an object"),
])
def test_a_bad_inventory_script_is_one_line_exit_2(tmp_path, monkeypatch, capsys, body, message):
    path, service = write(tmp_path, "fleet.py", "")
    script(tmp_path, "fleet.py", body)
    monkeypatch.setenv("KDEPLOY_INVENTORY_TIMEOUT", "1")
    assert cli.main(["render", "-i", str(path), "--service", str(service)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"kdeploy: .*{message}.*\n", err), err


def test_an_executable_ini_file_is_still_ini(tmp_path):
    path, service = write(tmp_path, "hosts", "[gpu]\ng1\n")
    path.chmod(0o755)  # copied from a share that marks everything executable: no #!, so not a script
    assert list(inventory.load(path, service).hosts) == ["g1"]


def test_set_env_on_an_inventory_directory_edits_the_service_file(tmp_path):
    inv = tmp_path / "inv"
    _, service = write(tmp_path, "unused.ini", "", {"inv/hosts.ini": "[gpu]\ng1\ng2\n"})
    edit = settings.set_env(inv, {"KDTREE_NSPLIT": "64"}, [], None, service)
    assert edit.path == service and set(edit.new.hosts) == {"g1", "g2"}
    assert all(h.service.env == {"KDTREE_NSPLIT": "64"} for h in edit.new.hosts.values())


def test_cli_set_env_on_a_directory_needs_the_service_file(tmp_path, capsys):
    inv = tmp_path / "inv"
    _, service = write(tmp_path, "unused.ini", "", {"inv/hosts.ini": "[gpu]\ng1\n"})
    assert cli.main(["set-env", "X=1", "-i", str(inv), "--no-apply"]) == 2
    assert capsys.readouterr().err.startswith(f"kdeploy: {inv}: an Ansible inventory has no kdeploy service: ")
    assert cli.main(["set-env", "X=1", "-i", str(inv), "--service", str(service), "--no-apply"]) == 0
    assert "X: '1'" in service.read_text()


def test_set_env_with_a_limit_that_names_no_changed_host_writes_and_rolls_out_to_none(tmp_path, capsys):
    """--limit narrows set-env's rollout (here to none of the changed hosts: no host is contacted); the file is
    edited for every host, and the hosts left out are named."""
    path, service = write(tmp_path, "hosts.ini", "[gpu]\ng1\ng2\n[edge]\ne1\n")
    assert cli.main(["set-env", "X=1", "-i", str(path), "--service", str(service), "--limit", "gpu:&edge",
                     "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["inventory"]["rolled_out_to"] == []
    assert "outside --limit 'gpu:&edge', not rolled out (they drift until `kdeploy push`): g1, g2, e1" in out.err
    assert "nothing to roll out" not in out.err and "X: '1'" in service.read_text()


# -- unsafe and vaulted values (issue 39, item 5) ----------------------------------------------------------------

VAULT = "$ANSIBLE_VAULT;1.1;AES256\n61626364\n"
UNSAFE_YAML = f"""\
all:
  vars:
    ansible_become: !unsafe true
    tags: !unsafe [a, {{b: "{{{{ c }}}}"}}]
  children:
    edge:
      hosts:
        h1:
          ansible_user: !unsafe "u{{{{x}}}}"
          ansible_port: !unsafe 2222
          ansible_ssh_common_args: !unsafe -J ops@jump
          db_password: !vault |
            {VAULT.replace(chr(10), chr(10) + "            ").rstrip()}
    gpu:
      hosts:
        h2:
          nested: !unsafe {{k: v, n: 3}}
"""


def test_unsafe_and_vaulted_values_read_as_ansible_reads_them(tmp_path):
    """`!unsafe` (in the inventory and in group_vars/) is the plain value, `{{` taken verbatim as Ansible never
    templates it; `!vault` in a variable kdeploy ignores is harmless. ansible-inventory writes both as
    `__ansible_unsafe`/`__ansible_vault` objects, and its saved --list JSON reads the same."""
    path, service = write(tmp_path, "fleet.yml", UNSAFE_YAML, {"group_vars/gpu.yml": "ansible_host: !unsafe 10.0.0.2"})
    text = ansible_list(str(path), tmp_path, raw=True)
    assert '"__ansible_unsafe": "u{{x}}"' in text and '"__ansible_vault": ' in text
    listing = ansible_reads(text)
    loaded = assert_resolves_as_ansible(path, service, listing)
    h1, h2 = loaded.hosts["h1"], loaded.hosts["h2"]
    assert (h1.user, h1.port, h1.become, h1.proxy_jump, h2.address) == ("u{{x}}", 2222, True, "ops@jump", "10.0.0.2")
    assert read_any(path).host_vars("h1")["db_password"] == ansible.Vaulted(VAULT)
    saved = tmp_path / "saved.json"
    saved.write_text(text)
    again = assert_resolves_as_ansible(saved, service, listing)
    assert again.hosts == loaded.hosts


def test_constructed_compose_values_come_through_ansible_inventory(tmp_path, monkeypatch):
    """ansible-core 2.19 writes `constructed`'s `compose:` results as `__ansible_unsafe`: they are plain values."""
    inv = tmp_path / "inv"
    _, service = write(tmp_path, "unused.ini", "", {
        "inv/01-hosts.ini": "[gpu]\ng1 num=11\ng2 num=12\n",
        "inv/02-constructed.yml": "plugin: ansible.builtin.constructed\nstrict: true\ncompose:\n"
                                  "  ansible_host: \"'10.0.0.' ~ num\"\n  ansible_user: \"'deploy' ~ num\"\n"})
    for key, value in ansible_env(tmp_path / ".ansible").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    text = ansible_list(str(inv), tmp_path, raw=True)
    assert '"__ansible_unsafe": "10.0.0.11"' in text
    loaded = assert_resolves_as_ansible(inv, service, ansible_reads(text))
    assert [(h.address, h.user) for h in loaded.hosts.values()] == [("10.0.0.11", "deploy11"),
                                                                     ("10.0.0.12", "deploy12")]


LIST_JSON = {"gpu": {"hosts": ["g1"], "vars": {"ansible_user": {"__ansible_unsafe": "ops"}}},
             "_meta": {"hostvars": {"g1": {"ansible_host": {"__ansible_unsafe": "10.0.0.1"},
                                           "kdeploy_service": {"sglang": {"extra_args": [
                                               {"__ansible_unsafe": "--x={{y}}"}]}},
                                           "secret": {"__ansible_vault": "$ANSIBLE_VAULT;1.1;AES256\n00\n"}}}}}


def test_unsafe_values_nested_in_list_json_and_script_output(tmp_path):
    """The same JSON as a saved file and as a script's --list (and a --host call's) output; Ansible's decoder
    reads it so too."""
    path, service = write(tmp_path, "fleet.json", json.dumps(LIST_JSON))
    expected = ansible_reads(json.dumps(LIST_JSON))
    assert read_any(path).host_vars("g1") == {**expected["gpu"]["vars"], **expected["_meta"]["hostvars"]["g1"]}
    no_meta = {"gpu": LIST_JSON["gpu"]}
    host = LIST_JSON["_meta"]["hostvars"]["g1"]
    script(tmp_path, "fleet.py", f"import json, sys\nprint(json.dumps({no_meta!r} if sys.argv[1] == '--list' "
                                 f"else {host!r}))\n")
    for source in (path, tmp_path / "fleet.py"):
        g1 = inventory.load(source, service).hosts["g1"]
        assert (g1.address, g1.user, g1.service.sglang.extra_args) == ("10.0.0.1", "ops", ["--x={{y}}"])


@pytest.mark.parametrize(("name", "text", "files", "message"), [
    ("fleet.yml", "all:\n  hosts:\n    h1:\n      ansible_user: !vault |\n        $ANSIBLE_VAULT;1.1;AES256\n"
                  "        00\n", {},
     r"fleet\.yml:3: h1: ansible_user: is encrypted with Ansible Vault, which kdeploy does not decrypt"),
    ("fleet.json", '{"g": {"hosts": ["h1"]}, "_meta": {"hostvars": {"h1": {"ansible_host": '
                   '{"__ansible_vault": "x"}}}}}', {},
     r"fleet\.json:1: h1: ansible_host: is encrypted with Ansible Vault"),
    ("fleet.json", '{"g": {"hosts": ["h1"], "vars": {"x": {"__ansible_unsafe": 5}}}}', {},
     r"fleet\.json:1: __ansible_unsafe must be a string, not int"),
    ("fleet.yml", "all:\n  hosts:\n    h1:\n      x: !vault [a]\n", {},
     r"fleet\.yml:4: the !vault tag requires a string value"),
    ("fleet.yml", "all:\n  hosts:\n    h1:\n      x: !secret y\n", {},
     r"fleet\.yml:4: unknown YAML tag '!secret' \(Ansible's are !unsafe and !vault\)"),
    ("hosts.ini", "[gpu]\nh1\n", {"group_vars/gpu/vault.yml": VAULT},
     r"group_vars/gpu/vault\.yml: encrypted with Ansible Vault, which kdeploy does not decrypt \(ansible-vault"),
    ("hosts", VAULT, {}, r"hosts: encrypted with Ansible Vault"),
])
def test_a_vaulted_or_malformed_value_is_one_line_naming_where(tmp_path, capsys, name, text, files, message):
    path, service = write(tmp_path, name, text, files)
    assert cli.main(["check", "-i", str(path), "--service", str(service)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"kdeploy: \S*{message}.*\n", err), err


# -- a script without _meta: its --host calls (issue 39, item 6) -------------------------------------------------

def host_script(tmp_path: Path, hosts: int, slow: str = "", fail: str = "") -> Path:
    """A shell inventory script of ``hosts`` hosts whose every --host call takes 0.2 s; host ``slow`` hangs,
    host ``fail`` exits 3."""
    names = ", ".join(f'\\"n{i:02d}\\"' for i in range(hosts))
    path = tmp_path / "fleet.sh"
    path.write_text(f"""#!/bin/sh
if [ "$1" = --list ]; then echo "{{\\"gpu\\": [{names}]}}"; exit 0; fi
sleep 0.2
[ "$2" = "{slow}" ] && sleep 60
[ "$2" = "{fail}" ] && {{ echo "cloud API: 403" >&2; exit 3; }}
echo "{{\\"ansible_host\\": \\"10.0.0.${{2#n}}\\"}}"
""")
    path.chmod(0o755)
    return path


def test_host_calls_run_at_once_each_within_the_bound_in_host_order(tmp_path, monkeypatch):
    """30 calls of 0.2 s each take 6 s one after another; a bound of 3 s holds for each call, not for all."""
    _, service = write(tmp_path, "unused.ini", "")
    monkeypatch.setenv("KDEPLOY_INVENTORY_TIMEOUT", "3")
    loaded = inventory.load(host_script(tmp_path, 30), service)
    assert [(h.name, h.address) for h in loaded.hosts.values()] == [(f"n{i:02d}", f"10.0.0.{i:02d}")
                                                                     for i in range(30)]


@pytest.mark.parametrize(("bound", "slow", "fail", "message"), [
    (1, "n07", "", r"fleet\.sh --host n07 \(inventory script\): did not finish within 1 s \(killed"),
    (5, "n02", "n11", r"fleet\.sh --host n11 \(inventory script\): exited 3: cloud API: 403"),
])
def test_a_failed_host_call_names_its_host_and_stops_the_others(tmp_path, monkeypatch, capsys, bound, slow, fail,
                                                                message):
    """The first call to fail is reported at once: a call still running (n02's hang) is killed, its bound not
    waited out."""
    _, service = write(tmp_path, "unused.ini", "")
    monkeypatch.setenv("KDEPLOY_INVENTORY_TIMEOUT", str(bound))
    start = time.monotonic()
    assert cli.main(["render", "-i", str(host_script(tmp_path, 20, slow, fail)), "--service", str(service)]) == 2
    assert time.monotonic() - start < 4
    err = capsys.readouterr().err
    assert re.fullmatch(rf"kdeploy: \S*{message}.*\n", err), err


# -- which format a YAML file is (issue 39, item 7) --------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ("# the fleet\nall:\n  chilren:\n    gpu:\n      hosts: {g1: }\n",
     "inv.yaml:3: all: unknown key 'chilren' (did you mean 'children'?)"),
    ("gpu:\n  hostz:\n    g1:\n", "inv.yaml:2: gpu: unknown key 'hostz' (did you mean 'hosts'?)"),
    ("all:\n  children:\n    gpu:\n      hosts: {g1: }\n      varz: {ansible_user: x}\n",
     "inv.yaml:5: gpu: unknown key 'varz' (did you mean 'vars'?)"),
    ("gpu:\n  hosts: {g1: }\nedge: g2\n", "inv.yaml:3: edge: a group is a mapping of hosts, children and vars, "
                                          "not 'g2'"),
    ("all:\n  children:\n    gpu: [g1]\n", "inv.yaml:3: gpu: a group is a mapping of hosts, children and vars, "
                                            "not a list"),
    ("host:\n  h1: {address: x}\n", "inv.yaml:1: host: unknown key (did you mean 'hosts'?)"),  # kdeploy's typo
])
def test_a_typo_is_named_in_the_format_the_file_is_in(tmp_path, capsys, text, message):
    """An Ansible YAML inventory is told by `all` or a group's section (or a misspelling of one): its typo is
    named with its line, never taken for a kdeploy inventory (`--service ... goes with an Ansible inventory
    only`); a kdeploy inventory's top-level typo stays kdeploy's error, with --service or without."""
    path, service = write(tmp_path, "inv.yaml", text)
    assert cli.main(["check", "-i", str(path), "--service", str(service)]) == 2
    assert capsys.readouterr().err == f"kdeploy: {tmp_path}/{message}\n"
