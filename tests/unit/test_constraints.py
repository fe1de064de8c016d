"""constraints.txt pins every dependency of pyproject.toml inside its bounds, and every bound has a major cap."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def test_constraints_pin_every_dependency_within_pyproject_bounds():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    for req in requirements:
        assert any(s.operator == "<" for s in req.specifier), f"{req}: no upper bound"
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(pinned), f"constraints.txt pins {req.name}=={pinned}, outside {req.specifier}"
