"""A minimal SGLang general plugin for tests: put tests/data/testplugin on PYTHONPATH and SGLang's
``load_plugins()`` (or kdeploy's reference server) finds it through the bare dist-info next to it.

Each worker prints ``MARKER``, or the text of ``$KDEPLOY_TESTPLUGIN_MARKER`` when that is set."""

import multiprocessing
import os
import sys

MARKER = "[kdeploy-testplugin] loaded"

_registered = False


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: one marker line per worker process (idempotent).

    One ``write`` call per line: ``print()`` writes the text and the newline separately, and with
    PYTHONUNBUFFERED (or a shared journald stream) lines of concurrent workers then run together."""
    global _registered
    if _registered:
        return
    _registered = True
    if multiprocessing.parent_process() is None:  # the launcher: markers come from the TP workers only
        sys.stdout.write(f"[kdeploy-testplugin] registered in the launcher pid={os.getpid()}\n")
    else:
        sys.stdout.write(f"{os.environ.get('KDEPLOY_TESTPLUGIN_MARKER', MARKER)} pid={os.getpid()}\n")
    sys.stdout.flush()
