"""The lab: what kdeploy is tested and demonstrated with, not what it deploys with.

Local sandbox hosts (systemd-nspawn with real systemd, sshd and journald), the reference server that
stands in for SGLang on them, the cached CPU venv of the real SGLang package, and the demo service.
A distribution of its own (kdeploy-lab, lab/pyproject.toml): it adds ``kdeploy sandbox`` through the
``kdeploy.plugins`` entry point, and the tests import it; no kdeploy module does.
"""
