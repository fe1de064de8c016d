"""kdeploy/ansible.py: Ansible inventories read as kdeploy inventories.

The parity tests take the real ``ansible-inventory --list`` (ansible-core, a dev dependency) as the reference
for the hosts, each group's members (children included) and the connection variables kdeploy resolves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdeploy import cli, inventory, settings
from kdeploy.errors import InvalidInput

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
