"""Secrets: values the service reads from ``service.environment_file``, shipped by kdeploy.

The inventory names them (``service.secrets``: environment variables of the controller and/or a local file
of ``NAME=value`` lines); their values are read on the controller when a command runs and exist only there,
in the SSH channel's stdin, and in the 0600 root-only file on the host. Never on a command line, in the unit,
the release, the history, or any output: those show ``***``.

On the host, the write is part of the activation: the content comes over stdin into a temp file next to the
environment file (umask 077), is checked against its salted digest, fsynced and renamed over it. The last
confirmed content is kept as ``<service dir>/.secrets.prev`` (0600) while a switch that changed it is
unconfirmed, so a failed gate's rollback and the host's own revert put it back; the confirmation removes it.
Whether the host's file matches the inventory is decided on a digest salted with ``.secrets.salt`` (random,
per write), so the value the state read sees is no plain hash of a short token.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets as random
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.inventory import ENV_NAME, HostConfig, Inventory
from kdeploy.core.layout import SECRETS_PREVIOUS as PREVIOUS  # the confirmation and the host's revert know it too
from kdeploy.core.layout import SECRETS_SALT

SALT = SECRETS_SALT
MASK = "***"
MIN_MASKED = 4  # shorter values are not masked in logs: they would mask ordinary words
_BAD = re.compile(r"[\x00-\x1f\x7f\ufeff]")
_ESCAPE = re.compile(r'(["\\`$])')
_BACKSLASHED = r"\\\1"


@dataclass(frozen=True)
class Secrets:
    """The resolved values, in inventory order (the file's, then ``env``'s)."""

    values: dict[str, str]

    def content(self) -> str:
        """The environment file: one ``NAME="value"`` line each, quoted so systemd's ``EnvironmentFile=`` reads
        the value back exactly (in double quotes a backslash keeps any of ``"\\`$`` literal, everything else
        is verbatim; systemd.exec(5))."""
        return "".join(f'{name}="{_ESCAPE.sub(_BACKSLASHED, value)}"\n' for name, value in self.values.items())

    def digest(self, salt: str) -> str:
        return salted_digest(salt, self.content())

    def masked(self) -> dict[str, str]:
        """What outputs show: the names, never a value."""
        return dict.fromkeys(self.values, MASK)

    def mask(self, text: str) -> str:
        return mask(text, self.values.values())


def mask(text: str, values: Iterable[str]) -> str:
    """``text`` with every occurrence of a value (of at least MIN_MASKED characters) as ``***``."""
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= MIN_MASKED:
            text = text.replace(value, MASK)
    return text


def salted_digest(salt: str, content: str) -> str:
    """What the host's state read computes with ``printf %s SALT; cat FILE | sha256sum``."""
    return hashlib.sha256(salt.encode() + content.encode()).hexdigest()


def check_value(name: str, value: str, where: str) -> None:
    """A value must be one line of UTF-8 text systemd accepts; errors name the variable, never the value."""
    if _BAD.search(value):
        raise InvalidInput(f"{where}: secret {name}: its value contains a newline, NUL, byte order mark or other "
                           "control character (systemd's EnvironmentFile= cannot carry it)")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidInput(f"{where}: secret {name}: its value is not valid UTF-8") from None


def parse_file(text: str, where: str) -> dict[str, str]:
    """``NAME=value`` lines; blank lines and ``#`` comments skipped. The value is everything after the first
    ``=``, verbatim, less one pair of matching quotes around all of it (no escapes are processed)."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        at = f"{where}:{number}"
        if not sep or not ENV_NAME.match(name):
            raise InvalidInput(f"{at}: expected NAME=value with NAME a valid environment variable name")
        if name in out:
            raise InvalidInput(f"{at}: secret {name} is set twice")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        check_value(name, value, at)
        out[name] = value
    return out


def resolve(inventory: Inventory, host: HostConfig, environ: Mapping[str, str] | None = None, *,
            strict: bool = True) -> Secrets | None:
    """The host's secrets read on the controller now (None: the service has none). ``strict=False`` (logs)
    leaves out what is missing instead of failing."""
    wanted = host.service.secrets
    if not wanted.env and wanted.file is None:
        return None
    environ = os.environ if environ is None else environ
    values: dict[str, str] = {}
    if wanted.file is not None:
        path = inventory.local_path(wanted.file)
        try:
            values = parse_file(files.read_text(Path(path), "the secrets file"), str(path))
        except InvalidInput:
            if strict:
                raise
    for name in wanted.env:
        if name not in environ:
            if strict:
                raise InvalidInput(f"{host.name}: secret {name}: environment variable {name} is not set on the "
                                   "controller (service.secrets.env)")
            continue
        if name in values and strict:
            raise InvalidInput(f"{host.name}: secret {name} is in both service.secrets.file and service.secrets.env")
        check_value(name, environ[name], f"{host.name}: environment variable {name}")
        values[name] = environ[name]
    return Secrets(values)


def new_salt() -> str:
    return random.token_hex(16)


@dataclass(frozen=True)
class Stamp:
    """The host's environment file as the state read sees it: a salt and the salted digest of the content."""

    salt: str
    digest: str


def read_command(service_dir: str, environment_file: str) -> str:
    """Prints ``<salt> <digest>`` when kdeploy wrote the file (nothing otherwise); the content stays there."""
    salt = shlex.quote(f"{service_dir}/{SALT}")
    ef = shlex.quote(environment_file)
    return (f"s=$(cat {salt} 2>/dev/null) && [ -f {ef} ] && "
            f"echo \"$s $({{ printf %s \"$s\"; cat {ef}; }} | sha256sum | cut -c1-64)\"")


def parse_stamp(text: str) -> Stamp | None:
    words = text.split()
    return Stamp(words[0], words[1]) if len(words) == 2 and len(words[1]) == 64 else None


def _tmp(environment_file: str) -> str:
    return shlex.quote(f"{environment_file}.kdeploy-tmp")


def write_stdin(secrets: Secrets, salt: str) -> bytes:
    """What :func:`write_script` reads: the salted digest on a first line (kept off the command line, which
    other users of the host may read in ``ps``), then the content."""
    return f"{secrets.digest(salt)}\n{secrets.content()}".encode()


def write_script(service_dir: str, environment_file: str, salt: str) -> str:
    """Activation lines (under ``set -eu``) that write stdin (:func:`write_stdin`) into the environment file
    atomically: the last confirmed content is saved first (unless an unconfirmed switch already saved it), the
    temp file is created 0600 root, checked against the digest (a cut-off stdin never lands), fsynced,
    renamed, and the salt stored."""
    d = shlex.quote(service_dir)
    ef, tmp = shlex.quote(environment_file), _tmp(environment_file)
    prev = f"{d}/{PREVIOUS}"
    return "\n".join([
        "umask 077",
        f"if [ ! -e {prev} ]; then",
        f"  if [ -f {ef} ]; then cp {ef} {prev}.tmp; else : > {prev}.tmp; fi",
        f"  mv -f {prev}.tmp {prev}",
        "fi",
        f"rm -f {tmp}",
        "read -r want",
        f"cat > {tmp}",
        f"chown 0:0 {tmp}",
        f"chmod 0600 {tmp}",
        f"[ \"$({{ printf %s {shlex.quote(salt)}; cat {tmp}; }} | sha256sum | cut -c1-64)\" = \"$want\" ]"
        f" || {{ rm -f {tmp}; echo 'secrets arrived incomplete' >&2; exit 1; }}",
        f"sync {tmp}",
        f"mv -T {tmp} {ef}",
        f"printf %s {shlex.quote(salt)} > {d}/{SALT}.tmp",  # two commands, so `set -e` sees a failed write
        f"mv -f {d}/{SALT}.tmp {d}/{SALT}",
    ])


def restore_script(service_dir: str, environment_file: str) -> str:
    """Put the last confirmed content back, if a pending switch changed it (the confirmation removes the copy)."""
    d = shlex.quote(service_dir)
    ef, tmp = shlex.quote(environment_file), _tmp(environment_file)
    return (f"if [ -f {d}/{PREVIOUS} ]; then (umask 077 && rm -f {tmp} && cp {d}/{PREVIOUS} {tmp} && sync {tmp} && "
            f"mv -T {tmp} {ef}); fi")
