"""The campaign's invariants, read out of band: each host's files, unit, processes and lock through nsenter (not
SSH, not kdeploy), and the router's ``/workers`` (docs/chaos.md "Invariants").

:func:`read_host` gathers a host's facts in one shell round; the checks are pure functions over those facts, so
the unit tests feed them the cases the campaign must catch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import httpx

from kdeploy_lab.sandbox import Sandbox

# History results that mean the release passed a gate on the host (docs/results-and-exit-codes.md).
GATED = frozenset({"deployed", "restored"})

_SCRIPT = r"""
cd {dir} 2>/dev/null || {{ echo "dir=missing"; exit 0; }}
echo "current=$(readlink current 2>/dev/null)"
echo "current_mtime=$(stat -c %.9Y current 2>/dev/null)"
echo "pending=$(test -e pending && echo yes)"
echo "staging=$(ls -A releases 2>/dev/null | grep '^\.staging-' | tr '\n' ' ')"
if flock -n .lock true 2>/dev/null; then echo "lock=free"; else echo "lock=held"; fi
echo "state=$(systemctl show {unit} -p ActiveState --value)"
echo "reload=$(systemctl show {unit} -p NeedDaemonReload --value)"
pid=$(systemctl show {unit} -p MainPID --value)
if [ "${{pid:-0}}" != 0 ] && [ -r /proc/$pid/stat ]; then
  boot=$(awk '/^btime/{{print $2}}' /proc/stat)
  echo "started=$(awk -v b="$boot" -v t="$(getconf CLK_TCK)" '{{printf "%.3f\n", b + $22 / t}}' /proc/$pid/stat)"
fi
echo "timers=$(systemctl list-units --all --no-legend --plain 'kdeploy-*{name}*.timer' 2>/dev/null |
  awk '{{print $1}}' | tr '\n' ' ')"
echo "unit_same=$(cmp -s /etc/systemd/system/{unit} current/.kdeploy/unit.service && echo yes)"
echo "env=$(grep '^Environment=' /etc/systemd/system/{unit} | grep -v PYTHONPATH | tr '\n' ' ')"
echo "history_begin"
cat history.jsonl 2>/dev/null
"""


@dataclass(frozen=True)
class HostFacts:
    host: str
    current: str | None  # the release `current` points to
    current_mtime: float | None  # when `current` was last swapped (the link's own mtime)
    pending: bool  # a switch armed, not confirmed or reverted
    staging: tuple[str, ...]
    lock_held: bool
    state: str  # the unit's ActiveState
    stale_unit: bool  # systemd runs another unit text than the file's (NeedDaemonReload)
    started: float | None  # epoch seconds the service's main process started
    timers: tuple[str, ...]  # kdeploy's transient timers (revert, re-admit) still armed
    unit_same: bool  # the installed unit is the current release's
    env: str  # the unit's Environment= lines (PYTHONPATH aside): what makes two ranks' releases the same
    history: tuple[dict, ...]


def parse_host(host: str, out: str) -> HostFacts:
    import json

    head, _, history = out.partition("history_begin\n")
    kv = dict(line.split("=", 1) for line in head.splitlines() if "=" in line)
    records = []
    for line in history.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"unparsable": line})

    def num(key: str) -> float | None:
        try:
            return float(kv.get(key, ""))
        except ValueError:
            return None

    current = kv.get("current") or None
    return HostFacts(host=host, current=current.removeprefix("releases/") if current else None,
                     current_mtime=num("current_mtime"), pending=kv.get("pending") == "yes",
                     staging=tuple(kv.get("staging", "").split()), lock_held=kv.get("lock") == "held",
                     state=kv.get("state", ""), stale_unit=kv.get("reload") == "yes", started=num("started"),
                     timers=tuple(kv.get("timers", "").split()), unit_same=kv.get("unit_same") == "yes",
                     env=kv.get("env", "").strip(), history=tuple(records))


def read_host(box: Sandbox, host: str, service_dir: str, service: str) -> HostFacts:
    script = _SCRIPT.format(dir=shlex.quote(service_dir), unit=shlex.quote(f"{service}.service"), name=service)
    return parse_host(host, box.exec(host, ["sh", "-c", script], timeout=30).stdout)


def settled(facts: HostFacts) -> bool:
    """Every host-side deadline has passed: no switch pending, no revert or re-admit timer armed, no lock held,
    the unit not between states."""
    return not (facts.pending or facts.timers or facts.lock_held) and facts.state in ("active", "failed", "inactive")


def host_violations(f: HostFacts) -> list[str]:
    """A settled host runs the release ``current`` points to, with that release's unit, and that release passed a
    gate there; no lock is held and nothing is pending."""
    out = []
    if f.current is None:
        return [f"{f.host}: no current release"]
    if f.state != "active":
        out.append(f"{f.host}: service {f.state}, not active")
    if not f.unit_same:
        out.append(f"{f.host}: the installed unit is not release {f.current}'s")
    if f.stale_unit:
        out.append(f"{f.host}: systemd runs an older unit text than the installed one (daemon-reload missing)")
    if f.started is not None and f.current_mtime is not None and f.started + 0.5 < f.current_mtime:
        out.append(f"{f.host}: the service started before `current` moved to {f.current}: it runs an older release")
    if not any(r.get("release") == f.current and (r.get("result") in GATED or r.get("gated") == f.current)
               for r in f.history):
        out.append(f"{f.host}: release {f.current} never passed a gate here (history: "
                   f"{[(r.get('release'), r.get('result')) for r in f.history[-3:]]})")
    if f.lock_held:
        out.append(f"{f.host}: the deploy lock is held with no kdeploy running")
    if f.pending:
        out.append(f"{f.host}: a switch is still pending after its deadline")
    if f.timers:
        out.append(f"{f.host}: timers still armed after their deadline: {' '.join(f.timers)}")
    return out


def release_payload(f: HostFacts) -> str | None:
    """The payload digest history gives the current release (release ids differ per node)."""
    return next((r.get("payload_hash") for r in reversed(f.history) if r.get("release") == f.current), None)


def server_violations(server: str, nodes: list[HostFacts]) -> list[str]:
    """The nodes of a server run one release: the same payload and the same environment."""
    if len(nodes) < 2:
        return []
    shapes = {(release_payload(f), f.env) for f in nodes}
    if len(shapes) == 1:
        return []
    return [f"server {server}: its nodes run different releases: "
            + ", ".join(f"{f.host}={f.current} (payload {release_payload(f)})" for f in nodes)]


def staging_violations(facts: list[HostFacts]) -> list[str]:
    return [f"{f.host}: staging left behind: {' '.join(f.staging)}" for f in facts if f.staging]


def router_violations(listed: set[str], serving: set[str]) -> list[str]:
    """The router lists exactly the servers that serve (by their heads' URLs)."""
    out = []
    if missing := serving - listed:
        out.append(f"router: serving but not listed: {', '.join(sorted(missing))}")
    if extra := listed - serving:
        out.append(f"router: listed but not serving: {', '.join(sorted(extra))}")
    return out


def router_workers(url: str) -> set[str]:
    return {w["url"] for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]}


def serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False
