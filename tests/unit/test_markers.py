"""The gate's default markers (kdeploy/markers.py) and the strings the payload logs must be the same.

The payload (kernels/kdtree) is deployed without kdeploy on the host, so it keeps its own copy of the
strings; this test keeps the two equal.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kdeploy import markers

PAYLOAD_MARKERS = Path(__file__).resolve().parents[2] / "kernels" / "kdtree" / "kdtree_ext" / "markers.py"


def _payload_markers() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("kdtree_payload_markers", PAYLOAD_MARKERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


def test_payload_and_gate_markers_are_the_same_strings():
    payload = _payload_markers()
    assert payload == {"PLUGIN_LOADED": markers.PLUGIN_LOADED, "DEFRAG": markers.DEFRAG,
                       "VERIFY_OVERRIDE": markers.VERIFY_OVERRIDE}
    assert (payload["DEFRAG"], payload["VERIFY_OVERRIDE"]) == markers.DEFAULT_MARKERS


def test_no_marker_contains_another():
    """The gate matches substrings: a skipped/disabled line must be able to avoid every marker."""
    values = list(_payload_markers().values())
    for a in values:
        assert not [b for b in values if a != b and a in b]
