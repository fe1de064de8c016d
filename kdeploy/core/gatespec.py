"""What a gate must prove about one run of a service, decided before the run and stored with the release.

The spec is computed from the inventory and from the payload's own manifest (``kdeploy-gate.json`` in the
payload directory: which markers its workers log, and the config line they log, as a function of the
service's environment), so kdeploy hard-wires no payload's strings. It is written into each release's
metadata, so that a rollback is gated with what the release it returns to was deployed with (its port,
workers, markers, model), not with the configuration that just failed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.inventory import ONE_NODE, ParitySet, Placement, Service
from kdeploy.core.render import unit_filename

MANIFEST = "kdeploy-gate.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParitySpec(_Frozen):
    """The golden set and its tolerances, resolved (the gate's prompts filled in)."""

    prompts: list[str] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    top_logprobs: int = Field(ge=1, le=20)
    match_tokens: int = Field(gt=0)
    logprob_tolerance: float = Field(gt=0)

    def set_key(self) -> str:
        """What a record must have been captured with to be compared (tolerances do not matter to it)."""
        text = json.dumps([self.prompts, self.max_tokens, self.top_logprobs])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class Setting(_Frozen):
    """One environment flag of the payload: its canonical values and the spellings each accepts."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    env: str
    default: str
    type: Literal["choice", "int", "str"] = "choice"
    values: dict[str, list[str]] = {}

    def canonical(self, raw: str | None) -> str:
        text = (raw if raw is not None else self.default).strip()
        if self.type == "int":
            try:
                return str(int(text))
            except ValueError:
                raise InvalidInput(f"{self.env}={raw!r}: expected an integer") from None
        if self.type == "str":
            return text
        for value, spellings in self.values.items():
            if text.lower() in (s.lower() for s in spellings):
                return value
        accepted = sorted({s for spellings in self.values.values() for s in spellings})
        raise InvalidInput(f"{self.env}={raw!r}: expected one of {', '.join(accepted)}")


class Marker(_Frozen):
    text: str = Field(min_length=1)
    when: dict[str, str] = {}  # setting name -> canonical value; all must hold


class PayloadGate(_Frozen):
    """The payload's ``kdeploy-gate.json``."""

    schema_: int = Field(1, alias="schema")
    config_line: str | None = None
    settings: list[Setting] = []
    markers: list[Marker] = []
    parity: ParitySet | None = None  # the payload's golden set (the inventory's `gate.parity` mapping wins)

    def config(self, env: dict[str, str]) -> dict[str, str]:
        """The canonical settings a worker must report for ``env``; bad values are invalid input."""
        return {s.name: s.canonical(env.get(s.env)) for s in self.settings}

    def markers_for(self, config: dict[str, str]) -> list[str]:
        return [m.text for m in self.markers if all(config.get(k) == v for k, v in m.when.items())]


def load_payload_gate(payload_dir: Path) -> PayloadGate | None:
    """The manifest of a payload directory; None when it has none (the gate then checks only what the
    inventory's ``gate.markers`` lists)."""
    path = payload_dir / MANIFEST
    if files.status(path, "payload gate manifest") is None:
        return None
    text = files.read_text(path, "payload gate manifest")
    try:
        gate = PayloadGate.model_validate(files.parsed(lambda: json.loads(text), str(path)))
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else (
            f"{'.'.join(map(str, exc.errors()[0]['loc']))}: {exc.errors()[0]['msg']}")
        raise InvalidInput(f"{path}: invalid payload gate manifest: {first}") from None
    names = {s.name for s in gate.settings}
    for marker in gate.markers:
        unknown = set(marker.when) - names
        if unknown:
            raise InvalidInput(f"{path}: marker {marker.text!r} depends on unknown settings {sorted(unknown)}")
    return gate


class Prompt(_Frozen):
    prompt: str
    expect: str


class GateSpec(_Frozen):
    """Everything the gate checks on one run; the release it must have loaded is passed beside it."""

    unit: str
    host: str = "127.0.0.1"  # the address the server binds (sglang.host): the gate dials it on the host
    port: int
    ready_path: str
    model: str
    prompts: list[Prompt]
    max_tokens: int
    workers: int  # on this node: a node of a server that spans hosts runs tp / nnodes of its ranks
    markers: list[str]
    config_line: str | None = None
    config: dict[str, str] = {}
    timeout: float
    poll_interval: float
    parity: ParitySpec | None = None  # None: no parity phase (turned off, or a release staged before it existed)
    nnodes: int = 1  # the server's nodes; only its head (node_rank 0) answers HTTP
    node_rank: int = 0

    @property
    def serves(self) -> bool:
        """This node answers the server's HTTP: a follower's /health is a dummy that proves nothing, so a
        follower is gated on its unit and its own ranks' markers only."""
        return self.node_rank == 0

    def with_workers(self, workers: int | None) -> GateSpec:
        """``--workers`` (the server's total) for this node."""
        return self if not workers else self.model_copy(update={"workers": per_node(workers, self.nnodes)})

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> GateSpec | None:
        """None for a missing or unreadable record (a release staged before specs were stored)."""
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return None


def per_node(workers: int, nnodes: int) -> int:
    """A server's worker count on each of its nodes (SGLang gives each node tp / nnodes ranks)."""
    if workers % nnodes:
        raise InvalidInput(f"--workers {workers} is not divisible by the server's {nnodes} nodes (each node runs "
                           "as many ranks)")
    return workers // nnodes


def gate_spec(service: Service, payload: PayloadGate | None, *, workers: int | None = None,
              timeout: float | None = None, place: Placement = ONE_NODE) -> GateSpec:
    """The spec for ``service`` on the node at ``place``: ``gate.markers`` in the inventory overrides the
    payload's markers; ``workers`` (else the service's) counts the whole server's."""
    config = payload.config(service.env) if payload else {}
    if service.gate.markers is not None:
        markers = list(service.gate.markers)
    else:
        markers = payload.markers_for(config) if payload else []
    return GateSpec(
        unit=unit_filename(service), host=service.sglang.host, port=service.sglang.port,
        ready_path=service.gate.ready_path,
        model=service.sglang.served_model_name or service.sglang.model_path,
        prompts=[Prompt(prompt=p.prompt, expect=p.expect) for p in service.gate.prompts],
        max_tokens=service.gate.max_tokens, workers=per_node(workers or service.workers, place.nnodes),
        markers=markers, nnodes=place.nnodes, node_rank=place.node_rank,
        config_line=payload.config_line if payload else None, config=config,
        timeout=timeout or service.gate_timeout, poll_interval=service.gate.poll_interval,
        parity=parity_spec(service, payload))


def parity_spec(service: Service, payload: PayloadGate | None) -> ParitySpec | None:
    """The golden set: the inventory's mapping, else the payload's, else the defaults; prompts default to
    the gate's own."""
    chosen = service.gate.parity
    if chosen is False:
        return None
    if chosen is True:
        chosen = payload.parity if payload and payload.parity else ParitySet()
    return ParitySpec(prompts=chosen.prompts or [p.prompt for p in service.gate.prompts],
                      max_tokens=chosen.max_tokens, top_logprobs=chosen.top_logprobs,
                      match_tokens=min(chosen.match_tokens or chosen.max_tokens, chosen.max_tokens),
                      logprob_tolerance=chosen.logprob_tolerance)
