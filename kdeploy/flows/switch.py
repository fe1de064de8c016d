"""The provisional switch and its ends: Switched -> Confirmed, or -> RolledBack (the controller went back).

The host arms its own revert before ``current`` moves, so a controller that dies leaves a host that goes
back by itself (docs/push.md, "provisional"); ``Reverted`` is the end where it did. Each transition returns
its typed outcome; the ``HostResult`` only reports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kdeploy.core import provisional, release, systemd
from kdeploy.core import secrets as secret
from kdeploy.core.errors import KdeployError, RemoteTimeout
from kdeploy.core.gatespec import GateSpec
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.report import HostResult, PhaseFailed, Result
from kdeploy.host import gate, parity
from kdeploy.ssh.remote import Remote


@dataclass(frozen=True)
class Confirmed:
    """The switch to ``release`` passed its gate and is kept."""

    release: str
    serving: bool = True


@dataclass(frozen=True)
class RolledBack:
    """The controller put the last confirmed release back; ``serving``: it runs and passed its gate again."""

    release: str | None
    serving: bool


@dataclass(frozen=True)
class Reverted:
    """The host went back to ``release`` by itself (its revert timer, or at boot) before the controller did."""

    release: str | None
    serving: bool = False


Outcome = Confirmed | RolledBack | Reverted


def revert_after(host: HostConfig, spec: GateSpec) -> float:
    """Seconds the host waits for the confirmation before it reverts by itself."""
    return host.service.gate.revert_after or provisional.deadline_seconds(host.service.unit.timeout_stop_sec,
                                                                          spec.timeout)


def switch(remote: Remote, host: HostConfig, result: HostResult, target: str, install_unit: bool,
           pending: provisional.Pending, *, secrets: secret.Secrets | None = None, restore: bool = False) -> str:
    """Arm the host's revert, then write ``secrets`` (over stdin) or, with ``restore``, put the last confirmed
    ones back, then switch ``current`` (and the unit) and restart: one round trip. Returns the run it
    replaces."""
    sv = host.service
    sdir = service_dir(sv)
    unit = unit_filename(sv)
    arm = provisional.arm_script(sdir, unit, provisional.timer_unit(sv.name), pending, sv.on_first_deploy_failure,
                                 sv.environment_file if sv.secrets.configured else None)
    env_step, stdin = "", None
    if secrets is not None and sv.environment_file:
        salt = secret.new_salt()
        env_step, stdin = secret.write_script(sdir, sv.environment_file, salt), secret.write_stdin(secrets, salt)
    elif restore and sv.environment_file and sv.secrets.configured:
        env_step = secret.restore_script(sdir, sv.environment_file)
    with result.phase("activate") as phase:
        old = remote.ask(release.activate_step(sdir, target, unit, install_unit, arm, env_step), stdin=stdin)
        phase.detail = (f"current -> {target}" + ("; unit installed, daemon-reload" if install_unit else "")
                        + "; old run stopping, restart queued"
                        + (f"; secrets written ({', '.join(secrets.masked())} = {secret.MASK})" if stdin else "")
                        + f"; reverts to {pending.previous or 'nothing'} by itself unless confirmed within "
                          f"{max(0, pending.deadline - time.time()):.0f}s")
    return old


def restart_and_follow(remote: Remote, host: HostConfig, result: HostResult, old: str,
                       timeout: float) -> systemd.UnitState:
    """Wait on the host for the run that replaces ``old`` (the activation stopped it and queued the restart:
    ``systemd.follow_command``); its state feeds the gate."""
    unit = unit_filename(host.service)
    with result.phase("restart") as phase:
        restarted = remote.ask(systemd.follow_step(unit, old, timeout, min(0.1, host.service.gate.poll_interval)))
        state = restarted.state
        if not restarted.followed:
            raise PhaseFailed(f"no new run of {unit} after {timeout:.0f}s (still {state.summary})")
        phase.detail = (f"new invocation {state.invocation[:12]} {state.summary}"
                        + (" after the old run stopped" if restarted.stopping else ""))
        return state


def confirm(remote: Remote, host: HostConfig, result: HostResult, pending: provisional.Pending) -> None:
    """Keep the switch: disarm the host's revert (it acts only on a ``pending`` that is still ours)."""
    with result.phase("confirm") as phase:
        lost = remote.ask(provisional.confirm_step(service_dir(host.service), provisional.timer_unit(host.service.name),
                                                   pending.token))
        if lost:
            raise PhaseFailed(f"the switch to {pending.target} was no longer pending: the host reverted by itself "
                              f"or another deploy took over ({lost})")
        phase.detail = f"{pending.target} kept; revert disarmed"


def disarm(remote: Remote, host: HostConfig, result: HostResult, pending: provisional.Pending) -> None:
    """The controller decided the host's end state itself: no revert may act on it later."""
    try:
        remote.ask(provisional.confirm_step(service_dir(host.service), provisional.timer_unit(host.service.name),
                                            pending.token))
    except KdeployError as exc:
        result.log.append(f"could not disarm the host's revert timer: {exc}")


def switch_and_gate(remote: Remote, host: HostConfig, result: HostResult, *, verify: bool, target: str,
                    install_unit: bool, pending: provisional.Pending, spec: GateSpec, previous_spec: GateSpec,
                    secrets: secret.Secrets | None = None, success: Result = Result.DEPLOYED,
                    baseline: parity.Baseline | None = None) -> Outcome:
    """Switch to ``target`` (and ``secrets``) provisionally, restart, gate (unless not ``verify``), confirm and
    end ``success``; on a failed gate go back to the last confirmed release (``pending.previous``) and
    secrets by itself. ``baseline``: what the gate's parity phase compares with (taken before the switch)."""
    result.attempted = target
    try:
        old = switch(remote, host, result, target, install_unit, pending, secrets=secrets)
        started = restart_and_follow(remote, host, result, old, host.service.unit.timeout_stop_sec + 60)
        record = gate.run_gate(remote, spec, result, release=target, started=started,
                               baseline=baseline) if verify else None
    except (PhaseFailed, RemoteTimeout) as exc:
        return go_back(remote, host, result, pending, getattr(exc, "detail", str(exc)), previous_spec)
    confirm(remote, host, result, pending)
    parity.keep(remote, service_dir(host.service), result, target, record)
    result.finish(success)
    return Confirmed(target)


def go_back(remote: Remote, host: HostConfig, result: HostResult, pending: provisional.Pending, why: str,
            spec: GateSpec) -> RolledBack:
    """Back to the last confirmed release, gated as it was deployed (``spec``), then disarm the revert.

    The revert is re-armed for the rollback's own restart and gate, so a controller that dies now still
    leaves the host going back by itself. Its phases are reported as ``rollback <phase>``.
    """
    previous = pending.previous
    with result.phase("rollback") as phase:
        if previous is None:
            state = _stop_first_deploy(remote, host)
            disarm(remote, host, result, pending)
            phase.ok = False
            phase.detail = f"first deploy failed ({why}); nothing to roll back to: service {state}"
            result.finish(Result.ROLLBACK_FAILED, phase.detail)
            return RolledBack(None, serving=False)
        again = provisional.new_pending(previous, previous, revert_after(host, spec), pending.token)
        try:
            with result.prefixed("rollback "):
                old = switch(remote, host, result, previous, True, again, restore=True)
                started = restart_and_follow(remote, host, result, old, host.service.unit.timeout_stop_sec + 60)
                gate.run_gate(remote, spec, result, release=previous, started=started,
                              baseline=parity.own_record(remote, service_dir(host.service), spec, previous))
                confirm(remote, host, result, again)
        except (PhaseFailed, KdeployError) as exc:
            disarm(remote, host, result, again)
            phase.ok = False
            phase.detail = (f"gate failed ({why}); rollback to {previous} FAILED: {exc}; "
                            f"host needs a human: current -> {previous}, unit of {previous} installed")
            result.release = previous
            result.finish(Result.ROLLBACK_FAILED, phase.detail)
            return RolledBack(previous, serving=False)
        phase.detail = f"gate failed ({why}); back on {previous}, its gate passed"
        result.release = previous
        result.finish(Result.ROLLED_BACK, why)
        return RolledBack(previous, serving=True)


def _stop_first_deploy(remote: Remote, host: HostConfig) -> str:
    """A first deploy failed: stop the service (``on_first_deploy_failure: stop``) or leave it; in words."""
    sv = host.service
    if sv.on_first_deploy_failure != "stop":
        return "left running as it is"
    restore = (secret.restore_script(service_dir(sv), sv.environment_file)
               if sv.secrets.configured and sv.environment_file else "true")
    remote.ask(systemd.disable_and_stop_step(unit_filename(sv), then=restore))
    return "stopped and disabled"
