"""known_hosts verdicts on real keys and certificates made by ssh-keygen (no network)."""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path

import pytest

from kdeploy.ssh import hostcert, knownhosts
from kdeploy.ssh.knownhosts import Offered


def now() -> int:
    """Read at each check: certificates are signed relative to the clock when the test runs, not when the
    module was collected (a long suite starts minutes later)."""
    return int(time.time())

def keygen(path: Path, kind: str = "ed25519") -> tuple[str, bytes]:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", path.name, "-f", str(path)], check=True)
    key_type, b64 = path.with_name(path.name + ".pub").read_text().split()[:2]
    return key_type, base64.b64decode(b64)


def sign(ca: Path, host_key: Path, *args: str) -> bytes:
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "web-1", *args, str(host_key) + ".pub"],
                   check=True, capture_output=True)
    return base64.b64decode(host_key.with_name(host_key.name + "-cert.pub").read_text().split()[1])


@pytest.fixture
def keys(tmp_path: Path) -> dict:
    out = {"dir": tmp_path}
    for name in ("host", "ca", "other_ca"):
        out[name] = keygen(tmp_path / name)
    return out


def offered_cert(keys: dict, cert: bytes) -> Offered:
    return Offered(keys["host"][0], keys["host"][1], cert)


def entries(text: str) -> list[knownhosts.Entry]:
    parsed, warnings = knownhosts.parse(text, "kh")
    assert not warnings
    return parsed


def line(marker: str, pattern: str, key: tuple[str, bytes]) -> str:
    return f"{marker} {pattern} {key[0]} {base64.b64encode(key[1]).decode()}\n".lstrip()


def test_plain_key_known_unknown_changed(keys: dict) -> None:
    offered = Offered(*keys["host"])
    assert knownhosts.decide(entries(line("", "web1,10.0.0.1", keys["host"])), ["10.0.0.1"], offered, now()).ok
    assert knownhosts.decide([], ["10.0.0.1"], offered, now()).status == "unknown"
    changed = knownhosts.decide(entries(line("", "10.0.0.1", keys["ca"])), ["10.0.0.1"], offered, now())
    assert changed.status == "changed" and "kh:1" in changed.reason


def test_patterns_ports_negation_and_hashed_entries(keys: dict) -> None:
    offered = Offered(*keys["host"])
    text = line("", "[10.0.0.1]:2222", keys["host"]) + line("", "*.gpu.example,!bad.gpu.example", keys["host"])
    kh = entries(text)
    assert knownhosts.decide(kh, [knownhosts.lookup_name("10.0.0.1", 2222)], offered, now()).ok
    assert not knownhosts.decide(kh, [knownhosts.lookup_name("10.0.0.1", 22)], offered, now()).ok
    assert knownhosts.decide(kh, ["A.gpu.example"], offered, now()).ok
    assert not knownhosts.decide(kh, ["bad.gpu.example"], offered, now()).ok
    hashed = knownhosts.entry_line("[10.0.0.1]:2222", *keys["host"], hashed=True)
    assert hashed.startswith("|1|") and "10.0.0.1" not in hashed
    assert knownhosts.decide(entries(hashed), ["[10.0.0.1]:2222"], offered, now()).ok
    assert knownhosts.is_hashed(hashed) and not knownhosts.is_hashed(text)


def test_hashed_by_ssh_keygen_is_read_and_ours_is_found_by_ssh_keygen(keys: dict) -> None:
    path = keys["dir"] / "known_hosts"
    path.write_text(line("", "web1.example", keys["host"]))
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(path)], check=True, capture_output=True)
    assert knownhosts.is_hashed(path.read_text())
    assert knownhosts.decide(entries(path.read_text()), ["web1.example"], Offered(*keys["host"]), now()).ok
    path.write_text(knownhosts.entry_line("web2.example", *keys["host"], hashed=True))
    found = subprocess.run(["ssh-keygen", "-F", "web2.example", "-f", str(path)], capture_output=True, text=True)
    assert found.returncode == 0 and keys["host"][0] in found.stdout


def test_valid_certificate_from_a_listed_ca(keys: dict) -> None:
    cert = sign(keys["dir"] / "ca", keys["dir"] / "host", "-h", "-n", "web1,10.0.0.1", "-V", "-5m:+1h")
    kh = entries(line("@cert-authority", "10.0.0.*", keys["ca"]))
    verdict = knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, cert), now())
    assert verdict.status == "certified", verdict.reason
    parsed = hostcert.parse(cert)
    assert parsed.principals == ["web1", "10.0.0.1"] and parsed.public_key == keys["host"][1]


@pytest.mark.parametrize(("args", "reason"), [
    (["-h", "-n", "web1,10.0.0.1", "-V", "20200101:20200102"], "expired at 2020-01-02"),
    (["-h", "-n", "web1,10.0.0.1", "-V", "+1d:+2d"], "not valid before"),
    (["-h", "-n", "web2,10.0.0.2"], "not valid for 10.0.0.1 (principals: web2, 10.0.0.2)"),
    (["-n", "10.0.0.1"], "user certificate, not a host certificate"),
])
def test_bad_certificates_are_refused_with_their_reason(keys: dict, args: list[str], reason: str) -> None:
    cert = sign(keys["dir"] / "ca", keys["dir"] / "host", *args)
    kh = entries(line("@cert-authority", "*", keys["ca"]))
    verdict = knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, cert), now())
    assert verdict.status == "refused" and reason in verdict.reason, verdict


def test_certificate_of_an_unlisted_ca_and_a_forged_signature(keys: dict) -> None:
    cert = sign(keys["dir"] / "other_ca", keys["dir"] / "host", "-h", "-n", "10.0.0.1")
    kh = entries(line("@cert-authority", "*", keys["ca"]) + line("@cert-authority", "other.example", keys["other_ca"]))
    verdict = knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, cert), now())
    assert verdict.status == "refused" and "which no @cert-authority line trusts for 10.0.0.1" in verdict.reason
    good = sign(keys["dir"] / "ca", keys["dir"] / "host", "-h", "-n", "10.0.0.1")
    forged = good[:-1] + bytes([good[-1] ^ 1])
    verdict = knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, forged), now())
    assert verdict.status == "refused" and "signature does not verify" in verdict.reason


def test_bad_certificate_falls_back_to_a_listed_plain_key_as_ssh_does(keys: dict) -> None:
    cert = sign(keys["dir"] / "other_ca", keys["dir"] / "host", "-h", "-n", "10.0.0.1")
    kh = entries(line("", "10.0.0.1", keys["host"]))
    assert knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, cert), now()).status == "known"


def test_revoked_host_key_and_revoked_ca_are_refused_whatever_else_lists_them(keys: dict) -> None:
    cert = sign(keys["dir"] / "ca", keys["dir"] / "host", "-h", "-n", "10.0.0.1")
    trusted = line("@cert-authority", "*", keys["ca"]) + line("", "10.0.0.1", keys["host"])
    for revoked, what in ((keys["host"], "host key"), (keys["ca"], "CA key")):
        kh = entries(trusted + line("@revoked", "*", revoked))
        verdict = knownhosts.decide(kh, ["10.0.0.1"], offered_cert(keys, cert), now())
        assert verdict.status == "revoked" and verdict.reason.startswith(what), verdict
    kh = entries(line("", "10.0.0.1", keys["host"]) + line("@revoked", "*", keys["host"]))
    assert knownhosts.decide(kh, ["10.0.0.1"], Offered(*keys["host"]), now()).status == "revoked"


@pytest.mark.parametrize("kind", ["rsa", "ecdsa"])
def test_rsa_and_ecdsa_cas_and_host_keys(tmp_path: Path, kind: str) -> None:
    keygen(tmp_path / "ca", kind)
    host = keygen(tmp_path / "host", kind)
    cert = sign(tmp_path / "ca", tmp_path / "host", "-h", "-n", "10.0.0.1")
    kh = knownhosts.parse((tmp_path / "ca.pub").read_text().join(["@cert-authority * ", ""]), "kh")[0]
    verdict = knownhosts.decide(kh, ["10.0.0.1"], Offered(host[0], host[1], cert), now())
    assert verdict.status == "certified", verdict.reason


def test_key_algorithm_order_puts_certificates_first_only_when_a_ca_is_trusted(keys: dict) -> None:
    available = ("ssh-ed25519", "rsa-sha2-512", "ssh-ed25519-cert-v01@openssh.com")
    kh = entries(line("@cert-authority", "10.0.0.1", keys["ca"]))
    assert knownhosts.preferred_key_types(kh, "10.0.0.1", available)[0] == "ssh-ed25519-cert-v01@openssh.com"
    assert knownhosts.preferred_key_types([], "10.0.0.1", available) == available


def test_unknown_markers_and_garbage_lines_are_skipped_with_a_warning(keys: dict) -> None:
    parsed, warnings = knownhosts.parse("@foo * ssh-ed25519 AAAA\nonly two\n# comment\n"
                                        + line("", "h", keys["host"]), "kh")
    assert len(parsed) == 1 and [w.split(":")[1] for w in warnings] == ["1", "2"]


def test_table_is_parsed_once_and_again_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    key = b"\x00\x00\x00\x0bssh-ed25519" + bytes(36)
    path.write_text(knownhosts.entry_line("a", "ssh-ed25519", key, True))
    first = knownhosts.table([path])
    assert knownhosts.table([path]) is first and len(first.matching(["a"])) == 1 and first.matching(["b"]) == []
    with path.open("a") as fh:  # a key recorded on first use
        fh.write(knownhosts.entry_line("b", "ssh-ed25519", key, True))
    again = knownhosts.table([path])
    assert again is not first and len(again.matching(["b"])) == 1


def test_a_known_hosts_file_with_bytes_that_are_not_utf8_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    key = b"\x00\x00\x00\x0bssh-ed25519" + bytes(36)
    path.write_bytes("# caf\u00e9 rack\nh\u00f6st ssh-ed25519 AAAA\n".encode("latin-1")
                     + knownhosts.entry_line("a", "ssh-ed25519", key, False).encode())
    table = knownhosts.table([path])  # raised UnicodeDecodeError (exit 1) before
    assert len(table.matching(["a"])) == 1 and table.matching(["host"]) == []
