"""Reaching hosts: the one SSH executor (``remote.Remote``: ``run``, ``ask`` a Step, ``start``), ssh_config
resolution, known_hosts and host certificates, and tunnels to a host's own ports. Builds on ``core``."""
