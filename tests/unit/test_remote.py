"""How kdeploy.ssh.remote reads a command's output and gives up on one whose input failed, on stand-in channels
(a real channel over a sandbox host: tests/integration/test_safety.py)."""

import subprocess
import sys
import threading
import time

import pytest

from kdeploy.ssh import remote


class StandInChannel:
    """The part of a paramiko channel that ``_drain`` and ``_cut_short`` use. ``stdout``/``stderr``: what the
    command prints, one piece per read. Its stderr shows up ``stderr_after`` s after it started, and its
    stdout cannot go on while stderr is unread (a full window). ``endless``: it keeps printing to that stream
    and never exits."""

    def __init__(self, stdout: list[bytes], stderr: list[bytes], *, stderr_after: float = 0.0,
                 endless: str = "") -> None:
        self.stdout, self.stderr, self.endless = stdout, stderr, endless
        self.stderr_at = time.monotonic() + stderr_after
        self.status_event = threading.Event()
        self.closed = self.input_ended = False
        self.timeout: float | None = 5.0

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def shutdown_write(self) -> None:
        self.input_ended = True

    def recv_stderr_ready(self) -> bool:
        return self.endless == "stderr" or (bool(self.stderr) and time.monotonic() >= self.stderr_at)

    def recv(self, size: int) -> bytes:
        if self.endless == "stdout":
            time.sleep(0.005)
            return b"still cleaning up\n"
        if self.stderr:
            assert self.timeout is not None
            time.sleep(self.timeout)
            raise TimeoutError
        return self.stdout.pop(0) if self.stdout else b""

    def recv_stderr(self, size: int) -> bytes:
        if self.endless == "stderr":
            time.sleep(0.005)
            return b"warning: still cleaning up\n"
        return self.stderr.pop(0) if self.stderr else b""

    def close(self) -> None:
        self.closed = True


def test_stderr_that_comes_while_stdout_is_awaited_is_read_so_stdout_can_go_on() -> None:
    channel = StandInChannel([b"a", b"b"], [b"1", b"2", b"3"], stderr_after=0.05)
    assert remote._drain(channel) == (b"ab", b"123")  # type: ignore[arg-type]


def test_no_output_for_the_channel_timeout_is_a_timeout() -> None:
    channel = StandInChannel([b"never"], [b"too late"], stderr_after=60)
    channel.timeout = 0.3
    with pytest.raises(TimeoutError):
        remote._drain(channel)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_command_that_keeps_printing_is_given_up_after_the_wait_in_all(stream: str) -> None:
    channel = StandInChannel([], [], endless=stream)
    started = time.monotonic()
    remote._cut_short(channel, 0.3)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed
    assert time.monotonic() - started < 3.0


def test_a_command_that_exits_is_not_waited_for_longer() -> None:
    channel = StandInChannel([b"removed staging\n"], [])
    channel.status_event.set()
    started = time.monotonic()
    remote._cut_short(channel, 30.0)  # type: ignore[arg-type]
    assert channel.input_ended and channel.closed and not channel.stdout
    assert time.monotonic() - started < 3.0


def test_paramikos_log_lines_stay_off_a_library_callers_stderr_unless_it_configures_logging():
    """The gate's polls of a port that is not up yet made paramiko log 'Secsh channel N open FAILED' to stderr."""
    code = ("import logging, sys; import kdeploy.ssh.remote; {setup}"
            "logging.getLogger('paramiko.transport').error('Secsh channel 4 open FAILED')")
    quiet = subprocess.run([sys.executable, "-c", code.format(setup="")], capture_output=True, text=True, check=True)
    assert quiet.stderr == ""
    logged = subprocess.run([sys.executable, "-c", code.format(setup="logging.basicConfig();")],
                            capture_output=True, text=True, check=True)
    assert "Secsh channel 4 open FAILED" in logged.stderr


def _sh(argv_text: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """Run a command line as sshd has the login shell run it (``sh -c``)."""
    return subprocess.run(["/bin/sh", "-c", argv_text], input=stdin, capture_output=True, text=True, timeout=10,
                          check=False)


def test_posix_runs_the_script_under_sh_and_become_puts_sudo_n_in_front(tmp_path) -> None:
    script = "echo \"$0\" \"it's\" $((1+1)); cat"
    assert remote.posix(script) == "exec /bin/sh -c " + remote.shlex.quote(script)
    wrapped = remote.posix(script, "svc-user")
    assert wrapped == "exec sudo -n -u svc-user -- /bin/sh -c " + remote.shlex.quote(script)
    # a stand-in sudo that records its arguments and runs what follows `--`: a real shell checks the quoting
    fake = tmp_path / "sudo"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$*" > "$(dirname "$0")/args"\n'
                    'while [ "$1" != -- ]; do shift; done; shift; exec "$@"\n')
    fake.chmod(0o755)
    done = _sh(f"PATH={tmp_path}:$PATH; {wrapped}", stdin="from stdin\n")
    assert (done.returncode, done.stdout) == (0, "/bin/sh it's 2\nfrom stdin\n")
    assert (tmp_path / "args").read_text().startswith("-n -u svc-user -- /bin/sh -c ")
    assert remote.posix(script, "root", "doas") == "exec doas -n -u root /bin/sh -c " + remote.shlex.quote(script)


@pytest.mark.parametrize(("rc", "stdout", "stderr", "expected"), [
    (0, "@@become-ok\n", "", None),
    (0, "banner from .bashrc\n@@become-ok\n", "sudo: unable to resolve host h1\n", None),
    (1, "", "sudo: a password is required\n", "sudo: a password is required (become: deploy needs passwordless "
     "sudo to root, e.g. `deploy ALL=(root) NOPASSWD: ALL` in /etc/sudoers.d"),
    (1, "", "Sorry, user deploy is not allowed to execute '/bin/sh -c echo @@become-ok' as root on h1.\n",
     "sudo refused: deploy may not run /bin/sh as root"),
    (127, "", "bash: line 1: exec: sudo: not found\n", "become: sudo is not installed on the host"),
    (0, "motd\n", "", "become via sudo failed: exit status 0"),
    (1, "", "sudo: unable to change to root gid: Operation not permitted\n",
     "become via sudo failed: sudo: unable to change to root gid"),
])
def test_become_failure_names_why_sudo_did_not_let_us_in(rc, stdout, stderr, expected) -> None:
    failure = remote.become_failure(remote.RunResult(rc, stdout, stderr), "deploy", "root")
    if expected is None:
        assert failure is None
    else:
        assert failure is not None and failure.startswith(expected) and "\n" not in failure


@pytest.mark.parametrize(("rc", "stderr", "expected"), [
    (1, "doas: Authentication required\n", "doas: a password is required (become: deploy needs passwordless doas to "
     "root, e.g. `permit nopass deploy as root` in /etc/doas.conf"),
    (1, "doas: Operation not permitted\n", "doas refused: deploy may not run /bin/sh as root"),
    (127, "sh: 1: exec: doas: not found\n", "become: doas is not installed on the host"),
])
def test_become_failure_with_doas(rc, stderr, expected) -> None:
    failure = remote.become_failure(remote.RunResult(rc, "", stderr), "deploy", "root", "doas")
    assert failure is not None and failure.startswith(expected)
