"""A host's deploy state in one read, and the one decision push, plan and status make from it.

``state_script`` is sent under the deploy lock (or alone, by plan and status); ``parse_state`` reads its
output; ``decide`` says what a push must do. Pure functions, unit-tested on captured real output.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kdeploy import history, provisional, release, systemd
from kdeploy.gatespec import GateSpec
from kdeploy.inventory import HostConfig
from kdeploy.lock import split_sections
from kdeploy.render import service_dir, unit_filename

HISTORY_LINES = 200
# Results after which the history's ``release`` is what ran from then on.
_RAN = ("deployed", "restored", "rolled_back", "reverted")


@dataclass(frozen=True)
class HostState:
    current: str | None
    manifest: dict[str, str]
    unit_text: str | None
    releases: list[str]
    unit: systemd.UnitState
    pending: provisional.Pending | None = None
    gates: dict[str, GateSpec] = field(default_factory=dict)  # release -> what it was deployed with
    history: list[dict] = field(default_factory=list)

    @property
    def confirmed(self) -> str | None:
        """The last release whose switch was confirmed: what a failed deploy returns to."""
        return self.pending.previous if self.pending else self.current

    def previous(self) -> str | None:
        """What ran before the confirmed release (a rollback's default target): from the history, else the
        newest older release by name."""
        now = self.confirmed
        for record in reversed(self.history):
            ran = record.get("release")
            if record.get("result") in _RAN and ran and ran != now and ran in self.releases:
                return str(ran)
        ordered = sorted(r for r in self.releases if not r.startswith("."))
        older = [r for r in ordered if now is None or r < now]
        return older[-1] if older else None


def state_script(host: HostConfig, *, with_history: bool = False) -> str:
    """Read everything push, plan, rollback and status decide on, without changing anything."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(f"{systemd.UNIT_DIR}/{unit_filename(host.service)}")
    lines = [
        f"echo @@current; r=$(readlink {d}/current 2>/dev/null) && basename \"$r\"",
        f"echo @@manifest; cat {d}/current/{release.META}/manifest.sha256 2>/dev/null",
        f"if [ -f {unit} ]; then echo @@unit; cat {unit}; echo; fi",
        f"echo @@releases; ls -1 {d}/releases 2>/dev/null",
        f"echo @@pending; {provisional.read_command(service_dir(host.service))}",
        f"echo @@gates; grep -H . {d}/releases/*/{release.META}/gate.json 2>/dev/null",
    ]
    if with_history:
        lines.append(f"echo @@history; {history.read_command(service_dir(host.service), HISTORY_LINES)}")
    lines += [f"echo @@show; {systemd.show_command(unit_filename(host.service))}", "true"]
    return "\n".join(lines)


def parse_gates(text: str) -> dict[str, GateSpec]:
    """``grep -H`` lines ``.../releases/<id>/.kdeploy/gate.json:<json>``."""
    out = {}
    marker = f"/{release.META}/gate.json:"
    for line in text.splitlines():
        path, sep, body = line.partition(marker)
        spec = GateSpec.from_json(body) if sep else None
        if spec is not None:
            out[path.rsplit("/", 1)[-1]] = spec
    return out


def parse_state(text: str) -> HostState:
    sections = split_sections(text)
    unit_text = sections.get("unit")  # `cat unit; echo` ends it with one extra empty line
    return HostState(
        current=sections.get("current", "").strip() or None,
        manifest=release.parse_manifest(sections.get("manifest", "")),
        unit_text=None if unit_text is None else unit_text.removesuffix("\n") + "\n",
        releases=[r for r in sections.get("releases", "").split() if r],
        unit=systemd.parse_show(sections.get("show", "")),
        pending=provisional.parse_pending(sections.get("pending", "")),
        gates=parse_gates(sections.get("gates", "")),
        history=history.parse(sections.get("history", "")),
    )


@dataclass(frozen=True)
class Decision:
    """What a push does to a host, and why (the same words in push, plan and status)."""

    delta: release.Delta
    unit_changed: bool
    stage: bool  # a new release must be built
    restart: bool
    install_unit: bool  # write the unit and daemon-reload
    reasons: list[str]

    @property
    def no_op(self) -> bool:
        return not self.restart


def decide(manifest: dict[str, str], unit_text: str, state: HostState, *, force_restart: bool = False) -> Decision:
    delta = release.diff(manifest, state.manifest)
    unit_changed = unit_text != state.unit_text
    reasons = []
    if state.current is None:
        reasons.append("never deployed")
    if not delta.empty:
        reasons.append(f"payload differs from the inventory ({delta.describe()})")
    if unit_changed:
        reasons.append("unit differs from the inventory")
    stage = bool(reasons)
    if state.pending:
        reasons.append(state.pending.describe())
    if state.unit.need_reload:
        reasons.append("unit file changed on disk but not reloaded")
    if not state.unit.running and state.current is not None:
        reasons.append(f"service is {state.unit.summary}")
    if force_restart:
        reasons.append("--force-restart")
    return Decision(delta, unit_changed, stage, bool(reasons), unit_changed or state.unit.need_reload, reasons)
