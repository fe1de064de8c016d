"""A prefill or decode server gated through a real pair (docs/topologies.md, "Prefill and decode").

A PD server cannot answer a completion alone: SGLang refuses one without ``bootstrap_room`` (400), and its
``/health`` uses a fake bootstrap host that proves nothing about pairs. So the gate sends its golden completions
and parity prompts the way sglang-router does: the same body, with ``bootstrap_host`` (the prefill's address
as the decode reaches it), ``bootstrap_port`` (the prefill's) and a random ``bootstrap_room``, to the server
under test and to a serving server of the other role at once, and judges the decode's answer. A prefill that
cannot hand its KV over, or a decode that cannot fetch it, fails the gate.
"""

from __future__ import annotations

import random
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdeploy.ssh.tunnel import ServiceHttp


FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang/srt/disaggregation/utils.py: no peer is contacted (SGLang's own /health)


@dataclass(frozen=True)
class Pairing:
    """The partner of a server under test: a serving server of the other role, reached over its own SSH
    connection, and where the pair's decode finds the prefill's bootstrap server. Without a partner (none
    serves yet: the fleet's first deploy) ``http`` is None and the server answers alone through SGLang's fake
    bootstrap host."""

    partner: str | None  # the partner's host name
    http: ServiceHttp | None
    own_role: str  # "prefill" or "decode": the server under test
    bootstrap_host: str
    bootstrap_port: int | None

    @property
    def other(self) -> str:
        return "decode" if self.own_role == "prefill" else "prefill"

    @classmethod
    def alone(cls, own_role: str) -> Pairing:
        return cls(None, None, own_role, FAKE_BOOTSTRAP_HOST, None)

    def fields(self) -> dict:
        """What the router adds to a request it sends to a pair."""
        return {"bootstrap_host": self.bootstrap_host, "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}


class PairedHttp:
    """The gate's HTTP for a PD server: readiness from the server itself, generation through the pair."""

    def __init__(self, own: ServiceHttp, pairing: Pairing) -> None:
        self.own, self.pairing = own, pairing

    def status(self, path: str) -> int | str:
        return self.own.status(path)

    def post_json(self, path: str, body: dict, *, timeout: float) -> tuple[int | None, str]:
        """``body`` to both servers at once with the bootstrap fields; the decode's answer, unless a side failed
        (its answer, named). A side that fails first ends the wait at once: its peer would wait for it until
        SGLang's own timeout (a prefill waits 300 s for a decode that never fetches its KV)."""
        paired = {**body, **self.pairing.fields()}
        partner = self.pairing.http
        assert partner is not None
        pool = ThreadPoolExecutor(2, thread_name_prefix="kdeploy-pair")
        try:
            mine = pool.submit(self.own.post_json, path, paired, timeout=timeout)
            theirs = pool.submit(partner.post_json, path, paired, timeout=timeout)
            first = next(iter(wait([mine, theirs], return_when=FIRST_COMPLETED).done))
            if first.result()[0] == 200:
                wait([mine, theirs])
            answers = {mine: self.pairing.own_role, theirs: self.pairing.other}
            for future in (f for f in (first, mine, theirs) if f.done()):
                status, text = future.result()
                if status != 200:
                    return status, self._named(answers[future], future is mine, status, text)
            return (mine if self.pairing.own_role == "decode" else theirs).result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a peer left waiting ends with the gate's tunnel

    def _named(self, role: str, own: bool, status: int | None, text: str) -> str:
        """A failed side's answer: the server under test's own decode answer as it is, the others named."""
        if own and role == "decode":
            return text
        who = f"this {role} server" if own else f"{role} {self.pairing.partner}"
        return f"{who} answered {status}: {text}"
