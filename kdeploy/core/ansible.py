"""Ansible inventories read as kdeploy inventories, so a fleet kept for Ansible is not retyped.

Every kind Ansible reads: INI and YAML files, ``ansible-inventory --list`` JSON, executable inventory scripts
(run with ``--list``, as Ansible runs them), directories of inventories with ``group_vars/`` and ``host_vars/``,
and, through ``ansible-inventory -i PATH --list`` where it is installed, anything its plugins read (cloud
plugin configs, TOML, ...). Ansible gives the hosts, the groups and the connection variables; what it lacks
(the ``service:`` block and any other kdeploy defaults) comes from a service file (``--service FILE``: the
shape of kdeploy's ``defaults:``). The result goes through :func:`kdeploy.core.inventory.parse` like any kdeploy
inventory. The rules follow ansible-core's own inventory plugins and its variable precedence;
tests/unit/test_ansible.py checks them against the real ``ansible-inventory --list``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ruamel.yaml.comments import CommentedMap, TaggedScalar
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import ScalarNode

from kdeploy.core import files, patterns
from kdeploy.core.defaults import WEEK
from kdeploy.core.errors import InvalidInput
from kdeploy.core.yamlsource import line_of, load_yaml, parse_yaml, read_text, yaml_loader

# ini, yaml: Ansible's own file formats; list: ansible-inventory --list JSON; plugin: only Ansible's plugins read it
Format = Literal["ini", "yaml", "list", "plugin"]
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
SCRIPT_TIMEOUT = 60.0  # seconds an inventory script (or ansible-inventory) may run; KDEPLOY_INVENTORY_TIMEOUT
# What a directory of inventories skips, as ansible-core (INVENTORY_IGNORE_EXTS' default and IGNORED_ALWAYS).
_IGNORED = re.compile(r"^\.|^host_vars$|^group_vars$|^vars_plugins$|"
                      r"(\.pyc|\.pyo|\.swp|\.bak|~|\.rpm|\.md|\.txt|\.rst|\.orig|\.cfg|\.retry)$")


class Unsafe(str):
    """A string Ansible never templates (``!unsafe`` in YAML, ``{"__ansible_unsafe": ...}`` in JSON, which is how
    ``ansible-inventory --list`` writes ``constructed``'s ``compose:`` values and cloud plugins' data): a plain
    string, ``{{`` included, that :func:`_plain` takes verbatim instead of refusing it as a template."""


@dataclass(frozen=True)
class Vaulted:
    """A value encrypted with Ansible Vault (``!vault``, ``{"__ansible_vault": ...}``). kdeploy holds no vault
    password, so it stays opaque: harmless in a variable kdeploy ignores, refused by :func:`_plain` in one it reads."""

    ciphertext: str = field(repr=False)


@dataclass
class Group:
    name: str
    hosts: list[str] = field(default_factory=list)  # direct members, in file order
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    vars: dict = field(default_factory=dict)
    depth: int = 0
    members: set[str] = field(default_factory=set, repr=False, compare=False)  # ``hosts`` as a set: a fleet of
    # thousands of hosts is no list scan per host

    def add(self, host: str) -> None:
        if host not in self.members:
            self.members.add(host)
            self.hosts.append(host)

    def discard(self, host: str) -> None:
        if host in self.members:
            self.members.discard(host)
            self.hosts.remove(host)


@dataclass
class AnsibleInventory:
    """Hosts and groups as Ansible builds them (``all`` and ``ungrouped`` included)."""

    path: Path
    basedir: Path | None = None  # where group_vars/ and host_vars/ are (None: already in the variables)
    groups: dict[str, Group] = field(default_factory=dict)
    hosts: dict[str, dict] = field(default_factory=dict)  # host -> its own variables
    origin: dict[str, tuple[Path, int | None]] = field(default_factory=dict)  # host -> file, line it is first in
    groups_of: dict[str, list[Group]] = field(default_factory=dict)  # host -> its groups, ``all``'s children on
    files: dict[Path, dict] = field(default_factory=dict)  # group_vars/host_vars read so far
    links: dict[tuple[str, str], str] = field(default_factory=dict)  # (parent, child) -> file:line that said so

    def group(self, name: str) -> Group:
        return self.groups.setdefault(name, Group(name))

    def add_host(self, name: str, group: str, variables: dict, where: tuple[Path, int | None]) -> None:
        self.hosts.setdefault(name, {}).update(variables)
        self.origin.setdefault(name, where)
        self.group(group).add(name)

    def add_child(self, parent: str, child: str, where: str) -> None:
        """``where``: the file:line that makes ``child`` a child of ``parent``, for the error if it closes a loop."""
        if child not in self.group(parent).children:
            self.groups[parent].children.append(child)
            self.group(child).parents.append(parent)
            self.links[(parent, child)] = where

    def reconcile(self) -> None:
        """What ansible-core does after parsing: top groups under ``all``, lone hosts in ``ungrouped``, depths."""
        for name in ("all", "ungrouped"):
            self.group(name)
        for group in list(self.groups.values()):
            if group.name != "all" and not group.parents:
                self.add_child("all", group.name, str(self.path))
        ungrouped = self.groups["ungrouped"]
        for host in self.hosts:
            if any(host in g.members for g in self.groups.values() if g.name not in ("all", "ungrouped")):
                ungrouped.discard(host)
            else:
                ungrouped.add(host)
        for name in self._ordered():  # depth: the longest path from ``all``, as ansible-core counts it
            for child in self.groups[name].children:
                self.groups[child].depth = max(self.groups[child].depth, self.groups[name].depth + 1)
        self.groups_of = {h: [] for h in self.hosts}
        for group in self.groups.values():
            for host in self.members(group.name) if group.name != "all" else ():
                self.groups_of[host].append(group)

    def _ordered(self) -> list[str]:
        """The groups, each before its children. The one check that no group is its own descendant, for every
        source (INI, YAML, --list JSON, scripts, directories, ansible-inventory): a loop would make every walk
        down the groups endless. One depth-first walk without recursion, so a chain of any length is fine."""
        state: dict[str, bool] = {}  # False: on the path being walked; True: done
        done: list[str] = []
        for root in ("all", *self.groups):  # from ``all`` first: a loop through it is named at its own line
            if root in state:
                continue
            path, todo = [root], [iter(self.groups[root].children)]
            state[root] = False
            while todo:
                child = next(todo[-1], None)
                if child is None:
                    state[path[-1]] = True
                    done.append(path.pop())
                    todo.pop()
                elif child not in state:
                    state[child] = False
                    path.append(child)
                    todo.append(iter(self.groups[child].children))
                elif not state[child]:
                    loop = " > ".join([*path[path.index(child):], child])
                    raise InvalidInput(f"{self.links[(path[-1], child)]}: group {child!r} is its own descendant "
                                       f"({loop})")
        return done[::-1]

    def members(self, name: str) -> list[str]:
        """Every host of a group, its children's included, in host order (each group walked once: groups may
        share children many times over)."""
        found: set[str] = set()
        seen = {name}
        todo = [name]
        while todo:
            group = self.groups[todo.pop()]
            found.update(group.hosts)
            todo += [child for child in group.children if child not in seen]
            seen.update(group.children)
        return [h for h in self.hosts if h in found]

    def host_vars(self, host: str) -> dict:
        """The host's variables with Ansible's precedence (its default VARIABLE_PRECEDENCE): the inventory's
        group variables (``all``, then the others by depth, priority, name) < ``group_vars/all`` <
        ``group_vars/<group>`` in the same order < the host's inventory variables < ``host_vars/<host>``."""
        groups = sorted(self.groups_of[host], key=lambda g: (g.depth, _priority(g), g.name))
        merged: dict = {}
        for variables in (_own(self.groups["all"]), *map(_own, groups), self._file_vars("group_vars", "all"),
                          *(self._file_vars("group_vars", g.name) for g in groups), self.hosts[host],
                          self._file_vars("host_vars", host)):
            merged.update(variables)
        return merged

    def where(self, host: str) -> tuple[Path, int | None]:
        return self.origin.get(host, (self.path, None))

    def _file_vars(self, kind: str, name: str) -> dict:
        if self.basedir is None:
            return {}
        folder = self.basedir / kind
        if folder / name not in self.files:
            self.files[folder / name] = _vars_dir(folder, name)
        return self.files[folder / name]


def _own(group: Group) -> dict:
    """A group's variables as its hosts see them: ``ansible_group_priority`` orders groups, it is no variable."""
    return {k: v for k, v in group.vars.items() if k != "ansible_group_priority"}


def _priority(group: Group) -> int:
    try:
        return int(group.vars.get("ansible_group_priority", 1))
    except (TypeError, ValueError):
        return 1


def _vars_dir(folder: Path, name: str) -> dict:
    """Ansible's host_group_vars plugin: ``<folder>/<name>`` with no extension, .yml, .yaml or .json, or a
    directory of such files (read in sorted order)."""
    found: dict = {}
    for path in _vars_files(folder / name):
        text = _not_vaulted(path, read_text(path, "variables file"))
        found.update(_decode(parse_yaml(text, path, "a variables file must be a mapping"), str(path)))
    return found


def _vars_files(base: Path) -> list[Path]:
    """``base`` with no extension, .yml, .yaml or .json, or the files of the directory ``base`` (sorted; its
    subdirectories too, each once however symlinks lead back to it)."""
    kinds = ("", ".yml", ".yaml", ".json")
    if not files.is_dir(base, "variables directory"):
        return [path for path in (base.with_name(base.name + ext) for ext in kinds)
                if files.status(path, "variables file") is not None and not files.is_dir(path, "variables file")]
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    todo = [base]
    while todo:
        folder = todo.pop()
        st = files.status(folder, "variables directory")
        if st is None or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        for entry in (folder / name for name in files.listdir(folder, "variables directory")):
            if files.is_dir(entry, "variables directory"):
                todo.append(entry)
            elif entry.suffix in kinds:
                found.append(entry)
    return sorted(found)


_VAULT_HEADER = "$ANSIBLE_VAULT;"


def _not_vaulted(path: Path, text: str) -> str:
    """``text``, unless the whole file is vault-encrypted: its variables are out of kdeploy's sight, and one of
    them may be a connection variable, so it is refused rather than skipped (ansible-inventory refuses it too
    without a vault password)."""
    if text.startswith(_VAULT_HEADER):
        raise InvalidInput(f"{path}: encrypted with Ansible Vault, which kdeploy does not decrypt (ansible-vault "
                           "decrypt it; a value encrypted alone, with `ansible-vault encrypt_string`, is refused "
                           "only in a variable kdeploy reads)")
    return text


_UNSAFE, _VAULT = "__ansible_unsafe", "__ansible_vault"  # how Ansible's JSON profiles write those values


def _decode(data: Any, source: str) -> Any:
    """A loaded inventory or variables document as Ansible reads it, changed in place (its line numbers kept):
    unsafe values (``!unsafe``, ``{"__ansible_unsafe": "..."}``) at any depth are their plain value, strings
    :class:`Unsafe`; vaulted ones (``!vault``, ``{"__ansible_vault": "..."}``) :class:`Vaulted`. ``source``: the
    file (its lines are added) or program named in errors. Iterative: a deep document is no recursion."""
    root = [data]
    todo: list[tuple[Any, Any, bool]] = [(root, 0, False)]
    while todo:
        parent, key, unsafe = todo.pop()
        value, tag = parent[key], getattr(getattr(parent[key], "tag", None), "value", None)
        if tag is not None and tag.startswith("!") and not tag.startswith("!!"):
            value, unsafe = _tagged(value, tag, parent, key, source), unsafe or tag == "!unsafe"
        elif isinstance(value, dict) and (_UNSAFE in value or _VAULT in value):
            marker = _UNSAFE if _UNSAFE in value else _VAULT  # as Ansible's decoder: the first of its keys wins
            if not isinstance(value[marker], str):
                kind = "a list" if isinstance(value[marker], list) else "a mapping" if isinstance(
                    value[marker], dict) else type(value[marker]).__name__
                raise InvalidInput(f"{_at(source, parent, key)}: {marker} must be a string, not {kind}")
            value = Unsafe(value[marker]) if marker == _UNSAFE else Vaulted(value[marker])
        if unsafe and isinstance(value, str) and not isinstance(value, Unsafe):
            value = Unsafe(value)
        if value is not parent[key]:  # a CommentedMap's own setitem would give a string back its quoted type
            (super(CommentedMap, parent) if isinstance(parent, CommentedMap) else parent).__setitem__(key, value)
        if isinstance(value, dict):
            todo += [(value, k, unsafe) for k in value]
        elif isinstance(value, list):
            todo += [(value, i, unsafe) for i in range(len(value))]
    return root[0]


def _tagged(value: Any, tag: str, parent: Any, key: Any, source: str) -> Any:
    """A YAML value with one of Ansible's tags, as its loader constructs it: ``!unsafe X`` is X read as an untagged
    plain scalar (so ``!unsafe 5`` is 5, as in Ansible) or the collection itself; ``!vault`` a string's ciphertext."""
    scalar = value.value if isinstance(value, TaggedScalar) else None
    if tag == "!unsafe":
        if scalar is None:
            return value
        loader = yaml_loader()
        node = ScalarNode(loader.resolver.resolve(ScalarNode, scalar, (True, False)), scalar)
        return loader.constructor.construct_object(node, deep=True)
    if tag in ("!vault", "!vault-encrypted"):
        if scalar is None:
            raise InvalidInput(f"{_at(source, parent, key)}: the {tag} tag requires a string value")
        return Vaulted(scalar)
    raise InvalidInput(f"{_at(source, parent, key)}: unknown YAML tag {tag!r} (Ansible's are !unsafe and !vault)")


def _at(source: str, parent: Any, key: Any) -> str:
    line = line_of(parent, (key,))
    return f"{source}{f':{line}' if line else ''}"


def detect(path: Path, text: str) -> tuple[Format | None, Any]:
    """The Ansible format of an inventory file, None for a kdeploy one (:func:`_mapping_format` tells a YAML
    mapping's; a YAML file with a top-level ``plugin:`` and ``.toml`` are for Ansible's plugins, a file that is
    no YAML mapping is INI).

    Also the YAML document as parsed on the way (round trip; None where it is no YAML): parsing is most of
    an inventory's load time, so a kdeploy inventory's loader takes it from here rather than parse twice."""
    suffix = path.suffix.lower()
    if suffix in (".ini", ".cfg"):
        return "ini", None
    if suffix == ".toml":
        return "plugin", None
    _not_vaulted(path, text)
    try:
        data: Any = load_yaml(text, path)
    except YAMLError:
        return (None if suffix in (".yaml", ".yml", ".json") else "ini"), None
    if isinstance(data, dict):
        if "plugin" in data and suffix in (".yaml", ".yml"):
            return "plugin", data
        return _mapping_format(data), data
    if data is None or suffix in (".yaml", ".yml", ".json"):
        return None, data
    return "ini", None


KDEPLOY_KEYS = ("defaults", "groups", "hosts")  # a kdeploy inventory's top level, by which detect() tells it


def _mapping_format(data: dict) -> Format | None:
    """A YAML mapping's format. kdeploy's has ``defaults``/``groups``/``hosts`` at the top (``groups: {kimi:
    [ct200]}`` is kdeploy's); ``--list`` JSON has ``_meta`` or groups that list their hosts; an Ansible YAML
    inventory has groups at the top, told by ``all`` or by a group with a section (``hosts``, ``children``,
    ``vars``, or a misspelling of one, so that ``all: {chilren: ...}`` is refused as Ansible's, naming the
    key). Anything else is kdeploy's, whose error names a misspelt top-level key (``host:``)."""
    keys = {str(key) for key in data}
    bodies = [value for value in data.values() if value is not None]
    if "_meta" in keys or (not keys & set(KDEPLOY_KEYS) and any(_listed(body) for body in bodies)):
        return "list"
    if keys & set(KDEPLOY_KEYS):
        return None
    sections = {str(key) for body in bodies if isinstance(body, dict) for key in body}
    if "all" in keys or any(key in _SECTIONS or patterns.suggest(key, sorted(_SECTIONS)) for key in sections):
        return "yaml"
    return None


def _listed(group: Any) -> bool:
    """A group as ``--list`` JSON writes it: a list of hosts, or ``hosts``/``children`` as lists."""
    return isinstance(group, list) or (isinstance(group, dict) and any(
        isinstance(group.get(key), list) for key in ("hosts", "children")))


def is_source(path: Path) -> bool:
    """An inventory that is no file of text to read: a directory, an executable inventory script, or a
    ``host1,host2`` list (Ansible's ``host_list``)."""
    st = files.status(path, "inventory")
    return (st is None and "," in str(path)) or (st is not None and stat.S_ISDIR(st.st_mode)) or _is_script(path)


def _is_script(path: Path) -> bool:
    """Executable, and a script or a program: an INI file left executable by a copy is still read as INI."""
    if not files.is_file(path, "inventory") or not os.access(path, os.X_OK):
        return False
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return False
    return head.startswith(b"#!") or head == b"\x7fELF"


def read(path: Path, text: str, fmt: Format) -> AnsibleInventory:
    """The hosts, groups and variables of one inventory file."""
    if fmt == "plugin":
        return _ansible_inventory(path, "an inventory plugin's config")
    found = AnsibleInventory(path, path.parent)
    _read_file(found, path, text, fmt)
    found.reconcile()
    return found


def read_source(path: Path) -> AnsibleInventory:
    """The hosts, groups and variables of a directory, an inventory script or a host list (:func:`is_source`)."""
    if files.is_dir(path, "inventory"):
        entries = _scan(path)
        plugin = next((entry for entry, fmt, _ in entries if fmt == "plugin"), None)
        if plugin is not None:  # then Ansible reads the whole directory, as it would
            return _ansible_inventory(path, f"{plugin} (in it)")
        found = AnsibleInventory(path, path)
        for entry, fmt, text in entries:
            if fmt is None:
                _read_list(found, _run_script(entry), entry, None)
            else:
                _read_file(found, entry, text, fmt)
    elif _is_script(path):
        found = AnsibleInventory(path, path.parent)
        _read_list(found, _run_script(path), path, None)
    else:
        return _ansible_inventory(path, "a host list")
    found.reconcile()
    return found


def _scan(folder: Path, seen: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[Path, Format | None, str]]:
    """The inventories of a directory, in the order Ansible reads them (sorted, subdirectories in place, the
    names it ignores skipped): each file's format and text, or None and "" for a script. Read into one, a
    group or host named in several files is one, and a later file's variables win. ``seen``: the directories
    it is in, which a symlink leading back to one of them does not read again."""
    st = files.status(folder, "the inventory directory")
    if st is None or (st.st_dev, st.st_ino) in seen:
        return []
    found: list[tuple[Path, Format | None, str]] = []
    for entry in (folder / name for name in files.listdir(folder, "the inventory directory")
                  if not _IGNORED.search(name)):
        if files.is_dir(entry, "inventory"):
            found += _scan(entry, seen | {(st.st_dev, st.st_ino)})
        elif _is_script(entry):
            found.append((entry, None, ""))
        else:
            text = read_text(entry)
            fmt, _ = detect(entry, text)
            if fmt is None:
                raise InvalidInput(f"{entry}: not an Ansible inventory (an inventory directory holds Ansible "
                                   "INI, YAML or --list JSON files, inventory scripts and plugin configs)")
            found.append((entry, fmt, text))
    return found


def _read_file(found: AnsibleInventory, path: Path, text: str, fmt: Format) -> None:
    if fmt == "ini":
        _read_ini(found, path, text)
    elif fmt == "yaml":
        _read_yaml(found, path, text)
    else:
        _read_list(found, parse_yaml(text, path), path, text)


def timeout() -> float:
    """How long an inventory script or ansible-inventory may run (``KDEPLOY_INVENTORY_TIMEOUT``, seconds)."""
    value = os.environ.get("KDEPLOY_INVENTORY_TIMEOUT")
    if value is None:
        return SCRIPT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0
    if not 0 < seconds <= WEEK:
        raise InvalidInput(f"KDEPLOY_INVENTORY_TIMEOUT={value!r}: expected seconds, a number above 0 and at most "
                           f"{WEEK:g} (a week)")
    return seconds


def run_json(argv: list[str], what: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Any:
    """The JSON an inventory program prints (None for no output at all), within :func:`timeout`, run in its own
    process group so that a hang kills it and its children; every failure one line naming ``what``."""
    return _Programs().run(argv, what, cwd, env)


class _Programs:
    """Inventory programs run by several threads at once (a script's ``--host`` calls), each in its own process
    group: :meth:`stop` kills those still running and starts no more, so that a failure or Ctrl-C is not held up
    by the others' time bounds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: list[subprocess.Popen] = []
        self._stopped = False

    def run(self, argv: list[str], what: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Any:
        """:func:`run_json`: each program has its own time bound, and its output a size bound (kdeploy's)."""
        bound = timeout()
        deadline = time.monotonic() + bound
        with self._lock:
            if self._stopped:
                raise InvalidInput(f"{what}: not run (another inventory program failed)")
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True, cwd=cwd, env=env)
            except OSError as exc:
                raise InvalidInput(f"{what}: cannot run it: {exc.strerror}") from None
            self._running.append(proc)
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout.fileno(), proc.stderr.fileno()
        try:
            with proc.stdout, proc.stderr:
                streams = files.drain({stdout: files.MAX_BYTES, stderr: 0}, deadline)
                proc.wait(max(deadline - time.monotonic(), 0.01))
        except (TimeoutError, subprocess.TimeoutExpired, files.TooLarge) as exc:
            _kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):  # a child that left the group may hold the pipes
                proc.wait(timeout=1)
            if isinstance(exc, files.TooLarge):
                raise InvalidInput(f"{what}: printed more than {files.size(files.MAX_BYTES)} (killed; "
                                   "kdeploy's bound)") from None
            raise InvalidInput(f"{what}: did not finish within {bound:g} s (killed; KDEPLOY_INVENTORY_TIMEOUT "
                               "sets the bound)") from None
        finally:
            with self._lock:
                self._running.remove(proc)
        out, err = streams[stdout], streams[stderr]
        last = next((line.strip() for line in reversed(err.decode(errors="replace").splitlines()) if line.strip()),
                    "")
        if proc.returncode != 0:
            raise InvalidInput(f"{what}: exited {proc.returncode}{f': {last}' if last else ''}")
        try:
            text = out.decode()
            return files.parsed(lambda: json.loads(text), what) if text.strip() else None
        except UnicodeDecodeError:
            raise InvalidInput(f"{what}: its output is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{what}: its output is not JSON: {exc.msg} (line {exc.lineno})") from None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for proc in self._running:
                _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """Its process group; not once it is reaped (its pid, the group's id, may then be another's)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


HOST_CALLS = 8  # a script's --host calls run at once (Ansible runs them one by one: a cloud API call each)


def _run_script(path: Path) -> Any:
    """An inventory script's ``--list`` output; without ``_meta.hostvars`` in it, each host's ``--host`` output
    as its variables (as Ansible does), :data:`HOST_CALLS` calls at a time, each within the time bound."""
    program = str(path.absolute())  # a bare name would be looked up on PATH
    data = run_json([program, "--list"], f"{path} --list (inventory script)")
    if not isinstance(data, dict) or "_meta" in data:
        return data
    hosts = AnsibleInventory(path)
    _read_list(hosts, data, path, None)
    programs = _Programs()

    def host_vars(host: str) -> dict:
        what = f"{path} --host {host} (inventory script)"
        found = _decode(programs.run([program, "--host", host], what) or {}, what)
        if not isinstance(found, dict):
            raise InvalidInput(f"{what}: its output must be a JSON object of the host's variables")
        return found

    pool = ThreadPoolExecutor(max_workers=HOST_CALLS, thread_name_prefix="inventory-host")
    try:
        calls = {host: pool.submit(host_vars, host) for host in hosts.hosts}
        done, _ = wait(calls.values(), return_when=FIRST_EXCEPTION)
        # Of the calls that failed first, the first in host order (not one that stop() then ended).
        error = next((call.exception() for call in calls.values() if call in done and call.exception()), None)
        if error is not None:
            raise error
        data["_meta"] = {"hostvars": {host: call.result() for host, call in calls.items()}}
    finally:
        programs.stop()
        pool.shutdown(cancel_futures=True)
    return data


def ansible_inventory_command() -> str | None:
    """``ansible-inventory`` on PATH, else beside this Python (a virtualenv that has ansible-core too)."""
    found = shutil.which("ansible-inventory")
    if found:
        return found
    beside = Path(sys.executable).with_name("ansible-inventory")
    return str(beside) if os.access(beside, os.X_OK) else None


def _ansible_inventory(path: Path, what: str) -> AnsibleInventory:
    """What Ansible's plugins make of ``path``: ``ansible-inventory -i PATH --list``, read as a --list JSON
    (its host variables have group_vars/ and host_vars/ in them already). It runs in the inventory's directory:
    ansible-inventory also reads the current directory's group_vars/, as a playbook's."""
    command = ansible_inventory_command()
    if command is None:
        raise InvalidInput(f"{path}: {what} is read by Ansible's inventory plugins: kdeploy runs `ansible-inventory "
                           "-i PATH --list` for it, and ansible-inventory is not installed (pip install ansible-core)")
    st = files.status(path, "inventory")
    folder = None if st is None else path if stat.S_ISDIR(st.st_mode) else path.parent
    source = str(path.absolute() if folder else path)
    # A source its plugin cannot parse is a warning and an empty inventory for ansible-inventory, unless asked.
    env = {"ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true", **os.environ}
    data = run_json([command, "-i", source, "--list"], f"{path}: ansible-inventory -i {path} --list", folder, env)
    found = AnsibleInventory(path)
    _read_list(found, data, path, None)
    found.reconcile()
    return found


def document(found: AnsibleInventory, service: Path | None,
             service_text: str | None = None) -> tuple[dict, Path, Callable[[tuple], str]]:
    """An Ansible inventory plus the service file (``service_text``: its content) as a kdeploy inventory
    document, the path its relative paths start from (the service file's), and where each key came from:
    what :func:`kdeploy.core.inventory.parse` takes."""
    path = found.path
    service = require_service(path, service)
    if service_text is None:
        service_text = read_text(service, *SERVICE_FILE)
    defaults = parse_yaml(service_text, service, "the service file must be a mapping like defaults:")
    # The topology: Ansible has no place for it, the service file does (beside the defaults, not one of them).
    servers_line = defaults.lc.key("servers")[0] + 1 if "servers" in defaults else None
    servers = defaults.pop("servers", None)
    hosts: dict[str, dict] = {}
    sources: dict[str, dict[str, str]] = {}
    for host in found.hosts:
        file, line = found.where(host)
        hosts[host], sources[host] = to_kdeploy(host, found.host_vars(host), line, file)
    groups = {g: found.members(g) for g in found.groups if g != "all"}
    raw = {"defaults": defaults, "groups": {g: {"hosts": m} for g, m in groups.items()}, "hosts": hosts,
           **({"servers": servers} if servers is not None else {})}

    def locate(where: tuple) -> str:
        level, rest = where[0], where[1:]
        if level == "defaults":
            line = line_of(defaults, rest)
            return f"{service}{f':{line}' if line else ''}: {'.'.join(map(str, rest))}"
        if level == "servers":  # a line of the service file, where the section is
            line = line_of(servers, rest) or servers_line
            return f"{service}{f':{line}' if line else ''}: {'.'.join(map(str, where))}"
        if level == "hosts" and len(rest) > 1:
            name, key = str(rest[0]), str(rest[1])
            var = sources[name].get(key, f"{PREFIX}{key}")
            file, line = found.where(name)
            return f"{file}{f':{line}' if line else ''}: {name}: {'.'.join([var, *map(str, rest[2:])])}"
        return f"{path}: {'.'.join(map(str, rest)) or level}"

    return raw, service, locate  # paths in the service file are relative to it


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
    connection = _plain(variables.get("ansible_connection"), f"{where}: ansible_connection")
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
    """A variable kdeploy reads, as plain data. Ansible would render ``{{ ... }}`` with Jinja and its facts;
    kdeploy cannot, so it refuses them, but in an :class:`Unsafe` string, which Ansible never renders either.
    A :class:`Vaulted` value is refused: kdeploy has no vault password."""
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, Unsafe):
        return str(value)
    if isinstance(value, Vaulted):
        raise InvalidInput(f"{where}: is encrypted with Ansible Vault, which kdeploy does not decrypt: a variable "
                           "kdeploy reads must be in plain text")
    if isinstance(value, str) and ("{{" in value or "{%" in value):
        raise InvalidInput(f"{where}: {value!r} is a Jinja template: kdeploy does not render templates, "
                           "put the value itself")
    return value


INI_LINE = 65536  # characters of an INI line: a host and its variables fit many times; shlex's time grows as its square


def _read_ini(found: AnsibleInventory, path: Path, text: str) -> None:
    """ansible-core's ``ini`` plugin: sections ``[g]``, ``[g:children]``, ``[g:vars]``; ``key=value`` values are
    Python literals where they parse as one; hosts before any section are ``ungrouped``."""
    group, state = "ungrouped", "hosts"
    pending: dict[str, tuple[int, str, list[str]]] = {}  # a group named before it is defined
    defined = {"all", "ungrouped", *found.groups}  # in a directory, earlier files' groups too
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{path}:{number}"
        if not line or line[0] in "#;":
            continue
        if len(line) > INI_LINE:
            raise InvalidInput(f"{where}: a line of {len(line)} characters, more than {INI_LINE}")
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
                found.add_host(name, group, variables, (path, number))
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
                found.add_child(group, child, where)
            else:
                pending.setdefault(child, (number, "children", []))[2].append((group, where))
    for name, (number, state, parents) in pending.items():
        if state == "vars":
            raise InvalidInput(f"{path}:{number}: section [{name}:vars] for undefined group {name!r}")
        raise InvalidInput(f"{path}:{number}: section [{parents[-1][0]}:children] names undefined group {name!r}")


def _resolve_pending(found: AnsibleInventory, group: str, pending: dict) -> None:
    for parent, where in pending[group][2]:
        found.add_child(parent, group, where)
        if parent in pending and pending[parent][1] == "children":
            _resolve_pending(found, parent, pending)
    del pending[group]


def _literal(value: str) -> Any:
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value
    return str(parsed) if parsed is ... or isinstance(parsed, complex) else parsed


def _read_yaml(found: AnsibleInventory, path: Path, text: str) -> None:
    """ansible-core's ``yaml`` plugin: top-level groups, each ``{hosts: {NAME: vars}, children: {...}, vars}``."""
    data = _decode(parse_yaml(text, path), str(path))
    known = list(found.hosts)
    for name, body in data.items():
        _yaml_group(found, path, str(name), body, (data, name))
    # The plugin reads a group's children before its hosts; the hosts keep the order they are written in.
    old = set(known)
    new = sorted((h for h in found.hosts if h not in old), key=lambda h: found.where(h)[1] or 0)
    found.hosts = {h: found.hosts[h] for h in [*known, *new]}


def _yaml_group(found: AnsibleInventory, path: Path, name: str, body: Any, where: tuple[Any, Any]) -> None:
    """One group and its children; ``where``: the mapping and key it is under (its line in errors). Stricter than
    Ansible, which warns and skips what it cannot read: a group that is no mapping, or a key of it that is no
    section, is refused, naming it and its line."""
    found.group(name)
    if body is None:
        return
    if not isinstance(body, dict):
        shown = "a list" if isinstance(body, list) else repr(body)
        raise InvalidInput(f"{path}:{line_of(where[0], (where[1],))}: {name}: a group is a mapping of hosts, "
                           f"children and vars, not {shown}")
    for key in body:
        if key not in _SECTIONS:
            raise InvalidInput(f"{path}:{line_of(body, (key,))}: {name}: unknown key {str(key)!r}"
                               f"{patterns.suggest(str(key), sorted(_SECTIONS))}")
    for section in ("vars", "children", "hosts"):
        value = body.get(section)
        if isinstance(value, str):
            value = {value: None}
        if value is not None and not isinstance(value, dict):
            raise InvalidInput(f"{path}:{line_of(body, (section,))}: {name}.{section}: must be a mapping")
        if section == "vars":
            found.group(name).vars.update(value or {})
        elif section == "children":
            for child, child_body in (value or {}).items():
                _yaml_group(found, path, str(child), child_body, (value, child))
                found.add_child(name, str(child), f"{path}:{line_of(value, (child,))}")
        else:
            for pattern, variables in (value or {}).items():
                line = line_of(value, (pattern,))
                if not isinstance(variables, dict | None):
                    raise InvalidInput(f"{path}:{line}: host {pattern}: its variables must be a mapping")
                names, port = expand(str(pattern), f"{path}:{line}")
                host_vars = dict(variables or {})
                if port is not None:
                    host_vars["ansible_port"] = port
                for host in names:
                    found.add_host(host, name, host_vars, (path, line))


def _read_list(found: AnsibleInventory, data: Any, path: Path, text: str | None) -> None:
    """ansible-core's ``script`` plugin on ``--list`` JSON: groups (a list of hosts, or ``{hosts: [...], vars:
    {...}, children: [...]}``), ``_meta.hostvars`` for the hosts the groups name. ``text``: the file it was read
    from (lines in errors), None for a program's output."""
    def where(*keys: Any) -> str:
        line = line_of(data, keys) if text is not None else None
        return f"{path}{f':{line}' if line else ''}" if text is not None else f"{path} (--list output)"

    if not isinstance(data, dict):
        raise InvalidInput(f"{where()}: an inventory's --list JSON must be an object of groups")
    _decode(data, where())
    hostvars: Any = {}
    if "_meta" in data:
        meta = data["_meta"]
        hostvars = meta.get("hostvars") if isinstance(meta, dict) else None
        if not isinstance(hostvars, dict):
            raise InvalidInput(f"{where('_meta')}: _meta.hostvars must be an object of host variables")
    named: list[str] = []
    for name, body in data.items():
        if name == "_meta":
            continue
        group = str(name)
        found.group(group)
        if not isinstance(body, dict):
            body = {"hosts": body}
        elif not any(key in body for key in ("hosts", "vars", "children")):
            body = {"hosts": [group], "vars": body}  # Ansible: a malformed group is its only host's variables
        hosts, variables, children = body.get("hosts", []), body.get("vars", {}), body.get("children", [])
        for key, value, kind in (("hosts", hosts, "a list"), ("vars", variables, "an object"),
                                 ("children", children, "a list")):
            if not isinstance(value, dict if kind == "an object" else list):
                raise InvalidInput(f"{where(name, key)}: {group}.{key} must be {kind}")
        for index, host in enumerate(hosts):
            found.add_host(str(host), group, {}, (path, line_of(data, (name, "hosts", index))))
            named.append(str(host))
        found.group(group).vars.update(variables)
        for index, child in enumerate(children):
            found.group(str(child))
            found.add_child(group, str(child), where(name, "children", index))
    for host in dict.fromkeys(named):
        own = hostvars.get(host, {})
        if not isinstance(own, dict):
            raise InvalidInput(f"{where('_meta', 'hostvars', host)}: _meta.hostvars.{host} must be an object")
        found.hosts[host].update(own)


def expand(pattern: str, where: str) -> tuple[list[str], int | None]:
    """Host names of a pattern (``gpu[01:16]``, ``node[a:c]``, ``[1:9:2]`` steps) and its ``:PORT``."""
    port = None
    m = _HOSTPORT.match(pattern)
    if m:
        pattern, port = (m.group(1), int(m.group(2))) if m.group(1) else (m.group(3), int(m.group(4)))
    elif pattern.endswith(":"):
        raise InvalidInput(f"{where}: host pattern {pattern!r} ends in ':' (reserved for a port)")
    try:
        return patterns.expand_ranges(pattern), port
    except ValueError as exc:
        raise InvalidInput(f"{where}: host pattern {pattern!r}: {exc}") from None



