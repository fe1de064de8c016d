"""The command-line flags a flow may need, in one value (the library API's ``Options``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdeploy.core.policy import Policy


@dataclass(frozen=True)
class Reach:
    """How the controller reaches a host: what every connection needs of the command's flags."""

    ssh_config: str | None = None  # --ssh-config: overrides KDEPLOY_SSH_CONFIG and the inventory's
    accept_new_host_keys: bool = False


@dataclass
class Options:
    accept_new_host_keys: bool = False
    lock_wait: float = 0
    force_restart: bool = False
    verify: bool = True
    workers: int | None = None
    timeout: float | None = None
    to_release: str | None = None
    force: bool = False
    history_limit: int = 20
    policy: Policy = field(default_factory=Policy)  # --canary, --batch, --max-fail (push, set-env, set, rollback)
    skip_preflight: bool = False
    ssh_config: str | None = None  # --ssh-config: overrides KDEPLOY_SSH_CONFIG and the inventory's
    router_add_missing: bool = False  # a host the router does not know is registered after its deploy
    command: str | None = None  # what the lock and history record (the CLI's own command line; see recorded_command)
    parity: bool = False  # verify --parity: compare the running release with its parity record
    accept_parity_change: bool = False  # push: the served model changes, its answers become the new reference

    @property
    def reach(self) -> Reach:
        return Reach(self.ssh_config, self.accept_new_host_keys)


def recorded_command(opts: Options, verb: str) -> str:
    """The command the lock and history record: the CLI's (``Options.command``), else the library call.
    Never ``sys.argv``: a wrapper script calling the library may hold secrets in its own arguments."""
    return opts.command or f"kdeploy {verb} (library)"
