"""The rollout policy of every command that restarts hosts (push, set-env, set, rollback): canary, batch, max-fail.

One type, one check against the hosts selected, one batch plan: the four commands cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kdeploy.core.errors import InvalidInput


def count(spec: str | None, total: int, default: int, option: str = "") -> int:
    """``N`` or ``N%`` of ``total`` (at least 1 for a percentage); ``default`` when not given. A bad value
    names ``option``."""
    if spec is None:
        return default
    try:
        if spec.endswith("%"):
            pct = float(spec[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            return max(1, math.ceil(total * pct / 100))
        value = int(spec)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        where = f"{option} " if option else ""
        raise InvalidInput(f"{where}{spec!r}: expected a count N or a percentage N% (1-100%)") from None


@dataclass(frozen=True)
class Policy:
    """``canary`` hosts go first, alone, and must pass; then batches of ``batch`` hosts (N or N%; default:
    ``--parallel``, behind a router 1: :meth:`routed`); more than ``max_fail`` failures (N or N%; default: no
    limit) stop new batches. ``analysis``: seconds the canary's metrics are watched against the rest's before
    they go (``--analysis``; kdeploy/flows/canary.py)."""

    canary: int = 0
    batch: str | None = None
    max_fail: str | None = None
    analysis: float | None = None

    def check(self, selected: int) -> None:
        """Before any host is touched: bad syntax, a batch of 0, a canary or a batch larger than the
        ``selected`` hosts (exit 2, naming the option). No host selected: nothing to check against."""
        if self.canary < 0:
            raise InvalidInput(f"--canary {self.canary}: expected a count of hosts (0: no canary)")
        if self.analysis is not None and not self.canary:
            raise InvalidInput("--analysis needs --canary N: the canary is what is analysed against the other hosts")
        count(self.max_fail, max(selected, 1), 1, "--max-fail")
        batch = count(self.batch, max(selected, 1), 1, "--batch")
        if batch == 0:
            raise InvalidInput("--batch 0: a batch restarts at least one host")
        if selected and self.canary > selected:
            raise InvalidInput(f"--canary {self.canary}: only {selected} host{'s' * (selected != 1)} selected")
        if selected and self.batch is not None and batch > selected:
            raise InvalidInput(f"--batch {self.batch}: only {selected} host{'s' * (selected != 1)} selected")

    def routed(self) -> Policy:
        """The policy for hosts behind a router: without ``--batch``, one host at a time, since a batch of
        ``--parallel`` hosts would take every worker of a small fleet out of its router at once."""
        return self if self.batch is not None else replace(self, batch="1")

    def batch_size(self, total: int, parallel: int) -> int:
        return count(self.batch, total, parallel, "--batch")

    def failures_allowed(self, total: int) -> int:
        return count(self.max_fail, total, total, "--max-fail")

    def batches(self, names: list[str], parallel: int) -> list[list[str]]:
        """Canary hosts alone first, then the rest in batches of at most ``batch_size``."""
        return plan_batches(names, self.canary, self.batch_size(len(names), parallel))


def plan_batches(names: list[str], canary: int, batch: int) -> list[list[str]]:
    """Canary hosts alone first, then the rest in batches of at most ``batch``."""
    batches = [names[:canary]] if canary > 0 and names else []
    rest = names[canary:] if canary > 0 else names
    batch = max(1, batch)
    return batches + [rest[i:i + batch] for i in range(0, len(rest), batch)]
