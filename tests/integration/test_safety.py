"""What keeps hosts safe: the deploy lock, host-key checks, plan, interrupted staging, a full disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kdeploy.core import release, state
from kdeploy.core.errors import RemoteTimeout
from kdeploy.core.layout import service_dir
from kdeploy.flows import fleet, push
from kdeploy.flows.options import Options
from kdeploy.host import lock
from kdeploy.ssh import sshconfig
from kdeploy.ssh.remote import Remote
from tests.conftest import Deployment


def _connect(dep: Deployment, host: str = "h1") -> Remote:
    inv = dep.load()
    cfg = inv.hosts[host]
    return Remote.connect(cfg, sshconfig.target_for(inv, cfg))


def _snapshot(dep: Deployment, host: str = "h1") -> str:
    """What a deploy changes: releases (path, inode, size, mtime), `current`, the unit and the running service.

    The service dir's own mtime, ``.lock`` and ``lock.json`` are left out: taking the lock touches them.
    """
    d = dep.service_dir
    return dep.sh(host, f"find {d}/releases {d}/current {d}/history.jsonl -printf '%p %i %s %T@ %l\\n' "
                        f"2>/dev/null | sort; "
                        f"sha256sum {dep.unit_path} 2>/dev/null; "
                        f"systemctl show {dep.service} -p InvocationID,ActiveState,UnitFileState", check=False)


def test_concurrent_push_fails_fast_naming_the_holder(deployment: Deployment,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    host = deployment.load().hosts["h1"]
    with _connect(deployment) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="kdeploy push test (other operator)")
        try:
            started = time.monotonic()
            code, doc = deployment.json(capsys, "push", "test", "--force-restart")
            assert code == 6
            assert time.monotonic() - started < 10
            assert doc["hosts"][0]["result"] == "locked"
            assert "other operator" in doc["hosts"][0]["error"] and str(os.getpid()) in doc["hosts"][0]["error"]
            code, doc = deployment.json(capsys, "lock", "status", "test")
            assert doc["hosts"][0]["lock"]["state"] == "held"
            # --lock-wait: the holder lets go after a second and the push goes through
            threading.Timer(1.0, held.release).start()
            code, doc = deployment.json(capsys, "push", "test", "--force-restart", "--lock-wait", "20")
            assert code == 0 and doc["hosts"][0]["result"] == "deployed"
        finally:
            held.release()
    code, doc = deployment.json(capsys, "lock", "status", "test")
    assert doc["hosts"][0]["lock"]["state"] == "free"


def test_stale_lock_is_reported_and_taken_over_loudly(deployment: Deployment,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    host = deployment.load().hosts["h1"]
    with _connect(deployment) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="kdeploy push (crashed)")
        info = deployment.sh("h1", f"cat {deployment.service_dir}/lock.json")
        holder_pid = lock.parse_info(info).remote_pid
        # the holder dies without cleaning up (like a host-side kill -9)
        deployment.sh("h1", f"kill -KILL {holder_pid} $(pgrep -P {holder_pid}) 2>/dev/null; true")  # no cleanup runs
        held.process.close()
    code, doc = deployment.json(capsys, "lock", "status", "test")
    assert doc["hosts"][0]["lock"]["state"] == "stale"
    assert doc["hosts"][0]["lock"]["holder"]["command"] == "kdeploy push (crashed)"
    code, doc = deployment.json(capsys, "push", "test", "--force-restart")
    assert code == 0
    preflight = next(p for p in doc["hosts"][0]["phases"] if p["name"] == "preflight")
    assert "STALE" in preflight["detail"] and "crashed" in preflight["detail"]
    code, doc = deployment.json(capsys, "lock", "status", "test")
    assert doc["hosts"][0]["lock"]["state"] == "free"


def test_lock_release_clears_a_stale_lock_and_refuses_a_live_one(deployment: Deployment,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    host = deployment.load().hosts["h1"]
    with _connect(deployment) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="live holder")
        holder_pid = lock.parse_info(deployment.sh("h1", f"cat {deployment.service_dir}/lock.json")).remote_pid
        code, doc = deployment.json(capsys, "lock", "release", "test")
        assert code == 6 and "live" in doc["hosts"][0]["error"]
        code, doc = deployment.json(capsys, "lock", "release", "test", "--force")
        assert code == 0 and doc["hosts"][0]["lock"] == {"state": "free", "holder": None}
        # the holder's shell really ended on the host, and its SSH channel with it
        assert deployment.sh("h1", f"kill -0 {holder_pid} 2>/dev/null && echo alive || echo gone").strip() == "gone"
        deadline = time.monotonic() + 10
        while not held.process.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held.process.exit_status_ready()
        held.process.close()
    assert deployment.kdeploy("push", "test", "--force-restart") == 0   # and the lock can be taken again


def test_lock_release_force_never_kills_a_process_that_does_not_hold_the_lock(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """lock.json names a PID that now belongs to an unrelated process (the holder's PID was reused): it is not
    killed, and since the lock stays held, `lock release --force` says so and exits 6."""
    host = deployment.load().hosts["h1"]
    d = deployment.service_dir
    with _connect(deployment) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="live holder")
        foreign = deployment.sh("h1", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo $!").strip()
        try:
            record = json.loads(deployment.sh("h1", f"cat {d}/lock.json"))
            record["remote_pid"] = int(foreign)
            deployment.sh("h1", f"printf '%s\\n' '{json.dumps(record)}' > {d}/lock.json")
            code, doc = deployment.json(capsys, "lock", "release", "test", "--force")
            host_doc = doc["hosts"][0]
            assert code == 6 and host_doc["result"] == "locked", doc
            assert host_doc["error"] == (f"h1: lock still held: the recorded holder (pid {foreign} on the host) does "
                                         "not hold the lock (it ended, or its PID was reused): nothing was killed")
            assert host_doc["lock"]["state"] == "held"
            assert deployment.sh("h1", f"kill -0 {foreign} && echo alive").strip() == "alive"
            assert not held.process.exit_status_ready()                   # the real holder is untouched too
            code, doc = deployment.json(capsys, "lock", "status", "test")
            assert doc["hosts"][0]["lock"]["state"] == "held"
        finally:
            deployment.sh("h1", f"kill -KILL {foreign}", check=False)
            held.release()


def test_unknown_host_key_is_refused_unless_accepted(deployment: Deployment, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    known = tmp_path / "empty_known_hosts"
    known.write_text("")
    deployment.edit(lambda doc: doc["defaults"].update(known_hosts=str(known)))
    before = _snapshot(deployment)
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 3 and doc["hosts"][0]["result"] == "unreachable", doc["hosts"][0]
    assert "host key unknown" in doc["hosts"][0]["error"] and "--accept-new-host-keys" in doc["hosts"][0]["error"]
    assert _snapshot(deployment) == before
    code, doc = deployment.json(capsys, "push", "test", "--accept-new-host-keys")
    assert code == 0
    assert "new host key recorded" in doc["hosts"][0]["phases"][0]["detail"]
    assert "ssh-ed25519" in known.read_text()
    # now it is known: no flag needed
    assert deployment.kdeploy("push", "test") == 0


def test_changed_host_key_is_always_refused(deployment: Deployment, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    address = deployment.load().hosts["h1"].address
    known = tmp_path / "known_hosts"
    known.write_text(f"{address} {key.with_suffix('.pub').read_text().split()[0]} "
                     f"{key.with_suffix('.pub').read_text().split()[1]}\n")
    deployment.edit(lambda doc: doc["defaults"].update(known_hosts=str(known)))
    before = _snapshot(deployment)
    capsys.readouterr()
    from kdeploy.cli import app as cli

    code = cli.main(["push", "test", "--inventory", str(deployment.path), "--accept-new-host-keys"])
    err = capsys.readouterr().err
    assert code == 3
    assert "HOST KEY CHANGED" in err and "Traceback" not in err
    assert _snapshot(deployment) == before


def test_unreachable_host_is_one_line_exit_3(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    deployment.edit(lambda doc: doc["hosts"]["h1"].update(port=2))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 3
    assert "unreachable" in doc["hosts"][0]["error"] and "refused" in doc["hosts"][0]["error"].lower()


def test_plan_changes_nothing(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    (deployment.payload / "new_kernel.py").write_text("X = 1\n")
    (deployment.payload / "kdeploy_testplugin" / "__init__.py").write_text(
        (deployment.payload / "kdeploy_testplugin" / "__init__.py").read_text() + "\n# changed\n")
    deployment.set_service(env={"KDTREE_DEFRAG_SORT": "1"})
    before = _snapshot(deployment)
    code, doc = deployment.json(capsys, "plan", "test")
    assert code == 0
    plan = doc["hosts"][0]["plan"]
    assert plan["add"] == ["new_kernel.py"]
    assert plan["change"] == ["kdeploy_testplugin/__init__.py"]
    assert plan["restart"] and plan["daemon_reload"]
    assert '+Environment="KDTREE_DEFRAG_SORT=1"' in plan["unit_diff"]
    code, doc = deployment.json(capsys, "push", "test", "--dry-run")
    assert code == 0 and doc["command"] == "plan"
    assert _snapshot(deployment) == before


def test_plan_on_a_fresh_host_creates_nothing(deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = deployment.json(capsys, "plan", "test")
    assert code == 0 and doc["hosts"][0]["plan"]["restart"]
    assert deployment.sh("h1", f"test -e {deployment.service_dir} && echo yes || echo no").strip() == "no"


def test_killed_mid_staging_leaves_the_host_unchanged(deployment: Deployment,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert deployment.kdeploy("push", "test") == 0
    before = _snapshot(deployment)
    # a payload big enough that staging takes a while
    (deployment.payload / "weights.bin").write_bytes(os.urandom(1 << 20) * 60)
    proc = subprocess.Popen([sys.executable, "-m", "kdeploy", "push", "test", "--inventory", str(deployment.path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            staging = deployment.sh("h1", f"ls -d {deployment.service_dir}/releases/.staging-* 2>/dev/null",
                                    check=False)
            if staging.strip():
                break
            assert proc.poll() is None, "push finished before it could be interrupted"
            time.sleep(0.05)
        else:
            pytest.fail("staging never started")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    time.sleep(1)  # let sshd notice the dropped connection
    after = _snapshot(deployment)
    # releases, `current`, the unit and the running service are exactly as before (a half-staged dir may remain)
    releases_dir = f"{deployment.service_dir}/releases "

    def strip(snap: str) -> list[str]:
        return [line for line in snap.splitlines() if ".staging-" not in line and not line.startswith(releases_dir)]

    assert strip(after) == strip(before)
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0 and doc["hosts"][0]["result"] == "deployed"
    assert deployment.sh("h1", f"ls -a {deployment.service_dir}/releases").count(".staging-") == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_upload_stops_within_a_second(deployment: Deployment, capsys: pytest.CaptureFixture[str],
                                                    sig: signal.Signals) -> None:
    """Ctrl-C (or a CI cancel's SIGTERM) during the upload: exit 130 at once, staging cleaned, host as it was,
    and the JSON names the release that was being staged."""
    assert deployment.kdeploy("push", "test") == 0
    before = _snapshot(deployment)
    (deployment.payload / "weights.bin").write_bytes(os.urandom(1 << 20) * 200)
    run = deployment.interrupt("push", "test", sig=sig, what="staging", wait=60, when=lambda: deployment.sh(
        "h1", f"ls -d {deployment.service_dir}/releases/.staging-* 2>/dev/null", check=False).strip())
    host = run.doc["hosts"][0]
    assert run.code == run.doc["exit_code"] == 130, run.err
    assert run.seconds < 1.5, f"took {run.seconds:.2f}s to stop"
    assert host["result"] == "interrupted" and host["attempted"], host
    stage = next(p for p in host["phases"] if p["name"] == "stage")
    assert not stage["ok"] and "interrupted" in stage["detail"], stage
    time.sleep(0.5)

    def unchanged(snap: str) -> list[str]:  # all but the history line it recorded and the releases dir's mtime
        skip = (f"{deployment.service_dir}/history.jsonl ", f"{deployment.service_dir}/releases ")
        return [line for line in snap.splitlines() if not line.startswith(skip)]

    assert unchanged(_snapshot(deployment)) == unchanged(before)
    assert ".staging-" not in deployment.sh("h1", f"ls -a {deployment.service_dir}/releases")
    last = deployment.history()[-1]
    assert last["result"] == "interrupted" and last["attempted"] == host["attempted"]


def _after_failed_staging(dep: Deployment, snapshot: str) -> list[str]:
    """The snapshot less what a failed staging may touch: the mtime of `releases/` (its temp dir came and went)
    and the history (a push that ends `invalid` is recorded)."""
    releases = f"{dep.service_dir}/releases "
    return [line for line in snapshot.splitlines() if "history.jsonl" not in line and not line.startswith(releases)]


def test_payload_file_changed_during_the_push_is_invalid_input(deployment: Deployment,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's sha256 check fails because the file changed after it was hashed: exit 2, naming the file."""
    assert deployment.kdeploy("push", "test") == 0
    before = _snapshot(deployment)
    edited = deployment.payload / "kdeploy_testplugin" / "__init__.py"
    edited.write_text(edited.read_text() + "# v2\n")
    class EditThenStream(release.TarStream):
        def __iter__(self) -> Iterator[bytes]:
            edited.write_text(edited.read_text() + "# saved by an editor during the push\n")
            return super().__iter__()

    monkeypatch.setattr(release, "TarStream", EditThenStream)
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 2 and host["result"] == "invalid", doc
    assert host["error"] == f"h1: payload file {edited} changed during the push, host unchanged: push again"
    assert next(p for p in host["phases"] if p["name"] == "stage")["ok"] is False
    assert _after_failed_staging(deployment, _snapshot(deployment)) == _after_failed_staging(deployment, before)


def test_other_staging_failures_refuse_the_host_unchanged(deployment: Deployment,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes corrupted on the way (the local files are intact): a refusal, exit 7, not an internal error."""
    assert deployment.kdeploy("push", "test") == 0
    before = _snapshot(deployment)
    (deployment.payload / "new.py").write_text("VALUE = 'original'\n")
    class Corrupting(release.TarStream):
        def __iter__(self) -> Iterator[bytes]:
            return (chunk.replace(b"'original'", b"'corruptd'") for chunk in super().__iter__())

    monkeypatch.setattr(release, "TarStream", Corrupting)
    code, doc = deployment.json(capsys, "push", "test")
    host = doc["hosts"][0]
    assert code == 7 and host["result"] == "preflight_refused", doc
    assert host["error"] == ("staging failed, host unchanged: 1 staged file(s) differ from the manifest (sha256): "
                             "./new.py")
    assert _after_failed_staging(deployment, _snapshot(deployment)) == _after_failed_staging(deployment, before)
    assert len(deployment.history()) == 1  # refused: none


def test_full_disk_is_refused_and_leaves_the_host_unchanged(deployment: Deployment,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    small = f"/srv/kdeploy-small-{deployment.service}"
    deployment.fleet.exec("h1", ["sh", "-c", f"mkdir -p {small} && mount -t tmpfs -o size=100m tmpfs {small}"])
    try:
        deployment.set_service(remote_root=small)
        assert deployment.kdeploy("push", "test") == 0
        before = _snapshot(deployment)
        (deployment.payload / "weights.bin").write_bytes(os.urandom(1 << 20) * 120)
        code, doc = deployment.json(capsys, "push", "test")
        assert code == 7
        assert doc["hosts"][0]["result"] == "preflight_refused"
        assert "preflight refused: disk:" in doc["hosts"][0]["error"]
        assert _snapshot(deployment) == before

        # Past the check (the disk fills up between preflight and upload): tar runs out of space mid-upload.
        code, doc = deployment.json(capsys, "push", "test", "--skip-preflight")
        host = doc["hosts"][0]
        assert (code, host["result"]) == (7, "preflight_refused"), doc
        releases = f"{small}/{deployment.service}/releases"
        assert host["error"].startswith(f"disk full on the host at {releases}, "), host["error"]
        assert "bytes free, host unchanged (staging removed): " in host["error"]
        assert "No space left on device" in host["error"] and "\n" not in host["error"]
        # no .staging-* left, nothing switched
        assert _after_failed_staging(deployment, _snapshot(deployment)) == _after_failed_staging(deployment, before)
        (deployment.payload / "weights.bin").unlink()

        # A read-only filesystem refuses before anything changes, and says so.
        (deployment.payload / "rev.txt").write_text("2")
        deployment.fleet.exec("h1", ["mount", "-o", "remount,ro", small])
        code, doc = deployment.json(capsys, "push", "test", "--skip-preflight")
        host = doc["hosts"][0]
        assert (code, host["result"]) == (7, "preflight_refused"), doc
        assert host["error"].startswith("h1: cannot take the deploy lock, host unchanged: ") and \
            host["error"].endswith("Read-only file system"), host["error"]
        deployment.fleet.exec("h1", ["mount", "-o", "remount,rw", small])
        assert _after_failed_staging(deployment, _snapshot(deployment)) == _after_failed_staging(deployment, before)
    finally:
        deployment.fleet.exec("h1", ["sh", "-c", f"systemctl stop {deployment.service}; umount {small}; "
                                                 f"rmdir {small}"], check=False)


@contextmanager
def small_releases(dep: Deployment, options: str) -> Iterator[str]:
    """A tmpfs (``size=``, ``nr_inodes=``) mounted on the host's ``releases/`` before the first push: the
    filesystem the releases land on is not the one of the service directory. Yields its path."""
    releases = f"{dep.service_dir}/releases"
    dep.sh("h1", f"mkdir -p {releases} && mount -t tmpfs -o {options} tmpfs {releases}")
    try:
        yield releases
    finally:
        dep.sh("h1", f"systemctl stop {dep.service}; umount {releases} || umount -l {releases}", check=False)


def test_running_out_of_inodes_mid_upload_says_inodes(deployment: Deployment, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight passed, then something took the last inodes of releases/ before the upload (a filler
    between the two): staging fails with ENOSPC although bytes are free, and says inodes ran out."""
    with small_releases(deployment, "size=256m,nr_inodes=200") as releases:
        assert deployment.kdeploy("push", "test") == 0
        before = _snapshot(deployment)
        fill = f"mkdir {releases}/.filler; i=0; while touch {releases}/.filler/$i 2>/dev/null; do i=$((i+1)); done"

        def verdict_then_fill(*args: object, **kwargs: object) -> str:
            said = preflight_verdict(*args, **kwargs)
            deployment.sh("h1", fill)
            return said

        preflight_verdict = push.preflight_verdict
        monkeypatch.setattr(push, "preflight_verdict", verdict_then_fill)
        (deployment.payload / "rev.txt").write_text("2")
        code, doc = deployment.json(capsys, "push", "test")
        host = doc["hosts"][0]
        assert (code, host["result"]) == (7, "preflight_refused"), doc
        assert "disk pass" in next(p for p in host["phases"] if p["name"] == "preflight")["detail"]
        error = host["error"]
        assert error.startswith(f"out of inodes on the host at {releases}, 0 inodes free ("), error
        assert re.search(r"\(\d+ bytes free\), host unchanged \(staging removed\): .*No space left on device$", error)
        deployment.sh("h1", f"rm -rf {releases}/.filler")
        assert _after_failed_staging(deployment, _snapshot(deployment)) == _after_failed_staging(deployment, before)


def _blackholed_while_staging(deployment: Deployment, capsys: pytest.CaptureFixture[str], rev: str) -> dict:
    """A push blackholed mid-upload until the host frees its lock, then a second push that deploys: the
    first's host report."""
    d = deployment.service_dir
    (deployment.payload / "weights.bin").write_bytes(os.urandom(1 << 20) * 200)  # seconds of upload
    first = subprocess.Popen([sys.executable, "-m", "kdeploy", "push", "test", "--json", "--inventory",
                              str(deployment.path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not deployment.sh("h1", f"ls -d {d}/releases/.staging-* 2>/dev/null", check=False).strip():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        deployment.fleet.blackhole("h1")
        cut = time.monotonic()
        try:
            while deployment.fleet.exec("h1", ["flock", "-n", f"{d}/.lock", "true"], check=False).returncode:
                assert time.monotonic() - cut < 30, "the lock is still held 30 s after the partition"
                time.sleep(0.1)
            freed = time.monotonic() - cut
        finally:
            deployment.fleet.heal("h1")
        assert freed < 5 + 3, f"lock freed {freed:.1f}s after the partition"  # + the watchdog's 1 s ticks

        (deployment.payload / "weights.bin").unlink()
        (deployment.payload / "rev.txt").write_text(rev)
        code, doc = deployment.json(capsys, "push", "test")
        assert (code, doc["hosts"][0]["result"]) == (0, "deployed"), doc
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    host = json.loads(out)["hosts"][0]
    assert (first.returncode, host["result"]) == (3, "unreachable"), host
    assert deployment.link() == f"releases/{doc['hosts'][0]['release']}"
    return host


def test_a_controller_blackholed_while_staging_loses_the_lock_and_a_second_one_deploys(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Without heartbeats the host frees the lock within ``lock_timeout`` (measured on the host), not when
    TCP gives up hours later; the first controller, back on the link, changes nothing more (exit 3): its
    next command fails the lock's fence. On a loaded machine its connection may instead die before it
    sends one (nothing changed either); the fence must then be seen on a second try."""
    deployment.set_service(lock_timeout=5)
    assert deployment.kdeploy("push", "test") == 0
    host = _blackholed_while_staging(deployment, capsys, "the second controller's")
    if host["error"].startswith("h1: connection lost"):
        host = _blackholed_while_staging(deployment, capsys, "the second controller's, again")
    assert "no longer holds the deploy lock" in host["error"], host["error"]
    assert deployment.kdeploy("verify", "test") == 0


def test_state_parser_reads_a_fresh_host(deployment: Deployment) -> None:
    host = deployment.load().hosts["h1"]
    with _connect(deployment) as remote:
        fresh = state.parse_state(remote.run(state.state_script(host, with_history=True)).stdout)
    assert fresh.current is None and fresh.manifest == {} and fresh.unit_text is None
    assert fresh.unit.load == "not-found" and fresh.releases == []
    assert fresh.pending is None and fresh.gates == {} and fresh.history == []


def test_a_slow_remote_command_is_a_timeout_not_unreachable(deployment: Deployment) -> None:
    with _connect(deployment) as remote:
        with pytest.raises(RemoteTimeout, match=r"did not finish within 0\.5s"):
            remote.run("sleep 3", timeout=0.5)
        assert remote.run("echo still here", timeout=10).stdout == "still here\n"


def test_a_command_that_writes_megabytes_to_stderr_before_stdout_finishes(deployment: Deployment) -> None:
    """Both streams are read as they come: unread stderr must not fill the channel's window and stall."""
    with _connect(deployment) as remote:
        out = remote.run("head -c 5000000 /dev/zero | tr '\\0' e >&2; echo done", timeout=20)
    assert (out.rc, out.stdout, len(out.stderr)) == (0, "done\n", 5_000_000)


def test_root_with_a_zsh_login_shell_that_prints_a_banner_changes_no_result(deployment: Deployment,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """sshd hands every command to root's login shell: zsh stops at a glob that matches nothing (kdeploy's
    scripts are POSIX sh, so they run under /bin/sh), and what its .zshenv prints (a banner, a warning)
    lands in front of every command's output, which kdeploy must not take for its own."""
    deployment.sh("h1", "cp -a /etc/passwd /etc/passwd.kdeploy-test && usermod -s /usr/bin/zsh root && "
                        "printf 'echo Welcome to gpu-01\\necho banner >&2\\n' > /root/.zshenv")
    try:
        results = []
        for args in (("push", "test"), ("push", "test"), ("status", "test"), ("verify", "test"),
                     ("history", "test"), ("lock", "status", "test")):
            code, doc = deployment.json(capsys, *args)
            results.append((args[0], code, doc["hosts"][0]["result"], doc["hosts"][0].get("error")))
        assert results == [("push", 0, "deployed", None), ("push", 0, "unchanged", None), ("status", 0, "ok", None),
                           ("verify", 0, "healthy", None), ("history", 0, "ok", None), ("lock", 0, "ok", None)]
    finally:
        deployment.sh("h1", "mv -f /etc/passwd.kdeploy-test /etc/passwd; rm -f /root/.zshenv")


def test_host_files_are_root_only_except_what_the_service_reads(deployment: Deployment,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The service runs as `nobody` and still reads its payload; the lock, the history and the release
    metadata are root's; the history records kdeploy's own command, never a wrapper's argv."""
    deployment.edit(lambda doc: doc["defaults"]["service"]["unit"].update(user="nobody"))
    code, doc = deployment.json(capsys, "push", "test")
    assert code == 0, [(h["error"], h["phases"]) for h in doc["hosts"]]
    assert deployment.sh("h1", f"ps -o user= -p {deployment.show('h1', 'MainPID')}").strip() == "nobody"
    d = deployment.service_dir
    release = doc["hosts"][0]["release"]
    paths = [d, f"{d}/.lock", f"{d}/history.jsonl", f"{d}/releases", f"{d}/releases/{release}",
             f"{d}/releases/{release}/kdeploy_testplugin", f"{d}/releases/{release}/kdeploy_testplugin/__init__.py",
             f"{d}/releases/{release}/.kdeploy", f"{d}/releases/{release}/.kdeploy/manifest.sha256",
             deployment.unit_path]
    modes = deployment.sh("h1", "stat -c %a " + " ".join(paths)).split()
    assert modes == ["755", "600", "600", "755", "755", "755", "644", "700", "600", "644"]
    assert deployment.history()[-1]["command"] == f"kdeploy push test --inventory {deployment.path} --json"

    host = deployment.load().hosts["h1"]
    with _connect(deployment) as remote:
        held = lock.acquire(remote, service_dir(host.service), command="kdeploy push test (other operator)")
        try:
            assert deployment.sh("h1", f"stat -c %a {d}/lock.json").strip() == "600"
        finally:
            held.release()

    monkeypatch.setattr("sys.argv", ["deploy_wrapper.py", "--vault-token", "s3cret"])
    report = fleet.push(deployment.load(), "test", Options(force_restart=True))
    assert report.exit_code == 0, [(h.error, h.phases) for h in report.hosts]
    history = deployment.sh("h1", f"cat {d}/history.jsonl")
    assert json.loads(history.splitlines()[-1])["command"] == "kdeploy push (library)"
    assert "s3cret" not in history
