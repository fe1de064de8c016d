"""Reading the inventory's source files: YAML documents that keep their comments and line numbers, so an
error names the line, and an edit writes the file back as it was but for the change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML, CommentedMap
from ruamel.yaml.error import YAMLError

from kdeploy.core.errors import InvalidInput

WEEK = 7 * 24 * 3600  # the longest wait kdeploy or a unit setting takes: a bound that still catches typos and .inf


def yaml_loader() -> YAML:
    """Round trip: the documents keep their comments and line numbers (for edits and error locations)."""
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    return yaml


def read_text(path: Path, what: str = "inventory", option: str = "--inventory PATH", *, exact: bool = False) -> str:
    """``exact``: with the file's own line endings (``\\r\\n`` stays), for an edit that writes it back."""
    try:
        with open(path, newline="" if exact else None) as fh:
            return fh.read()
    except FileNotFoundError:
        raise InvalidInput(f"{path}: {what} not found (pass {option})") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read {what}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise InvalidInput(f"{path}:{line}: {what} is not UTF-8 text ({exc.reason})") from None


def parse_yaml(text: str, path: Path,
               shape: str = "the inventory must be a mapping with defaults/groups/hosts") -> CommentedMap:
    """``text`` (the content of ``path``) as a round-trip document; ``shape``: the error when it is no mapping."""
    try:
        data = yaml_loader().load(text)
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
