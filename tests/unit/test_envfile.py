"""The preflight check of service.environment_file (kdeploy/core/probe.py): present, root's, readable by root only."""

from __future__ import annotations

import pytest

from kdeploy.core import probe


@pytest.mark.parametrize(("stat", "status", "words"), [
    ("0 600 regular file", "pass", "root, 0600"),
    ("0 400 regular file", "pass", "root, 0400"),
    ("0 600 regular empty file", "pass", "root, 0600"),
    (None, "fail", "is missing (the service would start without its secrets)"),
    ("1000 600 regular file", "fail", "owned by uid 1000, not root"),
    ("0 644 regular file", "fail", "has mode 0644: others can read its secrets (chmod 0600)"),
    ("0 600 directory", "fail", "is a directory, not a regular file"),
    ("garbage", "fail", "cannot read its owner and mode"),
])
def test_environment_file_check(stat, status, words):
    check = probe.check_environment_file("/etc/sglang/secrets.env", stat)
    assert check.status == status and words in check.detail, check


def test_no_environment_file_no_check_and_no_command():
    assert probe.check_environment_file(None, None) is None
    cmd = probe.preflight_command(python="/p", unit="u", port=1, places=())
    assert "envfile" not in cmd
    cmd = probe.preflight_command(python="/p", unit="u", port=1, places=(), environment_file="/etc/a b")
    assert cmd.endswith("echo '@@kdeploy envfile'; stat -L -c '%u %a %F' '/etc/a b' 2>/dev/null; "
                        "echo \"@@kdeploy rc 0\"")
