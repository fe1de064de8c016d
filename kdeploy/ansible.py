"""Ansible inventories (INI and YAML) read as kdeploy inventories, so a fleet kept for Ansible is not retyped.

Ansible gives the hosts, the groups and the connection variables; what it lacks (the ``service:`` block and
any other kdeploy defaults) comes from a service file (``--service FILE``: the shape of kdeploy's
``defaults:``). The result goes through :func:`kdeploy.inventory.parse` like any kdeploy inventory. The rules
follow ansible-core's own ``ini`` and ``yaml`` inventory plugins and its variable precedence;
tests/unit/test_ansible.py checks them against the real ``ansible-inventory --list``.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ruamel.yaml.error import YAMLError

from kdeploy import inventory
from kdeploy.errors import InvalidInput

Format = Literal["ini", "yaml"]
_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:#.*)?$")
_GROUP_NAME = re.compile(r"^([^:\]\s]+)\s*(?:#.*)?$")
_HOSTPORT = re.compile(r"^\[(.+)\]:([0-9]+)$|^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")
_SECTIONS = {"hosts", "children", "vars"}
# kdeploy setting <- the Ansible variables that give it, first set wins: the ssh connection plugin lists them the
# other way round and its config manager keeps the last one set, so `ansible_ssh_host` beats `ansible_host`.
CONNECTION_VARS = {
    "address": ("ansible_ssh_host", "ansible_host"),
    "port": ("ansible_ssh_port", "ansible_port"),
    "user": ("ansible_ssh_user", "ansible_user"),
    "identity_file": ("ansible_ssh_private_key_file", "ansible_private_key_file"),
    "become": ("ansible_become",),
    "become_user": ("ansible_become_user",),
    "become_method": ("ansible_become_method",),
}
SSH_ARGS_VARS = ("ansible_ssh_args", "ansible_ssh_common_args", "ansible_ssh_extra_args")
SERVICE_FILE = ("service file", "--service FILE")  # how errors name it
PREFIX = "kdeploy_"  # kdeploy_<setting>: any host-level kdeploy setting as an Ansible host or group variable


@dataclass
class Group:
    name: str
    hosts: list[str] = field(default_factory=list)  # direct members, in file order
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    vars: dict = field(default_factory=dict)
    depth: int = 0


@dataclass
class AnsibleInventory:
    """Hosts and groups as Ansible builds them (``all`` and ``ungrouped`` included)."""

    path: Path
    groups: dict[str, Group] = field(default_factory=dict)
    hosts: dict[str, dict] = field(default_factory=dict)  # host -> its own variables
    lines: dict[str, int] = field(default_factory=dict)  # host -> line of its first definition
    groups_of: dict[str, list[Group]] = field(default_factory=dict)  # host -> its groups, ``all``'s children on
    files: dict[Path, dict] = field(default_factory=dict)  # group_vars/host_vars read so far

    def group(self, name: str) -> Group:
        return self.groups.setdefault(name, Group(name))

    def add_host(self, name: str, group: str, variables: dict, line: int | None) -> None:
        self.hosts.setdefault(name, {}).update(variables)
        if line:
            self.lines.setdefault(name, line)
        members = self.group(group).hosts
        if name not in members:
            members.append(name)

    def add_child(self, parent: str, child: str) -> None:
        if child not in self.group(parent).children:
            self.groups[parent].children.append(child)
            self.group(child).parents.append(parent)

    def reconcile(self) -> None:
        """What ansible-core does after parsing: top groups under ``all``, lone hosts in ``ungrouped``, depths."""
        for name in ("all", "ungrouped"):
            self.group(name)
        for group in list(self.groups.values()):
            if group.name != "all" and not group.parents:
                self.add_child("all", group.name)
        ungrouped = self.groups["ungrouped"]
        for host in self.hosts:
            others = [g for g in self.groups.values() if host in g.hosts and g.name not in ("all", "ungrouped")]
            if others and host in ungrouped.hosts:
                ungrouped.hosts.remove(host)
            elif not others and host not in ungrouped.hosts:
                ungrouped.hosts.append(host)
        self._deepen("all", 0, ())
        self.groups_of = {h: [] for h in self.hosts}
        for group in self.groups.values():
            for host in self.members(group.name) if group.name != "all" else ():
                self.groups_of[host].append(group)

    def _deepen(self, name: str, depth: int, seen: tuple[str, ...]) -> None:
        if name in seen:
            raise InvalidInput(f"{self.path}: group {name!r} is its own descendant")
        group = self.groups[name]
        group.depth = max(group.depth, depth)
        for child in group.children:
            self._deepen(child, depth + 1, (*seen, name))

    def members(self, name: str) -> list[str]:
        """Every host of a group, its children's included, in host order."""
        found: set[str] = set()
        todo = [name]
        while todo:
            group = self.groups[todo.pop()]
            found.update(group.hosts)
            todo.extend(group.children)
        return [h for h in self.hosts if h in found]

    def host_vars(self, host: str) -> dict:
        """The host's variables with Ansible's precedence (its default VARIABLE_PRECEDENCE): the inventory's
        group variables (``all``, then the others by depth, priority, name) < ``group_vars/all`` <
        ``group_vars/<group>`` in the same order < the host's inventory variables < ``host_vars/<host>``."""
        groups = sorted(self.groups_of[host], key=lambda g: (g.depth, _priority(g), g.name))
        merged: dict = {}
        for variables in (self.groups["all"].vars, *(g.vars for g in groups), self._file_vars("group_vars", "all"),
                          *(self._file_vars("group_vars", g.name) for g in groups), self.hosts[host],
                          self._file_vars("host_vars", host)):
            merged.update(variables)
        return merged

    def _file_vars(self, kind: str, name: str) -> dict:
        folder = self.path.parent / kind
        if folder / name not in self.files:
            self.files[folder / name] = _vars_dir(folder, name)
        return self.files[folder / name]


def _priority(group: Group) -> int:
    try:
        return int(group.vars.get("ansible_group_priority", 1))
    except (TypeError, ValueError):
        return 1


def _vars_dir(folder: Path, name: str) -> dict:
    """Ansible's host_group_vars plugin: ``<folder>/<name>`` with no extension, .yml, .yaml or .json, or a
    directory of such files (read in sorted order)."""
    found: dict = {}
    candidates = [folder / f"{name}{ext}" for ext in ("", ".yml", ".yaml", ".json")]
    if (folder / name).is_dir():
        candidates = sorted(p for p in (folder / name).rglob("*")
                            if p.is_file() and p.suffix in ("", ".yml", ".yaml", ".json"))
    for path in candidates:
        if path.is_file():
            data = inventory.parse_yaml(inventory.read_text(path, "variables file"), path,
                                        "a variables file must be a mapping")
            found.update(data)
    return found


def detect(path: Path, text: str) -> tuple[Format | None, Any]:
    """``ini`` or ``yaml`` for an Ansible inventory, None for a kdeploy one (top-level ``hosts:``/``defaults:``;
    an Ansible YAML inventory has groups at the top, each a mapping of ``hosts``/``children``/``vars``).

    Also the YAML document as parsed on the way (round trip; None where it is no YAML): parsing is most of
    an inventory's load time, so a kdeploy inventory's loader takes it from here rather than parse twice."""
    suffix = path.suffix.lower()
    if suffix in (".ini", ".cfg"):
        return "ini", None
    try:
        data: Any = inventory.yaml_loader().load(text)
    except YAMLError:
        return (None if suffix in (".yaml", ".yml", ".json") else "ini"), None
    if isinstance(data, dict):
        groups = [v for v in data.values() if v is not None]
        if groups and all(isinstance(v, dict) and v and set(v) <= _SECTIONS for v in groups):
            return "yaml", data
        return None, data
    if data is None or suffix in (".yaml", ".yml", ".json"):
        return None, data
    return "ini", None


def read(path: Path, text: str, fmt: Format) -> AnsibleInventory:
    found = AnsibleInventory(path)
    (_read_ini if fmt == "ini" else _read_yaml)(found, text)
    found.reconcile()
    return found


def load(path: Path, text: str, fmt: Format, service: Path | None,
         service_text: str | None = None) -> inventory.Inventory:
    """The kdeploy inventory of an Ansible inventory plus the service file (``service_text``: its content)."""
    service = require_service(path, service)
    if service_text is None:
        service_text = inventory.read_text(service, *SERVICE_FILE)
    defaults = inventory.parse_yaml(service_text, service, "the service file must be a mapping like defaults:")
    found = read(path, text, fmt)
    hosts: dict[str, dict] = {}
    sources: dict[str, dict[str, str]] = {}
    for host in found.hosts:
        hosts[host], sources[host] = to_kdeploy(host, found.host_vars(host), found.lines.get(host), path)
    groups = {g: found.members(g) for g in found.groups if g != "all"}
    raw = {"defaults": defaults, "groups": {g: {"hosts": m} for g, m in groups.items()}, "hosts": hosts}

    def locate(where: tuple) -> str:
        level, rest = where[0], where[1:]
        if level == "defaults":
            line = inventory.line_of(defaults, rest)
            return f"{service}{f':{line}' if line else ''}: {'.'.join(map(str, rest))}"
        if level == "hosts" and len(rest) > 1:
            name, key = str(rest[0]), str(rest[1])
            var = sources[name].get(key, f"{PREFIX}{key}")
            line = found.lines.get(name)
            return f"{path}{f':{line}' if line else ''}: {name}: {'.'.join([var, *map(str, rest[2:])])}"
        return f"{path}: {'.'.join(map(str, rest)) or level}"

    return inventory.parse(raw, service, locate=locate)  # paths in the service file are relative to it


def require_service(path: Path, service: Path | None) -> Path:
    if service is None:
        raise InvalidInput(f"{path}: an Ansible inventory has no kdeploy service: pass --service FILE "
                           "(or KDEPLOY_SERVICE; docs/inventory.md, Ansible inventories)")
    return service


def to_kdeploy(host: str, variables: dict, line: int | None, path: Path) -> tuple[dict, dict[str, str]]:
    """A host's kdeploy settings from its Ansible variables, and which variable gave each setting."""
    where = f"{path}{f':{line}' if line else ''}: {host}"
    settings: dict = {"address": host}
    sources: dict[str, str] = {}
    connection = variables.get("ansible_connection")
    if connection not in (None, "ssh", "paramiko", "smart"):
        raise InvalidInput(f"{where}: ansible_connection={connection}: kdeploy reaches hosts over SSH only")
    for key, names in CONNECTION_VARS.items():
        name = next((n for n in names if variables.get(n) is not None), None)  # a null is unset, as in Ansible
        if name is not None:
            settings[key], sources[key] = _plain(variables[name], f"{where}: {name}"), name
    if "identity_file" in settings:  # ssh reads it relative to where Ansible runs, not to the inventory
        settings["identity_file"] = os.path.abspath(os.path.expanduser(str(settings["identity_file"])))
    for name in SSH_ARGS_VARS:
        if name in variables and "proxy_jump" not in settings:
            jump = proxy_jump(str(_plain(variables[name], f"{where}: {name}")), f"{where}: {name}")
            if jump is not None:
                settings["proxy_jump"], sources["proxy_jump"] = jump, name
    for name, value in variables.items():
        if str(name).startswith(PREFIX):
            key = str(name)[len(PREFIX):]
            settings[key], sources[key] = _plain(value, f"{where}: {name}"), str(name)
    return settings, sources


def proxy_jump(args: str, where: str) -> str | None:
    """The jump host(s) of ssh arguments: ``-J HOST``, ``-o ProxyJump=HOST`` (the first one, as ssh takes it)."""
    try:
        words = shlex.split(args)
    except ValueError as exc:
        raise InvalidInput(f"{where}: cannot split the ssh arguments: {exc}") from None
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word in ("-J", "-o") or (word[:2] in ("-J", "-o") and len(word) > 2):
            flag, value = (word, nxt) if len(word) == 2 else (word[:2], word[2:])
            if flag == "-J":
                return value
            key, _, opt = value.replace("=", " ", 1).partition(" ")
            if key.lower() == "proxyjump":
                return opt.strip()
            if key.lower() == "proxycommand":
                raise InvalidInput(f"{where}: ProxyCommand is not supported: use -o ProxyJump=HOST, or a Host "
                                   "entry with ProxyJump in ssh_config")
    return None


def _plain(value: Any, where: str) -> Any:
    """Ansible would render ``{{ ... }}`` with Jinja and its facts; kdeploy cannot, so it refuses them."""
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, str) and ("{{" in value or "{%" in value):
        raise InvalidInput(f"{where}: {value!r} is a Jinja template: kdeploy does not render templates, "
                           "put the value itself")
    return value


def _read_ini(found: AnsibleInventory, text: str) -> None:
    """ansible-core's ``ini`` plugin: sections ``[g]``, ``[g:children]``, ``[g:vars]``; ``key=value`` values are
    Python literals where they parse as one; hosts before any section are ``ungrouped``."""
    group, state = "ungrouped", "hosts"
    pending: dict[str, tuple[int, str, list[str]]] = {}  # a group named before it is defined
    defined = {"all", "ungrouped"}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{found.path}:{number}"
        if not line or line[0] in "#;":
            continue
        m = _SECTION.match(line)
        if m:
            group, state = m.group(1), m.group(2) or "hosts"
            if state not in _SECTIONS:
                raise InvalidInput(f"{where}: section [{line[1:-1]}] has unknown type {state!r}")
            if group not in defined:
                if state == "vars":
                    pending.setdefault(group, (number, "vars", []))
                found.group(group)
                defined.add(group)
            if group in pending and state != "vars":
                if pending[group][1] == "children":
                    _resolve_pending(found, group, pending)
                else:
                    del pending[group]
            continue
        if line.startswith("[") and line.endswith("]"):
            raise InvalidInput(f"{where}: invalid section {line!r} (no spaces or other characters allowed)")
        if state == "hosts":
            try:
                words = shlex.split(line, comments=True)
            except ValueError as exc:
                raise InvalidInput(f"{where}: cannot parse the host line: {exc}") from None
            names, port = expand(words[0], where)
            variables = {}
            for word in words[1:]:
                if "=" not in word:
                    raise InvalidInput(f"{where}: expected key=value host variable, got {word!r}")
                key, _, value = word.partition("=")
                variables[key] = _literal(value)
            if port is not None:
                variables["ansible_port"] = port
            for name in names:
                found.add_host(name, group, variables, number)
        elif state == "vars":
            if "=" not in line:
                raise InvalidInput(f"{where}: expected key=value, got {line!r}")
            key, _, value = line.partition("=")
            found.group(group).vars[key.strip()] = _literal(value.strip())
        else:
            m = _GROUP_NAME.match(line)
            if not m:
                raise InvalidInput(f"{where}: expected a group name, got {line!r}")
            child = m.group(1)
            if child in defined:
                found.add_child(group, child)
            else:
                pending.setdefault(child, (number, "children", []))[2].append(group)
    for name, (number, state, parents) in pending.items():
        if state == "vars":
            raise InvalidInput(f"{found.path}:{number}: section [{name}:vars] for undefined group {name!r}")
        raise InvalidInput(f"{found.path}:{number}: section [{parents[-1]}:children] names undefined group "
                           f"{name!r}")


def _resolve_pending(found: AnsibleInventory, group: str, pending: dict) -> None:
    for parent in pending[group][2]:
        found.add_child(parent, group)
        if parent in pending and pending[parent][1] == "children":
            _resolve_pending(found, parent, pending)
    del pending[group]


def _literal(value: str) -> Any:
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return str(parsed) if parsed is ... or isinstance(parsed, complex) else parsed


def _read_yaml(found: AnsibleInventory, text: str) -> None:
    """ansible-core's ``yaml`` plugin: top-level groups, each ``{hosts: {NAME: vars}, children: {...}, vars}``."""
    data = inventory.parse_yaml(text, found.path)
    for name, body in data.items():
        _yaml_group(found, str(name), body)
    # The plugin reads a group's children before its hosts; the hosts keep the order they are written in.
    found.hosts = dict(sorted(found.hosts.items(), key=lambda item: found.lines.get(item[0]) or 0))


def _yaml_group(found: AnsibleInventory, name: str, body: Any) -> None:
    found.group(name)
    if not isinstance(body, dict):
        return
    for section in ("vars", "children", "hosts"):
        value = body.get(section)
        if isinstance(value, str):
            value = {value: None}
        if value is not None and not isinstance(value, dict):
            raise InvalidInput(f"{found.path}:{inventory.line_of(body, (section,))}: {name}.{section}: must be a "
                               "mapping")
        if section == "vars":
            found.group(name).vars.update(value or {})
        elif section == "children":
            for child, child_body in (value or {}).items():
                _yaml_group(found, str(child), child_body)
                found.add_child(name, str(child))
        else:
            for pattern, variables in (value or {}).items():
                where = f"{found.path}:{inventory.line_of(value, (pattern,))}"
                if not isinstance(variables, dict | None):
                    raise InvalidInput(f"{where}: host {pattern}: its variables must be a mapping")
                names, port = expand(str(pattern), where)
                host_vars = dict(variables or {})
                if port is not None:
                    host_vars["ansible_port"] = port
                for host in names:
                    found.add_host(host, name, host_vars, inventory.line_of(value, (pattern,)))


def expand(pattern: str, where: str) -> tuple[list[str], int | None]:
    """Host names of a pattern (``gpu[01:16]``, ``node[a:c]``, ``[1:9:2]`` steps) and its ``:PORT``."""
    port = None
    m = _HOSTPORT.match(pattern)
    if m:
        pattern, port = (m.group(1), int(m.group(2))) if m.group(1) else (m.group(3), int(m.group(4)))
    elif pattern.endswith(":"):
        raise InvalidInput(f"{where}: host pattern {pattern!r} ends in ':' (reserved for a port)")
    try:
        return _ranges(pattern), port
    except ValueError as exc:
        raise InvalidInput(f"{where}: host pattern {pattern!r}: {exc}") from None


def _ranges(pattern: str) -> list[str]:
    if "[" not in pattern:
        return [pattern]
    head, rest = pattern.split("[", 1)
    body, sep, tail = rest.partition("]")
    bounds = body.split(":")
    if not sep or len(bounds) not in (2, 3):
        raise ValueError("a range is [begin:end] or [begin:end:step]")
    beg, end = bounds[0] or "0", bounds[1]
    step = int(bounds[2]) if len(bounds) == 3 else 1
    if not end:
        raise ValueError("a range needs an end")
    width = len(beg) if beg[0] == "0" and len(beg) > 1 else 0
    if width and width != len(end):
        raise ValueError("begin and end of a zero-padded range must have the same length")
    if beg in string.ascii_letters and end in string.ascii_letters:
        i, j = string.ascii_letters.index(beg), string.ascii_letters.index(end)
        if i > j:
            raise ValueError("a range must have begin <= end")
        seq = list(string.ascii_letters[i:j + 1:step])
    else:
        seq = [str(n).zfill(width) for n in range(int(beg), int(end) + 1, step)]
    return [name for s in seq for name in _ranges(f"{head}{s}{tail}")]

