"""One line of human output, whatever a string holds.

Messages and findings carry strings kdeploy does not choose: file names, paths typed on the command line,
variables, what a host answered. A newline in one would print a second line that a reader, or a CI
annotator matching ``file:line:``, takes for a line of kdeploy's own; an ANSI escape could move the cursor
over one. So every human line goes through :func:`one_line`, which writes such characters as Python's
``repr`` does inside quotes (``\\n``, ``\\x1b``, ``\\u2028``). The JSON report keeps the raw strings:
``json.dumps`` escapes them already.
"""

from __future__ import annotations

import re

# C0, DEL and C1; the Unicode line and paragraph separators; the bidirectional marks, embeddings, overrides
# and isolates (they can make a line read in another order than it is written); the BOM and the noncharacters
# U+FFFE/U+FFFF (XML cannot hold those).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff\ufffe\uffff]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _SHORT.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def one_line(text: str) -> str:
    """``text`` with every character that could break or disguise a line of output escaped (``\\n``,
    ``\\x1b``, ``\\u202e``); a backslash itself is left as it is (regular expressions stay readable)."""
    return _UNSAFE.sub(_escape, text)


def first_unsafe(text: str) -> str | None:
    """The first character of ``text`` that :func:`one_line` would escape, None when there is none: where a string
    is written somewhere no escaping happens (the unit file), such a string is refused instead."""
    found = _UNSAFE.search(text)
    return found.group() if found else None
