"""kdtree: SGLang extension loaded in every TP worker through the ``sglang.srt.plugins`` entry point.

This first cut only announces itself; the Tier-0 defrag and the verify-attention override land with
their own issue. Until then it says so instead of claiming markers for things that are not in place.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from kdtree_ext.markers import LOADED

_installed = False


def _log(text: str) -> None:
    """One write per line: concurrent workers share the journal stream."""
    sys.stdout.write(f"{text} pid={os.getpid()}\n")
    sys.stdout.flush()


def register() -> None:
    """Entry point called by SGLang's ``load_plugins()``; idempotent per process."""
    global _installed
    if _installed:
        return
    _installed = True
    if os.environ.get("KDTREE_VERIFY", "on") == "off":
        _log("[kdtree] disabled: KDTREE_VERIFY=off")
        return
    if multiprocessing.parent_process() is None:
        _log("[kdtree] registered in the launcher process (markers come from the TP workers)")
        return
    _log(LOADED)
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        reason = f"sglang not importable ({exc})"
    else:
        reason = "not implemented in this payload version"
    _log(f"[kdtree] Tier-0 defrag skipped: {reason}")
    _log(f"[kdtree] verify override skipped: {reason}")
