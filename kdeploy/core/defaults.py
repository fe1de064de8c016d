"""The defaults, bounds and choices of kdeploy's options, each defined once, in a module that imports nothing heavy.

The command line declares its options with them at every start (``--help``, each TAB of completion), before any
command runs; their home modules (the inventory's models, the fleet, logs) import pydantic, paramiko and jinja2.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

DEFAULT_INVENTORY = Path("inventory.yaml")
DEFAULT_PARALLEL = 16  # hosts worked on at once
WEEK = 7 * 24 * 3600  # the longest wait kdeploy or a unit setting takes: a bound that still catches typos and .inf


class Run(StrEnum):
    """Which run of the service ``logs`` reads: every line, or one invocation (by ``_SYSTEMD_INVOCATION_ID``)."""

    ALL = "all"
    CURRENT = "current"
    PREVIOUS = "previous"
