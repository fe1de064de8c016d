"""The product's core: what kdeploy knows and decides, with no connection to anything.

The inventory (and its Ansible source), host patterns, rollout policy, the on-host layout, releases and
their manifests, a host's state and the one push decision (``state.decide``), the gate's spec, units,
secrets, the provisional switch's scripts, the probe's checks, remote steps as data (``step``), and the
results every command reports (``report``). Imports nothing of kdeploy above it.
"""
