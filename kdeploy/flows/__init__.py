"""What each command does: on one host, as explicit states (push) or one read (views), and over many
(``fleet``: the library API); with the commands that run no flow of their own (check, exec, logs, hooks,
set/set-env edits). Each host reports into a :class:`kdeploy.core.report.HostResult` that the flow writes
and never reads back to decide what to do next.
"""
