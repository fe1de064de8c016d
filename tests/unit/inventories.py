"""An inventory written from text into a test's directory (with the project's unit template beside it), loaded,
or refused with one line: what the topology and role tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdeploy.core import inventory
from kdeploy.core.errors import InvalidInput

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "sglang.service.j2"


def load(tmp_path: Path, text: str) -> inventory.Inventory:
    (tmp_path / "templates").mkdir(exist_ok=True)
    (tmp_path / "templates" / TEMPLATE.name).write_text(TEMPLATE.read_text())
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return inventory.load(path)


def refused(tmp_path: Path, text: str) -> str:
    """The one-line error loading ``text`` gives."""
    with pytest.raises(InvalidInput) as err:
        load(tmp_path, text)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    return message
