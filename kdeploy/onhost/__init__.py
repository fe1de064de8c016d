"""Programs that run ON the hosts, kept as real files (linted, unit-tested) and sent as the text of a command.

The Python ones run under the host's own interpreter (the service's python for the probe, any ``python3``
from 3.5 on for the staging check): stdlib only, no kdeploy import. The shell ones are templates whose
``@NAME@`` marks are filled from :mod:`kdeploy.core.layout` and friends when they are sent.
"""

from __future__ import annotations

import functools
import re
from importlib import resources


@functools.cache
def source(name: str) -> str:
    """The text of program ``name`` (a file of this package)."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def shell(name: str, **values: str) -> str:
    """Shell program ``name`` with its ``@NAME@`` marks filled (every mark must have a value), less the
    comment lines that head the file: they are for its readers here, not for the host."""
    lines = source(name).splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return re.sub(r"@([A-Z_]+)@", lambda m: values[m.group(1)], "\n".join(lines))
