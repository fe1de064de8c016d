"""Edit the inventory in place (``set-env``, ``set``): comments, order, indentation and line endings survive.

With an Ansible inventory the edit goes to the kdeploy service file instead (the defaults of every host).

An edit is computed on the round-trip document and validated exactly as a load would; ``fleet.check_edit``
then computes what its push would (units, payload hashes), and only then is it written atomically. A bad
value, or one that would not read back from the written file as given, leaves the file byte-for-byte
unchanged. An edit at a level changes that level only: a mapping it shares with other places (a YAML anchor
and its aliases, a ``<<`` merge key) is replaced there by a copy before it is changed. ``locked`` keeps a
second kdeploy from editing the same file while an edit is rolled out (and maybe reverted).

The edit remembers each key it set or removed (``Change``), so a failed rollout is undone by the inverse
edit on the file as it is by then (``revert``): what someone changed meanwhile by hand survives, and a key
they changed too is left as they set it.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import io
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

from kdeploy.core import ansible, inventory
from kdeploy.core.errors import InvalidInput, LockHeld
from kdeploy.host import lock


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
        return "".join(difflib.unified_diff(_lines(self.before), _lines(self.after),
                                            fromfile=f"{self.path} (before)", tofile=f"{self.path} (after)"))


def _lines(text: str) -> list[str]:
    return _lf(text).splitlines(keepends=True)  # a CRLF file's diff as any other


def _lf(text: str) -> str:
    """``text`` with ``\\n`` line ends, as it is parsed (ruamel would keep the ``\\r`` in comments)."""
    return text.replace("\r\n", "\n")


_COMMENT = re.compile(r"(?:^|\s)#.*")


@dataclass(frozen=True)
class Layout:
    """How a YAML file is indented and where its lines end: the edited document is written back the same way,
    so that only the edited lines change (ruamel writes its own defaults otherwise: 2 spaces, ``- item`` flush
    with its key, ``\\n``)."""

    mapping: int = 2  # a nested mapping's keys, from their parent key's column
    sequence: int = 2  # a block list item's text, from its parent key's column
    offset: int = 0  # its dash, from its parent key's column
    newline: str = "\n"

    @classmethod
    def of(cls, text: str) -> Layout:
        """The first nested block mapping's and the first block list's indentation; ``\\r\\n`` if the first line
        ends so."""
        mapping = sequence = offset = None
        lines = [line for line in (_COMMENT.sub("", line).rstrip() for line in text.splitlines()) if line.strip()]
        for parent, line in itertools.pairwise(lines):
            if not parent.endswith(":") or parent.lstrip().startswith("-"):
                continue
            body = line.lstrip()
            at = len(line) - len(body) - (len(parent) - len(parent.lstrip()))
            if body.startswith("- ") and offset is None:
                offset, sequence = at, at + len(body) - len(body[1:].lstrip())
            elif not body.startswith("-") and at > 0 and mapping is None:
                mapping = at
        end = text.find("\n")
        return cls(mapping or 2, max(sequence or 2, (offset or 0) + 2), offset or 0,
                   "\r\n" if end > 0 and text[end - 1] == "\r" else "\n")

    def dump(self, doc: CommentedMap) -> str:
        yaml = _yaml()
        yaml.indent(mapping=self.mapping, sequence=self.sequence, offset=self.offset)
        buf = io.StringIO()
        yaml.dump(doc, buf)
        return buf.getvalue().replace("\n", self.newline)


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
    """``4.0`` a float, ``8`` an int, ``true`` a bool, as YAML reads them; anything else the text exactly as
    given (YAML's reading of it could differ: it folds line breaks, drops quotes and ``# comments``)."""
    try:
        value = YAML(typ="safe").load(text)
    except (YAMLError, RecursionError):  # `[[[...]]]` nested past Python's stack is no scalar either
        return text
    return value if isinstance(value, int | float | bool) else text


@dataclass(frozen=True)
class Level:
    """The mapping an edit changes (``defaults``, a group's or a host's) in its round-trip document."""

    node: CommentedMap
    name: str
    shared: set[int]  # what in the document more than one place holds (``_shared``)

    def child(self, *keys: str) -> CommentedMap:
        """The mapping at ``keys`` under this level, this level's own (created if missing)."""
        node = self.node
        for key in keys:
            node = _child(node, key, self.shared)
        return node


def _level(doc: CommentedMap, inv: inventory.Inventory, scope: str | None) -> Level:
    """The level that holds settings for ``scope`` (None: defaults, else a host or a group)."""
    top = Level(doc, "", _shared(doc))
    if scope is None:
        return Level(top.child("defaults"), "defaults", top.shared)
    if scope in inv.hosts:
        return Level(top.child("hosts", scope), f"hosts.{scope}", top.shared)
    if scope in inv.groups:
        groups = top.child("groups")
        if isinstance(groups.get(scope), list):  # short form `name: [h1, h2]` -> mapping with hosts
            groups[scope] = CommentedMap([("hosts", groups[scope])])
        return Level(top.child("groups", scope), f"groups.{scope}", top.shared)
    raise InvalidInput(f"--target {scope!r}: no such host or group (--target is the host or group whose settings "
                       "change; --limit PATTERN narrows the rollout)")


def _shared(doc: CommentedMap) -> set[int]:
    """The ids of the mappings and lists that more than one place of ``doc`` holds: an anchor's node is the
    very object at each of its aliases, and a ``<<`` merge key's mappings are also where they are defined.
    Anchors nothing refers to are marked to be written anyway (ruamel drops them otherwise)."""
    seen: set[int] = set()
    twice: set[int] = set()

    def walk(node: object) -> None:
        if not isinstance(node, CommentedMap | CommentedSeq):
            return
        if id(node) in seen:
            twice.add(id(node))
            return
        seen.add(id(node))
        if node.anchor.value is not None:
            node.anchor.always_dump = True
        children = node if isinstance(node, CommentedSeq) else [*(v for _, v in node.non_merged_items()), *node.merge]
        for child in children:
            walk(child)

    walk(doc)
    return twice


def _child(node: CommentedMap, key: str, shared: set[int]) -> CommentedMap:
    """``node[key]`` as ``node``'s own mapping: one that other places hold too (``shared``, or taken in by a
    ``<<`` merge key) is replaced here by a copy first, so that changing it changes nothing elsewhere."""
    if node.get(key) is None:
        node[key] = CommentedMap()
    child = node[key]
    if not isinstance(child, dict):
        raise InvalidInput(f"{key}: expected a mapping in the inventory")
    if id(child) in shared or key not in dict(node.non_merged_items()):
        child = node[key] = _copy(child, shared)
    return child


def _copy(node: object, shared: set[int]) -> object:
    """``node``'s content, merged keys included, in the same block or flow style; copied down to what other
    places hold too, which stays shared (and is written as an alias, as before)."""
    def inner(value: object) -> object:
        return value if id(value) in shared else _copy(value, shared)

    if isinstance(node, dict):
        copy: CommentedMap | CommentedSeq = CommentedMap((key, inner(value)) for key, value in node.items())
    elif isinstance(node, list):
        copy = CommentedSeq(inner(value) for value in node)
    else:
        return node
    if getattr(node, "fa", None) is not None and node.fa.flow_style():
        copy.fa.set_flow_style()
    return copy


def _prune(node: CommentedMap, key: str) -> None:
    """Remove ``node[key]`` that the edit left empty, unless a ``<<`` merge key would bring another back."""
    if not node[key] and not any(key in source for source in node.merge):
        del node[key]


def _apply(path: str | Path, scope: str | None, change: Callable[[Level], None],
           service: Path | None = None) -> Edit:
    path = Path(path)  # the library's callers may pass a str, as inventory.load takes one
    if ansible.is_source(path):  # an Ansible directory or script: its service file is what is edited
        return _apply_service(path, None, service, scope, change)
    before = inventory.read_text(path, exact=True)  # read once: the edit, its checks and its undo start from this
    text = _lf(before)
    fmt, document = ansible.detect(path, text)
    if fmt is not None:
        return _apply_service(path, (text, fmt), service, scope, change)
    if service is not None:
        raise inventory.service_without_ansible(path)
    original = inventory.checked(document, text, path)
    old = inventory.parse(original, path)
    doc = _yaml().load(text)
    level = _level(doc, old, scope)
    change(level)
    after, written = _write_out(doc, before)
    # validate exactly as a load would, before writing anything; an error names the key the edit made invalid,
    # not a line: the edited text is not in the file (its line N is another line there)
    new = inventory.parse(written, path, locate=lambda keys: f"{path}: not changed: {'.'.join(map(str, keys))}")
    return Edit(path, before, after, level.name, old, new, tuple(diff(original, doc)))


def _apply_service(path: Path, file: tuple[str, ansible.Format] | None, service: Path | None, scope: str | None,
                   change: Callable[[Level], None]) -> Edit:
    """An Ansible inventory (``file``: its text and format; None for a directory or script): its hosts, groups
    and variables stay Ansible's; the edit goes to the service file, the defaults level of every host."""
    if scope is not None:
        raise InvalidInput(f"--target {scope}: {path} is an Ansible inventory: set-env/set edit its service file, "
                           "for all hosts; per host or group, set kdeploy_service in Ansible's variables")
    service = ansible.require_service(path, service)
    before = inventory.read_text(service, *ansible.SERVICE_FILE, exact=True)
    found = ansible.read(path, *file) if file else ansible.read_source(path)  # once: a script runs once
    old = replace(inventory.from_ansible(found, service, _lf(before)), source=path)
    original = inventory.parse_yaml(_lf(before), service)
    doc = inventory.parse_yaml(_lf(before), service)
    change(Level(doc, "defaults", _shared(doc)))
    after, _ = _write_out(doc, before)
    new = replace(inventory.from_ansible(found, service, _lf(after)), source=path)  # source: what hooks pass on as -i
    return Edit(service, before, after, "defaults", old, new, tuple(diff(original, doc)))


def _write_out(doc: CommentedMap, like: str) -> tuple[str, CommentedMap]:
    """``doc`` as the text of the file ``like`` edited, and that text read back: ``like``'s own lines wherever
    the edit left them (``_keep_lines``), else ruamel's dump laid out like ``like``. Refused where even the
    dump reads back other values than ``doc``'s (ruamel writes some strings, e.g. with U+0085, so that YAML
    reads another one back)."""
    layout = Layout.of(like)
    dumped = layout.dump(doc)
    kept = _keep_lines(like, layout.dump(_yaml().load(_lf(like))), dumped)
    if kept != dumped:
        with contextlib.suppress(YAMLError):  # the file's own lines do not fit the new ones
            back = _yaml().load(kept)
            if not diff(doc, back):
                return kept, back
    back = _yaml().load(dumped)
    for change in diff(doc, back):
        raise InvalidInput(f"{change.key}: {_show(change.old)} would not read back from the YAML file as given "
                           f"(it would read {_show(change.new)})")
    return dumped, back


def _keep_lines(original: str, unedited: str, edited: str) -> str:
    """``edited`` with each line it has in common with ``unedited`` (the dump of ``original`` as it is) taken
    from ``original`` itself, so that what a dump rewrites (spaces, ``~``, a ``---``) stays where the edit did
    not go. Only where the dump has as many lines as ``original``: line ``i`` of the one is line ``i`` of the
    other; else ``edited`` as it is."""
    old, base, new = (re.findall(r"[^\n]*\n|[^\n]+\Z", text) for text in (original, unedited, edited))
    if len(old) != len(base):
        return edited
    matcher = difflib.SequenceMatcher(None, base, new, autojunk=False)
    return "".join("".join(old[i1:i2] if tag == "equal" else new[j1:j2])
                   for tag, i1, i2, j1, j2 in matcher.get_opcodes())


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
    undone, kept, shared = 0, [], _shared(doc)
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
            _remove(doc, change, shared)
        else:
            _put(doc, change, shared)
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


def _remove(doc: CommentedMap, change: Change, shared: set[int]) -> None:
    """Remove a key the edit added, and the mappings the edit created for it if nothing else is in them now."""
    nodes = [doc]
    for key in change.path[:-1]:
        nodes.append(_child(nodes[-1], key, shared))
    del nodes[-1][change.path[-1]]
    for depth in range(1, change.created + 1):
        if nodes[-depth]:
            break
        del nodes[-depth - 1][change.path[-depth - 1]]


def _put(doc: CommentedMap, change: Change, shared: set[int]) -> None:
    """Put a key back to its old value; one the edit removed goes back to its place, with its comment."""
    node = doc
    for key in change.path[:-1]:
        node = _child(node, key, shared)  # a removal may have taken its now-empty mapping too
    key = change.path[-1]
    if key in node:
        node[key] = change.old
        return
    node.insert(min(change.index or 0, len(node)), key, change.old)
    if change.comment is not None:
        node.ca.items[key] = change.comment


def set_env(path: str | Path, assignments: dict[str, str], unset: list[str], scope: str | None = None,
            service: Path | None = None) -> Edit:
    inventory.check_env(assignments)  # as given: the check of the written file could pass another value

    def change(level: Level) -> None:
        env = level.child("service", "env")
        for key, value in assignments.items():
            env[key] = value
        for key in unset:
            if key not in env:
                raise InvalidInput(f"--unset {key}: not set at {level.name} (nothing to remove there)")
            del env[key]
        _prune(level.child("service"), "env")
        _prune(level.node, "service")

    return _apply(path, scope, change, service)


def set_values(path: str | Path, assignments: dict[str, str], scope: str | None = None,
               service: Path | None = None) -> Edit:
    """``hicache.ratio=4.0``-style settings, relative to ``service`` (a leading ``service.`` is allowed)."""
    def change(level: Level) -> None:
        for dotted, raw in assignments.items():
            parts = dotted.removeprefix("service.").split(".")
            if not all(parts):
                raise InvalidInput(f"{dotted!r}: expected a dotted setting path like hicache.ratio")
            level.child("service", *parts[:-1])[parts[-1]] = _scalar(raw)

    return _apply(path, scope, change, service)


def write(edit: Edit) -> None:
    _replace(edit.path, edit.after, expect=edit.before)


def revert(edit: Edit) -> list[str]:
    """Undo ``edit`` on the file as it is now, keeping what others changed since; returns the keys left alone."""
    text = inventory.read_text(edit.path, exact=True)
    if text == edit.after:  # nobody touched it: the exact old text (a round trip cannot keep every layout)
        _replace(edit.path, edit.before, expect=text)
        return []
    doc = inventory.parse_yaml(_lf(text), edit.path)
    undone, kept = undo(doc, edit.changes)
    if undone:
        _replace(edit.path, _write_out(doc, text)[0], expect=text)
    return kept


def _replace(path: Path, text: str, *, expect: str) -> None:
    """Atomic replace (temp file in the same directory + rename), keeping the file's mode; refused when the
    file is no longer ``expect``, so that a hand edit made since it was read is never overwritten."""
    if inventory.read_text(path, exact=True) != expect:
        raise LockHeld(f"{path} was changed by someone else while kdeploy was editing it: not written")
    mode = path.stat().st_mode & 0o777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: str | Path, wait: float, command: str, service: bool = False) -> Iterator[None]:
    """Hold the edit lock of the inventory (or of an Ansible inventory's ``service`` file): an flock on
    ``.<name>.lock`` beside it (the file itself is replaced by every write, so it cannot carry the lock), which
    names its holder. Waits up to ``wait`` seconds."""
    path = Path(path)
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
