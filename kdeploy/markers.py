"""Log markers the kdtree extension prints once per TP worker; the gate's defaults count them.

Kept in one place so the extension and the gate cannot drift apart.
"""

PLUGIN_LOADED = "[kdtree] plugin loaded"
DEFRAG = "[kdtree] defrag Tier-0"
VERIFY_OVERRIDE = "[kdtree] installed verify override"
DEFAULT_MARKERS: tuple[str, ...] = (DEFRAG, VERIFY_OVERRIDE)
