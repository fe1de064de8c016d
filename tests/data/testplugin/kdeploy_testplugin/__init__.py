"""A minimal SGLang general plugin for tests: put tests/data/testplugin on PYTHONPATH and SGLang's
``load_plugins()`` (or kdeploy's reference server) finds it through the bare dist-info next to it."""

import os
import sys

MARKER = "[kdeploy-testplugin] loaded"

_registered = False


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: one marker line per process (idempotent).

    One ``write`` call per line: ``print()`` writes the text and the newline separately, and with
    PYTHONUNBUFFERED (or a shared journald stream) lines of concurrent workers then run together."""
    global _registered
    if _registered:
        return
    _registered = True
    sys.stdout.write(f"{MARKER} pid={os.getpid()}\n")
    sys.stdout.flush()
