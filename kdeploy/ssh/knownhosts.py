"""known_hosts as OpenSSH reads it: hashed names, patterns, ``@cert-authority`` and ``@revoked``.

Pure parsing and one decision function (:func:`decide`), so every verdict on a host key is unit-tested
without a network; ``remote`` only feeds it the key the host offered.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.filecache import FileCache
from kdeploy.ssh import hostcert


@dataclass(frozen=True)
class Entry:
    marker: str | None       # None, "cert-authority" or "revoked"
    patterns: str            # the host field as written (comma list, or one |1|salt|hash)
    key_type: str
    key: bytes               # the public key blob
    source: str              # "path:line", for messages

    def matches(self, name: str) -> bool:
        if self.patterns.startswith("|1|"):
            return _hashed_match(self.patterns, name)
        matched = False
        for pattern in self.patterns.split(","):
            if _glob(pattern.removeprefix("!")).fullmatch(name.lower()):
                if pattern.startswith("!"):
                    return False
                matched = True
        return matched


def _glob(pattern: str) -> re.Pattern[str]:
    """OpenSSH patterns know only ``*`` and ``?`` (``[`` is literal: ``[host]:2222``)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower()))


def _hashed_match(field: str, name: str) -> bool:
    try:
        _, _, salt, digest = field.split("|")
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(mac, base64.b64decode(digest))
    except ValueError:
        return False


def lookup_name(host: str, port: int) -> str:
    """The name known_hosts stores a host under: ``host``, or ``[host]:port`` off port 22."""
    return host if port == 22 else f"[{host}]:{port}"


def parse(text: str, source: str) -> tuple[list[Entry], list[str]]:
    """Entries, and one warning per line that is not one (OpenSSH skips those too)."""
    entries, warnings = [], []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = None
        if fields[0].startswith("@"):
            marker = fields.pop(0)[1:]
            if marker not in ("cert-authority", "revoked"):
                warnings.append(f"{source}:{number}: unknown marker @{marker}, line ignored")
                continue
        try:
            if len(fields) < 3:
                raise ValueError("too few fields")
            blob = base64.b64decode(fields[2], validate=True)
        except ValueError as exc:
            warnings.append(f"{source}:{number}: unreadable entry ({exc}), line ignored")
            continue
        entries.append(Entry(marker, fields[0], fields[1], blob, f"{source}:{number}"))
    return entries, warnings


def load(paths: list[Path]) -> tuple[list[Entry], list[str]]:
    """Every readable file of ``paths`` (missing ones are empty, like OpenSSH's)."""
    entries, warnings = [], []
    for path in paths:
        try:
            if files.status(path, "known_hosts") is None:
                continue
            # bounded like every file kdeploy reads; a line that is not UTF-8 is a bad line, as in OpenSSH
            text = files.read_bytes(path, "known_hosts").decode(errors="replace")
        except InvalidInput as exc:  # the connect's failure (unreachable), as any other known_hosts refusal
            raise OSError(str(exc)) from None
        more, bad = parse(text, str(path))
        entries += more
        warnings += bad
    return entries, warnings


class Table:
    """known_hosts files parsed once, with the entries that match each name looked up so far: 1000 hashed
    lines cost one HMAC each per name, once per run instead of once per connect."""

    def __init__(self, entries: list[Entry], warnings: list[str]) -> None:
        self.entries, self.warnings = entries, warnings
        self._matching: dict[tuple[str, ...], list[Entry]] = {}

    def matching(self, names: list[str]) -> list[Entry]:
        """The entries for any of ``names``: all :func:`decide` and :func:`preferred_key_types` need."""
        key = tuple(names)
        if key not in self._matching:
            self._matching[key] = [e for e in self.entries if any(e.matches(n) for n in names)]
        return self._matching[key]


_TABLES: FileCache[Table] = FileCache()


def table(paths: list[Path]) -> Table:
    """:func:`load`, parsed again only when a file changed (recording a key changes it)."""
    return _TABLES.get(paths, lambda: Table(*load(paths)))


@dataclass(frozen=True)
class Offered:
    """The host key the server proved it holds: a plain key, or a certificate (its blob in ``cert``)."""

    key_type: str
    key: bytes               # plain key blob (for a certificate: the certified key)
    cert: bytes | None = None


@dataclass(frozen=True)
class Verdict:
    status: str              # "known", "certified", "unknown", "changed", "revoked", "refused"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("known", "certified")


def preferred_key_types(entries: list[Entry], name: str, available: tuple[str, ...]) -> tuple[str, ...]:
    """Host key algorithms to offer, in OpenSSH's order: certificates first when a CA is trusted for the
    host, then the types known_hosts lists for it, then the rest (so a host with several keys offers the
    one we can check)."""
    mine = [e for e in entries if e.matches(name) and e.marker != "revoked"]
    first = []
    if any(e.marker == "cert-authority" for e in mine):
        first += [t for t in available if t.endswith(hostcert.CERT_SUFFIX)]
    known = {e.key_type for e in mine if e.marker is None}
    first += [t for t in available if t in known or (t.startswith("rsa-sha2-") and "ssh-rsa" in known)]
    return tuple(dict.fromkeys(first + list(available)))


def decide(entries: list[Entry], names: list[str], offered: Offered, now: int) -> Verdict:
    """OpenSSH's host key check. ``names``: what the host is known as (HostKeyAlias or address, as
    ``lookup_name`` writes it); the first is the certificate principal to match.

    A certificate is accepted when a CA trusted for the host signed it as a host certificate for this
    name and it is valid now; a bad certificate falls back to its plain key (as ``ssh`` does), and when
    that is not listed either, the certificate's fault is the reason. A ``@revoked`` key (host key or CA)
    is refused, whatever else lists it.
    """
    mine = [e for e in entries if any(e.matches(n) for n in names)]
    revoked = {e.key for e in mine if e.marker == "revoked"}
    cert = None
    if offered.cert is not None:
        try:
            cert = hostcert.parse(offered.cert)
        except hostcert.CertError as exc:
            return Verdict("refused", f"unreadable host certificate: {exc}")
    if offered.key in revoked or (cert is not None and cert.ca_key in revoked):
        what = "CA key" if cert is not None and cert.ca_key in revoked else "host key"
        return Verdict("revoked", f"{what} {hostcert.fingerprint(cert.ca_key if what == 'CA key' else offered.key)}"
                                  " is marked @revoked in known_hosts; refusing")
    cert_problem = None
    if cert is not None:
        cas = [e for e in mine if e.marker == "cert-authority"]
        if not any(e.key == cert.ca_key for e in cas):
            cert_problem = (f"host certificate signed by CA {hostcert.fingerprint(cert.ca_key)}, which no "
                            f"@cert-authority line trusts for {names[0]}")
        else:
            try:
                hostcert.check(cert, _principal(names[0]), now)
                return Verdict("certified", f"certificate {cert.key_id!r} signed by a trusted CA")
            except hostcert.CertError as exc:
                cert_problem = str(exc)
    plain = [e for e in mine if e.marker is None]
    if any(e.key == offered.key for e in plain):
        return Verdict("known")
    if cert_problem:
        return Verdict("refused", cert_problem)
    same_type = [e for e in plain if e.key_type == offered.key_type]
    if same_type:
        return Verdict("changed", f"known_hosts {same_type[0].source} has {hostcert.fingerprint(same_type[0].key)}")
    return Verdict("unknown")


def _principal(name: str) -> str:
    """Certificates name hosts without the ``[...]:port`` known_hosts wrapping."""
    return name[1:].rsplit("]:", 1)[0] if name.startswith("[") else name


def is_hashed(text: str) -> bool:
    """Whether the file's entries are hashed (``HashKnownHosts yes``): then new ones must be too."""
    return any(line.split()[0].startswith("|1|") for line in text.splitlines()
               if line.split() and not line.startswith(("#", "@")))


def entry_line(name: str, key_type: str, key: bytes, hashed: bool) -> str:
    """A new known_hosts line for ``name``, hashed like ``ssh-keygen -H`` writes it when asked."""
    host = name
    if hashed:
        salt = os.urandom(20)
        mac = hmac.new(salt, name.encode(), hashlib.sha1).digest()
        host = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(mac).decode()}"
    return f"{host} {key_type} {base64.b64encode(key).decode()}\n"
