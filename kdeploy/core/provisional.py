"""Provisional activation ("commit confirmed"): every switch is reverted BY THE HOST unless confirmed.

Before ``current`` and the unit are switched, the host arms a transient systemd timer (``systemd-run
--on-active``) and writes ``<service dir>/pending`` (a token, the last confirmed release, the target and
the deadline). Once the gate passed, the controller confirms: it stops the timer and removes
``pending``, in one round trip. If the controller dies, its link drops or it is cancelled before that,
the timer fires at the deadline and the host itself goes back to the last confirmed release and its
unit, restarts the service and records ``reverted`` in its history.

The revert takes the deploy lock first, so it never runs beside a live controller: one that is still
gating (or rolling back) holds the lock, and stops the waiting revert when it confirms. It acts only if
``pending`` still carries its own token. A push that finds ``pending`` treats the host as changed (never
``unchanged``) and re-arms with the same last confirmed release.

A transient timer does not survive a reboot of the host, so arming also installs a persistent boot guard
(``kdeploy-boot-guard-<service>.service``, wanted by the service and ordered before it): when the service
starts with ``pending`` on the disk that was armed before the current boot, the guard runs the same revert
(lock, token, unit, secrets, ``reverted`` history line) before the service starts, so a host that reboots
between the switch and the confirm comes up on its last confirmed release. At a normal boot it costs a file
test (``ConditionPathExists``).
"""

from __future__ import annotations

import shlex
import time
import uuid
from dataclasses import dataclass, replace

from kdeploy import onhost
from kdeploy.core import layout
from kdeploy.core.step import RunResult, Step
from kdeploy.core.systemd import UNIT_DIR

PREVIOUS_SECRETS = layout.SECRETS_PREVIOUS  # the last confirmed secrets while a switch is pending
PENDING = layout.PENDING
SCRIPT = layout.REVERT_SCRIPT
NONE = "-"  # no confirmed release yet (a first deploy)
LOST = "LOST"  # a confirm's answer when ``pending`` is not (or no longer) the one it keeps
MARGIN = 60.0  # seconds beyond restart + gate before the host acts on its own
HOLDER_WAIT = 60  # seconds a fired revert waits for a held deploy lock (at most revert_after) before ending its holder
SWAP_TRIES, SWAP_PAUSE = 24, 5  # a revert whose swap fails (a full disk) tries again for 2 minutes, pending kept
TRANSIENT_DIR = "/run/systemd/transient"  # where systemd keeps the unit files of systemd-run's units

GUARD_SCRIPT = layout.GUARD_SCRIPT
BOOT_MARK = layout.PENDING_BOOT  # the boot `pending` was armed in: the guard acts only in a later boot
# A boot, also a container's (whose kernel boot_id does not change): the kernel's boot_id and when PID 1 started.
_BOOT_ID = "$(cat /proc/sys/kernel/random/boot_id)-$(cut -d' ' -f22 /proc/1/stat)"

# The host's own way back (kdeploy/onhost/revert.sh): run by a transient service at the deadline, by the guard at boot.
_REVERT = onhost.shell("revert.sh", UNIT_DIR=UNIT_DIR, SECRETS_PREVIOUS=layout.SECRETS_PREVIOUS, LOCK=layout.LOCK,
                       LOCK_RECORD=layout.LOCK_RECORD, PENDING=layout.PENDING, RELEASES=layout.RELEASES,
                       META=layout.META, CURRENT=layout.CURRENT, HISTORY=layout.HISTORY,
                       SWAP_TRIES=str(SWAP_TRIES), SWAP_PAUSE=str(SWAP_PAUSE))


@dataclass(frozen=True)
class Pending:
    """A switch the host has not been told to keep."""

    token: str
    previous: str | None  # the last confirmed release; None before the first confirmed deploy
    target: str
    deadline: int  # epoch seconds at which the host reverts

    def line(self) -> str:
        return f"{self.token} {self.previous or NONE} {self.target} {self.deadline}\n"

    def joined(self, head: Pending) -> Pending:
        """This node's switch under its server's head's token and deadline: the nodes of one server are kept,
        or go back by themselves, as one."""
        return replace(self, token=head.token, deadline=head.deadline)

    def describe(self) -> str:
        left = self.deadline - time.time()
        when = f"in {left:.0f}s" if left > 0 else f"{-left:.0f}s ago (reverting or the host rebooted)"
        return f"switch to {self.target} not confirmed; the host reverts to {self.previous or 'nothing'} {when}"


def new_pending(previous: str | None, target: str, seconds: float, token: str | None = None) -> Pending:
    """``token``: keep an armed revert's identity while moving its deadline (a rollback in progress)."""
    return Pending(token or uuid.uuid4().hex[:16], previous, target, int(time.time() + seconds))


def parse_pending(text: str) -> Pending | None:
    words = text.split()
    if len(words) != 4 or not words[3].isdigit():
        return None
    token, previous, target, deadline = words
    return Pending(token, None if previous == NONE else previous, target, int(deadline))


def timer_unit(service_name: str) -> str:
    """One revert unit per service (systemd-run names the .timer and the .service after it)."""
    return "kdeploy-revert-" + service_name.replace("@", "-at-")


def _stop(timer: str) -> str:
    """Stop and forget the revert's timer and service; skipped (two systemctl calls, each a round trip to
    PID 1) when systemd holds neither: transient units live in TRANSIENT_DIR while loaded, and ``--collect``
    unloads them once stopped. Where that directory does not exist, they are always stopped."""
    t = shlex.quote(timer)
    d = shlex.quote(TRANSIENT_DIR)
    return (f"[ -d {d} ] && [ ! -e {d}/{t}.timer ] && [ ! -e {d}/{t}.service ] || {{ "
            f"systemctl stop {t}.timer {t}.service 2>/dev/null || true; "
            f"systemctl reset-failed {t}.timer {t}.service 2>/dev/null || true; }}")


def guard_unit(unit_file: str) -> str:
    """The boot guard's unit (one per service, like its revert timer)."""
    return "kdeploy-boot-guard-" + unit_file.removesuffix(".service").replace("@", "-at-") + ".service"


def _unit_path(path: str) -> str:
    """A path as a unit file's value: systemd expands % specifiers, and $ and quotes in command lines."""
    return path.replace("%", "%%")


def guard_unit_text(service_dir: str, unit_file: str) -> str:
    """The same for every deploy of a service, so it is written once (and systemd never sees it change)."""
    script = _unit_path(f"{service_dir}/{GUARD_SCRIPT}").replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$")
    return "\n".join([
        "# Managed by kdeploy: puts the last confirmed release back if the host rebooted before a switch was "
        "confirmed,",
        "# and arms again the router re-admit of a drained host that a reboot took away.",
        "[Unit]",
        f"Description=kdeploy: boot guard of {unit_file}",
        f"Before={unit_file}",
        f"ConditionPathExists=|{_unit_path(f'{service_dir}/{PENDING}')}",
        f"ConditionPathExists=|{_unit_path(f'{service_dir}/{layout.READMIT_ARM}')}",
        "",
        "[Service]",
        "Type=oneshot",
        f'ExecStart=/bin/sh "{script}"',
        "",
        "[Install]",
        f"WantedBy={unit_file}",
    ]) + "\n"


def _guard_script(service_dir: str, unit_file: str, policy: str, environment_file: str | None) -> str:
    """What the guard runs: the router re-admit of a drained host armed again (a reboot ends transient timers),
    then the revert, with the token of the `pending` it finds, unless that was armed in this boot (a live switch
    whose revert timer still runs)."""
    d = shlex.quote(service_dir)
    return "\n".join([
        # a drained host's re-admit (a transient timer: gone with a reboot) until it ran; armed already: no-op
        f"[ ! -f {d}/{layout.READMIT_ARM} ] || /bin/sh {d}/{layout.READMIT_ARM} >/dev/null 2>&1 || true",
        f"read -r tok rest < {d}/{PENDING} 2>/dev/null || exit 0",
        f'[ "$(cat {d}/{BOOT_MARK} 2>/dev/null)" != "{_BOOT_ID}" ] || exit 0',
        f"exec /bin/sh {d}/{SCRIPT} {d} {shlex.quote(unit_file)} \"$tok\" {shlex.quote(policy)} "
        f"{shlex.quote(environment_file or NONE)} {HOLDER_WAIT} boot",
    ])


def _install_guard(service_dir: str, unit_file: str, policy: str, environment_file: str | None) -> list[str]:
    """Lines that write the guard's script and install and enable its unit (a link in the service's .wants,
    as `systemctl enable` makes, without its reload: systemd reads it at the next reload or boot)."""
    d = shlex.quote(service_dir)
    name = guard_unit(unit_file)
    path = shlex.quote(f"{UNIT_DIR}/{name}")
    text = guard_unit_text(service_dir, unit_file)
    wants = shlex.quote(f"{UNIT_DIR}/{unit_file}.wants")
    return [
        f"printf '%s\\n' {shlex.quote(_guard_script(service_dir, unit_file, policy, environment_file))} "
        f"> {d}/{GUARD_SCRIPT}",
        f'[ "$(cat {path} 2>/dev/null)" = {shlex.quote(text.rstrip())} ] || '
        f"{{ printf %s {shlex.quote(text)} > {path}.tmp && chmod 0644 {path}.tmp && mv -T {path}.tmp {path}; }}",
        f"[ -L {wants}/{name} ] || {{ mkdir -p {wants} && ln -sfn ../{name} {wants}/{name}; }}",
        f'echo "{_BOOT_ID}" > {d}/{BOOT_MARK}',
    ]


def stop_revert_service(timer: str) -> str:
    """Stop a revert that fired and waits for the lock: only safe while holding the lock (it is then
    still waiting, not half way through)."""
    return f"systemctl stop {shlex.quote(timer)}.service 2>/dev/null || true"


def arm_script(service_dir: str, unit_file: str, timer: str, pending: Pending, policy: str,
               environment_file: str | None = None) -> str:
    """Lines for the activation script: replace any armed revert, record ``pending``, arm the timer.
    ``environment_file``: where kdeploy writes the service's secrets (the revert restores them too).
    Once fired, the revert waits for a held lock at most as long as the deadline was (``HOLDER_WAIT`` at
    most): a holder still there by then has a dead link, and a short ``revert_after`` means a quick revert."""
    d = shlex.quote(service_dir)
    seconds = max(1, int(pending.deadline - time.time()))
    argv = ["systemd-run", "--quiet", "--collect", f"--unit={timer}", f"--on-active={seconds}",
            "--timer-property=AccuracySec=1s", f"--description=kdeploy: revert {unit_file} unless confirmed",
            "/bin/sh", f"{service_dir}/{SCRIPT}", service_dir, unit_file, pending.token, policy,
            environment_file or NONE, str(min(HOLDER_WAIT, seconds))]
    return "\n".join([
        _stop(timer),
        f"printf '%s\\n' {shlex.quote(_REVERT)} > {d}/{SCRIPT}",
        *_install_guard(service_dir, unit_file, policy, environment_file),
        # two simple commands: `set -e` ignores a failure left of `&&`, and a full disk failed the printf that way
        # (pending never written, the switch went ahead with no way back)
        f"printf %s {shlex.quote(pending.line())} > {d}/.pending.tmp",
        f"mv -f {d}/.pending.tmp {d}/{PENDING}",
        " ".join(shlex.quote(a) for a in argv),
    ])


def confirm_command(service_dir: str, timer: str, token: str, then: str = "") -> str:
    """Disarm and keep the switch (and the secrets it wrote); prints CONFIRMED only if ``pending`` was still
    ours (else LOST). ``then`` (the history line) runs only once kept, in the same command."""
    d = shlex.quote(service_dir)
    return "\n".join([
        _stop(timer),
        f"read -r tok rest < {d}/{PENDING} 2>/dev/null || tok=",
        f"if [ \"$tok\" = {shlex.quote(token)} ]; then rm -f {d}/{PENDING} {d}/{PREVIOUS_SECRETS}; "
        + (f"if {{ {then}; }}; then echo RECORDED; fi; " if then else "") + "echo CONFIRMED; else echo LOST; fi",
    ])


def read_command(service_dir: str) -> str:
    path = shlex.quote(f"{service_dir}/{PENDING}")
    return f"[ ! -f {path} ] || cat {path} 2>/dev/null"  # mostly absent: no process for it then


def deadline_seconds(stop_timeout: float, gate_timeout: float) -> float:
    """Restart (the old run's stop + the follow's margin) + the whole gate + a margin."""
    return stop_timeout + 60 + gate_timeout + MARGIN


def confirm_step(service_dir: str, timer: str, token: str, then: str = "") -> Step[tuple[str | None, bool]]:
    """``confirm_command`` as a step: (None once kept, else why not: ``LOST`` when no longer ours; whether
    ``then`` ran and succeeded)."""
    def parse(out: RunResult) -> tuple[str | None, bool]:
        if "CONFIRMED" in out.stdout:
            return None, "RECORDED" in out.stdout.split()
        return (out.last_error() if not out.ok else LOST), False

    return Step(confirm_command(service_dir, timer, token, then), parse, 60)
