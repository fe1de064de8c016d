"""Room on a host: where a push writes, what it needs there, what each filesystem has free, the verdict.

A push writes into ``releases/`` (its staging directory is one of them), the service directory (lock, history,
pending switch), the unit directory and, with ``service.secrets``, beside the environment file. Any of them may
be a filesystem of its own (a small one mounted on ``releases/``), so each is measured where it is, and the needs
of the places on one filesystem are summed against it: two places that each fit may not fit together. Blocks and
inodes both: a filesystem with space left but no free inode refuses a new file just the same.

:func:`measure` builds the shell that measures a place (``df`` and ``stat`` print alike in GNU coreutils and
busybox), :func:`parse` reads it, :func:`verdict` decides.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kdeploy.core.layout import RELEASES, service_dir
from kdeploy.core.systemd import UNIT_DIR

if TYPE_CHECKING:
    from kdeploy.core.inventory import Service

MIB = 1024**2
RELEASE_MARGIN_BYTES = 64 * MIB  # besides the upload: the release's metadata, and room for the service's own files
RELEASE_MARGIN_INODES = 16       # besides the release's entries: the staging directory, .kdeploy/ and its files
SMALL_BYTES = 1 * MIB            # the unit, history line, lock and pending files, the environment file


@dataclass(frozen=True)
class Need:
    """What a push writes at ``path`` (measured at its nearest existing ancestor: a first deploy creates it)."""

    what: str    # releases, service, units, secrets
    path: str
    bytes: int
    inodes: int


@dataclass(frozen=True)
class Filesystem:
    """One filesystem as ``df`` sees it. ``dev`` (``stat``'s device number) is its identity: the places with one
    number are summed (an overlay or a btrfs subvolume has a number of its own, though it shares its space)."""

    dev: int
    type: str
    mount: str
    free_bytes: int           # available to an unprivileged writer, as df says
    free_inodes: int | None   # None where the filesystem counts no inodes (btrfs)


def needs(service: Service, upload_bytes: int = 0, entries: int = 0) -> tuple[Need, ...]:
    """Every place a push writes on the host, with what it needs there: ``upload_bytes`` and ``entries`` (the new
    release's files and directories: tmpfs counts a hard link as an inode too) in releases, a little elsewhere."""
    sd = service_dir(service)
    places = [Need("releases", f"{sd}/{RELEASES}", upload_bytes + RELEASE_MARGIN_BYTES,
                   entries + RELEASE_MARGIN_INODES),
              Need("service", sd, SMALL_BYTES, 16),   # history, lock files, pending, revert scripts, probe cache
              Need("units", UNIT_DIR, SMALL_BYTES, 8)]  # the unit, its temp, the boot guard and its .wants link
    if service.secrets.configured and service.environment_file:  # the file and its temp beside it
        places.append(Need("secrets", service.environment_file, SMALL_BYTES, 4))
    return tuple(places)


def measure(path: str) -> str:
    """Shell printing the filesystem of ``path``'s nearest existing ancestor: its device number, ``df -P -T -B1``'s
    line (type, bytes available, mount point) and ``df -P -i``'s (inodes); read by :func:`parse`."""
    return (f"d={shlex.quote(path)}; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; "
            "stat -L -c %d \"$d\" && df -P -T -B1 \"$d\" | tail -n 1 && df -P -i \"$d\" | tail -n 1")


def parse(text: str) -> Filesystem | None:
    """:func:`measure`'s three lines; None where any is missing or unreadable."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 3:
        return None
    blocks, inodes = lines[1].split(None, 6), lines[2].split()
    try:
        dev, fstype, avail, mount = int(lines[0]), blocks[1], int(blocks[4]), blocks[6]
        total, free = int(inodes[1]), int(inodes[3])
    except (IndexError, ValueError):
        return None
    return Filesystem(dev, fstype, mount, avail, None if total == 0 else free)


def size(n: float) -> str:
    """Bytes in binary units: 512 B, 41.2 GiB."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def count(n: int) -> str:
    """A count as people read it: 840, 9999, 12.3k, 2.1M."""
    if n < 10_000:
        return str(n)
    return f"{n / 1000:.1f}k" if n < 1_000_000 else f"{n / 1_000_000:.1f}M"


def verdict(places: Sequence[Need], found: Sequence[Filesystem | None]) -> tuple[str, str]:
    """``pass``, ``warn`` or ``fail`` and the numbers. The places on one filesystem are summed against its free
    blocks and (where it counts them) inodes: ``fail`` when they do not fit, ``warn`` under twice the need or
    where a place could not be measured. The detail names the filesystems at the worst status (every one when
    all pass)."""
    groups: dict[int, tuple[Filesystem, list[Need]]] = {}
    unknown: list[Need] = []
    for need, fs in zip(places, found, strict=True):
        if fs is None:
            unknown.append(need)
        else:
            groups.setdefault(fs.dev, (fs, []))[1].append(need)
    rows = [_fits(fs, on) for fs, on in groups.values()]
    rows += [("warn", f"{n.what} {n.path}: free space unknown") for n in unknown]
    worst = next((s for s in ("fail", "warn") if any(status == s for status, _ in rows)), "pass")
    return worst, " | ".join(text for status, text in rows if status == worst)


def _fits(fs: Filesystem, on: Sequence[Need]) -> tuple[str, str]:
    """One filesystem against the summed needs of the places on it."""
    want_bytes, want_inodes, inodes = sum(n.bytes for n in on), sum(n.inodes for n in on), fs.free_inodes
    short = [what for what, lacks in (("space", fs.free_bytes < want_bytes),
                                      ("inodes", inodes is not None and inodes < want_inodes)) if lacks]
    tight = fs.free_bytes < 2 * want_bytes or (inodes is not None and inodes < 2 * want_inodes)
    status = "fail" if short else "warn" if tight else "pass"
    free = size(fs.free_bytes) + (f", {count(inodes)} inodes" if inodes is not None else "")
    want = size(want_bytes) + (f", {count(want_inodes)} inodes" if inodes is not None else "")
    where = ", ".join(f"{n.what} {n.path}" for n in on)
    say = {"fail": f": not enough {' nor '.join(short)}", "warn": ": tight", "pass": ""}[status]
    return status, f"{where} ({fs.type} at {fs.mount}): {free} free; need {want}{say}"
