"""Log markers, one line per TP worker; kdeploy's gate counts them (kept equal to kdeploy/markers.py by a test)."""

LOADED = "[kdtree] plugin loaded"
DEFRAG = "[kdtree] defrag Tier-0"
VERIFY_OVERRIDE = "[kdtree] installed verify override"
