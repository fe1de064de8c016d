"""The payload's gate manifest (kernels/kdtree/kdeploy-gate.json) and the strings the payload logs agree.

kdeploy reads the markers, the config line and the flag values from that manifest, not from its own code;
the payload keeps its strings in kdtree_ext/markers.py and parses its flags in kdtree_ext.read_config.
These tests keep the three in step, and check what the gate expects for each setting.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kdeploy.core.errors import InvalidInput
from kdeploy.core.gatespec import load_payload_gate

PAYLOAD = Path(__file__).resolve().parents[2] / "kernels" / "kdtree"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _payload_markers() -> dict[str, str]:
    module = _load("kdtree_payload_markers", PAYLOAD / "kdtree_ext" / "markers.py")
    return {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


def test_manifest_names_the_strings_the_payload_logs():
    gate = load_payload_gate(PAYLOAD)
    payload = _payload_markers()
    assert gate is not None and gate.config_line == payload["CONFIG"]
    assert {m.text for m in gate.markers} == {payload["DEFRAG"], payload["VERIFY_OVERRIDE"]}
    assert {s.env for s in gate.settings} == {"KDTREE_VERIFY", "KDTREE_DEFRAG_SORT", "KDTREE_NSPLIT"}


@pytest.mark.parametrize(("env", "config", "markers"), [
    ({}, {"verify": "on", "defrag": "0", "nsplit": "64"}, ["[kdtree] installed verify override"]),
    ({"KDTREE_DEFRAG_SORT": "1"}, {"verify": "on", "defrag": "1", "nsplit": "64"},
     ["[kdtree] installed verify override", "[kdtree] defrag Tier-0"]),
    ({"KDTREE_DEFRAG_SORT": "On", "KDTREE_NSPLIT": " 32 "}, {"verify": "on", "defrag": "1", "nsplit": "32"},
     ["[kdtree] installed verify override", "[kdtree] defrag Tier-0"]),
    ({"KDTREE_VERIFY": "off", "KDTREE_DEFRAG_SORT": "1"}, {"verify": "off", "defrag": "1", "nsplit": "64"}, []),
])
def test_expected_config_and_markers_follow_the_settings(env, config, markers):
    gate = load_payload_gate(PAYLOAD)
    assert gate is not None
    assert gate.config(env) == config
    assert gate.markers_for(config) == markers


def test_the_payload_reports_the_same_canonical_values():
    """kdtree_ext.config_line prints what the manifest's canonical values say, for every spelling."""
    sys.path.insert(0, str(PAYLOAD))
    try:
        import kdtree_ext
        gate = load_payload_gate(PAYLOAD)
        assert gate is not None
        for env in ({}, {"KDTREE_DEFRAG_SORT": "yes", "KDTREE_VERIFY": "0", "KDTREE_NSPLIT": "8"}):
            line = kdtree_ext.config_line(kdtree_ext.read_config(env))
            said = dict(w.split("=", 1) for w in line.removeprefix(gate.config_line).split())
            assert {k: v for k, v in said.items() if k != "release"} == gate.config(env)
    finally:
        sys.path.remove(str(PAYLOAD))
        for name in [m for m in sys.modules if m == "kdtree_ext" or m.startswith("kdtree_ext.")]:
            del sys.modules[name]


def test_bad_flag_values_are_invalid_input_before_any_host():
    gate = load_payload_gate(PAYLOAD)
    assert gate is not None
    with pytest.raises(InvalidInput, match="KDTREE_DEFRAG_SORT='maybe': expected one of"):
        gate.config({"KDTREE_DEFRAG_SORT": "maybe"})
    with pytest.raises(InvalidInput, match="KDTREE_NSPLIT='abc': expected an integer"):
        gate.config({"KDTREE_NSPLIT": "abc"})


def test_no_marker_contains_another():
    """The gate matches substrings: a skipped/disabled line must be able to avoid every marker."""
    values = list(_payload_markers().values())
    for a in values:
        assert not [b for b in values if a != b and a in b]
