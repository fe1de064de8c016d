"""Errors that map to the CLI's documented exit codes.

Every failure a user can cause or meet is one of these, so the CLI prints one line and exits with the
code the contract promises; anything else is an internal error (exit 1).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    INVALID = 2
    UNREACHABLE = 3
    ROLLED_BACK = 4
    ROLLBACK_FAILED = 5
    LOCKED = 6
    PREFLIGHT = 7
    COMMAND_FAILED = 8  # kdeploy exec: the command exited non-zero (or ran past --timeout) on a host
    INTERRUPTED = 130


# When hosts end differently, the most severe code is the command's: 5 > 4 > 3 > 8 > 7 > 6 > 1 > 130 > 0.
_SEVERITY = [ExitCode.OK, ExitCode.INTERRUPTED, ExitCode.INTERNAL, ExitCode.LOCKED, ExitCode.PREFLIGHT,
             ExitCode.COMMAND_FAILED, ExitCode.UNREACHABLE, ExitCode.ROLLED_BACK, ExitCode.ROLLBACK_FAILED]


def most_severe(codes: list[int]) -> ExitCode:
    """The exit code for several hosts: the most severe of theirs (an invalid-input code wins outright)."""
    codes = [ExitCode(c) for c in codes]
    if ExitCode.INVALID in codes:
        return ExitCode.INVALID
    return max(codes, key=_SEVERITY.index, default=ExitCode.OK)


class KdeployError(Exception):
    """A failure with a one-line message and an exit code."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InvalidInput(KdeployError):
    exit_code = ExitCode.INVALID


class Unreachable(KdeployError):
    """Connect timeout, refused, no route, reset, SSH auth or host-key refusal."""

    exit_code = ExitCode.UNREACHABLE


class RemoteTimeout(KdeployError):
    """A command on a host that is still connected did not finish in time: the host is slow or stuck, not
    unreachable, so after a switch it is rolled back rather than reconnected to."""


class LockHeld(KdeployError):
    exit_code = ExitCode.LOCKED


class PreflightRefused(KdeployError):
    exit_code = ExitCode.PREFLIGHT
