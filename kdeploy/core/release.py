"""Releases on a host: payload manifests, the delta to ship, and the scripts that stage and switch them.

Remote layout, per service::

    <remote_root>/<service>/releases/<UTC time>-<hash>/   payload files + .kdeploy/ (manifest.sha256, modes,
                                                           files, unit.service, unit.sha256, unit.name)
    <remote_root>/<service>/current -> releases/<id>       swapped atomically (temp link + rename)
    <remote_root>/<service>/history.jsonl                  one line per deploy

Each script is one round trip and leaves the host unchanged when it fails half way: staging happens in
``releases/.staging-*`` (removed on the next push), and only a rename makes anything visible.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path, PurePosixPath

from kdeploy import onhost
from kdeploy.core import disk, files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.layout import CURRENT, META, RELEASES, STAGING
from kdeploy.core.report import PhaseFailed
from kdeploy.core.step import RunResult, Step
from kdeploy.core.systemd import UNIT_DIR, parse_old_run, restart_command, stop_command
from kdeploy.core.text import first_unsafe

NOT_SWITCHED_RC = 75  # the activation failed before the switch: nothing the service reads changed (EX_TEMPFAIL)
_SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache", META}
_SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class LocalFile:
    path: str  # relative, "/"-separated
    sha256: str
    size: int
    mode: int  # what the host gets: 0o755 when its owner may execute it here, else 0o644
    source: Path


@dataclass(frozen=True)
class Payload:
    root: Path
    files: dict[str, LocalFile]

    @property
    def manifest(self) -> dict[str, str]:
        return {p: f.sha256 for p, f in self.files.items()}

    @property
    def modes(self) -> dict[str, int]:
        return {p: f.mode for p, f in self.files.items()}

    @property
    def identity(self) -> dict[str, str]:
        """What decides whether a file changed on the host: content and mode (``file_identity``)."""
        return file_identity(self.manifest, self.modes)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


def _walk(root: Path) -> list[Path]:
    """Every file under ``root``, through symlinked files and directories, caches skipped, in the order of
    their paths. Iterative, so that a payload nested however deep is no recursion, and a directory or file that
    cannot be read is one line naming it.

    A broken symlink or one that leads back to a directory it is in is refused: skipping either would ship
    a payload without something that was put in it.
    """
    found: list[Path] = []
    st = files.status(root, "payload directory")
    todo = [(root, {(st.st_dev, st.st_ino): root})] if st is not None else []
    while todo:
        directory, ancestors = todo.pop()
        for path in (directory / name for name in files.listdir(directory, "payload directory")):
            if path.name in _SKIP_DIRS:
                continue
            if os.path.islink(path) and not os.path.exists(path):  # a link that leads nowhere, or to itself
                raise InvalidInput(f"{path}: broken symlink in the payload (-> {os.readlink(path)})")
            st = files.status(path, "payload file")
            if st is None:  # gone since the listing
                continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in ancestors:
                    raise InvalidInput(f"{path}: symlink cycle in the payload (the same directory as "
                                       f"{ancestors[key]}, which contains it)")
                todo.append((path, {**ancestors, key: path}))
            elif stat.S_ISREG(st.st_mode) and path.suffix not in _SKIP_SUFFIXES:
                found.append(path)
    return sorted(found, key=lambda path: path.parts)


def scan_payload(root: Path) -> Payload:
    """Hash every file of the payload directory (``_walk``) and fix its mode.

    Files land on the service's PYTHONPATH as root extracts them: a world-writable one would let any local
    user change the service's code, a setuid one would stay setuid. Those are refused; every other file
    gets 0644, or 0755 when its owner may execute it.
    """
    try:
        return _scan(root)
    except OSError as exc:  # a directory or file in it that cannot be read (permissions), named with its reason
        raise InvalidInput(f"{exc.filename or root}: cannot read the payload: {exc.strerror}") from None


def _scan(root: Path) -> Payload:
    if not files.is_dir(root, "payload directory"):
        raise InvalidInput(f"{root}: payload directory not found")
    found: dict[str, LocalFile] = {}
    for path in _walk(root):
        name = path.relative_to(root).as_posix()
        if "\\" in name or first_unsafe(name) is not None:
            raise InvalidInput(f"{path}: payload file names may not contain control characters or backslashes")
        if any("\udc80" <= c <= "\udcff" for c in name):  # bytes that are not UTF-8 (surrogate escapes)
            raise InvalidInput(f"{root}: payload file name {name.encode(errors='surrogateescape')!r} is not UTF-8 "
                               "(manifests, tar headers and the host's checks are UTF-8): rename it")
        mode = path.stat().st_mode  # _walk has looked at it already
        if mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH):
            raise InvalidInput(f"{path}: mode {stat.S_IMODE(mode):04o}: setuid, setgid and world-writable files "
                               "are refused in the payload (chmod it)")
        try:
            sha, size = _sha256_file(path)
        except OSError as exc:
            raise InvalidInput(f"{path}: cannot read payload file: {exc.strerror}") from None
        found[name] = LocalFile(name, sha, size, 0o755 if mode & stat.S_IXUSR else 0o644, path)
    if not found:
        raise InvalidInput(f"{root}: payload directory is empty")
    return Payload(root, found)


def changed_since_scan(payload: Payload, names: list[str]) -> list[str]:
    """Which of ``names`` no longer hold what ``scan_payload`` hashed (edited, or gone): told apart from a
    host-side failure when staging them failed."""
    changed = []
    for name in names:
        try:
            sha, _ = _sha256_file(payload.files[name].source)
        except OSError:
            changed.append(name)
            continue
        if sha != payload.files[name].sha256:
            changed.append(name)
    return changed


def manifest_text(manifest: dict[str, str]) -> str:
    """``sha256sum -c`` format, sorted, so the host can verify what arrived."""
    return "".join(f"{sha}  ./{path}\n" for path, sha in sorted(manifest.items()))


def parse_manifest(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        sha, sep, path = line.partition("  ")
        if sep and len(sha) == 64:
            out[path.removeprefix("./")] = sha
    return out


def _in_file_order(paths: dict[str, object]) -> list[str]:
    """Byte order of ``./path``, as ``LC_ALL=C sort`` lists the staged files on the host."""
    return sorted(paths, key=lambda p: f"./{p}".encode())


def modes_text(modes: dict[str, int]) -> str:
    """``.kdeploy/modes``: ``0644 ./path`` per file, as ``find -printf '%#m %p'`` prints them on the host."""
    return "".join(f"{modes[p]:04o} ./{p}\n" for p in _in_file_order(modes))


def parse_modes(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        mode, sep, path = line.partition(" ")
        if sep and path.startswith("./") and len(mode) >= 4 and set(mode) <= set("01234567"):
            out[path.removeprefix("./")] = int(mode, 8)
    return out


def file_identity(manifest: dict[str, str], modes: dict[str, int]) -> dict[str, str]:
    """Per file, ``"<sha256> <mode>"``: a file changed when either did. A file without a recorded mode (a
    release staged before modes were recorded) matches nothing, so it ships once more, with its mode."""
    return {p: f"{sha} {modes[p]:04o}" if p in modes else f"{sha} ?" for p, sha in manifest.items()}


def parse_identity(manifest: str, modes: str) -> dict[str, str]:
    """The host's side of ``Payload.identity``, from a release's ``manifest.sha256`` and ``modes``."""
    return file_identity(parse_manifest(manifest), parse_modes(modes))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Delta:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def upload(self) -> list[str]:
        return sorted(self.added + self.changed)

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.removed)

    def describe(self) -> str:
        return f"+{len(self.added)} ~{len(self.changed)} -{len(self.removed)} ={len(self.unchanged)}"


def diff(local: dict[str, str], remote: dict[str, str]) -> Delta:
    return Delta(
        added=sorted(p for p in local if p not in remote),
        changed=sorted(p for p in local if p in remote and remote[p] != local[p]),
        removed=sorted(p for p in remote if p not in local),
        unchanged=sorted(p for p in local if remote.get(p) == local[p]),
    )


RELEASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # what release_id makes, and older ids too


def check_name(value: str, option: str) -> str:
    """A release named by the user (``rollback --to``): a name a release directory can have, checked before any
    host is contacted (no path, no staging directory, nothing a line could be forged with)."""
    if not RELEASE_NAME.fullmatch(value):
        raise InvalidInput(f"{option} {value!r}: not a release id (like 20261206T020000.000Z-1a2b3c4d; "
                           "`kdeploy history` lists them)")
    return value


def release_id(manifest: dict[str, str], unit_text: str, now: datetime | None = None) -> str:
    """``<UTC time to the millisecond>-<hash>``: ids sort in the order they were made (pruning and the
    rollback fallback rely on it), also for pushes within one second."""
    now = now or datetime.now(UTC)
    digest = sha256_text(manifest_text(manifest) + "\0" + unit_text)[:8]
    return f"{now:%Y%m%dT%H%M%S}.{now.microsecond // 1000:03d}Z-{digest}"


CHUNK = 1024 * 1024  # what hashing and the tar stream hold of a file at a time


def _sha256_file(path: Path) -> tuple[str, int]:
    """The file's sha256 and size, read in chunks (payloads carry objects of hundreds of MB)."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class TarStream:
    """The files to ship (with their normalised modes) plus the release metadata, as one uncompressed tar
    stream, produced in chunks of at most ``CHUNK`` bytes as the upload asks for them: memory stays bounded
    whatever the payload's size. The service reads the payload; the metadata is kdeploy's own, for root only
    (0700/0600). A file whose size changed since the scan raises OSError (its content is checked on the host)."""

    def __init__(self, payload: Payload, upload: list[str], meta: dict[str, str]) -> None:
        self.payload, self.upload, self.meta = payload, upload, meta
        self.sent = 0  # bytes handed out so far

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._blocks():
            self.sent += len(chunk)
            yield chunk

    def _blocks(self) -> Iterator[bytes]:
        for name in self.upload:
            src, size = self.payload.files[name].source, self.payload.files[name].size
            with src.open("rb") as fh:
                info = _tar_info(name, size, self.payload.files[name].mode)
                info.mtime = int(os.fstat(fh.fileno()).st_mtime)
                yield info.tobuf(tarfile.PAX_FORMAT)
                left = size
                while left:
                    chunk = fh.read(min(CHUNK, left))
                    if not chunk:
                        raise OSError(f"{src}: file shrank while it was read")
                    left -= len(chunk)
                    yield chunk
                if fh.read(1):
                    raise OSError(f"{src}: file grew while it was read")
            yield _padding(size)
        meta_dir = _tar_info(META, 0, 0o700)
        meta_dir.type = tarfile.DIRTYPE
        yield meta_dir.tobuf(tarfile.PAX_FORMAT)
        for name, text in self.meta.items():
            data = text.encode()
            yield _tar_info(f"{META}/{name}", len(data), 0o600).tobuf(tarfile.PAX_FORMAT) + data + _padding(len(data))
        yield bytes(2 * tarfile.BLOCKSIZE)  # end of archive


def _tar_info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _padding(size: int) -> bytes:
    return bytes(-size % tarfile.BLOCKSIZE)


_VERIFY_CODE = onhost.source("verify_release.py")  # runs on the host: kdeploy/onhost/verify_release.py


def stage_script(service_dir: str, release: str, has_current: bool, delta: Delta) -> str:
    """Build releases/<release> from hard links to ``current`` plus the tar on stdin, then verify it."""
    d = shlex.quote(service_dir)
    staging = f"{d}/{RELEASES}/{STAGING}{release}"
    drop = delta.changed + delta.removed
    lines = [
        "set -eu",
        "umask 022",
        # On any failure: no staging dir is left, and what the filesystem of releases/ had left when it failed
        # (blocks and inodes, before the staging dir is removed) is said: a full disk is the usual cause.
        f"failed() {{ rc=$?; ( {disk.measure(f'{service_dir}/{RELEASES}')} ) 2>/dev/null | "
        f"sed 's/^/{FREE_MARK}/' >&2 || :; rm -rf {staging}; exit $rc; }}",
        "trap failed EXIT",
        f"rm -rf {d}/{RELEASES}/{STAGING}*",
        f"mkdir -p {staging}",
    ]
    if has_current:
        lines.append(f"cp -al {d}/{CURRENT}/. {staging}/")
    lines += [f"cd {staging}", f"rm -rf {META}",
              "find . -name __pycache__ -type d -prune -exec rm -rf {} +"]
    if drop:
        lines.append("rm -f -- " + " ".join(shlex.quote(p) for p in drop))
    lines += [
        "tar -x --no-same-owner -f -",
        f"sha256sum -c --quiet --strict {META}/unit.sha256",
        f"find . -type f ! -path './{META}/*' | LC_ALL=C sort > {META}/found",
        f"cmp -s {META}/files {META}/found || {{ echo 'staged files differ from the manifest' >&2; exit 1; }}",
        f"find . -type f ! -path './{META}/*' -printf '%#m %p\\n' | LC_ALL=C sort -k2 | cmp -s {META}/modes - "
        "|| { echo 'staged file modes differ from the manifest' >&2; exit 1; }",
        "find . -mindepth 1 -type d -empty -delete",
        f"rm -f {META}/found",
        # Verified and durable before it is visible: only what this upload wrote (one link: not shared with
        # `current`) and the directories are synced; `sync -f` (syncfs) waited for every dirty page of the whole
        # filesystem, anyone's. Hosts without python3 get coreutils, one file after the other.
        "if command -v python3 >/dev/null 2>&1; then",
        f"  python3 -I -c {shlex.quote(_VERIFY_CODE)} {META}/manifest.sha256",
        "else",
        f"  sha256sum -c --quiet --strict {META}/manifest.sha256",
        "  find . \\( -type d -o -type f -links 1 \\) -exec sync -- {} +",
        "fi",
        f"mv -T {staging} {d}/{RELEASES}/{shlex.quote(release)}",
        "trap - EXIT",
        "echo STAGED",
    ]
    return "\n".join(lines) + "\n"


FREE_MARK = "kdeploy-free: "  # each line of the stage failure's measure of releases/ (disk.measure)


_STAGE_CAUSES = ("No space left", "Disk quota exceeded", "Read-only file system")


@dataclass(frozen=True)
class StageFailure:
    """Why staging failed (the host is unchanged: the staging directory is gone) and what the filesystem of
    ``releases/`` had left then."""

    error: str
    room: disk.Filesystem | None = None

    @property
    def disk_full(self) -> bool:
        return any(c in self.error for c in _STAGE_CAUSES[:2])

    def describe(self, where: str) -> str:
        """One line; a full disk says which ran out, inodes (a filesystem with bytes free can still refuse a
        new file: ENOSPC either way) or blocks, with its number."""
        room = self.room
        if self.disk_full and room is not None and room.free_inodes == 0:
            return (f"out of inodes on the host at {where}, 0 inodes free ({room.free_bytes} bytes free), host "
                    f"unchanged (staging removed): {self.error}")
        if self.disk_full:
            free = f", {room.free_bytes} bytes free" if room is not None else ""
            return f"disk full on the host at {where}{free}, host unchanged (staging removed): {self.error}"
        if _STAGE_CAUSES[2] in self.error:
            return f"read-only file system at {where}, host unchanged: {self.error}"
        return f"staging failed, host unchanged: {self.error}"


def parse_stage_failure(stderr: str, rc: int) -> StageFailure:
    """The stage script's error (the last line naming a cause, else its last line but tar's closing one), and
    the measure of releases/ its failure handler printed."""
    measured, lines = [], []
    for line in stderr.splitlines():
        if line.startswith(FREE_MARK):
            measured.append(line.removeprefix(FREE_MARK))
        elif line.strip():
            lines.append(line.strip())
    causes = [line for line in lines if any(c in line for c in _STAGE_CAUSES)]
    said = causes or [line for line in lines if not line.startswith("tar: Exiting with failure status")] or lines
    return StageFailure(said[-1] if said else f"exit status {rc}", disk.parse("\n".join(measured)))


def entries(files: Mapping[str, object]) -> int:
    """Files and directories of a release (each needs an inode where the filesystem counts them)."""
    return len(files) + len({str(PurePosixPath(p).parent) for p in files})


def release_meta(manifest: dict[str, str], modes: dict[str, int], unit_text: str, unit_name: str,
                 gate: str = "") -> dict[str, str]:
    """The release's own record: what to verify it against, its unit, and what its gate checks (``gate``:
    a GateSpec as JSON, so a rollback to it is gated the way it was deployed)."""
    return {
        **({"gate.json": gate + "\n"} if gate else {}),
        "manifest.sha256": manifest_text(manifest),
        "modes": modes_text(modes),
        "files": "".join(f"./{p}\n" for p in _in_file_order(manifest)),
        "unit.service": unit_text,
        "unit.sha256": f"{sha256_text(unit_text)}  {META}/unit.service\n",
        "unit.name": unit_name + "\n",
    }


def activate_script(service_dir: str, release: str, unit_file: str, install_unit: bool, arm: str = "",
                    env_step: str = "", restart: bool = True) -> str:
    """Point ``current`` at ``release`` and restart on it; with ``install_unit``, install that release's own
    unit and reload.

    ``arm`` (``provisional.arm_script``) runs first, so no switch is ever left without its revert (a server's
    nodes are armed ahead instead, every node before any moves: ``arm_step``); then
    ``env_step`` (``kdeploy.core.secrets``: write stdin into the environment file, or restore it). The
    unit is copied to a temp name in the unit directory, checked against the release's recorded sha256,
    made 0644 like any unit file (the release's copy is root's only), then renamed over the live one, so
    systemd never sees a half-written unit. Only then, with every step that can refuse behind it, the old
    run is asked to stop; the reload (~0.1 s of systemd's CPU, more on a busy host) runs while it stops, and
    a restart job takes over the stop (``systemd.stop_command``, ``systemd.restart_command``): the restart
    costs the service's own stop and start, nothing of kdeploy's. From the stop on, the script ignores the
    signals a lost SSH session or a killed controller could bring and no longer exits on the first error, so
    a stopped service is always restarted (a failed reload still fails the activation, after the restart).
    Without ``restart`` (a node of a server that spans hosts) the old run is only asked to stop: the server
    starts its nodes once every old run is gone (``systemd.start_step``), so no old follower, still waiting
    for a head, joins the new group.
    """
    d = shlex.quote(service_dir)
    rel = f"{d}/{RELEASES}/{shlex.quote(release)}"
    lines = [*_refusable(service_dir, release, arm), *([env_step] if env_step else [])]
    if install_unit:
        tmp = shlex.quote(f"{UNIT_DIR}/.{unit_file}.kdeploy-tmp")
        lines += [
            f"cp {rel}/{META}/unit.service {tmp}",
            f'echo "$(cut -c1-64 {rel}/{META}/unit.sha256)  "{tmp} | sha256sum -c --quiet --strict'
            f" || {{ rm -f {tmp}; exit 1; }}",
            f"chmod 0644 {tmp}",
            f"mv -T {tmp} {shlex.quote(f'{UNIT_DIR}/{unit_file}')}",
        ]
    lines += [
        f"ln -sfn {RELEASES}/{shlex.quote(release)} {d}/.{CURRENT}.tmp",
        f"mv -T {d}/.{CURRENT}.tmp {d}/{CURRENT}",
        "trap '' HUP PIPE TERM INT",
        stop_command(unit_file),
        "set +e",
        " && ".join([f"{{ {_enable_command(unit_file, reload=not install_unit)}; }}",
                     *(["systemctl daemon-reload"] if install_unit else [])]) + "; rc=$?",
        *([f"{restart_command(unit_file)} || rc=1"] if restart else []),
        '[ "$rc" = 0 ] && echo ACTIVATED; exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _refusable(service_dir: str, release: str, arm: str) -> list[str]:
    """The release is there, then ``arm``: until the revert is armed nothing the service reads has changed, so a
    failure there (a full disk) exits NOT_SWITCHED_RC, and the host is as it was."""
    rel = f"{shlex.quote(service_dir)}/{RELEASES}/{shlex.quote(release)}"
    return ["set -eu", f"trap 'exit {NOT_SWITCHED_RC}' EXIT", f"test -d {rel}",
            *([f"{{\n{arm}\n}} </dev/null"] if arm else []), "trap - EXIT"]


def _enable_command(unit_file: str, *, reload: bool) -> str:
    """Enable only a unit that is not enabled yet: `systemctl enable` rescans every unit file and reloads the
    manager even when nothing changes (0.2-0.3 s on an idle host, where `is-enabled` takes 6 ms). Without
    ``reload`` the caller's own daemon-reload follows."""
    u = shlex.quote(unit_file)
    return (f'[ "$(systemctl is-enabled {u} 2>/dev/null)" = enabled ] || '
            f"systemctl enable --quiet{'' if reload else ' --no-reload'} {u}")


def releases_to_prune(releases: list[str], keep: int, protect: set[str]) -> list[str]:
    """Oldest releases beyond the newest ``keep``; the current and previous ones are never pruned."""
    ordered = sorted(r for r in releases if not r.startswith("."))
    return [r for r in ordered[:-keep] if r not in protect] if len(ordered) > keep else []


def prune_command(service_dir: str, releases: list[str]) -> str:
    if not releases:
        return ""
    d = shlex.quote(service_dir)
    return "rm -rf -- " + " ".join(f"{d}/{RELEASES}/{shlex.quote(r)}" for r in releases)


def stage_step(service_dir: str, release: str, has_current: bool, delta: Delta) -> Step[StageFailure | None]:
    """``stage_script`` as a step (its tar comes on stdin): None once staged, else why not."""
    return Step(stage_script(service_dir, release, has_current, delta),
                lambda out: None if out.ok and "STAGED" in out.stdout else parse_stage_failure(out.stderr, out.rc),
                600)


class SwitchRefused(PhaseFailed):
    """The activation failed before anything the service reads changed (its revert could not be armed): the host
    is as it was, its last confirmed release still runs. ``first``: no node of the server had switched before."""

    def __init__(self, detail: str, first: bool = True) -> None:
        super().__init__(detail)
        self.first = first


def _raise_failure(release: str, out: RunResult) -> None:
    """A failed activation (or its arming alone) raises, :class:`SwitchRefused` when nothing was switched."""
    if out.rc == NOT_SWITCHED_RC:
        raise SwitchRefused(f"switching to {release} was refused on the host, nothing changed: {out.last_error()}")
    if not out.ok:
        raise PhaseFailed(f"switching to {release} failed: {out.last_error()}")


def parse_activation(release: str, out: RunResult) -> str:
    """The run the activation replaces (``systemd.parse_old_run``)."""
    _raise_failure(release, out)
    return parse_old_run(out.stdout)


def arm_step(service_dir: str, release: str, arm: str) -> Step[None]:
    """The start of an activation alone: the revert of the switch to ``release`` armed ahead, on every node of a
    server before any of them moves."""
    return Step("\n".join(_refusable(service_dir, release, arm)) + "\n", partial(_raise_failure, release), 60)


def activate_step(service_dir: str, release: str, unit_file: str, install_unit: bool, arm: str = "",
                  env_step: str = "", restart: bool = True) -> Step[str]:
    """``activate_script`` as a step: the run it replaces."""
    return Step(activate_script(service_dir, release, unit_file, install_unit, arm, env_step, restart),
                partial(parse_activation, release), 120)
