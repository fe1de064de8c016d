"""What a command leaves behind on a host when it ends: its history line, and old releases pruned."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from kdeploy.core import history, release
from kdeploy.core.inventory import HostConfig
from kdeploy.core.layout import service_dir
from kdeploy.core.report import HostResult
from kdeploy.flows.session import Wanted
from kdeploy.host import lock


def finish_command(host: HostConfig, result: HostResult, started: float, releases: list[str],
                   local: Wanted | None = None, keep: set[str | None] = frozenset(), *, command: str,
                   secrets: str | None = None) -> str:
    """Append the history line and prune old releases (sent to the lock holder, run under the lock).

    Never pruned: the release now current, the one attempted, and ``keep`` (what ran before the command
    and the last confirmed release: a rollback's targets). ``secrets``: "changed" when the push wrote them.
    """
    sdir = service_dir(host.service)
    attempted = result.attempted
    who = lock.holder_info(command)
    entry = {
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "user": who.user, "controller": who.controller, "command": who.command,
        "payload_hash": release.sha256_text(release.manifest_text(local.payload.manifest))[:16] if local else None,
        "unit_hash": release.sha256_text(local.unit_text)[:16] if local else None,
        "duration": round(time.monotonic() - started, 2),
        "result": result.result, "release": result.release, "attempted": attempted, "error": result.error,
    }
    if secrets:
        entry["secrets"] = secrets
    protect = {str(r) for r in (result.release, attempted, *keep) if r}
    prune = release.releases_to_prune(sorted(set(releases) | ({attempted} if attempted else set())),
                                      host.service.keep_releases, protect)
    return "\n".join(c for c in (history.append_command(sdir, entry), release.prune_command(sdir, prune)) if c)
