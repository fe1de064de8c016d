"""Edit the inventory in place (``set-env``, ``set``): comments, order and formatting survive.

An edit is computed on the round-trip document and validated exactly as a load would; ``fleet.check_edit``
then computes what its push would (units, payload hashes), and only then is it written atomically. A bad
value leaves the file byte-for-byte unchanged. ``locked`` keeps a second kdeploy from editing the same file
while an edit is rolled out (and maybe reverted).
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

from kdeploy import inventory, lock
from kdeploy.errors import InvalidInput, LockHeld


@dataclass(frozen=True)
class Edit:
    path: Path
    before: str
    after: str
    level: str
    old: inventory.Inventory  # ``before`` and ``after``, validated
    new: inventory.Inventory

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


def _apply(path: Path, scope: str | None, change: Callable[[CommentedMap, str], None]) -> Edit:
    before = inventory.read_text(path)  # read once: the edit, its checks and its undo all start from this text
    old = inventory.parse(inventory.parse_yaml(before, path), path)
    doc = inventory.parse_yaml(before, path)
    level, name = _level(doc, old, scope)
    change(level, name)
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    after = buf.getvalue()
    new = inventory.parse(_yaml().load(after), path)  # validate exactly as a load would, before writing anything
    return Edit(path, before, after, name, old, new)


def set_env(path: Path, assignments: dict[str, str], unset: list[str], scope: str | None = None) -> Edit:
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

    return _apply(path, scope, change)


def set_values(path: Path, assignments: dict[str, str], scope: str | None = None) -> Edit:
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

    return _apply(path, scope, change)


def write(edit: Edit, text: str | None = None) -> None:
    """Atomic replace (temp file in the same directory + rename), keeping the file's mode."""
    text = edit.after if text is None else text
    mode = edit.path.stat().st_mode & 0o777 if edit.path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=edit.path.parent, prefix=f".{edit.path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, edit.path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: Path, wait: float, command: str) -> Iterator[None]:
    """Hold the inventory's edit lock: an flock on ``.<name>.lock`` beside it (the inventory itself is replaced
    by every write, so it cannot carry the lock), which names its holder. Waits up to ``wait`` seconds."""
    inventory.read_text(path)  # a missing inventory fails as a load would, without leaving a lock file behind
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
