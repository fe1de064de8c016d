"""Reading the inventory's source files: YAML documents that keep their comments and line numbers, so an
error names the line, and an edit writes the file back as it was but for the change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML, CommentedMap
from ruamel.yaml.error import YAMLError
from ruamel.yaml.scanner import RoundTripScanner, ScannerError

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput

MAX_ALIASES = 1000  # YAML aliases (*name) in one document: an inventory uses a handful


class _Refused(ScannerError):
    """A document past a bound the scanner keeps: refused by :func:`load_yaml` (its ``problem`` says which), never
    taken for a format hint."""


class _Scanner(RoundTripScanner):
    """ruamel's scanner, refusing flow collections (``[``, ``{``) nested deeper than :data:`files.MAX_DEPTH`: it
    does work in proportion to the nesting for every token, so 20000 ``[`` would take minutes to parse; and more
    than :data:`MAX_ALIASES` aliases: a chain of merge keys (``mN: {<<: *mN-1, ...}``) is built in time and memory
    that grow as the square of its length, before any count of the values could stop it."""

    aliases = 0

    def fetch_flow_collection_start(self, TokenClass: Any, to_push: str) -> None:
        if self.flow_level >= files.MAX_DEPTH:
            raise _Refused(None, None, f"nested deeper than {files.MAX_DEPTH} levels", self.reader.get_mark())
        super().fetch_flow_collection_start(TokenClass, to_push)

    def fetch_alias(self) -> None:
        self.aliases += 1
        if self.aliases > MAX_ALIASES:
            raise _Refused(None, None, f"more than {MAX_ALIASES} YAML aliases", self.reader.get_mark())
        super().fetch_alias()


def yaml_loader() -> YAML:
    """Round trip: the documents keep their comments and line numbers (for edits and error locations)."""
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.Scanner = _Scanner
    return yaml


def read_text(path: Path, what: str = "inventory", option: str = "--inventory PATH", *, exact: bool = False) -> str:
    """``exact``: with the file's own line endings (``\\r\\n`` stays), for an edit that writes it back."""
    return files.read_text(path, what, missing=f"{what} not found (pass {option})", exact=exact)


def load_yaml(text: str, path: Path) -> Any:
    """``text`` (the content of ``path``) as a round-trip document, no deeper than :data:`files.MAX_DEPTH`; a
    YAML error is left to the caller (:func:`parse_yaml` reports it, format detection takes it as a hint)."""
    try:
        return files.parsed(lambda: yaml_loader().load(text), str(path))
    except _Refused as exc:  # not a YAML error for format detection to read as a hint: refused here
        raise InvalidInput(f"{path}:{exc.problem_mark.line + 1}: {exc.problem}") from None


def parse_yaml(text: str, path: Path,
               shape: str = "the inventory must be a mapping with defaults/groups/hosts") -> CommentedMap:
    """``text`` (the content of ``path``) as a round-trip document; ``shape``: the error when it is no mapping."""
    try:
        data = load_yaml(text, path)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InvalidInput(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        data = CommentedMap()
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: {shape}")
    return data


def line_of(raw: Any, where: tuple) -> int | None:
    """1-based line of the deepest key of ``where`` that exists in the document."""
    line = None
    node = raw
    for key in where:
        if isinstance(node, CommentedMap) and key in node:
            line = node.lc.key(key)[0] + 1
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            if hasattr(node, "lc"):
                line = node.lc.item(key)[0] + 1
            node = node[key]
        else:
            break
    return line
