"""``kdeploy probe`` and push preflight, the library part: pure builders of remote commands, pure parsers.

Nothing here touches the network: :func:`probe_command` and :func:`preflight_command` build ONE shell command
each (run it with the service's SSH session), :func:`parse_probe` and :func:`parse_preflight` read what it
printed, and the ``check_*`` functions turn numbers into a :class:`Check` (pass / warn / fail + the numbers).

The probe runs the service's interpreter on a small stdlib-only program that finds SGLang without importing
it (importing SGLang pulls torch and CUDA: seconds, and can fail for reasons of its own) and reads its
source with ``ast``: version, plugin loader, ``HookRegistry``, the KV allocator classes whose ``__init__``
takes ``need_sort``, the attention-backend registry (with a ``triton`` backend to delegate to) and the
``--attention-backend`` choices. It prints one line ``KDEPLOY_PROBE {json}``; the verdict ``compatible``
says whether the kdtree payload can install its Tier-0 defrag and its verify override there.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kdeploy import onhost
from kdeploy.core import disk
from kdeploy.core.layout import PROBE_CACHE
from kdeploy.core.step import Step

PROBE_PREFIX = "KDEPLOY_PROBE "
CACHE = PROBE_CACHE  # in the service directory: see probe_command
SECTION = "@@kdeploy "
GIB = 1024**3
GB = 1e9
HICACHE_RESERVE_BYTES = 10 * GIB     # SGLang 0.5.23: HICACHE_HOST_MEMORY_RESERVE_BYTES

PROBE_CODE = onhost.source("probe_sglang.py")  # runs on the host: kdeploy/onhost/probe_sglang.py


def probe_command(python: str, cache: str | None = None) -> str:
    """One remote shell command: the service's python runs the probe (no PYTHONPATH: the payload's
    sitecustomize must not run). Output: one ``KDEPLOY_PROBE {json}`` line. ``cache``: a file where the probe
    keeps what it read from SGLang's sources, for as long as they do not change (written only where its
    directory exists)."""
    return (f"env -u PYTHONPATH {shlex.quote(python)} -I -c {shlex.quote(PROBE_CODE)}"
            + (f" {shlex.quote(cache)}" if cache else ""))


@dataclass(frozen=True)
class ProbeReport:
    key: ClassVar[str] = "probe"  # its place in a host's --json (kdeploy.core.report.Details)
    ok: bool                      # the probe ran and printed its line
    installed: bool = False
    version: str | None = None
    python: str | None = None
    python_version: str | None = None
    plugin_loader: bool = False
    hook_registry: bool = False
    allocators: tuple[str, ...] = ()
    attention_registry: bool = False
    triton_backend: bool = False
    backend_choices: str | None = None
    problems: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def compatible(self) -> bool:
        return self.ok and self.installed and not self.problems

    @property
    def loader(self) -> str:
        """How the payload gets in: SGLang's plugin loader, else its sitecustomize fallback."""
        if not self.installed:
            return "none"
        return "plugin" if self.plugin_loader else "sitecustomize"

    def summary(self) -> str:
        if not self.ok:
            return f"probe failed: {'; '.join(self.problems)}"
        if not self.installed:
            return f"sglang not installed for {self.python}"
        found = [f"sglang {self.version or '?'} (python {self.python_version})",
                 "plugin loader" if self.plugin_loader else "no plugin loader (sitecustomize fallback)",
                 "HookRegistry" if self.hook_registry else "no HookRegistry (wrapped __init__)",
                 f"{len(self.allocators)} allocator classes with need_sort",
                 "attention registry" if self.attention_registry else "no attention registry"]
        verdict = "compatible" if self.compatible else "NOT compatible: " + "; ".join(self.problems)
        return ", ".join(found) + f": {verdict}"

    def to_json(self) -> dict:
        return {**self.raw, "loader": self.loader, "compatible": self.compatible, "problems": list(self.problems),
                "summary": self.summary()}


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def parse_probe(stdout: str, stderr: str = "", exit_code: int = 0) -> ProbeReport:
    """Read the probe's output (the last ``KDEPLOY_PROBE`` line wins); never raises."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(PROBE_PREFIX)), None)
    if line is None:
        if exit_code == 127:
            why = f"interpreter not found ({_tail(stderr) or _tail(stdout) or 'exit 127'})"
        else:
            why = _tail(stderr) or _tail(stdout) or f"exit status {exit_code}, no output"
        return ProbeReport(ok=False, problems=(why,))
    try:
        data = json.loads(line[len(PROBE_PREFIX):])
    except ValueError as exc:
        return ProbeReport(ok=False, problems=(f"unreadable probe output: {exc}",))
    if not isinstance(data, dict):
        return ProbeReport(ok=False, problems=("unreadable probe output: not an object",))
    installed = bool(data.get("installed"))
    report = ProbeReport(
        ok=True, installed=installed, version=data.get("version"), python=data.get("python"),
        python_version=data.get("python_version"), plugin_loader=bool(data.get("plugin_loader")),
        hook_registry=bool(data.get("hook_registry")), allocators=tuple(data.get("allocators") or ()),
        attention_registry=bool(data.get("attention_registry")), triton_backend=bool(data.get("triton_backend")),
        backend_choices=data.get("backend_choices"), raw=data)
    problems = [] if installed else [f"sglang not installed for {report.python}"]
    if installed:
        if not report.allocators:
            problems.append("no KV allocator class takes need_sort (Tier-0 defrag cannot install)")
        if not report.attention_registry:
            problems.append("no attention-backend registry (verify override cannot install)")
        elif not report.triton_backend:
            problems.append("no 'triton' attention backend to delegate to")
        if report.backend_choices is None:
            problems.append("no add_attention_backend_choices (--attention-backend kdtree would not parse)")
    return ProbeReport(**{**report.__dict__, "problems": tuple(problems)})


# ----------------------------------------------------------------------------------------------- checks

@dataclass(frozen=True)
class Check:
    name: str
    status: str          # "pass" | "warn" | "fail"
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != "fail"


_GPU_RE = re.compile(r"^GPU (\d+): (.+?)(?: \(UUID: [^)]*\))?$")


def parse_gpus(nvidia_smi_l: str) -> list[str]:
    """The GPU names of ``nvidia-smi -L`` (MIG lines and noise skipped)."""
    return [m.group(2) for m in map(_GPU_RE.match, (ln.strip() for ln in nvidia_smi_l.splitlines())) if m]


def check_gpus(nvidia_smi_l: str | None, exit_code: int, tp: int) -> Check:
    """``nvidia-smi -L`` must list at least tp GPUs; a host without nvidia-smi gets a warning."""
    if nvidia_smi_l is None or exit_code == 127:
        return Check("gpus", "warn", f"nvidia-smi not found: cannot count GPUs (tp={tp} needs {tp})")
    if exit_code != 0:
        return Check("gpus", "fail", f"nvidia-smi -L failed (exit {exit_code}): {_tail(nvidia_smi_l) or 'no output'}")
    gpus = parse_gpus(nvidia_smi_l)
    kinds = ", ".join(sorted(set(gpus))) or "none"
    if len(gpus) < tp:
        return Check("gpus", "fail", f"tp={tp} needs {tp} GPUs, host has {len(gpus)} ({kinds})")
    return Check("gpus", "pass", f"tp={tp} needs {tp} GPUs, host has {len(gpus)} ({kinds}): ok")


_KV_RE = re.compile(r"KV Cache is allocated\..*?K size: ([0-9.]+) GB, V size: ([0-9.]+) GB")


def parse_kv_cache_gb(journal_text: str) -> float | None:
    """Device KV GB per rank (K + V) from the last ``KV Cache is allocated. ... K size: X GB, V size: Y GB``
    line of a journal, or None."""
    found = [float(m.group(1)) + float(m.group(2)) for m in map(_KV_RE.search, journal_text.splitlines()) if m]
    return found[-1] if found else None


def parse_mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo in bytes."""
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def check_hicache(*, enabled: bool, ranks: int, mem_available_bytes: int | None, ratio: float | None = None,
                  size_gb: float | None = None, device_kv_gb_per_rank: float | None = None,
                  kv_source: str = "inventory") -> Check:
    """SGLang's own startup check, minutes earlier: every rank's host pool (``--hicache-size`` GB, else
    ratio x device KV bytes per rank) plus its 10 GiB reserve must fit in MemAvailable."""
    if not enabled:
        return Check("hicache", "pass", "HiCache off")
    if size_gb is not None:
        per_rank_gb, how = size_gb, f"--hicache-size {size_gb:g} GB"
    elif device_kv_gb_per_rank is None:
        return Check("hicache", "warn", "device KV size per rank unknown: set hicache.device_kv_gb_per_rank "
                                        "or deploy once (read from the journal's 'KV Cache is allocated' line)")
    else:
        ratio = 2.0 if ratio is None else ratio
        per_rank_gb, how = ratio * device_kv_gb_per_rank, f"ratio {float(ratio)!r}"
    need = ranks * per_rank_gb * GB + HICACHE_RESERVE_BYTES
    text = f"{how} needs {ranks} x {per_rank_gb:.1f} GB + 10 GiB = {need / GB:.0f} GB"
    source = "" if size_gb is not None else f" (device KV {device_kv_gb_per_rank:g} GB per rank from {kv_source})"
    if mem_available_bytes is None:
        return Check("hicache", "warn", f"{text}; host MemAvailable unknown{source}")
    text += f", host has {mem_available_bytes / GB:.0f} GB available"
    if need > mem_available_bytes:
        return Check("hicache", "fail", f"{text}: SGLang would stop with 'Not enough host memory'{source}")
    if need > 0.9 * mem_available_bytes:
        return Check("hicache", "warn", f"{text}: less than 10% headroom{source}")
    return Check("hicache", "pass", f"{text}: ok{source}")


@dataclass(frozen=True)
class Listener:
    pid: int
    comm: str
    cgroup: str


def check_port(port: int, unit: str, listeners: list[Listener] | None) -> Check:
    """The service's port must be free, or held by the service itself (it restarts in place)."""
    if listeners is None:
        return Check("port", "warn", f"cannot tell who listens on port {port} (ss missing)")
    if not listeners:
        return Check("port", "pass", f"port {port} free")
    suffix = f"/{unit}.service" if not unit.endswith(".service") else f"/{unit}"
    ours = [ln for ln in listeners if any(part.endswith(suffix) for part in ln.cgroup.split())]
    others = [ln for ln in listeners if ln not in ours]
    who = ", ".join(f"pid {ln.pid} ({ln.comm})" for ln in (others or ours))
    if others:
        return Check("port", "fail", f"port {port} held by {who}, not by {unit}")
    return Check("port", "pass", f"port {port} held by {unit} ({who}): replaced in place")


def check_environment_file(path: str | None, stat_line: str | None, written: bool = False) -> Check | None:
    """``service.environment_file`` must exist, be root's and be readable by root only: the unit reads it with
    ``EnvironmentFile=-`` (a missing file is no error to systemd), so without this check SGLang would start
    without its HF_TOKEN, and a group- or world-readable file leaks it. ``stat_line``: ``stat -c '%u %a %F'``.
    ``written``: kdeploy writes it (``service.secrets``), so a missing one is created by the push."""
    if path is None:
        return None
    if not stat_line and written:
        return Check("envfile", "pass", f"environment_file {path}: written by this push (service.secrets)")
    if not stat_line:
        return Check("envfile", "fail", f"environment_file {path} is missing (the service would start without "
                                        "its secrets)")
    try:
        uid, mode, kind = stat_line.split(None, 2)
        uid_n, mode_n = int(uid), int(mode, 8)
    except ValueError:
        return Check("envfile", "fail", f"environment_file {path}: cannot read its owner and mode ({stat_line!r})")
    if kind not in ("regular file", "regular empty file"):  # stat's %F names an empty file apart
        return Check("envfile", "fail", f"environment_file {path} is a {kind}, not a regular file")
    if uid_n != 0:
        return Check("envfile", "fail", f"environment_file {path} is owned by uid {uid_n}, not root")
    if mode_n & 0o077:
        return Check("envfile", "fail", f"environment_file {path} has mode {mode_n:04o}: others can read its "
                                        "secrets (chmod 0600)")
    return Check("envfile", "pass", f"environment_file {path}: root, {mode_n:04o}")


# ----------------------------------------------------------------------------------------------- one round trip

def preflight_command(*, python: str, unit: str, port: int, places: Sequence[disk.Need],
                      environment_file: str | None = None, probe_cache: str | None = None,
                      kv_from_journal: bool = True) -> str:
    """ONE shell command for every preflight check (and the probe): sections ``@@kdeploy NAME`` each
    followed by its output and ``@@kdeploy rc N``. Parse with :func:`parse_preflight`.

    ``places``: where the push writes (``disk.needs``), each measured where it is.

    ``kv_from_journal``: the HiCache check needs the device KV size from the service's journal. It is read
    from the running invocation's first lines (the line comes at start-up), else backwards to the last run's
    line: a GPU host's journal of the unit can hold months of request logs, which a full scan would read on
    every push."""
    q = shlex.quote
    unit_q = q(unit if unit.endswith(".service") else f"{unit}.service")
    parts = [
        f"echo '{SECTION}probe'; {probe_command(python, probe_cache)} 2>&1; echo \"{SECTION}rc $?\"",
        *(f"echo '{SECTION}{_place(n)}'; {disk.measure(n.path)}; echo \"{SECTION}rc $?\"" for n in places),
        f"echo '{SECTION}nvidia-smi'; if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>&1; "
        f"echo \"{SECTION}rc $?\"; else echo \"{SECTION}rc 127\"; fi",
        f"echo '{SECTION}meminfo'; grep -E '^Mem(Total|Available):' /proc/meminfo; echo \"{SECTION}rc $?\"",
        f"echo '{SECTION}port'; if command -v ss >/dev/null 2>&1; then "
        f"for p in $(ss -Hltnp 2>/dev/null | awk '$4 ~ /:{int(port)}$/' | grep -o 'pid=[0-9]*' | cut -d= -f2 | "
        f"sort -u); do echo \"$p $(cat /proc/$p/comm 2>/dev/null || echo ?) "
        f"$(cut -d: -f3 /proc/$p/cgroup 2>/dev/null | tr '\\n' ' ')\"; done; echo \"{SECTION}rc 0\"; "
        f"else echo \"{SECTION}rc 127\"; fi",
    ]
    if kv_from_journal:
        kv = "-o cat --no-pager 2>/dev/null | grep -m 1 -F 'KV Cache is allocated'"
        parts.append(f"echo '{SECTION}journal'; inv=$(systemctl show -p InvocationID --value {unit_q} 2>/dev/null); "
                     f"{{ [ -n \"$inv\" ] && journalctl _SYSTEMD_INVOCATION_ID=\"$inv\" {kv}; }} || "
                     f"journalctl -u {unit_q} -r {kv}; echo \"{SECTION}rc 0\"")
    if environment_file:
        parts.append(f"echo '{SECTION}envfile'; stat -L -c '%u %a %F' {q(environment_file)} 2>/dev/null; "
                     f"echo \"{SECTION}rc 0\"")
    return "; ".join(parts)


@dataclass(frozen=True)
class Section:
    text: str
    rc: int | None


def parse_sections(stdout: str) -> dict[str, Section]:
    """``@@kdeploy NAME`` ... ``@@kdeploy rc N`` blocks of :func:`preflight_command`'s output."""
    sections: dict[str, Section] = {}
    name: str | None = None
    lines: list[str] = []
    for line in stdout.splitlines():
        if line.startswith(SECTION):
            word = line[len(SECTION):].strip()
            if word.startswith("rc ") and name is not None:
                try:
                    rc = int(word[3:])
                except ValueError:
                    rc = None
                sections[name] = Section("\n".join(lines), rc)
                name, lines = None, []
            else:
                name, lines = word, []
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = Section("\n".join(lines), None)   # cut off mid-section
    return sections


def parse_listeners(text: str) -> list[Listener]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].isdigit():
            out.append(Listener(int(parts[0]), parts[1], parts[2] if len(parts) > 2 else ""))
    return out


@dataclass(frozen=True)
class Preflight:
    probe: ProbeReport
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return self.probe.compatible and all(c.ok for c in self.checks)

    def all_checks(self) -> tuple[Check, ...]:
        status = "pass" if self.probe.compatible else "fail"
        return (Check("sglang", status, self.probe.summary()), *self.checks)


def parse_preflight(stdout: str, *, unit: str, port: int, tp: int, places: Sequence[disk.Need],
                    hicache_enabled: bool = False, hicache_ratio: float | None = None,
                    hicache_size_gb: float | None = None, device_kv_gb_per_rank: float | None = None,
                    environment_file: str | None = None, secrets_written: bool = False) -> Preflight:
    """Every check from the output of :func:`preflight_command`. The device KV GB per rank comes from the
    inventory (``hicache.device_kv_gb_per_rank``) when given, else from the last run's journal line."""
    s = parse_sections(stdout)
    empty = Section("", None)
    probe_s = s.get("probe", empty)
    probe = parse_probe(probe_s.text, "", probe_s.rc if probe_s.rc is not None else 1)
    nv = s.get("nvidia-smi", empty)
    mem = s.get("meminfo", empty)
    port_s = s.get("port", empty)
    kv_source = "inventory"
    if device_kv_gb_per_rank is None:
        device_kv_gb_per_rank = parse_kv_cache_gb(s.get("journal", empty).text)
        kv_source = "the last run's journal"
    checks = (
        Check("disk", *disk.verdict(places, [_measured(s.get(_place(n), empty)) for n in places])),
        check_gpus(nv.text if nv.rc is not None else None, nv.rc if nv.rc is not None else 127, tp),
        check_hicache(enabled=hicache_enabled, ranks=tp, mem_available_bytes=parse_mem_available(mem.text),
                      ratio=hicache_ratio, size_gb=hicache_size_gb, device_kv_gb_per_rank=device_kv_gb_per_rank,
                      kv_source=kv_source),
        check_port(port, unit, parse_listeners(port_s.text) if port_s.rc == 0 else None),
    )
    envfile = check_environment_file(environment_file, s.get("envfile", empty).text.strip() or None,
                                     secrets_written)
    return Preflight(probe, (*checks, envfile) if envfile else checks)


def _place(need: disk.Need) -> str:
    """The preflight's section of one place: disk:releases, disk:units, ..."""
    return f"disk:{need.what}"


def _measured(section: Section) -> disk.Filesystem | None:
    return disk.parse(section.text) if section.rc == 0 else None


def probe_step(python: str) -> Step[ProbeReport]:
    """``probe_command`` as a step: its report says what failed, so no exit status ends it."""
    return Step(probe_command(python), lambda out: parse_probe(out.stdout, out.stderr, out.rc), 60)
