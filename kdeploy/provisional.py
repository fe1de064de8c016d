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

A transient timer does not survive a reboot of the host: the service then starts on the unconfirmed
release at boot, and the next kdeploy run sees ``pending`` and gates (or rolls back) it.
"""

from __future__ import annotations

import shlex
import time
import uuid
from dataclasses import dataclass

from kdeploy.systemd import UNIT_DIR

PREVIOUS_SECRETS = ".secrets.prev"  # kdeploy.secrets.PREVIOUS: the last confirmed secrets while a switch is pending

PENDING = "pending"
SCRIPT = ".revert.sh"  # beside it: systemd would expand $ and % in a command line given to systemd-run
NONE = "-"  # no confirmed release yet (a first deploy)
MARGIN = 60.0  # seconds beyond restart + gate before the host acts on its own
HOLDER_WAIT = 60  # seconds a fired revert waits for a held deploy lock (at most revert_after) before ending its holder
TRANSIENT_DIR = "/run/systemd/transient"  # where systemd keeps the unit files of systemd-run's units

# Runs on the host as a transient service: $1 service dir, $2 unit file, $3 token, $4 first-deploy policy,
# $5 the environment file kdeploy writes secrets into ("-": none; its last confirmed content is put back),
# $6 how long to wait for a held deploy lock before ending its holder.
_REVERT = r"""d=$1 unit=$2 token=$3 policy=$4 envfile=$5 wait=$6
exec 9>>"$d/.lock" || exit 1
if ! flock -w "$wait" 9; then  # a live controller confirms or re-arms long before: the holder's link is dead
  pid=$(sed -n 's/.*"remote_pid": *\([0-9]*\).*/\1/p' "$d/lock.json" 2>/dev/null)
  [ -n "$pid" ] && { pkill -TERM -P "$pid"; kill -TERM "$pid"; }
  flock -w 30 9 || exit 1
fi
read -r tok prev target deadline < "$d/pending" 2>/dev/null || exit 0
[ "$tok" = "$token" ] || exit 0
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
info=$(printf '{"user":"systemd","controller":"%s","pid":%s,"since":"%s","command":"%s","remote_pid":%s}' \
  "$(hostname)" $$ "$now" "kdeploy-revert: unconfirmed switch to $target" $$)
printf '%s\n' "$info" > "$d/.lock.json.tmp" && mv -f "$d/.lock.json.tmp" "$d/lock.json"
if [ "$envfile" != - ] && [ -f "$d/PREVIOUS" ]; then
  (umask 077 && rm -f "$envfile.kdeploy-tmp" && cp "$d/PREVIOUS" "$envfile.kdeploy-tmp" &&
    sync "$envfile.kdeploy-tmp" && mv -T "$envfile.kdeploy-tmp" "$envfile")
fi
if [ "$prev" = "-" ]; then
  release=null
  if [ "$policy" = stop ]; then
    systemctl disable --quiet "$unit"; systemctl stop "$unit"; what="first deploy not confirmed: service stopped"
  else
    what="first deploy not confirmed: service left running"
  fi
else
  release="\"$prev\""
  cp "$d/releases/$prev/.kdeploy/unit.service" "UNIT_DIR/.$unit.kdeploy-revert" &&
    chmod 0644 "UNIT_DIR/.$unit.kdeploy-revert" && mv -T "UNIT_DIR/.$unit.kdeploy-revert" "UNIT_DIR/$unit"
  ln -sfn "releases/$prev" "$d/.current.tmp" && mv -T "$d/.current.tmp" "$d/current"
  systemctl daemon-reload
  systemctl restart "$unit"
  what="switch to $target not confirmed by the deadline: the host went back to $prev by itself"
fi
rm -f "$d/pending" "$d/PREVIOUS"
printf '{"attempted":"%s","command":"kdeploy-revert","controller":"%s","error":"%s","release":%s,%s}\n' \
  "$target" "$(hostname)" "$what" "$release" "\"result\":\"reverted\",\"time\":\"$now\",\"user\":\"systemd\"" \
  >> "$d/history.jsonl"
[ "$(cat "$d/lock.json" 2>/dev/null)" = "$info" ] && rm -f "$d/lock.json"
exit 0""".replace("UNIT_DIR", UNIT_DIR).replace("PREVIOUS", PREVIOUS_SECRETS)


@dataclass(frozen=True)
class Pending:
    """A switch the host has not been told to keep."""

    token: str
    previous: str | None  # the last confirmed release; None before the first confirmed deploy
    target: str
    deadline: int  # epoch seconds at which the host reverts

    def line(self) -> str:
        return f"{self.token} {self.previous or NONE} {self.target} {self.deadline}\n"

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
        f"printf %s {shlex.quote(pending.line())} > {d}/.pending.tmp && mv -f {d}/.pending.tmp {d}/{PENDING}",
        " ".join(shlex.quote(a) for a in argv),
    ])


def confirm_command(service_dir: str, timer: str, token: str) -> str:
    """Disarm and keep the switch (and the secrets it wrote); prints CONFIRMED only if ``pending`` was still
    ours (else LOST)."""
    d = shlex.quote(service_dir)
    return "\n".join([
        _stop(timer),
        f"read -r tok rest < {d}/{PENDING} 2>/dev/null || tok=",
        f"if [ \"$tok\" = {shlex.quote(token)} ]; then rm -f {d}/{PENDING} {d}/{PREVIOUS_SECRETS}; echo CONFIRMED; "
        "else echo LOST; fi",
    ])


def read_command(service_dir: str) -> str:
    path = shlex.quote(f"{service_dir}/{PENDING}")
    return f"[ ! -f {path} ] || cat {path} 2>/dev/null"  # mostly absent: no process for it then


def deadline_seconds(stop_timeout: float, gate_timeout: float) -> float:
    """Restart (the old run's stop + the follow's margin) + the whole gate + a margin."""
    return stop_timeout + 60 + gate_timeout + MARGIN
