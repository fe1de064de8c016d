"""Host patterns in Ansible's language (TARGET and ``--limit``): which hosts of an inventory a pattern names.

A port of ansible-core's ``InventoryManager`` (``split_host_pattern``, ``order_patterns``, ``_evaluate_patterns``,
``_match_one_pattern``, ``_enumerate_matches``, subscripts), so that a pattern selects the hosts Ansible selects
(tests/unit/test_patterns.py compares with ``ansible PATTERN --list-hosts``). kdeploy differs on purpose in
three places, each safer for a deploy tool: a part that matches no host or group name is an error naming the
nearest one (Ansible warns and ignores it: a typo in ``all:!gpu03`` would deploy gpu03); a range ``gpu[01:16]``
whose base names nothing is read as the inventory's host range (Ansible matches nothing); the result keeps the
inventory's order (the order canaries and batches pick hosts in).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from kdeploy.core.errors import InvalidInput

_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]$")
_SPECIAL = (".", "?", "*", "[")
# ansible-core's parse_address (parsing/utils/addresses.py): is the whole pattern one host (ranges allowed,
# an optional :port)? Then its colons are no separators.
_NUM_RANGE = r"\[(?:[0-9]+:[0-9]+)(?::[0-9]+)?\]"
_HEX_RANGE = r"\[(?:[0-9a-f]+:[0-9a-f]+)(?::[0-9]+)?\]"
_ALNUM_RANGE = r"\[(?:[a-z]:[a-z]|[0-9]+:[0-9]+)(?::[0-9]+)?\]"
_V6 = rf"(?:[0-9a-f]{{1,4}}|{_HEX_RANGE})"
_V4 = rf"(?:[01]?[0-9]{{1,2}}|2[0-4][0-9]|25[0-5]|{_NUM_RANGE})"
_LABEL = rf"(?:[\w]|{_ALNUM_RANGE})(?:[\w_-]|{_ALNUM_RANGE})*(?<![_-])"
_ADDRESS = [re.compile(p, re.I) for p in (
    rf"^(?:{_V4}\.){{3}}{_V4}$",
    rf"^((?:{_V6}:){{7}}{_V6}|(?:{_V6}:){{1,6}}:|(?:{_V6}:)(?::{_V6}){{1,6}}|(?:{_V6}:){{2}}(?::{_V6}){{1,5}}|"
    rf"(?:{_V6}:){{3}}(?::{_V6}){{1,4}}|(?:{_V6}:){{4}}(?::{_V6}){{1,3}}|(?:{_V6}:){{5}}(?::{_V6}){{1,2}}|"
    rf"(?:{_V6}:){{6}}(?::{_V6})|:(?::{_V6}){{1,6}}|{_V6}?::|(?:0:){{6}}(?:{_V6}\.){{3}}{_V6}|"
    rf"::(?:ffff:)?(?:{_V6}\.){{3}}{_V6}|(?:0:){{5}}ffff:(?:{_V6}\.){{3}}{_V6})$",
    rf"^{_LABEL}(?:\.{_LABEL})*$",
)]
_HOSTPORT = [re.compile(r"^\[(.+)\]:([0-9]+)$"), re.compile(r"^((?:[^:\[\]]|\[[^\]]*\])*):([0-9]+)$")]
_COLON_PARTS = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
_COLON_WHOLE = re.compile(r"(?:[\s:]|[^\s:\[\]]|\[[^\]]*\])*")  # what _COLON_PARTS and its separators consume


def _is_address(pattern: str) -> bool:
    for regex in _HOSTPORT:
        m = regex.match(pattern)
        if m:
            pattern = m.group(1)
    return any(regex.match(pattern) for regex in _ADDRESS)


def split(pattern: str, what: str = "pattern") -> list[str]:
    """``a,b`` or ``a:b:!c`` into its parts (ansible-core's ``split_host_pattern``): commas first; without
    one, colons separate unless the whole is one host name, address or range (``gpu[01:16]``, ``::1``).
    An unmatched ``[`` or ``]`` is refused: ansible-core drops it, so ``~[`` would be ``~``, every host."""
    if "," in pattern:
        parts = pattern.split(",")
    elif _is_address(pattern):
        parts = [pattern]
    else:
        if not _COLON_WHOLE.fullmatch(pattern):
            raise InvalidInput(f"{what} {pattern!r}: an unmatched '[' or ']'")
        parts = _COLON_PARTS.findall(pattern)
    return [p.strip() for p in parts if p.strip()]


def _ordered(parts: Sequence[str]) -> list[str]:
    """Unions first, then ``&`` intersections, then ``!`` exclusions, whatever the order written (Ansible's
    ``order_patterns``); only ``&``/``!`` parts mean ``all`` first."""
    regular = [p for p in parts if p[0] not in "&!"]
    return (regular or ["all"]) + [p for p in parts if p[0] == "&"] + [p for p in parts if p[0] == "!"]


MAX_RANGE = 100_000  # names one host pattern may stand for: far beyond a fleet, far below a typo that fills memory


def expand_ranges(pattern: str) -> list[str]:
    """The names of an inventory host range: ``gpu[01:16]`` (zero-padded), ``node[a:f]``, steps ``[1:9:2]``,
    several ranges in one name, at most :data:`MAX_RANGE` names. ValueError says what is wrong."""
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
        seq: Sequence[str | int] = string.ascii_letters[i:j + 1:step]
    else:
        if step == 0:
            raise ValueError("a range's step cannot be 0")
        seq = range(int(beg), int(end) + 1, step)
    too_many = ValueError(f"stands for more than {MAX_RANGE} hosts")
    try:
        if len(seq) > MAX_RANGE:
            raise too_many
    except OverflowError:  # more than the platform's largest size
        raise too_many from None
    names: list[str] = []
    for item in seq:
        names += expand_ranges(f"{head}{str(item).zfill(width)}{tail}")
        if len(names) > MAX_RANGE:
            raise too_many
    return names


class Selector:
    """Evaluates patterns over an inventory's hosts (in inventory order) and groups (each with every member,
    children's included; ``all`` is implied). ``what`` names the pattern in errors: ``target``, ``--limit``."""

    def __init__(self, hosts: Iterable[str], groups: Mapping[str, Sequence[str]]) -> None:
        self.hosts = list(hosts)
        self.groups = {"all": self.hosts, **{g: list(m) for g, m in groups.items() if g != "all"}}
        self._index = {h: i for i, h in enumerate(self.hosts)}

    def select(self, pattern: str, what: str = "target") -> list[str]:
        """The hosts ``pattern`` names, each once, in inventory order (possibly none). A blank pattern, an
        empty comma item, a part that matches no host or group, a bad regex or subscript: InvalidInput."""
        if not pattern.strip():
            raise InvalidInput(f"{what} {pattern!r} is blank: name a host, a group, `all` or a pattern")
        if "," in pattern and any(not p.strip() for p in pattern.split(",")):
            raise InvalidInput(f"{what} {pattern!r}: empty name in comma list")
        return self.evaluate(split(pattern, what), what)

    def evaluate(self, parts: Sequence[str], what: str = "target") -> list[str]:
        chosen: dict[str, None] = {}
        for part in _ordered(parts):
            if part in self._index:
                chosen[part] = None
                continue
            that = self._match_one(part, what)
            if part[0] == "!":
                chosen = {h: None for h in chosen if h not in that}
            elif part[0] == "&":
                chosen = {h: None for h in chosen if h in that}
            else:
                chosen.update(dict.fromkeys(that))
        return sorted(chosen, key=self._index.__getitem__)

    def _match_one(self, part: str, what: str) -> set[str]:
        pattern = part[1:] if part[0] in "&!" else part
        if not pattern:
            raise InvalidInput(f"{what}: {part!r} names nothing after {part[0]!r}")
        expr, subscript = _split_subscript(pattern)
        named, found = self._enumerate(expr, what)
        if subscript is not None and named:
            chosen = self._subscript(found, subscript, pattern, what)
            ranged = self._range(pattern, what)
            if ranged and ranged != set(chosen):
                raise InvalidInput(
                    f"{what} {pattern!r} is ambiguous: {expr!r} names a group or host, so Ansible reads the "
                    f"brackets as positions in its hosts ({', '.join(chosen)}), not the host range "
                    f"({', '.join(self._ordered_names(ranged))}); for the range use a regex (~gpu0[1-4]$) or a list")
            return set(chosen)
        if named:
            return set(found)
        ranged = self._range(pattern, what) if "[" in pattern and pattern[0] != "~" else None
        if ranged:
            return ranged
        raise InvalidInput(f"{what} {pattern!r}: no such host or group{suggest(pattern, self.names())}")

    def _enumerate(self, expr: str, what: str) -> tuple[bool, list[str]]:
        """Ansible's ``_enumerate_matches``: the hosts of every group the expression matches, and the hosts it
        matches when it matched no group or is a glob, regex or dotted name; and whether it matched any name
        (a group with no hosts is a match, a typo is none)."""
        try:
            regex = re.compile(expr[1:]) if expr[0] == "~" else re.compile(fnmatch.translate(expr))
        except re.error as exc:
            raise InvalidInput(f"{what} {expr!r}: not a valid regular expression: {exc}") from None
        groups = [g for g in self.groups if regex.match(g)]
        found = [h for g in groups for h in self.groups[g]]
        hosts = []
        if not groups or expr[0] == "~" or any(c in expr for c in _SPECIAL):
            hosts = [h for h in self.hosts if regex.match(h)]
        return bool(groups or hosts), list(dict.fromkeys(found + hosts))

    def _range(self, pattern: str, what: str) -> set[str] | None:
        """The hosts an inventory range names (``gpu[01:16]``: each name as a host, group or glob); None when
        the brackets are no range."""
        try:
            names = expand_ranges(pattern)
        except ValueError:
            return None
        found: set[str] = set()
        for name in names:
            if name in self._index:
                found.add(name)
            elif "[" not in name:
                found.update(self._enumerate(name, what)[1])
        return found

    def _subscript(self, found: list[str], subscript: tuple[int, int | None], pattern: str, what: str) -> list[str]:
        """Ansible's ``_apply_subscript`` on the matches in inventory order: ``[i]``, ``[-1]``, ``[i:j]``
        (inclusive), ``[i:]``."""
        start, end = subscript
        ordered = self._ordered_names(found)
        try:
            if end:
                return ordered[start:(len(ordered) - 1 if end == -1 else end) + 1]
            return [ordered[start]]
        except IndexError:
            raise InvalidInput(f"{what} {pattern!r}: no host at that position ({len(ordered)} matched)") from None

    def _ordered_names(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names), key=self._index.__getitem__)

    def names(self) -> list[str]:
        return [*self.groups, *self.hosts]


def _split_subscript(pattern: str) -> tuple[str, tuple[int, int | None] | None]:
    if pattern[0] == "~":
        return pattern, None
    m = _SUBSCRIPT.match(pattern)
    if not m:
        return pattern, None
    expr, index, start, _, end = m.groups()
    if index:
        return expr, (int(index), None)
    return expr, (int(start), int(end) if end else -1)


def limit_parts(limit: str, read: Callable[[Path], str]) -> list[str]:
    """``--limit``'s parts; ``@FILE`` stands for the patterns in FILE, one a line (Ansible's retry files)."""
    if not limit.strip():
        raise InvalidInput(f"--limit {limit!r} is blank: name a host, a group or a pattern")
    parts: list[str] = []
    for part in split(limit, "--limit"):
        if part.startswith("@"):
            parts += [line.strip() for line in read(Path(part[1:])).splitlines() if line.strip()]
        else:
            parts.append(part)
    if not parts:
        raise InvalidInput(f"--limit {limit!r} names no host")
    return parts


def complete(incomplete: str, names: Sequence[str]) -> list[str]:
    """Shell completion of a pattern: the names that complete its last part (after the last ``,`` or ``:``,
    a leading ``!`` or ``&`` kept), the names already written left out."""
    cut = max(incomplete.rfind(","), incomplete.rfind(":"))
    head, last = incomplete[:cut + 1], incomplete[cut + 1:]
    sign = last[:1] if last[:1] in ("!", "&") else ""
    last = last[len(sign):]
    written = {p.lstrip("!&") for p in re.split(r"[,:]", head)}
    return [f"{head}{sign}{n}" for n in dict.fromkeys(names) if n.startswith(last) and n not in written]


def suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
