"""JSON Schemas of kdeploy's contracts: the ``--json`` report and the inventory file.

The report is built by hand from dataclasses (``Report.as_json``); the models here describe that
document field by field, and the tests validate real reports against them (extra keys forbidden) and
compare their fields with the dataclasses', so the schema cannot drift from what kdeploy prints.
``report.SCHEMA_VERSION`` changes only when a field is removed or changes meaning; new fields keep it.
"""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from kdeploy.core import inventory
from kdeploy.core.report import SCHEMA_VERSION, Result

ResultName = Literal[tuple(r.value for r in Result)]  # type: ignore[valid-type]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PhaseDoc(_Doc):
    name: str = Field(description="Phase name (connect, preflight, stage, parity-baseline, activate, restart, "
                                  "unit, ready, completion, parity, workers, confirm, rollback, 'rollback <phase>', "
                                  "relock, pre_host, post_host, analysis, ...).")
    ok: bool = Field(description="Whether the phase passed.")
    seconds: float = Field(description="Wall time of the phase.")
    detail: str = Field(description="What the phase found, or why it failed (one line).")
    data: dict[str, Any] | None = Field(None, description="The phase's numbers, where it has any (parity: "
                                                          "prompts, positions, max_gap, tolerance, reference; "
                                                          "on a mismatch prompt, position, token_before, "
                                                          "token_now, gap; analysis: decision, reason, required, "
                                                          "duration, interval, bounds, canary, baseline, failed, "
                                                          "checks, series, docs/gate.md); absent otherwise.")


class PlanDoc(_Doc):
    add: list[str] = Field(description="Payload files a push would add.")
    change: list[str] = Field(description="Payload files a push would change.")
    remove: list[str] = Field(description="Payload files a push would remove.")
    unit_diff: str = Field(description="Unified diff of the installed unit against the rendered one ('' if equal).")
    daemon_reload: bool = Field(description="Whether the push would run systemctl daemon-reload.")
    restart: bool = Field(description="Whether the push would restart the service.")
    reasons: list[str] = Field(description="Why the host needs a restart ('secrets: changed' among them).")
    secrets: dict[str, str] = Field(description="The service's secrets by name, each value shown as '***'.")


class StatusDoc(_Doc):
    active: str = Field(description="systemd ActiveState of the unit.")
    sub: str = Field(description="systemd SubState of the unit.")
    since: str = Field(description="When the unit entered its state ('' if unknown).")
    env: dict[str, str] = Field(description="The unit's live environment flags (kdeploy's own left out).")
    last_deploy: dict[str, Any] | None = Field(description="The host's last history record, if any.")
    drift: list[str] = Field(description="Differences between the host and the inventory (empty: in sync).")
    secrets: dict[str, str] = Field(description="The service's secrets by name, each value shown as '***'.")


class LockHolderDoc(_Doc):
    user: str = Field(description="Who took the lock (KDEPLOY_USER, else the local user).")
    controller: str = Field(description="The machine the holding kdeploy runs on.")
    pid: int = Field(description="The holding kdeploy's process id on the controller.")
    since: str = Field(description="When the lock was taken (UTC, ISO 8601).")
    command: str = Field(description="The holder's kdeploy command, secret-looking values as ***.")
    remote_pid: int | None = Field(default=None, description="The lock's holder process on the host.")


class LockDoc(_Doc):
    state: Literal["free", "held", "stale"] = Field(description="The deploy lock's state.")
    holder: LockHolderDoc | None = Field(description="Who holds it (null when free).")


class ExecDoc(_Doc):
    exit_status: int | None = Field(description="The command's exit status (null: stopped by --timeout or Ctrl-C; "
                                                "its output is then what it printed until then).")
    stdout: str = Field(description="Its standard output (the inventory's secrets masked as ***).")
    stderr: str = Field(description="Its standard error (the inventory's secrets masked as ***).")


class CheckDoc(_Doc):
    findings: list[str] = Field(description="Every problem found for the host, each 'file:line: ...' (empty: ok).")
    systemd_analyze: bool = Field(description="Whether the rendered unit went through systemd-analyze verify.")


class ServerDoc(_Doc):
    name: str = Field(description="The server's name (its key under `servers`).")
    node_rank: int = Field(description="This host's node rank in it (0: the head).")
    nodes: list[str] = Field(description="The server's nodes in rank order.")


class HostDoc(_Doc):
    host: str = Field(description="Host name from the inventory.")
    ok: bool = Field(description="Whether the host ended well (exit_code 0).")
    result: ResultName = Field(description="How the host ended; see docs/results-and-exit-codes.md.")
    release: str | None = Field(description="The release the host runs now (null if unknown or none).")
    phases: list[PhaseDoc] = Field(description="The phases run on the host, in order.")
    exit_code: int = Field(description="The exit code this host's result stands for.")
    error: str | None = Field(description="Why the host did not end well (null when it did).")
    log: list[str] | None = Field(default=None, description="Journal lines captured at a failure.")
    attempted: str | None = Field(default=None, description="The release the command staged or switched to.")
    restored: ResultName | None = Field(default=None, description="set-env/set: how putting the old config "
                                                                  "back ended on this host.")
    traceback: str | None = Field(default=None, description="An internal error's traceback.")
    router: Literal["in", "out"] | None = Field(default=None, description="Membership in the SGLang router as the "
                                                                        "command left the host (docs/router.md).")
    server: ServerDoc | None = Field(default=None, description="The server that spans hosts this host is a node "
                                                               "of (docs/topologies.md); absent for a single host.")
    role: Literal["prefill", "decode"] | None = Field(default=None, description="The host's server's role in a "
                                                      "prefill/decode fleet (docs/topologies.md); absent: unified.")
    plan: PlanDoc | None = Field(default=None, description="plan: what a push would change.")
    status: StatusDoc | None = Field(default=None, description="status: the service's live state and drift.")
    history: list[dict[str, Any]] | None = Field(default=None, description="history: the host's raw history "
                                                                          "records, newest last.")
    lock: LockDoc | None = Field(default=None, description="lock status/release: the deploy lock.")
    check: CheckDoc | None = Field(default=None, description="check: what was found without SSH.")
    exec: ExecDoc | None = Field(default=None, description="exec: what the command left on the host.")
    probe: dict[str, Any] | None = Field(default=None, description="probe: what the service python offers the "
                                                                   "payload (see docs/payload.md).")


class InventoryEditDoc(_Doc):
    path: str = Field(description="The inventory file edited.")
    level: str = Field(description="Where the edit was written (defaults, groups.<g>, hosts.<h>).")
    diff: str = Field(description="Unified diff of the edit.")
    rolled_out_to: list[str] = Field(description="Hosts whose unit the edit changed.")
    reverted: bool = Field(description="Whether the edit was reverted after a failed or interrupted rollout.")
    conflicts: list[str] | None = Field(default=None, description="Parts of the revert left alone (changed "
                                                                  "meanwhile by someone else).")
    restored_hosts: dict[str, ResultName] | None = Field(default=None, description="Hosts pushed the old config "
                                                                                   "again, and how that ended.")


class ReportDoc(_Doc):
    """The one JSON document ``--json`` prints on stdout."""

    schema_version: Literal[SCHEMA_VERSION] = Field(description="Version of this document's schema (changes only on a "
                                                   "breaking change).")
    kdeploy_version: str = Field(description="The kdeploy version that wrote the document.")
    command: str = Field(description="The command (push, plan, verify, rollback, ...).")
    ok: bool = Field(description="Whether every host ended well.")
    exit_code: int = Field(description="kdeploy's exit code: the most severe of the hosts'.")
    hosts: list[HostDoc] = Field(description="One entry per host, in inventory order.")
    summary: dict[str, int] = Field(description="'hosts': the number of hosts, then the count of each result.")
    inventory: InventoryEditDoc | None = Field(default=None, description="set-env/set: the inventory edit.")
    pre_deploy: list[PhaseDoc] | None = Field(default=None, description="push, rollback, set-env/set: each run "
                                              "of an inventory's pre_deploy hook (docs/hooks.md).")
    post_rollout: list[PhaseDoc] | None = Field(default=None, description="push, rollback, set-env/set: each run "
                                                "of an inventory's post_rollout hook (docs/hooks.md).")


def report_schema() -> dict[str, Any]:
    """The JSON Schema of the ``--json`` report (``kdeploy schema report``)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **ReportDoc.model_json_schema()}


def inventory_schema() -> dict[str, Any]:
    """The JSON Schema of an inventory file (``kdeploy schema inventory``), for editors and CI linters.

    Generated from :class:`kdeploy.core.inventory.HostConfig`. Nothing is required below ``hosts.<h>.address``:
    any level may leave a setting to another (the merged host is checked by ``kdeploy render``).
    """
    host = inventory.HostConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs = host.pop("$defs")
    for model in defs.values():
        model.pop("required", None)
    settings = {k: v for k, v in host["properties"].items() if k not in ("name", "address")}

    def level(description: str, **more: Any) -> dict[str, Any]:
        props = {**more, **settings}
        return {"type": "object", "additionalProperties": False, "description": description, "properties": props}

    server = inventory.ServerSettings.model_json_schema(ref_template="#/$defs/{model}")
    defs["Server"] = {**server, "additionalProperties": False}
    string_list = {"type": "array", "items": {"type": "string"}}
    defs["Group"] = level("A group's members and settings for them (group > defaults).",
                          hosts={**string_list, "description": "The group's members (host names)."})
    defs["Host"] = {**level("One host: its address and its own settings (host > group > defaults).",
                            address=host["properties"]["address"]), "required": ["address"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kdeploy inventory",
        "description": "Hosts, groups and layered settings (docs/inventory.md).",
        "type": "object", "additionalProperties": False, "required": ["hosts"],
        "properties": {
            "defaults": level("Settings for every host."),
            "groups": {"type": "object", "description": "Groups by name: a list of members, or a mapping.",
                       "additionalProperties": {"anyOf": [{**string_list, "description": "Members only."},
                                                          {"$ref": "#/$defs/Group"}]}},
            "hosts": {"type": "object", "description": "Hosts by name (letters, digits, `_.-`).",
                      "additionalProperties": {"$ref": "#/$defs/Host"}},
            "servers": {"type": "object", "description": "Servers that span hosts, by name "
                                                         "(docs/topologies.md).",
                        "additionalProperties": {"$ref": "#/$defs/Server"}},
        },
        "$defs": defs,
    }


# docs/inventory.md's reference tables: (marker, model, key prefix, nested model fields shown as rows)
_TABLES: list[tuple[str, type[BaseModel], tuple[str, ...]]] = [
    ("host", inventory.HostConfig, ("name",)),
    ("service", inventory.Service, ()),
    ("service.secrets", inventory.SecretSettings, ()),
    ("service.sglang", inventory.SGLang, ()),
    ("service.sglang.disaggregation", inventory.Disaggregation, ()),
    ("service.hicache", inventory.HiCache, ()),
    ("service.gate", inventory.Gate, ()),
    ("service.unit", inventory.UnitSettings, ()),
    ("router", inventory.Router, ()),
    ("servers", inventory.ServerSettings, ()),
    ("hooks", inventory.Hooks, ()),
]
_BEGIN = re.compile(r"<!-- BEGIN generated: (\S+) .*?-->\n.*?<!-- END generated -->", re.DOTALL)


def _type_text(info: FieldInfo) -> str:
    """The type column: the annotation without None, with its bounds."""
    ann = info.annotation
    union = typing.get_origin(ann) in (types.UnionType, typing.Union)
    args = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]
    inner, metadata = args[0], list(info.metadata)
    if typing.get_origin(inner) is typing.Annotated:  # AbsPath | None: the checks sit inside the union
        inner, metadata = typing.get_args(inner)[0], [*metadata, *inner.__metadata__]
    origin = typing.get_origin(inner)
    if origin is Literal:
        text = " \\| ".join(f"`{v}`" for v in typing.get_args(inner))
    elif origin is list:
        item = typing.get_args(inner)[0]
        text = "list of `{prompt, expect}`" if item is inventory.GatePrompt else "list of strings"
    elif origin is dict:
        text = "mapping string -> string"
    elif isinstance(inner, type) and issubclass(inner, BaseModel):
        text = "mapping"
    elif any(getattr(m, "func", None) is inventory._absolute for m in metadata):
        text = "absolute path"
    else:
        text = {bool: "bool", int: "int", float: "float"}.get(inner, "string")
    bounds = [f"{op} {getattr(m, attr)}" for m in metadata
              for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(m, attr, None) is not None]
    return f"{text} {', '.join(bounds)}" if bounds else text


def _default_text(info: FieldInfo) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and extra.get("doc_default"):
        return str(extra["doc_default"])
    if info.is_required():
        return "required"
    value = info.default
    if value is None:
        return "none"
    return f"`{json.dumps(value) if isinstance(value, bool | list | dict) else value}`"


def reference_table(model: type[BaseModel], skip: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """Markdown rows ``| key | type | default | meaning |`` for ``model``'s fields (nested mappings inline)."""
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        nested = typing.get_args(info.annotation) or (info.annotation,)
        if model is inventory.SGLang and inventory.Speculative in nested:
            rows += reference_table(inventory.Speculative, prefix=f"{name}.")
            continue
        if model is inventory.Gate and inventory.ParitySet in nested:
            rows.append(f"| `{prefix}{name}` | mapping \\| bool | {_default_text(info)} | {info.description} |")
            rows += reference_table(inventory.ParitySet, prefix=f"{prefix}{name}.")
            continue
        if model is inventory.Gate and inventory.AnalysisGate in nested:
            rows.append(f"| `{prefix}{name}` | mapping | {_default_text(info)} | {info.description} |")
            rows += reference_table(inventory.AnalysisGate, prefix=f"{prefix}{name}.")
            continue
        rows.append(f"| `{prefix}{name}` | {_type_text(info)} | {_default_text(info)} | {info.description} |")
    return rows


def update_reference(text: str) -> str:
    """``text`` (docs/inventory.md) with every generated table regenerated from the models."""
    tables = {marker: (model, skip) for marker, model, skip in _TABLES}

    def table(match: re.Match[str]) -> str:
        model, skip = tables[match.group(1)]
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *reference_table(model, skip)]
        head = match.group(0).split("\n", 1)[0]
        return "\n".join([head, *rows, "<!-- END generated -->"])

    return _BEGIN.sub(table, text)


if __name__ == "__main__":  # python -m kdeploy.cli.schema docs/inventory.md: regenerate its tables
    import sys

    doc = Path(sys.argv[1])
    doc.write_text(update_reference(doc.read_text()))
