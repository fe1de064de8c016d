"""Log markers, one line per TP worker; kdeploy's gate counts them by substring.

The payload is deployed without kdeploy on the host, so it cannot import kdeploy/markers.py: the two files
hold the same strings and tests/unit/test_markers.py keeps them equal.
"""

PLUGIN_LOADED = "[kdtree] plugin loaded"
DEFRAG = "[kdtree] defrag Tier-0"
VERIFY_OVERRIDE = "[kdtree] installed verify override"
CONFIG = "[kdtree] config"  # + the effective settings and the release this worker loaded
