"""What a command leaves behind on a host when it ends: its history line, and old releases pruned."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from kdeploy.core import history, release
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import service_dir
from kdeploy.core.report import HostResult, Result
from kdeploy.flows.session import Wanted
from kdeploy.host import lock


def _entry(result: HostResult, started: float, local: Wanted | None, command: str, secrets: str | None) -> dict:
    who = lock.holder_info(command)
    entry = {
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "user": who.user, "controller": who.controller, "command": who.command,
        "payload_hash": release.sha256_text(release.manifest_text(local.payload.manifest))[:16] if local else None,
        "unit_hash": release.sha256_text(local.unit_text)[:16] if local else None,
        "duration": round(time.monotonic() - started, 2),
        "result": result.result, "release": result.release, "attempted": result.attempted, "error": result.error,
        # the release that runs passed its gate in this command, whatever the result says since (``failed``:
        # the router did not take the host back)
        "gated": result.release if result.gated is not None and result.gated == result.release else None,
    }
    if secrets:
        entry["secrets"] = secrets
    return entry


def confirmed_line(host: HostConfig, result: HostResult, started: float, local: Wanted | None = None, *,
                   command: str, success: Result, gated: bool, secrets: str | None = None) -> str:
    """The history line the confirm writes in the same command that keeps the switch (``success``, the release
    attempted, ``gated`` when the gate ran), so a host reset right after its confirm still has the line that says
    its release passed; the command's end then writes another line only if its result changed since
    (:attr:`HostResult.recorded`)."""
    entry = _entry(result, started, local, command, secrets)
    entry.update(result=success, release=result.attempted, error=None, gated=result.attempted if gated else None)
    return history.append_command(service_dir(host.service), entry)


def finish_command(host: HostConfig, result: HostResult, started: float, releases: list[str],
                   local: Wanted | None = None, keep: set[str | None] = frozenset(), *, command: str,
                   secrets: str | None = None) -> str:
    """Append the history line (unless the confirm wrote it with the same result) and prune old releases (sent to
    the lock holder, run under the lock).

    Never pruned: the release now current, the one attempted, and ``keep`` (what ran before the command
    and the last confirmed release: a rollback's targets). ``secrets``: "changed" when the push wrote them.
    """
    sdir = service_dir(host.service)
    attempted = result.attempted
    line = "" if result.recorded == result.result else history.append_command(
        sdir, _entry(result, started, local, command, secrets))
    protect = {str(r) for r in (result.release, attempted, *keep) if r}
    prune = release.releases_to_prune(sorted(set(releases) | ({attempted} if attempted else set())),
                                      host.service.keep_releases, protect)
    return "\n".join(c for c in (line, release.prune_command(sdir, prune)) if c)
