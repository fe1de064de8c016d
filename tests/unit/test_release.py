"""kdeploy/core/release.py: manifests, deltas, release ids, pruning, and the stage/activate scripts RUN for real
with sh (as on a host) in a temp dir playing the service dir (only systemctl is a fake that records its arguments)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kdeploy.core import release as release_module
from kdeploy.core.disk import Filesystem
from kdeploy.core.errors import InvalidInput
from kdeploy.core.release import (
    META,
    Delta,
    StageFailure,
    TarStream,
    activate_script,
    changed_since_scan,
    diff,
    manifest_text,
    parse_identity,
    parse_manifest,
    parse_stage_failure,
    prune_command,
    release_id,
    release_meta,
    releases_to_prune,
    scan_payload,
    sha256_text,
    stage_script,
)
from kdeploy.core.systemd import UNIT_DIR, parse_old_run

UNIT = "svc.service"
STOP = [f"show -p InvocationID --value {UNIT}", f"stop --no-block {UNIT}"]
START = f"restart --no-block {UNIT}"
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
SHA_A = "a" * 64
SHA_B = "b" * 64


def make_tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    return root


# --- scan_payload ------------------------------------------------------------------------------------------


def test_scan_payload_hashes_and_skips_caches(tmp_path):
    root = make_tree(tmp_path / "p", {
        "pkg/__init__.py": "x = 1\n", "pkg/data.bin": b"\x00\x01", "top.txt": "",
        "pkg/__pycache__/mod.cpython-311.pyc": b"junk", "pkg/stale.pyc": b"junk", "pkg/opt.pyo": b"junk",
        ".git/HEAD": "ref", f"{META}/manifest.sha256": "old", "pkg/.mypy_cache/x": "y",
    })
    (root / "emptydir").mkdir()
    payload = scan_payload(root)
    assert sorted(payload.files) == ["pkg/__init__.py", "pkg/data.bin", "top.txt"]
    assert payload.files["pkg/__init__.py"].sha256 == sha256_text("x = 1\n")
    assert payload.files["pkg/data.bin"].size == 2
    assert payload.size == 6 + 2 + 0
    assert payload.manifest == {p: f.sha256 for p, f in payload.files.items()}


def test_scan_payload_follows_symlinks(tmp_path):
    outside = make_tree(tmp_path / "outside", {"real.py": "real\n"})
    root = make_tree(tmp_path / "p", {"a.py": "a\n"})
    (root / "link.py").symlink_to(outside / "real.py")
    payload = scan_payload(root)
    assert payload.files["link.py"].sha256 == sha256_text("real\n")


def test_scan_payload_follows_symlinked_directories(tmp_path):
    outside = make_tree(tmp_path / "outside", {"lib/x.py": "x\n", "lib/sub/y.py": "y\n", "lib/__pycache__/z.pyc": ""})
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "pkg/b.py": "b\n"})
    (root / "lib").symlink_to(outside / "lib")
    (root / "alias").symlink_to("pkg")                     # a second name for a directory of the payload
    payload = scan_payload(root)
    assert sorted(payload.files) == ["a.py", "alias/b.py", "lib/sub/y.py", "lib/x.py", "pkg/b.py"]
    assert payload.files["lib/sub/y.py"].sha256 == sha256_text("y\n")


@pytest.mark.parametrize("target", ["missing.py", "missing-dir/", "self"])
def test_scan_payload_refuses_a_broken_symlink(tmp_path, target):
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "pkg/b.py": "b\n"})
    link = root / "pkg" / "self" if target == "self" else root / "pkg" / "link"
    link.symlink_to(target)
    with pytest.raises(InvalidInput) as err:
        scan_payload(root)
    assert str(err.value) == f"{link}: broken symlink in the payload (-> {target})"


@pytest.mark.parametrize("target", ["..", ".", "../.."])
def test_scan_payload_refuses_a_symlink_cycle(tmp_path, target):
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "pkg/b.py": "b\n"})
    (root / "pkg" / "loop").symlink_to(target)
    with pytest.raises(InvalidInput) as err:
        scan_payload(root)
    message = str(err.value)
    assert message.startswith(f"{root}/pkg/loop")
    assert ": symlink cycle in the payload (the same directory as " in message


def test_scan_payload_normalises_modes(tmp_path):
    local = {"ro.py": 0o400, "private.py": 0o600, "tool.sh": 0o700, "group.sh": 0o750, "shared.py": 0o664,
             "plain.py": 0o644, "other-exec": 0o645}
    root = make_tree(tmp_path / "p", dict.fromkeys(local, "x\n"))
    for name, mode in local.items():
        (root / name).chmod(mode)
    payload = scan_payload(root)
    assert payload.modes == {"ro.py": 0o644, "private.py": 0o644, "tool.sh": 0o755, "group.sh": 0o755,
                             "shared.py": 0o644, "plain.py": 0o644, "other-exec": 0o644}
    assert payload.identity["tool.sh"] == f"{sha256_text('x' + chr(10))} 0755"


@pytest.mark.parametrize("mode", [0o666, 0o602, 0o4755, 0o2755, 0o6711])
def test_scan_payload_refuses_setuid_setgid_and_world_writable(tmp_path, mode):
    root = make_tree(tmp_path / "p", {"ok.py": "", "pkg/sitecustomize.py": "x\n"})
    (root / "pkg/sitecustomize.py").chmod(mode)
    with pytest.raises(InvalidInput) as err:
        scan_payload(root)
    assert str(err.value) == (f"{root}/pkg/sitecustomize.py: mode {mode:04o}: setuid, setgid and world-writable "
                              "files are refused in the payload (chmod it)")


@pytest.mark.parametrize("name", ["new\nline.py", "car\rriage.py", "tab\there.py", "back\\slash.py"])
def test_scan_payload_rejects_bad_names(tmp_path, name):
    root = make_tree(tmp_path / "p", {"ok.py": "", name: "x"})
    with pytest.raises(InvalidInput, match="control characters or backslashes"):
        scan_payload(root)


def test_scan_payload_rejects_a_name_that_is_not_utf8(tmp_path):
    root = make_tree(tmp_path / "p", {"ok.py": ""})
    (root / os.fsdecode(b"\xff\xfe.txt")).write_text("x")
    with pytest.raises(InvalidInput, match=r"b'\\xff\\xfe\.txt' is not UTF-8"):
        scan_payload(root)


def test_scan_payload_empty_or_missing(tmp_path):
    root = make_tree(tmp_path / "p", {"__pycache__/x.pyc": b""})
    with pytest.raises(InvalidInput, match="payload directory is empty"):
        scan_payload(root)
    with pytest.raises(InvalidInput, match="payload directory not found"):
        scan_payload(tmp_path / "missing")


def test_changed_since_scan(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "b.py": "b\n", "c.py": "c\n", "d.py": "d\n"})
    payload = scan_payload(root)
    assert changed_since_scan(payload, ["a.py", "b.py", "c.py"]) == []
    (root / "a.py").write_text("A\n")                      # edited
    (root / "b.py").unlink()                               # removed
    (root / "d.py").write_text("D\n")                      # edited, but not among the files asked about
    (root / "c.py").chmod(0o755)                           # a mode change is not a content change
    assert changed_since_scan(payload, ["a.py", "b.py", "c.py"]) == ["a.py", "b.py"]


# --- manifests, diff, ids, pruning ------------------------------------------------------------------------------


def test_manifest_round_trip():
    manifest = {"b.py": SHA_B, "a/x y.py": SHA_A, "z/-dash": SHA_A}
    text = manifest_text(manifest)
    assert text == f"{SHA_A}  ./a/x y.py\n{SHA_B}  ./b.py\n{SHA_A}  ./z/-dash\n"
    assert parse_manifest(text) == manifest
    # junk lines (sha256sum's stderr, a short hash) are ignored
    assert parse_manifest("garbage\n" + text + "abc  ./short\n") == manifest
    assert parse_manifest("") == {}


def test_manifest_is_what_sha256sum_checks(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "d/b c.py": "b\n"})
    (root / "m").write_text(manifest_text(scan_payload(root).manifest))
    ok = subprocess.run(["sha256sum", "-c", "--strict", "m"], cwd=root, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (root / "a.py").write_text("changed\n")
    bad = subprocess.run(["sha256sum", "-c", "--strict", "m"], cwd=root, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "./a.py: FAILED" in bad.stdout


def test_diff():
    local = {"same": SHA_A, "changed": SHA_B, "added": SHA_A}
    remote = {"same": SHA_A, "changed": SHA_A, "removed": SHA_B}
    delta = diff(local, remote)
    assert delta == Delta(added=["added"], changed=["changed"], removed=["removed"], unchanged=["same"])
    assert delta.upload == ["added", "changed"]
    assert not delta.empty
    assert delta.describe() == "+1 ~1 -1 =1"
    same = diff(local, local)
    assert same.empty and same.upload == [] and same.unchanged == sorted(local)
    first = diff(local, {})
    assert first.added == sorted(local) and not (first.changed or first.removed)


def test_a_mode_change_is_a_change():
    local = {"same": f"{SHA_A} 0644", "exec": f"{SHA_A} 0755"}
    assert diff(local, {"same": f"{SHA_A} 0644", "exec": f"{SHA_A} 0644"}).changed == ["exec"]
    manifest = manifest_text({"same": SHA_A, "exec": SHA_A})
    assert parse_identity(manifest, "0644 ./same\n0755 ./exec\n") == local
    # a release staged before modes were recorded: each file differs once, so it ships again with its mode
    old = parse_identity(manifest, "")
    assert old == {"same": f"{SHA_A} ?", "exec": f"{SHA_A} ?"}
    assert diff(local, old).changed == ["exec", "same"]


def test_release_id():
    manifest = {"a.py": SHA_A}
    rid = release_id(manifest, "unit-1", T0)
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{8}", rid)
    assert rid.startswith("20250102T030405.000Z-")
    assert release_id(manifest, "unit-1", T0) == rid                       # deterministic
    assert release_id(manifest, "unit-2", T0) != rid                       # the unit text counts
    assert release_id({"a.py": SHA_B}, "unit-1", T0) != rid                # so does the payload
    assert release_id(manifest, "unit-1", T0 + timedelta(seconds=1))[:20] == "20250102T030406.000Z"
    later = release_id(manifest, "unit-1", T0 + timedelta(milliseconds=7))
    assert later[:20] == "20250102T030405.007Z" and later > rid            # same second: still in order
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{8}", release_id(manifest, "u"))    # now, in UTC


def test_releases_to_prune():
    ids = [f"2025010{i}T000000Z-0000000{i}" for i in range(1, 8)]     # 7 releases, oldest first
    shuffled = [ids[3], ids[0], ids[6], ".staging-x", ids[1], ids[5], ids[2], ids[4], ".tmp"]
    assert releases_to_prune(shuffled, 3, set()) == ids[:4]
    # a protected (current / previous) release is never pruned, however old
    assert releases_to_prune(shuffled, 3, {ids[1], ids[6]}) == [ids[0], ids[2], ids[3]]
    assert releases_to_prune(ids[:3], 3, set()) == []
    assert releases_to_prune([".staging-1", ".staging-2", ids[0]], 1, set()) == []


def test_prune_command():
    assert prune_command("/opt/k/svc", []) == ""
    assert prune_command("/opt/my k/svc", ["r1", "r 2"]) == (
        "rm -rf -- '/opt/my k/svc'/releases/r1 '/opt/my k/svc'/releases/'r 2'")


def test_release_meta():
    meta = release_meta({"b.py": SHA_B, "a.py": SHA_A, "B.py": SHA_A}, {"b.py": 0o644, "a.py": 0o755, "B.py": 0o644},
                        "[Unit]\n", UNIT)
    assert meta["files"] == "./B.py\n./a.py\n./b.py\n"           # byte order, like `LC_ALL=C sort`
    assert meta["modes"] == "0644 ./B.py\n0755 ./a.py\n0644 ./b.py\n"
    assert meta["unit.service"] == "[Unit]\n"
    assert meta["unit.sha256"] == f"{sha256_text('[Unit]' + chr(10))}  {META}/unit.service\n"
    assert meta["unit.name"] == "svc.service\n"
    assert parse_manifest(meta["manifest.sha256"]) == {"b.py": SHA_B, "a.py": SHA_A, "B.py": SHA_A}


def test_tar_stream_contents(tmp_path):
    root = make_tree(tmp_path / "p", {"a.py": "a\n", "d/b.py": "b\n", "skip.py": "s\n"})
    payload = scan_payload(root)
    data = b"".join(TarStream(payload, ["a.py", "d/b.py"], {"x": "meta\n"}))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == ["a.py", "d/b.py", META, f"{META}/x"]
        assert all(m.isfile() and m.uid == 0 for name, m in members.items() if name != META)
        assert members["a.py"].uname == "root"
        assert members["a.py"].mode == 0o644
        assert (members[META].isdir(), members[META].mode, members[f"{META}/x"].mode) == (True, 0o700, 0o600)
        assert tar.extractfile("d/b.py").read() == b"b\n"


# --- the stage and activate scripts, run for real -----------------------------------------------------------


@dataclass
class Staged:
    release: str
    delta: Delta
    proc: subprocess.CompletedProcess[bytes]
    tarball: bytes


def remote_identity(sdir: Path) -> dict[str, str] | None:
    """What the state read gets from the host: the current release's manifest and modes."""
    current = sdir / "current"
    if not current.exists():
        return None
    modes = current / META / "modes"
    return parse_identity((current / META / "manifest.sha256").read_text(), modes.read_text() if modes.exists() else "")


def stage(sdir: Path, payload_root: Path, *, unit_text: str = "[Unit]\nDescription=v1\n",
          when: datetime = T0) -> Staged:
    """What push does: diff against the current release, ship the delta + meta, run stage_script."""
    payload = scan_payload(payload_root)
    remote = remote_identity(sdir)
    delta = diff(payload.identity, remote or {})
    rid = release_id(payload.manifest, unit_text, when)
    tarball = b"".join(TarStream(payload, delta.upload, release_meta(payload.manifest, payload.modes, unit_text, UNIT)))
    return Staged(rid, delta, run_script(stage_script(str(sdir), rid, remote is not None, delta), tarball), tarball)


def run_script(script: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], input=stdin, capture_output=True, timeout=60, check=False,
                          env=env)


@pytest.fixture
def fake_systemctl(tmp_path):
    """A `systemctl` that appends its arguments to a log, remembers `enable` for `is-enabled` and shows one
    run id: (env for the script, log path)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    log = tmp_path / "systemctl.log"
    enabled = tmp_path / "enabled"
    tool = bindir / "systemctl"
    tool.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                    f'case "$1" in enable) touch {enabled};; is-enabled) test -e {enabled} && echo enabled;;\n'
                    '  show) echo 0ld;; esac\n')
    tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    return env, log


def activate(sdir: Path, rid: str, unit_dir: Path, env: dict, install_unit: bool = True):
    script = activate_script(str(sdir), rid, UNIT, install_unit)
    if install_unit:
        assert UNIT_DIR in script
    # UNIT_DIR is baked in when the script is built: point it at a temp dir before running
    return run_script(script.replace(UNIT_DIR, str(unit_dir)), env=env)


def snapshot(tree: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under tree: (bytes, inode)."""
    return {p.relative_to(tree).as_posix(): (p.read_bytes(), p.stat().st_ino)
            for p in sorted(tree.rglob("*")) if p.is_file()}


def leftovers(sdir: Path) -> list[str]:
    return sorted(p.name for p in (sdir / "releases").iterdir() if p.name.startswith(".staging-"))


V1 = {"pkg/__init__.py": "init v1\n", "pkg/changed.py": "old\n", "pkg/removed.py": "bye\n",
      "pkg/sub/same.py": "same\n", "data/blob.bin": bytes(range(256)) * 8, "gone/only.py": "only\n"}


def test_first_stage(tmp_path):
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", V1)
    staged = stage(sdir, payload_root)
    assert staged.proc.returncode == 0, staged.proc.stderr.decode()
    assert staged.proc.stdout.decode().splitlines()[-1] == "STAGED"
    rel = sdir / "releases" / staged.release
    assert sorted((sdir / "releases").iterdir()) == [rel]           # no .staging-* left
    files = snapshot(rel)
    assert {name: data for name, (data, _) in files.items() if not name.startswith(META)} == {
        k: v.encode() if isinstance(v, str) else v for k, v in V1.items()}
    assert sorted(n for n in files if n.startswith(META)) == [
        f"{META}/files", f"{META}/manifest.sha256", f"{META}/modes", f"{META}/unit.name", f"{META}/unit.service",
        f"{META}/unit.sha256"]
    assert (rel / META / "unit.service").read_text() == "[Unit]\nDescription=v1\n"
    assert parse_manifest((rel / META / "manifest.sha256").read_text()) == scan_payload(payload_root).manifest
    # what the service reads is readable by any user; kdeploy's own metadata by root only
    assert {p.relative_to(sdir).as_posix(): p.stat().st_mode & 0o777 for p in [sdir, sdir / "releases", rel,
            rel / "pkg", rel / "pkg/sub", rel / META, rel / META / "files"]} == {
        ".": 0o755, "releases": 0o755, f"releases/{staged.release}": 0o755, f"releases/{staged.release}/pkg": 0o755,
        f"releases/{staged.release}/pkg/sub": 0o755, f"releases/{staged.release}/{META}": 0o700,
        f"releases/{staged.release}/{META}/files": 0o600}
    assert not (sdir / "current").exists()          # staging never switches anything


def test_second_stage_hard_links_unchanged_files(tmp_path, fake_systemctl):
    env, _ = fake_systemctl
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", V1)
    first = stage(sdir, payload_root)
    assert first.proc.returncode == 0, first.proc.stderr.decode()
    assert activate(sdir, first.release, tmp_path / "units", env, install_unit=False).returncode == 0
    rel1 = sdir / "releases" / first.release
    (rel1 / "pkg/__pycache__").mkdir()                                   # what Python writes at run time
    (rel1 / "pkg/__pycache__/x.cpython-311.pyc").write_bytes(b"bytecode")
    before = snapshot(rel1)

    (payload_root / "pkg/changed.py").write_text("new\n")
    (payload_root / "pkg/removed.py").unlink()
    (payload_root / "gone/only.py").unlink()
    (payload_root / "gone").rmdir()
    make_tree(payload_root, {"pkg/added.py": "added\n"})
    second = stage(sdir, payload_root, when=T0 + timedelta(minutes=1))
    assert second.proc.returncode == 0, second.proc.stderr.decode()
    assert second.delta.added == ["pkg/added.py"]
    assert second.delta.changed == ["pkg/changed.py"]
    assert second.delta.removed == ["gone/only.py", "pkg/removed.py"]
    with tarfile.open(fileobj=io.BytesIO(second.tarball)) as tar:        # only the delta travels
        assert sorted(n for n in tar.getnames() if not n.startswith(META)) == ["pkg/added.py", "pkg/changed.py"]

    rel2 = sdir / "releases" / second.release
    after = snapshot(rel2)
    for name in ("pkg/__init__.py", "pkg/sub/same.py", "data/blob.bin"):
        assert after[name][1] == before[name][1], f"{name} should be a hard link to the previous release"
    assert after["pkg/changed.py"] == (b"new\n", after["pkg/changed.py"][1])
    assert after["pkg/changed.py"][1] != before["pkg/changed.py"][1]
    assert after["pkg/added.py"][0] == b"added\n"
    assert "pkg/removed.py" not in after and "gone/only.py" not in after
    assert not (rel2 / "gone").exists()                                  # emptied directories go too
    assert not (rel2 / "pkg/__pycache__").exists()                       # caches are not carried over
    assert (rel2 / META / "files").read_text() == "".join(f"./{p}\n" for p in sorted(scan_payload(payload_root).files))
    assert snapshot(rel1) == before                                       # previous release untouched, byte for byte
    assert os.readlink(sdir / "current") == f"releases/{first.release}"
    assert leftovers(sdir) == []


def _flip_content(data: bytes) -> bytes:
    i = data.index(b"old\n")                    # pkg/changed.py's content in the tar stream
    return data[:i] + b"OLD\n" + data[i + 4:]


@pytest.mark.parametrize("case", ["truncated", "garbage", "content-flipped", "manifest-mismatch", "unit-mismatch",
                                  "file-not-in-manifest", "file-missing", "mode-mismatch"])
def test_failed_stage_leaves_nothing(tmp_path, case):
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", V1)
    good = stage(sdir, payload_root)
    assert good.proc.returncode == 0
    payload = scan_payload(payload_root)
    rid = release_id(payload.manifest, "[Unit]\n", T0 + timedelta(hours=1))
    meta = release_meta(payload.manifest, payload.modes, "[Unit]\n", UNIT)
    upload = sorted(payload.files)
    if case == "manifest-mismatch":
        meta["manifest.sha256"] = meta["manifest.sha256"].replace(payload.manifest["pkg/changed.py"], SHA_A)
    elif case == "unit-mismatch":
        meta["unit.service"] = "[Unit]\nDescription=tampered\n"
    elif case == "file-not-in-manifest":
        meta["files"] = meta["files"].replace("./pkg/removed.py\n", "")
        meta["manifest.sha256"] = "".join(
            line + "\n" for line in meta["manifest.sha256"].splitlines() if not line.endswith("removed.py"))
    elif case == "file-missing":
        upload.remove("pkg/removed.py")
    elif case == "mode-mismatch":
        meta["modes"] = meta["modes"].replace("0644 ./pkg/changed.py", "0755 ./pkg/changed.py")
    tarball = b"".join(TarStream(payload, upload, meta))
    if case == "truncated":
        tarball = tarball[:1500]
    elif case == "garbage":
        tarball = b"\x00not a tar\xff" * 100
    elif case == "content-flipped":
        tarball = _flip_content(tarball)
    # a fresh release (no current): everything comes from the tar
    proc = run_script(stage_script(str(sdir), rid, False, diff(payload.manifest, {})), tarball)
    assert proc.returncode != 0
    assert "STAGED" not in proc.stdout.decode()
    assert sorted(p.name for p in (sdir / "releases").iterdir()) == [good.release]
    if case == "file-not-in-manifest":
        assert "staged files differ from the manifest" in proc.stderr.decode()
    if case == "mode-mismatch":
        assert "staged file modes differ from the manifest" in proc.stderr.decode()


def modes_of(tree: Path) -> dict[str, int]:
    return {p.relative_to(tree).as_posix(): p.stat().st_mode & 0o7777
            for p in sorted(tree.rglob("*")) if p.is_file() and META not in p.parts}


def test_stage_normalises_modes_and_ships_a_mode_only_change(tmp_path, fake_systemctl):
    env, _ = fake_systemctl
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", {"a.py": "a\n", "bin/tool": "#!/bin/sh\n", "b.py": "b\n"})
    (payload_root / "a.py").chmod(0o600)
    (payload_root / "bin/tool").chmod(0o700)
    first = stage(sdir, payload_root)
    assert first.proc.returncode == 0, first.proc.stderr.decode()
    rel1 = sdir / "releases" / first.release
    assert modes_of(rel1) == {"a.py": 0o644, "b.py": 0o644, "bin/tool": 0o755}
    assert activate(sdir, first.release, tmp_path / "units", env, install_unit=False).returncode == 0

    (payload_root / "b.py").chmod(0o755)                      # only the mode changes
    second = stage(sdir, payload_root, when=T0 + timedelta(minutes=1))
    assert second.proc.returncode == 0, second.proc.stderr.decode()
    assert second.delta.changed == ["b.py"] and second.delta.unchanged == ["a.py", "bin/tool"]
    rel2 = sdir / "releases" / second.release
    assert modes_of(rel2) == {"a.py": 0o644, "b.py": 0o755, "bin/tool": 0o755}
    assert modes_of(rel1)["b.py"] == 0o644                    # a new file, not a chmod of the shared one


def test_stage_over_a_release_without_modes_ships_every_file_once(tmp_path, fake_systemctl):
    env, _ = fake_systemctl
    sdir = tmp_path / "svc"
    payload_root = make_tree(tmp_path / "payload", {"a.py": "a\n", "pkg/b.py": "b\n"})
    first = stage(sdir, payload_root)
    assert activate(sdir, first.release, tmp_path / "units", env, install_unit=False).returncode == 0
    (sdir / "releases" / first.release / META / "modes").unlink()     # as a release staged before modes
    second = stage(sdir, payload_root, when=T0 + timedelta(minutes=1))
    assert second.proc.returncode == 0, second.proc.stderr.decode()
    assert second.delta.changed == ["a.py", "pkg/b.py"]
    assert activate(sdir, second.release, tmp_path / "units", env, install_unit=False).returncode == 0
    assert stage(sdir, payload_root, when=T0 + timedelta(minutes=2)).delta.empty


def test_stage_removes_stale_staging_dirs(tmp_path):
    sdir = tmp_path / "svc"
    (sdir / "releases/.staging-20240101T000000Z-deadbeef/pkg").mkdir(parents=True)
    staged = stage(sdir, make_tree(tmp_path / "payload", {"a.py": "a\n"}))
    assert staged.proc.returncode == 0
    assert [p.name for p in (sdir / "releases").iterdir()] == [staged.release]


def test_stage_in_a_dir_with_spaces_never_touches_a_sibling(tmp_path):
    """The cleanup trap must remove `<service dir>/releases/.staging-*`, not a path cut at the space."""
    sibling = make_tree(tmp_path / "k", {"precious": "keep me\n"})
    sdir = tmp_path / "k dir" / "svc"
    payload_root = make_tree(tmp_path / "payload", {"a.py": "a\n"})
    payload = scan_payload(payload_root)
    rid = release_id(payload.manifest, "u", T0)
    tarball = b"".join(TarStream(payload, ["a.py"], release_meta(payload.manifest, payload.modes, "u", UNIT)))
    failed = run_script(stage_script(str(sdir), rid, False, diff(payload.manifest, {})), tarball[:700])
    assert failed.returncode != 0
    assert (sibling / "precious").read_text() == "keep me\n"
    assert list((sdir / "releases").iterdir()) == []
    ok = run_script(stage_script(str(sdir), rid, False, diff(payload.manifest, {})), tarball)
    assert ok.returncode == 0, ok.stderr.decode()
    assert (sdir / "releases" / rid / "a.py").read_text() == "a\n"


@pytest.fixture(params=["python3", "coreutils"])
def verifier(request, tmp_path) -> tuple[str, dict[str, str] | None]:
    """The stage script's two verifiers: the host's python3, or sha256sum + sync on a PATH without python."""
    if request.param == "python3":
        return request.param, None
    bindir = tmp_path / "nopython"
    bindir.mkdir()
    for d in filter(os.path.isdir, os.environ["PATH"].split(os.pathsep)):
        for tool in Path(d).iterdir():
            if not tool.name.startswith("python") and not (bindir / tool.name).exists():
                (bindir / tool.name).symlink_to(tool)
    return request.param, {**os.environ, "PATH": str(bindir)}


def test_stage_checks_every_byte_before_the_release_appears(tmp_path, verifier):
    kind, env = verifier
    big = os.urandom(3 << 20)
    payload = scan_payload(make_tree(tmp_path / "payload", {"a.py": "a\n", "d/big.bin": big}))
    rid = release_id(payload.manifest, "u", T0)
    delta = diff(payload.identity, {})
    tarball = b"".join(TarStream(payload, delta.upload, release_meta(payload.manifest, payload.modes, "u", UNIT)))
    at = tarball.index(big[:64]) + len(big) // 2
    corrupted = tarball[:at] + bytes([tarball[at] ^ 1]) + tarball[at + 1:]
    script = stage_script(str(tmp_path / "svc"), rid, False, delta)
    failed = run_script(script, corrupted, env)
    assert failed.returncode != 0
    failure = parse_stage_failure(failed.stderr.decode(), failed.returncode)
    assert failure.room is not None and failure.room.free_bytes > 0  # what the filesystem of releases/ has left
    if kind == "python3":
        assert failure.error == "1 staged file(s) differ from the manifest (sha256): ./d/big.bin"
    else:
        assert "./d/big.bin: FAILED" in failed.stdout.decode()
    assert list((tmp_path / "svc" / "releases").iterdir()) == []
    ok = run_script(script, tarball, env)
    assert ok.returncode == 0 and ok.stdout.decode().split() == ["STAGED"], ok.stderr.decode()
    assert (tmp_path / "svc" / "releases" / rid / "d" / "big.bin").read_bytes() == big


# The stage script's stderr when releases/ ran out mid-upload, captured on tmpfs: size=1m with 1000 inodes (a 3 MiB
# file), and nr_inodes=40 with 64 MiB (60 files); tar's lines abridged.
OUT_OF_BLOCKS = """\
tar: weights.bin: Wrote only 1536 of 10240 bytes
tar: .kdeploy/manifest.sha256: Cannot write: No space left on device
tar: .kdeploy/unit.name: Cannot write: No space left on device
tar: Exiting with failure status due to previous errors
kdeploy-free: 42
kdeploy-free: tmpfs          tmpfs  1048576 1048576         0     100% /tmp/kdcap/blk
kdeploy-free: tmpfs            1000    13   987    2% /tmp/kdcap/blk
"""
OUT_OF_INODES = """\
tar: m58.py: Cannot open: No space left on device
tar: m59.py: Cannot open: No space left on device
tar: .kdeploy: Cannot mkdir: No space left on device
tar: .kdeploy/unit.name: Cannot open: No such file or directory
tar: Exiting with failure status due to previous errors
kdeploy-free: 41
kdeploy-free: tmpfs          tmpfs 67108864 147456  66961408       1% /tmp/kdcap/ino
kdeploy-free: tmpfs              40    40     0  100% /tmp/kdcap/ino
"""


def test_a_stage_failure_names_a_full_or_read_only_disk_and_the_space_left():
    """A full disk says which ran out, blocks or inodes (ENOSPC either way), with the number left."""
    full = parse_stage_failure(OUT_OF_BLOCKS, 2)
    assert full == StageFailure("tar: .kdeploy/unit.name: Cannot write: No space left on device",
                                Filesystem(42, "tmpfs", "/tmp/kdcap/blk", 0, 987)) and full.disk_full
    assert full.describe("/srv/x/releases") == (
        "disk full on the host at /srv/x/releases, 0 bytes free, host unchanged (staging removed): "
        "tar: .kdeploy/unit.name: Cannot write: No space left on device")
    inodes = parse_stage_failure(OUT_OF_INODES, 2)
    assert inodes.describe("/srv/x/releases") == (
        "out of inodes on the host at /srv/x/releases, 0 inodes free (66961408 bytes free), host unchanged "
        "(staging removed): tar: .kdeploy: Cannot mkdir: No space left on device")
    readonly = parse_stage_failure("mkdir: cannot create directory '/srv/x/releases/.staging-1': Read-only file "
                                   "system\n", 1)
    assert readonly.describe("/srv/x/releases").startswith("read-only file system at /srv/x/releases, host unchanged")
    assert parse_stage_failure("", 9) == StageFailure("exit status 9", None)


def test_stage_ships_symlinked_files_as_files(tmp_path):
    outside = make_tree(tmp_path / "elsewhere", {"real.py": "real\n", "lib/deep.py": "deep\n"})
    payload_root = make_tree(tmp_path / "payload", {"a.py": "a\n"})
    (payload_root / "link.py").symlink_to(outside / "real.py")
    (payload_root / "lib").symlink_to(outside / "lib")
    sdir = tmp_path / "svc"
    staged = stage(sdir, payload_root)
    assert staged.proc.returncode == 0, staged.proc.stderr.decode()
    release = sdir / "releases" / staged.release
    for name, text in (("link.py", "real\n"), ("lib/deep.py", "deep\n")):
        assert not (release / name).is_symlink() and (release / name).read_text() == text
    assert not (release / "lib").is_symlink()


def test_activate_installs_unit_and_switches_current(tmp_path, fake_systemctl):
    env, log = fake_systemctl
    sdir = tmp_path / "svc"
    units = tmp_path / "units"
    units.mkdir()
    unit_text = "[Unit]\nDescription=v1 \"quoted\" 100%\n"
    staged = stage(sdir, make_tree(tmp_path / "payload", {"a.py": "a\n"}), unit_text=unit_text)
    proc = activate(sdir, staged.release, units, env, install_unit=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines()[-1] == "ACTIVATED"
    assert os.readlink(sdir / "current") == f"releases/{staged.release}"      # relative
    assert (sdir / "current" / "a.py").read_text() == "a\n"
    assert (units / UNIT).read_bytes() == unit_text.encode()
    assert (units / UNIT).stat().st_mode & 0o777 == 0o644                      # the release's copy is 0600
    assert sorted(p.name for p in units.iterdir()) == [UNIT]                   # no temp file left
    assert not (sdir / ".current.tmp").exists()
    # the old run is asked to stop only once the unit is in place; systemd reloads while it stops, and the
    # restart job takes over the stop
    assert log.read_text().splitlines() == [*STOP, f"is-enabled {UNIT}", f"enable --quiet --no-reload {UNIT}",
                                            "daemon-reload", START]
    assert parse_old_run(proc.stdout.decode()) == "0ld"
    log.unlink()
    assert activate(sdir, staged.release, units, env, install_unit=True).returncode == 0
    assert log.read_text().splitlines() == [*STOP, f"is-enabled {UNIT}", "daemon-reload", START]  # enabled already


def test_activate_restarts_a_stopped_service_whatever_happens_after_the_stop(tmp_path, fake_systemctl):
    """The session is hung up and terminated right after the stop, and the reload fails: the service is still
    restarted, and the activation still fails."""
    env, log = fake_systemctl
    tool = Path(env["PATH"].split(":")[0]) / "systemctl"
    tool.write_text(tool.read_text() + 'case "$1" in stop) kill -HUP $PPID; kill -TERM $PPID;; '
                                       'daemon-reload) exit 1;; esac\n')
    sdir = tmp_path / "svc"
    units = tmp_path / "units"
    units.mkdir()
    staged = stage(sdir, make_tree(tmp_path / "payload", {"a.py": "a\n"}))
    proc = activate(sdir, staged.release, units, env, install_unit=True)
    assert proc.returncode == 1 and "ACTIVATED" not in proc.stdout.decode()
    assert log.read_text().splitlines()[-2:] == ["daemon-reload", START]


def test_activate_without_unit_does_not_reload(tmp_path, fake_systemctl):
    env, log = fake_systemctl
    sdir = tmp_path / "svc"
    units = tmp_path / "units"
    units.mkdir()
    (units / UNIT).write_text("live unit\n")
    payload_root = make_tree(tmp_path / "payload", {"a.py": "a\n"})
    first = stage(sdir, payload_root)
    (payload_root / "a.py").write_text("b\n")
    second = stage(sdir, payload_root, when=T0 + timedelta(seconds=5))
    assert activate(sdir, first.release, units, env, install_unit=False).returncode == 0
    assert activate(sdir, second.release, units, env, install_unit=False).returncode == 0
    assert os.readlink(sdir / "current") == f"releases/{second.release}"
    assert (sdir / "current" / "a.py").read_text() == "b\n"
    assert (units / UNIT).read_text() == "live unit\n"
    assert log.read_text().splitlines() == [*STOP, f"is-enabled {UNIT}", f"enable --quiet {UNIT}", START,
                                            *STOP, f"is-enabled {UNIT}", START]


def test_activate_refuses_missing_release_or_tampered_unit(tmp_path, fake_systemctl):
    env, log = fake_systemctl
    sdir = tmp_path / "svc"
    units = tmp_path / "units"
    units.mkdir()
    (units / UNIT).write_text("live unit\n")
    staged = stage(sdir, make_tree(tmp_path / "payload", {"a.py": "a\n"}))
    assert activate(sdir, "20990101T000000Z-00000000", units, env).returncode != 0
    assert not (sdir / "current").exists()
    (sdir / "releases" / staged.release / META / "unit.service").write_text("[Service]\nExecStart=/bin/evil\n")
    proc = activate(sdir, staged.release, units, env)
    assert proc.returncode != 0
    assert (units / UNIT).read_text() == "live unit\n"          # the live unit was not replaced
    assert sorted(p.name for p in units.iterdir()) == [UNIT]    # and its temp copy is gone
    assert not (sdir / "current").exists()                      # nor current switched
    assert not log.exists()                                     # and systemctl never called: the old run
                                                                # was never stopped


def test_tar_stream_is_produced_in_bounded_chunks_and_refuses_a_resized_file(tmp_path, monkeypatch):
    monkeypatch.setattr(release_module, "CHUNK", 1000)
    root = make_tree(tmp_path / "p", {"big.bin": "x" * 4500, "small.py": "s\n"})
    payload = scan_payload(root)
    stream = TarStream(payload, ["big.bin", "small.py"], {"x": "meta\n"})
    chunks = list(stream)
    assert max(len(c) for c in chunks) <= 1536 and stream.sent == sum(map(len, chunks))  # 1000 + a header
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        assert tar.extractfile("big.bin").read() == b"x" * 4500
    (root / "big.bin").write_text("x" * 10)  # shrank after the scan
    with pytest.raises(OSError, match="shrank"):
        list(TarStream(payload, ["big.bin"], {}))
    (root / "big.bin").write_text("x" * 4501)  # grew after the scan
    with pytest.raises(OSError, match="grew"):
        list(TarStream(payload, ["big.bin"], {}))


@pytest.mark.parametrize("name", ["../../etc", "a/b", ".staging-x", "", "a\nb", "-rf", "a b"])
def test_a_release_named_by_the_user_is_checked_before_any_host(name):
    with pytest.raises(InvalidInput, match=r"^--to .*: not a release id"):
        release_module.check_name(name, "--to")


def test_release_ids_pass_the_name_check():
    made = release_module.release_id({"a": "b" * 64}, "unit")
    assert release_module.check_name(made, "--to") == made
