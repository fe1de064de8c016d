"""Per-host flows: what one command does on one host, as explicit states (push), or as one read (views).

``kdeploy.fleet`` runs them over many hosts; each reports into a :class:`kdeploy.report.HostResult` that it
writes and never reads back to decide what to do next.
"""
