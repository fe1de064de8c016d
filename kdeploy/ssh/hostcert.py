"""OpenSSH host certificates (PROTOCOL.certkeys), parsed and checked with ``cryptography``.

paramiko accepts a certificate as a host key but never checks it (paramiko#771): who signed it, for which
names, until when. These pure functions do, so a site whose known_hosts trusts an SSH CA
(``@cert-authority``) is verified as strictly as ``ssh`` verifies it.
"""

from __future__ import annotations

import hashlib
import struct
from base64 import b64encode
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

CERT_SUFFIX = "-cert-v01@openssh.com"
HOST_CERT = 2
# How many public fields (strings or mpints, both length-prefixed) each certified key type has.
_KEY_FIELDS = {"ssh-ed25519": 1, "ssh-rsa": 2, "ecdsa-sha2-nistp256": 2, "ecdsa-sha2-nistp384": 2,
               "ecdsa-sha2-nistp521": 2}
_CURVES = {"nistp256": (ec.SECP256R1, hashes.SHA256), "nistp384": (ec.SECP384R1, hashes.SHA384),
           "nistp521": (ec.SECP521R1, hashes.SHA512)}
_RSA_HASHES = {"rsa-sha2-256": hashes.SHA256, "rsa-sha2-512": hashes.SHA512}
FOREVER = 2**64 - 1


class CertError(ValueError):
    """A certificate that cannot be parsed or does not verify; the message is the one-line reason."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CertError("truncated certificate")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(">Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u32())

    def mpint(self) -> int:
        return int.from_bytes(self.string(), "big", signed=True)

    def raw_field(self) -> bytes:
        """One field with its length prefix, as it appears in a key blob."""
        start = self.pos
        self.string()
        return self.data[start:self.pos]


def _strings(data: bytes) -> list[bytes]:
    reader = _Reader(data)
    out = []
    while reader.pos < len(data):
        out.append(reader.string())
    return out


def ssh_string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


@dataclass(frozen=True)
class HostCert:
    cert_type: str          # e.g. ssh-ed25519-cert-v01@openssh.com
    public_key: bytes       # the certified plain key's blob (what known_hosts would list)
    serial: int
    kind: int               # 1 user, 2 host
    key_id: str
    principals: list[str]
    valid_after: int
    valid_before: int
    critical_options: list[str]
    ca_key: bytes           # the signing CA's public key blob
    signature: bytes
    signed: bytes           # everything the signature covers

    @property
    def key_type(self) -> str:
        return self.cert_type.removesuffix(CERT_SUFFIX)


def parse(blob: bytes) -> HostCert:
    """A certificate blob (the host key the server offered) as fields; CertError if malformed."""
    reader = _Reader(blob)
    cert_type = reader.string().decode(errors="replace")
    key_type = cert_type.removesuffix(CERT_SUFFIX)
    if key_type == cert_type or key_type not in _KEY_FIELDS:
        raise CertError(f"unsupported certificate type {cert_type}")
    reader.string()  # nonce
    fields = b"".join(reader.raw_field() for _ in range(_KEY_FIELDS[key_type]))
    serial = reader.u64()
    kind = reader.u32()
    key_id = reader.string().decode(errors="replace")
    principals = [p.decode(errors="replace") for p in _strings(reader.string())]
    valid_after, valid_before = reader.u64(), reader.u64()
    critical = [name.decode(errors="replace") for name in _strings(reader.string())[::2]]
    reader.string()  # extensions
    reader.string()  # reserved
    ca_key = reader.string()
    signed = blob[:reader.pos]
    signature = reader.string()
    if reader.pos != len(blob):
        raise CertError("trailing data after the certificate signature")
    return HostCert(cert_type, ssh_string(key_type.encode()) + fields, serial, kind, key_id, principals,
                    valid_after, valid_before, critical, ca_key, signature, signed)


def check(cert: HostCert, name: str, now: int) -> None:
    """Everything ``ssh`` checks of a host certificate except "is the CA trusted" (the caller's known_hosts
    lookup): a host certificate, for ``name``, valid now, no critical option, signed by its CA key."""
    if cert.kind != HOST_CERT:
        raise CertError(f"certificate {cert.key_id!r} is a user certificate, not a host certificate")
    if name not in cert.principals:
        listed = ", ".join(cert.principals) or "none"
        raise CertError(f"certificate {cert.key_id!r} is not valid for {name} (principals: {listed})")
    if now < cert.valid_after:
        raise CertError(f"certificate {cert.key_id!r} is not valid before {_when(cert.valid_after)}")
    if now >= cert.valid_before:
        raise CertError(f"certificate {cert.key_id!r} expired at {_when(cert.valid_before)}")
    if cert.critical_options:
        raise CertError(f"certificate {cert.key_id!r} has unsupported critical options: "
                        f"{', '.join(cert.critical_options)}")
    verify_signature(cert.ca_key, cert.signature, cert.signed)


def verify_signature(key_blob: bytes, signature: bytes, data: bytes) -> None:
    """Check an SSH signature blob made by ``key_blob`` over ``data``; CertError if it does not verify."""
    key = _Reader(key_blob)
    key_type = key.string().decode(errors="replace")
    sig = _Reader(signature)
    sig_type = sig.string().decode(errors="replace")
    raw = sig.string()
    try:
        if key_type == "ssh-ed25519" and sig_type == key_type:
            Ed25519PublicKey.from_public_bytes(key.string()).verify(raw, data)
        elif key_type.startswith("ecdsa-sha2-") and sig_type == key_type:
            curve, digest = _CURVES[key.string().decode()]
            point = ec.EllipticCurvePublicKey.from_encoded_point(curve(), key.string())
            rs = _Reader(raw)
            point.verify(encode_dss_signature(rs.mpint(), rs.mpint()), data, ec.ECDSA(digest()))
        elif key_type == "ssh-rsa" and sig_type in _RSA_HASHES:
            e, n = key.mpint(), key.mpint()
            rsa.RSAPublicNumbers(e, n).public_key().verify(raw, data, padding.PKCS1v15(), _RSA_HASHES[sig_type]())
        else:
            raise CertError(f"CA signature type {sig_type} with a {key_type} key is not accepted")
    except InvalidSignature:
        raise CertError("certificate signature does not verify against its CA key") from None
    except (KeyError, ValueError) as exc:
        if isinstance(exc, CertError):
            raise
        raise CertError(f"malformed CA key or signature: {exc}") from None


def fingerprint(blob: bytes) -> str:
    """``ssh-keygen -l`` style: SHA256 of the key blob, unpadded base64."""
    return "SHA256:" + b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _when(stamp: int) -> str:
    if stamp >= FOREVER:
        return "forever"
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
