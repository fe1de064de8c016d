"""kdeploy/core/disk.py: where a push writes, what it needs there, the measure of each place and the verdict."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kdeploy.core import disk, inventory
from kdeploy.core.disk import Filesystem, Need

# disk.measure's output, captured on Debian 12 (GNU coreutils 9.1, then busybox 1.35 as df/stat): the root ext4 and
# a tmpfs mounted with size=8m,nr_inodes=64 on a path with a space; /proc stands for a filesystem that counts no
# inodes (btrfs prints 0 in every inode column too).
GNU_EXT4 = ("65024\n/dev/vda       ext4 270553174016 23522299904 85421993984      22% /\n"
            "/dev/vda       16777216 428102 16349114    3% /\n")
BUSYBOX_TMPFS = ("40\ntmpfs                tmpfs        8388608         0   8388608   0% /tmp/kdcap/small fs\n"
                 "tmpfs                       64         1        63   2% /tmp/kdcap/small fs\n")
GNU_PROC = ("21\nproc           proc        0     0         0        - /proc\n"
            "proc                0     0     0     - /proc\n")

ROOT = Filesystem(65024, "ext4", "/", 85421993984, 16349114)
GIB = 1024**3
MIB = 1024**2


def test_the_measure_reads_as_gnu_and_busybox_print_it():
    assert disk.parse(GNU_EXT4) == ROOT
    assert disk.parse(BUSYBOX_TMPFS) == Filesystem(40, "tmpfs", "/tmp/kdcap/small fs", 8388608, 63)
    assert disk.parse(GNU_PROC) == Filesystem(21, "proc", "/proc", 0, None)  # no inodes counted: None
    # stat or df failed (their errors go to stderr), or the output was cut off: not measured
    assert disk.parse("") is None
    assert disk.parse(GNU_EXT4.split("\n", 1)[1]) is None
    assert disk.parse("65024\ndf: /x: No such file or directory\n\n") is None


def test_a_place_not_there_yet_is_measured_at_its_nearest_existing_ancestor(tmp_path):
    """A first deploy has no releases/ (nor service directory) yet: its filesystem is the one it will be made on."""
    out = subprocess.run(["sh", "-c", disk.measure(str(tmp_path / "no such" / "svc" / "releases"))],
                         capture_output=True, text=True, check=True).stdout
    fs = disk.parse(out)
    assert fs is not None and fs.dev == os.stat(tmp_path).st_dev and fs.free_bytes > 0


def _service(tmp_path: Path, **extra: object) -> inventory.Service:
    raw = {"defaults": {"service": {"name": "svc", "python": "/usr/bin/python3", "sglang": {"model_path": "/m"},
                                    "remote_root": "/opt/k", **extra}},
           "hosts": {"h1": {"address": "10.0.0.1"}}}
    return inventory.parse(raw, tmp_path / "inventory.yaml").hosts["h1"].service


def test_a_push_writes_its_releases_service_directory_units_and_secrets(tmp_path):
    assert disk.needs(_service(tmp_path), 10 * MIB, 40) == (
        Need("releases", "/opt/k/svc/releases", 74 * MIB, 56),
        Need("service", "/opt/k/svc", MIB, 16),
        Need("units", "/etc/systemd/system", MIB, 8))
    # with secrets kdeploy writes the environment file (a temp file beside it, then a rename); without, it only
    # reads it
    assert disk.needs(_service(tmp_path, environment_file="/etc/sglang/s.env"))[-1].what == "units"
    with_secrets = _service(tmp_path, environment_file="/etc/sglang/s.env", secrets={"env": ["HF_TOKEN"]})
    assert disk.needs(with_secrets)[-1] == Need("secrets", "/etc/sglang/s.env", MIB, 4)


PLACES = (Need("releases", "/opt/k/svc/releases", 210 * MIB, 1200), Need("service", "/opt/k/svc", MIB, 16),
          Need("units", "/etc/systemd/system", MIB, 8))


def test_places_on_one_filesystem_pass_with_their_summed_numbers():
    assert disk.verdict(PLACES, [ROOT] * 3) == (
        "pass", "releases /opt/k/svc/releases, service /opt/k/svc, units /etc/systemd/system (ext4 at /): "
                "79.6 GiB, 16.3M inodes free; need 212.0 MiB, 1224 inodes")


def test_a_small_filesystem_on_releases_is_measured_itself():
    small = Filesystem(7, "tmpfs", "/opt/k/svc/releases", 100 * MIB, 5000)
    status, detail = disk.verdict(PLACES, [small, ROOT, ROOT])
    assert (status, detail) == ("fail", "releases /opt/k/svc/releases (tmpfs at /opt/k/svc/releases): "
                                        "100.0 MiB, 5000 inodes free; need 210.0 MiB, 1200 inodes: not enough space")
    roomy = Filesystem(7, "tmpfs", "/opt/k/svc/releases", 10 * GIB, 5000)
    status, detail = disk.verdict(PLACES, [roomy, ROOT, ROOT])
    assert status == "pass" and detail.count("(") == 2, detail   # each filesystem with its own numbers
    assert " | service /opt/k/svc, units /etc/systemd/system (ext4 at /): 79.6 GiB" in detail


def test_places_that_fit_alone_but_not_together_are_refused():
    fs = Filesystem(3, "xfs", "/opt", 211 * MIB, 10**6)   # the release fits, release + unit + service do not
    status, detail = disk.verdict(PLACES, [fs] * 3)
    assert status == "fail" and detail.endswith("211.0 MiB, 1.0M inodes free; need 212.0 MiB, 1224 inodes: "
                                                "not enough space")


@pytest.mark.parametrize(("kind", "free_bytes", "free_inodes", "status", "said"), [
    ("ext4", 10 * GIB, 1000, "fail", "10.0 GiB, 1000 inodes free; need 212.0 MiB, 1224 inodes: not enough inodes"),
    ("ext4", MIB, 1000, "fail", "1.0 MiB, 1000 inodes free; need 212.0 MiB, 1224 inodes: not enough space nor inodes"),
    ("ext4", 400 * MIB, 10**6, "warn", "400.0 MiB, 1.0M inodes free; need 212.0 MiB, 1224 inodes: tight"),
    ("ext4", 10 * GIB, 2000, "warn", "10.0 GiB, 2000 inodes free; need 212.0 MiB, 1224 inodes: tight"),
    ("btrfs", 10 * GIB, None, "pass", "10.0 GiB free; need 212.0 MiB"),   # counts no inodes
])
def test_blocks_and_inodes_are_both_checked(kind, free_bytes, free_inodes, status, said):
    assert disk.verdict(PLACES, [Filesystem(1, kind, "/", free_bytes, free_inodes)] * 3) == (
        status, f"releases /opt/k/svc/releases, service /opt/k/svc, units /etc/systemd/system ({kind} at /): {said}")


def test_a_place_that_could_not_be_measured_warns_unless_another_fails():
    assert disk.verdict(PLACES, [ROOT, ROOT, None]) == ("warn", "units /etc/systemd/system: free space unknown")
    full = Filesystem(2, "ext4", "/opt", 0, 10)
    status, detail = disk.verdict(PLACES, [full, full, None])
    assert status == "fail" and "unknown" not in detail and "not enough space nor inodes" in detail


def test_sizes_and_counts_read_as_people_say_them():
    assert [disk.size(n) for n in (512, 1536, 210 * MIB, int(41.2 * GIB), 3 * 1024 * GIB)] == \
        ["512 B", "1.5 KiB", "210.0 MiB", "41.2 GiB", "3.0 TiB"]
    assert [disk.count(n) for n in (840, 9999, 12_345, 2_100_000)] == ["840", "9999", "12.3k", "2.1M"]
