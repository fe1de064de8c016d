"""A host's deploy state in one read, and the one decision push, plan and status make from it.

``state_script`` is sent under the deploy lock (or alone, by plan and status); ``parse_state`` reads its
output; ``decide`` says what a push must do. Pure functions, unit-tested on captured real output.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kdeploy.core import history, provisional, release, systemd
from kdeploy.core import secrets as secret
from kdeploy.core.gatespec import GateSpec
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import CURRENT, GATE_RECORD, HISTORY, META, RELEASES, service_dir
from kdeploy.core.render import unit_filename
from kdeploy.core.step import Step, split_sections

HISTORY_LINES = 200
# Results after which the history's ``release`` is what ran from then on.
_RAN = ("deployed", "restored", "rolled_back", "reverted")


@dataclass(frozen=True)
class ReleaseFiles:
    """The current release's directory against its own manifest: what hands changed there since it was staged."""

    present: bool = True  # False: `current` points at a release directory that is gone
    edited: list[str] = field(default_factory=list)  # content or mode no longer what the release recorded
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # files the manifest does not list

    def reasons(self, current: str) -> list[str]:
        if not self.present:
            return [f"current release directory releases/{current} is gone from the host"]
        named = (("release files edited on the host", self.edited), ("release files missing on the host", self.missing),
                 ("extra files in the release", self.extra))
        return [f"{what}: {_some(paths)}" for what, paths in named if paths]


def _some(paths: list[str], shown: int = 5) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


@dataclass(frozen=True)
class HostState:
    current: str | None
    manifest: dict[str, str]  # path -> "<sha256> <mode>" of the current release (release.file_identity)
    unit_text: str | None
    releases: list[str]
    unit: systemd.UnitState
    pending: provisional.Pending | None = None
    gates: dict[str, GateSpec] = field(default_factory=dict)  # release -> what it was deployed with
    history: list[dict] = field(default_factory=list)
    secrets: secret.Stamp | None = None  # the environment file kdeploy last wrote, as a salted digest
    files: ReleaseFiles | None = None  # the current release's directory as found (None: not read)

    @property
    def has_release(self) -> bool:
        """``current`` points at a release directory that is there (a new release can start from it)."""
        return self.current is not None and (self.files is None or self.files.present)

    @property
    def on_disk(self) -> dict[str, str]:
        """The current release's files as they are, in ``manifest``'s terms: what was changed there by hand
        matches no payload file (``"?"``), so a push ships it again rather than hard-linking it."""
        found = self.files
        if found is None:
            return self.manifest
        if not found.present:
            return {}
        kept = {p: i for p, i in self.manifest.items() if p not in found.missing}
        return {**kept, **dict.fromkeys(found.edited + found.extra, "?")}

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


def _current(d: str) -> str:
    """The release ``current`` points at (a shell builtin takes its last part: every process spawned for
    a read costs each host of a fleet ~1.5 ms of CPU)."""
    return f"echo @@current; r=$(readlink {d}/{CURRENT} 2>/dev/null) && echo \"${{r##*/}}\""


def files_script(d: str) -> str:
    """The current release's files (mode and path, caches and kdeploy's metadata left out) and those whose
    content fails the release's manifest; ``@@gone`` when there is no release directory to look at. Two
    processes; ``sha256sum`` reads the whole release (~0.7 s per 200 MB)."""
    return "\n".join([
        f"if cd {d}/{CURRENT} 2>/dev/null; then",
        f"  echo @@found; find . -type d \\( -name __pycache__ -o -path ./{release.META} \\) -prune -o ! -type d"
        " -printf '%#m %p\\n'",
        f"  echo @@failed; sha256sum -c --quiet {release.META}/manifest.sha256 2>/dev/null",
        "  cd /",
        "else echo @@gone; fi",
    ])


def parse_files(sections: dict[str, str], manifest: dict[str, str]) -> ReleaseFiles | None:
    """``files_script``'s sections against the recorded ``manifest`` (``HostState.manifest``)."""
    if "found" not in sections:
        return ReleaseFiles(present=False) if "gone" in sections else None
    found = release.parse_modes(sections["found"])
    failed = {line.rpartition(": FAILED")[0].removeprefix("./") for line in sections.get("failed", "").splitlines()
              if ": FAILED" in line}
    recorded = {p: identity.rpartition(" ")[2] for p, identity in manifest.items()}  # "0644", or "?": not recorded
    missing = sorted(p for p in manifest if p not in found)
    edited = sorted(p for p in manifest if p in found and (p in failed or recorded[p] not in ("?", f"{found[p]:04o}")))
    return ReleaseFiles(edited=edited, missing=missing, extra=sorted(p for p in found if p not in manifest))


def state_script(host: HostConfig, *, with_history: bool = False, with_files: bool = False) -> str:
    """Read everything push, plan, rollback and status decide on, without changing anything; ``with_files``:
    also what was changed by hand in the current release (``files_script``), which a push must repair."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(f"{systemd.UNIT_DIR}/{unit_filename(host.service)}")
    lines = [
        _current(d),
        f"echo @@manifest; cat {d}/{CURRENT}/{META}/manifest.sha256 2>/dev/null",
        f"echo @@modes; cat {d}/{CURRENT}/{META}/modes 2>/dev/null",
        f"if [ -f {unit} ]; then echo @@unit; cat {unit}; echo; fi",
        f"echo @@releases; ls -1 {d}/{RELEASES} 2>/dev/null",
        f"echo @@pending; {provisional.read_command(service_dir(host.service))}",
        f"echo @@gates; grep -H . {d}/{RELEASES}/*/{GATE_RECORD} 2>/dev/null",
    ]
    sv = host.service
    if sv.secrets.configured and sv.environment_file:
        lines.append(f"echo @@secrets; {secret.read_command(service_dir(sv), sv.environment_file)}")
    if with_history:
        lines.append(f"echo @@history; {history.read_command(service_dir(host.service), HISTORY_LINES)}")
    if with_files:
        lines.append(files_script(d))
    lines += [f"echo @@show; {systemd.show_command(unit_filename(host.service))}", "true"]
    return "\n".join(lines)


def parse_gates(text: str) -> dict[str, GateSpec]:
    """``grep -H`` lines ``.../releases/<id>/.kdeploy/gate.json:<json>``."""
    out = {}
    marker = f"/{GATE_RECORD}:"
    for line in text.splitlines():
        path, sep, body = line.partition(marker)
        spec = GateSpec.from_json(body) if sep else None
        if spec is not None:
            out[path.rsplit("/", 1)[-1]] = spec
    return out


def parse_state(text: str) -> HostState:
    sections = split_sections(text)
    unit_text = sections.get("unit")  # `cat unit; echo` ends it with one extra empty line
    manifest = release.parse_identity(sections.get("manifest", ""), sections.get("modes", ""))
    return HostState(
        current=sections.get("current", "").strip() or None,
        manifest=manifest,
        unit_text=None if unit_text is None else unit_text.removesuffix("\n") + "\n",
        releases=[r for r in sections.get("releases", "").split() if r],
        unit=systemd.parse_show(sections.get("show", "")),
        pending=provisional.parse_pending(sections.get("pending", "")),
        gates=parse_gates(sections.get("gates", "")),
        history=history.parse(sections.get("history", "")),
        secrets=secret.parse_stamp(sections.get("secrets", "")),
        files=parse_files(sections, manifest),
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
    secrets_changed: bool = False  # the activation writes the environment file

    @property
    def no_op(self) -> bool:
        return not self.restart


def secrets_changed(wanted: secret.Secrets | None, state: HostState) -> bool:
    """The host's environment file is not what kdeploy would write now (or kdeploy never wrote it)."""
    if wanted is None:
        return False
    return state.secrets is None or wanted.digest(state.secrets.salt) != state.secrets.digest


def decide(identity: dict[str, str], unit_text: str, state: HostState, *, force_restart: bool = False,
           secrets: secret.Secrets | None = None) -> Decision:
    """``identity``: the payload's files as ``Payload.identity`` (content and mode) against the host's;
    ``secrets``: what the environment file must hold (None: kdeploy does not manage it).

    The reasons compare the payload with what the current release recorded; the delta to stage compares it
    with the release's files as they are (``HostState.on_disk``), so files changed by hand on the host are
    uploaded again, not hard-linked, and stray ones are left out."""
    delta = release.diff(identity, state.on_disk)
    recorded = release.diff(identity, state.manifest)
    damage = state.files.reasons(state.current) if state.files and state.current else []
    unit_changed = unit_text != state.unit_text
    reasons = []
    if state.current is None:
        reasons.append("never deployed")
    if not recorded.empty and (state.has_release or state.current is None):  # a gone release recorded nothing
        reasons.append(f"payload differs from the inventory ({recorded.describe()})")
    reasons += damage
    if unit_changed:
        reasons.append("unit differs from the inventory")
    stage = bool(reasons)
    ship = secrets_changed(secrets, state)
    if ship:
        reasons.append("secrets: changed")
    if state.pending:
        reasons.append(state.pending.describe())
    if state.unit.need_reload:
        reasons.append("unit file changed on disk but not reloaded")
    if not state.unit.running and state.current is not None:
        reasons.append(f"service is {state.unit.summary}")
    if force_restart:
        reasons.append("--force-restart")
    return Decision(delta, unit_changed, stage, bool(reasons), unit_changed or state.unit.need_reload, reasons,
                    ship)


def status_script(host: HostConfig) -> str:
    """The push state (hand edits in the release included) plus what status shows: live Environment, last
    deploy."""
    d = shlex.quote(service_dir(host.service))
    unit = shlex.quote(unit_filename(host.service))
    return "\n".join([
        state_script(host, with_files=True),
        f"echo @@env; systemctl show -p Environment --value {unit}",
        f"echo @@last; tail -n 1 {d}/{HISTORY} 2>/dev/null",
        "true",
    ])


@dataclass(frozen=True)
class Status:
    state: HostState
    env: dict[str, str]  # the unit's live Environment
    last_deploy: dict | None


def parse_status(text: str) -> Status:
    sections = split_sections(text)
    last = history.parse(sections.get("last", ""))
    return Status(
        state=parse_state(text), env=systemd.parse_environment(sections.get("env", "")),
        last_deploy=last[-1] if last else None)


def drift(identity: dict[str, str], unit_text: str, status: Status, secrets: secret.Secrets | None = None) -> list[str]:
    """How the host differs from what the inventory would deploy now (empty: no drift): the reasons a push
    would act on, hand edits inside the release included."""
    if status.state.current is None:
        return ["never deployed"]
    return decide(identity, unit_text, status.state, secrets=secrets).reasons


def running_script(host: HostConfig) -> str:
    """What verify needs: the release that runs, an unconfirmed switch, and the gate it was deployed with."""
    d = shlex.quote(service_dir(host.service))
    return "\n".join([
        _current(d),
        f"echo @@pending; {provisional.read_command(service_dir(host.service))}",
        f"echo @@gate; cat {d}/{CURRENT}/{GATE_RECORD} 2>/dev/null",
        "true",
    ])


@dataclass(frozen=True)
class Running:
    current: str | None
    pending: provisional.Pending | None
    gate: GateSpec | None


def parse_running(text: str) -> Running:
    sections = split_sections(text)
    return Running(sections.get("current", "").strip() or None,
                   provisional.parse_pending(sections.get("pending", "")), GateSpec.from_json(sections.get("gate", "")))


def state_step(host: HostConfig, *, with_files: bool = False) -> Step[HostState]:
    """The host's state read without the lock (plan: reads only)."""
    return Step(state_script(host, with_files=with_files), lambda out: parse_state(out.stdout), 60)


def running_step(host: HostConfig) -> Step[Running]:
    """What runs now and how it was gated (verify)."""
    return Step(running_script(host), lambda out: parse_running(out.stdout), 30)


def status_step(host: HostConfig) -> Step[Status]:
    """The state ``kdeploy status`` shows, with the unit's live environment and the last history line."""
    return Step(status_script(host), lambda out: parse_status(out.stdout), 60)
