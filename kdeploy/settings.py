"""Edit the inventory in place (``set-env``, ``set``): comments, order and formatting survive.

With an Ansible inventory the edit goes to the kdeploy service file instead (the defaults of every host).

An edit is computed on the round-trip document and validated exactly as a load would; ``fleet.check_edit``
then computes what its push would (units, payload hashes), and only then is it written atomically. A bad
value leaves the file byte-for-byte unchanged. ``locked`` keeps a second kdeploy from editing the same file
while an edit is rolled out (and maybe reverted).

The edit remembers each key it set or removed (``Change``), so a failed rollout is undone by the inverse
edit on the file as it is by then (``revert``): what someone changed meanwhile by hand survives, and a key
they changed too is left as they set it.
"""

from __future__ import annotations

import difflib
import fcntl
import io
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from kdeploy import ansible, inventory, lock
from kdeploy.errors import InvalidInput, LockHeld


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()  # where a key is not in the document


@dataclass(frozen=True)
class Change:
    """One key an edit set or removed, with what it needs to be undone on a later version of the file."""

    path: tuple[str, ...]  # from the document's root
    old: object  # MISSING: the edit added the key
    new: object  # MISSING: the edit removed it
    created: int = 0  # how many of the mappings holding it the edit created (undo removes them if empty)
    index: int | None = None  # its place among its siblings before the edit (where undo puts it back)
    comment: object = None  # its comment before the edit (ruamel's token)

    @property
    def key(self) -> str:
        return ".".join(map(str, self.path))


@dataclass(frozen=True)
class Edit:
    path: Path
    before: str
    after: str
    level: str
    old: inventory.Inventory  # ``before`` and ``after``, validated
    new: inventory.Inventory
    changes: tuple[Change, ...]

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
                                            fromfile=f"{self.path} (before)", tofile=f"{self.path} (after)"))


def split_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise InvalidInput(f"{text!r}: expected KEY=VALUE")
    return key.strip(), value


def _yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # ruamel folds longer plain scalars onto a new line: a long path would be reformatted
    return yaml


def _scalar(text: str) -> object:
    """A value typed the way YAML would read it (``4.0`` float, ``8`` int, ``true`` bool, else str)."""
    value = YAML(typ="safe").load(text) if text.strip() else text
    return value if isinstance(value, str | int | float | bool) else text


def _level(doc: CommentedMap, inv: inventory.Inventory, scope: str | None) -> tuple[CommentedMap, str]:
    """The mapping that holds settings for ``scope`` (None: defaults, else a host or a group)."""
    if scope is None:
        return _child(doc, "defaults"), "defaults"
    if scope in inv.hosts:
        return _child(_child(doc, "hosts"), scope), f"hosts.{scope}"
    if scope in inv.groups:
        groups = _child(doc, "groups")
        if isinstance(groups.get(scope), list):  # short form `name: [h1, h2]` -> mapping with hosts
            groups[scope] = CommentedMap([("hosts", groups[scope])])
        return _child(groups, scope), f"groups.{scope}"
    raise InvalidInput(f"--target {scope!r}: no such host or group (scopes are a host or a group)")


def _child(node: CommentedMap, key: str) -> CommentedMap:
    if node.get(key) is None:
        node[key] = CommentedMap()
    child = node[key]
    if not isinstance(child, dict):
        raise InvalidInput(f"{key}: expected a mapping in the inventory")
    return child


def _apply(path: Path, scope: str | None, change: Callable[[CommentedMap, str], None],
           service: Path | None = None) -> Edit:
    before = inventory.read_text(path)  # read once: the edit, its checks and its undo all start from this text
    fmt, document = ansible.detect(path, before)
    if fmt is not None:
        return _apply_service(path, before, fmt, service, scope, change)
    if service is not None:
        raise inventory.service_without_ansible(path)
    original = inventory.checked(document, before, path)
    old = inventory.parse(original, path)
    doc = _yaml().load(before)
    level, name = _level(doc, old, scope)
    change(level, name)
    after = _dump(doc)
    new = inventory.parse(_yaml().load(after), path)  # validate exactly as a load would, before writing anything
    return Edit(path, before, after, name, old, new, tuple(diff(original, doc)))


def _apply_service(path: Path, text: str, fmt: ansible.Format, service: Path | None, scope: str | None,
                   change: Callable[[CommentedMap, str], None]) -> Edit:
    """An Ansible inventory: its hosts, groups and variables stay Ansible's; the edit goes to the service file,
    the defaults level of every host."""
    if scope is not None:
        raise InvalidInput(f"--target {scope}: {path} is an Ansible inventory: set-env/set edit its service file, "
                           "for all hosts; per host or group, set kdeploy_service in Ansible's variables")
    service = ansible.require_service(path, service)
    before = inventory.read_text(service, *ansible.SERVICE_FILE)
    old = ansible.load(path, text, fmt, service, before)
    original = inventory.parse_yaml(before, service)
    doc = inventory.parse_yaml(before, service)
    change(doc, "defaults")
    after = _dump(doc)
    new = ansible.load(path, text, fmt, service, after)
    return Edit(service, before, after, "defaults", old, new, tuple(diff(original, doc)))


def _dump(doc: CommentedMap) -> str:
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    return buf.getvalue()


def diff(old: object, new: object, path: tuple[str, ...] = (), *, created: int = 0, index: int | None = None,
         comment: object = None) -> list[Change]:
    """The keys whose values differ between two documents, mapping by mapping down to the values (a value
    that is not a mapping, e.g. a list, is compared whole)."""
    olds, news = _keys(old), _keys(new)
    if olds is None or news is None:
        return [] if old == new else [Change(path, old, new, created, index, comment)]
    place = {key: i for i, key in enumerate(olds)}
    items = getattr(getattr(old, "ca", None), "items", {})
    return [change for key in [*olds, *(k for k in news if k not in place)]
            for change in diff(olds.get(key, MISSING), news.get(key, MISSING), (*path, key),
                               created=created + 1 if old is MISSING else 0, index=place.get(key),
                               comment=items.get(key))]


def _keys(node: object) -> dict | None:
    """A mapping's entries (none where the mapping is missing); None for any other value."""
    if node is MISSING:
        return {}
    return node if isinstance(node, dict) else None


def undo(doc: CommentedMap, changes: tuple[Change, ...]) -> tuple[int, list[str]]:
    """Undo ``changes`` on ``doc``, key by key: (how many were undone, one line per key left alone because
    someone changed it since the edit: their value stays)."""
    undone, kept = 0, []
    for change in changes:
        now = _get(doc, change.path)
        if now == change.old:  # already back
            continue
        if now != change.new:
            what = "removed meanwhile" if now is MISSING else f"changed meanwhile to {_show(now)}"
            by_us = "removing it" if change.new is MISSING else f"set {_show(change.new)}"
            kept.append(f"{change.key}: {what} (kdeploy {by_us}); left as it is")
            continue
        if change.old is MISSING:
            _remove(doc, change)
        else:
            _put(doc, change)
        undone += 1
    return undone, kept


def _show(value: object) -> str:
    return repr(str(value)) if isinstance(value, str) else repr(value)  # ruamel's quoted strings: as plain ones


def _get(doc: CommentedMap, path: tuple[str, ...]) -> object:
    node: object = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return MISSING
        node = node[key]
    return node


def _remove(doc: CommentedMap, change: Change) -> None:
    """Remove a key the edit added, and the mappings the edit created for it if nothing else is in them now."""
    nodes = [doc]
    for key in change.path[:-1]:
        nodes.append(nodes[-1][key])
    del nodes[-1][change.path[-1]]
    for depth in range(1, change.created + 1):
        if nodes[-depth]:
            break
        del nodes[-depth - 1][change.path[-depth - 1]]


def _put(doc: CommentedMap, change: Change) -> None:
    """Put a key back to its old value; one the edit removed goes back to its place, with its comment."""
    node = doc
    for key in change.path[:-1]:
        node = _child(node, key)  # a removal may have taken its now-empty mapping too
    key = change.path[-1]
    if key in node:
        node[key] = change.old
        return
    node.insert(min(change.index or 0, len(node)), key, change.old)
    if change.comment is not None:
        node.ca.items[key] = change.comment


def set_env(path: Path, assignments: dict[str, str], unset: list[str], scope: str | None = None,
            service: Path | None = None) -> Edit:
    def change(level: CommentedMap, name: str) -> None:
        env = _child(_child(level, "service"), "env")
        for key, value in assignments.items():
            env[key] = value
        for key in unset:
            if key not in env:
                raise InvalidInput(f"--unset {key}: not set at {name} (nothing to remove there)")
            del env[key]
        if not env:
            del level["service"]["env"]
        if not level["service"]:
            del level["service"]

    return _apply(path, scope, change, service)


def set_values(path: Path, assignments: dict[str, str], scope: str | None = None,
               service: Path | None = None) -> Edit:
    """``hicache.ratio=4.0``-style settings, relative to ``service`` (a leading ``service.`` is allowed)."""
    def change(level: CommentedMap, name: str) -> None:
        for dotted, raw in assignments.items():
            parts = dotted.removeprefix("service.").split(".")
            if not all(parts):
                raise InvalidInput(f"{dotted!r}: expected a dotted setting path like hicache.ratio")
            node = _child(level, "service")
            for part in parts[:-1]:
                node = _child(node, part)
            node[parts[-1]] = _scalar(raw)

    return _apply(path, scope, change, service)


def write(edit: Edit) -> None:
    _replace(edit.path, edit.after, expect=edit.before)


def revert(edit: Edit) -> list[str]:
    """Undo ``edit`` on the file as it is now, keeping what others changed since; returns the keys left alone."""
    text = inventory.read_text(edit.path)
    if text == edit.after:  # nobody touched it: the exact old text (a round trip cannot keep every layout)
        _replace(edit.path, edit.before, expect=text)
        return []
    doc = inventory.parse_yaml(text, edit.path)
    undone, kept = undo(doc, edit.changes)
    if undone:
        _replace(edit.path, _dump(doc), expect=text)
    return kept


def _replace(path: Path, text: str, *, expect: str) -> None:
    """Atomic replace (temp file in the same directory + rename), keeping the file's mode; refused when the
    file is no longer ``expect``, so that a hand edit made since it was read is never overwritten."""
    if inventory.read_text(path) != expect:
        raise LockHeld(f"{path} was changed by someone else while kdeploy was editing it: not written")
    mode = path.stat().st_mode & 0o777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: Path, wait: float, command: str, service: bool = False) -> Iterator[None]:
    """Hold the edit lock of the inventory (or of an Ansible inventory's ``service`` file): an flock on
    ``.<name>.lock`` beside it (the file itself is replaced by every write, so it cannot carry the lock), which
    names its holder. Waits up to ``wait`` seconds."""
    inventory.read_text(path, *(ansible.SERVICE_FILE if service else ()))  # a missing file fails as a load
    # would, without leaving a lock file behind
    lock_path = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise InvalidInput(f"{lock_path}: cannot create the inventory's lock file: {exc.strerror}") from None
    try:
        deadline = time.monotonic() + wait
        while not _try_flock(fd):
            if time.monotonic() >= deadline:
                holder = lock.parse_info(os.pread(fd, 4096, 0).decode(errors="replace"))
                raise LockHeld(f"{path} is being edited by {holder.describe() if holder else 'another kdeploy'}: "
                               "try again when it is done, or wait with --lock-wait SECONDS")
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(lock.holder_info(command).__dict__).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # lets go of the flock


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
