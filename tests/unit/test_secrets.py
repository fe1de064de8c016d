"""kdeploy/core/secrets.py: reading, checking and quoting secrets, the salted decision, masking, and the host-side
write/restore scripts (run here with sh on a temp directory)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kdeploy.core import inventory, provisional, secrets
from kdeploy.core.errors import InvalidInput
from kdeploy.core.state import decide, parse_state
from kdeploy.flows import logs


def _inventory(tmp_path: Path, service_extra: dict, host_extra: dict | None = None) -> inventory.Inventory:
    service = {"name": "svc", "python": "/usr/bin/python3", "sglang": {"model_path": "/m"}, **service_extra}
    raw = {"defaults": {"service": service}, "hosts": {"h1": {"address": "10.0.0.1", **(host_extra or {})},
                                                        "h2": {"address": "10.0.0.2"}}}
    return inventory.parse(raw, tmp_path / "inventory.yaml")


def test_content_is_quoted_so_systemd_reads_it_back_exactly():
    value = "a 'b' \"c\" $HOME \\d `e` #f  "
    assert secrets.Secrets({"K": value, "E": ""}).content() == 'K="a \'b\' \\"c\\" \\$HOME \\\\d \\`e\\` #f  "\nE=""\n'


@pytest.mark.parametrize("value", ["a\nb", "a\x00b", "a\tb", "\ufeffa", "a\x7f", "a\rb"])
def test_values_systemd_cannot_carry_are_refused_without_showing_them(value):
    with pytest.raises(InvalidInput, match="secret K: its value contains a newline") as err:
        secrets.check_value("K", value, "here")
    assert value not in str(err.value)


def test_file_format(tmp_path):
    text = "# comment\n\nA=plain value\nB='quoted'\nC=\"dq\"\nD=x=y\r\nE=\n"
    assert secrets.parse_file(text, "f") == {"A": "plain value", "B": "quoted", "C": "dq", "D": "x=y", "E": ""}


@pytest.mark.parametrize(("text", "message"), [
    ("novalue\n", "f:1: expected NAME=value"),
    ("1BAD=x\n", "f:1: expected NAME=value"),
    ("A=hunter2\nA=hunter2\n", "f:2: secret A is set twice"),
    ("A=hunter2\x01\n", "f:1: secret A: its value contains"),
])
def test_bad_files_name_the_line_never_the_value(text, message):
    with pytest.raises(InvalidInput, match=message) as err:
        secrets.parse_file(text, "f")
    assert "hunter2" not in str(err.value)


def test_resolve_reads_the_file_then_the_environment(tmp_path):
    (tmp_path / "s.env").write_text("FROM_FILE=f1\n")
    inv = _inventory(tmp_path, {"environment_file": "/etc/s.env", "secrets": {"env": ["HF_TOKEN"], "file": "s.env"}})
    got = secrets.resolve(inv, inv.hosts["h1"], {"HF_TOKEN": "hf_abc"})
    assert got is not None and got.values == {"FROM_FILE": "f1", "HF_TOKEN": "hf_abc"}
    assert got.masked() == {"FROM_FILE": "***", "HF_TOKEN": "***"}


def test_a_missing_variable_is_invalid_input_naming_it(tmp_path):
    inv = _inventory(tmp_path, {"environment_file": "/etc/s.env", "secrets": {"env": ["HF_TOKEN"]}})
    with pytest.raises(InvalidInput, match="secret HF_TOKEN: environment variable HF_TOKEN is not set"):
        secrets.resolve(inv, inv.hosts["h1"], {})
    got = secrets.resolve(inv, inv.hosts["h1"], {}, strict=False)  # logs: nothing to mask, no error
    assert got is not None and got.values == {}


def test_a_name_in_both_file_and_env_is_refused(tmp_path):
    (tmp_path / "s.env").write_text("HF_TOKEN=f\n")
    inv = _inventory(tmp_path, {"environment_file": "/etc/s.env", "secrets": {"env": ["HF_TOKEN"], "file": "s.env"}})
    with pytest.raises(InvalidInput, match=r"in both service\.secrets\.file and service\.secrets\.env"):
        secrets.resolve(inv, inv.hosts["h1"], {"HF_TOKEN": "e"})


def test_secrets_need_an_environment_file_and_layer_like_other_settings(tmp_path):
    with pytest.raises(InvalidInput, match=r"secrets need service\.environment_file"):
        _inventory(tmp_path, {"secrets": {"env": ["HF_TOKEN"]}})
    with pytest.raises(InvalidInput, match="not a valid environment variable name"):
        _inventory(tmp_path, {"environment_file": "/e", "secrets": {"env": ["BAD-NAME"]}})
    inv = _inventory(tmp_path, {"environment_file": "/e", "secrets": {"env": ["HF_TOKEN"]}},
                     {"service": {"secrets": {"env": ["OTHER_TOKEN"]}}})
    assert inv.hosts["h1"].service.secrets.env == ["OTHER_TOKEN"]  # the host's list replaces the defaults'
    assert inv.hosts["h2"].service.secrets.env == ["HF_TOKEN"]
    assert secrets.resolve(_inventory(tmp_path, {}), _inventory(tmp_path, {}).hosts["h1"], {}) is None


def _state(stamp: str = "") -> object:
    return parse_state(f"@@current\nR1\n@@unit\nU\n@@secrets\n{stamp}\n@@show\nActiveState=active\nSubState=running\n")


def test_decide_compares_a_salted_digest():
    wanted = secrets.Secrets({"HF_TOKEN": "hf_abc"})
    assert decide({}, "U\n", _state(), secrets=None).secrets_changed is False
    never = decide({}, "U\n", _state(), secrets=wanted)
    assert never.secrets_changed and never.restart and not never.stage and "secrets: changed" in never.reasons
    same = decide({}, "U\n", _state(f"salt1 {wanted.digest('salt1')}"), secrets=wanted)
    assert not same.secrets_changed and "secrets: changed" not in same.reasons
    rotated = decide({}, "U\n", _state(f"salt1 {wanted.digest('salt1')}"), secrets=secrets.Secrets({"HF_TOKEN": "x"}))
    assert rotated.secrets_changed and rotated.reasons == ["secrets: changed"]
    assert wanted.digest("salt1") != wanted.digest("salt2")  # no plain hash of the token


def test_masking():
    s = secrets.Secrets({"A": "hf_secretvalue", "B": "abc", "C": "hf_secret"})
    assert s.mask("token=hf_secretvalue, hf_secret; abc") == "token=***, ***; abc"


def test_logs_mask_every_hosts_known_values(tmp_path, monkeypatch):
    (tmp_path / "s.env").write_text("FILE_SECRET=from-the-file\n")
    inv = _inventory(tmp_path, {"environment_file": "/e", "secrets": {"env": ["HF_TOKEN"], "file": "s.env"}})
    monkeypatch.setenv("HF_TOKEN", "hf_live_token")
    mask = logs.masker(inv, ["h1", "h2"])
    assert mask("h1 | env HF_TOKEN=hf_live_token x=from-the-file") == "h1 | env HF_TOKEN=*** x=***"


def _sh(script: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", f"set -eu\n{script}"], input=stdin, capture_output=True, check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the script chowns to root")
def test_write_keeps_the_confirmed_content_and_restore_puts_it_back(tmp_path):
    sdir, ef = tmp_path / "svc", tmp_path / "etc" / "s.env"
    sdir.mkdir()
    ef.parent.mkdir()
    ef.write_text('OLD="1"\n')
    new = secrets.Secrets({"HF_TOKEN": "hf_new"})
    script = secrets.write_script(str(sdir), str(ef), "s1")
    assert new.digest("s1") not in script and "hf_new" not in script
    cut_off = _sh(script, secrets.write_stdin(new, "s1")[:-5])
    assert cut_off.returncode == 1 and b"incomplete" in cut_off.stderr and ef.read_text() == 'OLD="1"\n'
    done = _sh(script, secrets.write_stdin(new, "s1"))
    assert done.returncode == 0, done.stderr
    assert ef.read_text() == new.content() and oct(ef.stat().st_mode & 0o777) == "0o600"
    assert (sdir / ".secrets.salt").read_text() == "s1" and (sdir / ".secrets.prev").read_text() == 'OLD="1"\n'
    read = _sh(secrets.read_command(str(sdir), str(ef))).stdout.decode()
    assert secrets.parse_stamp(read) == secrets.Stamp("s1", new.digest("s1"))
    # a second unconfirmed write keeps the last CONFIRMED content, not the unconfirmed one
    again = secrets.Secrets({"HF_TOKEN": "hf_newer"})
    assert _sh(secrets.write_script(str(sdir), str(ef), "s2"), secrets.write_stdin(again, "s2")).returncode == 0
    assert (sdir / ".secrets.prev").read_text() == 'OLD="1"\n'
    assert _sh(secrets.restore_script(str(sdir), str(ef))).returncode == 0
    assert ef.read_text() == 'OLD="1"\n' and oct(ef.stat().st_mode & 0o777) == "0o600"
    assert not list(ef.parent.glob("*kdeploy-tmp"))


def test_the_confirmation_drops_the_saved_secrets_and_the_revert_restores_them():
    confirm = provisional.confirm_command("/srv/svc", "t", "tok")
    assert "rm -f /srv/svc/pending /srv/svc/.secrets.prev; echo CONFIRMED" in confirm
    pending = provisional.new_pending("R1", "R2", 60)
    arm = provisional.arm_script("/srv/svc", "svc.service", "t", pending, "stop", "/etc/s.env")
    assert " stop /etc/s.env " in arm and 'cp "$d/.secrets.prev" "$envfile.kdeploy-tmp"' in arm
    assert " stop - " in provisional.arm_script("/srv/svc", "svc.service", "t", pending, "stop")
