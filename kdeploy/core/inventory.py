"""The inventory: hosts, groups and layered settings, validated before anything touches a host.

Settings live at three levels (``defaults``, each group, each host) and merge with the precedence
host > group > defaults. Every string that can reach a systemd unit is checked for control characters,
because a newline in a value would inject a unit directive.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from ruamel.yaml.comments import CommentedMap

from kdeploy.core import ansible, files, patterns
from kdeploy.core.analysis import Bounds
from kdeploy.core.defaults import DEFAULT_INVENTORY, WEEK
from kdeploy.core.errors import InvalidInput
from kdeploy.core.report import HostResult, ServerRef
from kdeploy.core.text import first_unsafe
from kdeploy.core.yamlsource import line_of, parse_yaml, read_text

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
SSH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}\Z")  # a DNS name (253 at most) or an ssh_config alias
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")  # what useradd accepts (without a trailing $)
UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.@-]*\Z")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
SECRET_NAME = re.compile(r"(?:^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?)\Z",
                         re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control(value: str) -> str:
    """Refuse what would break the unit file: control characters, any other character ``str.splitlines`` breaks
    at (U+0085, U+2028, U+2029: the unit is read back line by line, so it would never compare equal), and the
    characters every human line escapes (C1, bidirectional controls, BOM: :func:`text.first_unsafe`)."""
    if _CONTROL.search(value):
        raise ValueError("contains a newline or control character (it would corrupt the unit file)")
    if value.splitlines() not in ([value], []):
        breaker = next(c for c in value if len(f"a{c}b".splitlines()) > 1)
        raise ValueError(f"contains the line separator U+{ord(breaker):04X} (the unit file would not read back "
                         "as written)")
    unsafe = first_unsafe(value)
    if unsafe is not None:  # C1 controls, bidirectional controls, BOM: invisible or reordering in the unit
        raise ValueError(f"contains the control character U+{ord(unsafe):04X} (the unit file would show it raw)")
    return value


def _bind_address(value: str) -> str:
    """``sglang.host``: the gate tunnels to the server at the address it binds, so it must be one it can dial."""
    if value != "localhost":
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError("must be an IP address (127.0.0.1, 0.0.0.0, ::, an address of the host) or "
                             "'localhost': the gate reaches the server through SSH at the address it binds") from None
    return value


def _ssh_address(value: str) -> str:
    """``address`` (``ansible_host``): what SSH dials, or looks up as an ssh_config ``Host``. Checked at load, so
    that what would fail only at connect (empty, blank, ``user@host``, ``host:port``) or be read as more than a
    name (a leading ``-`` as an ssh option, shell or control characters) stops every command before any host."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not SSH_NAME.match(value):
            raise ValueError(f"{value!r} is no host name, IP address or ssh_config Host alias (letters, digits, "
                             "'_', '.', '-', not starting with '-' or '.'; a user goes in `user`, a port in "
                             "`port`)") from None
    return value


def _user_name(value: str) -> str:
    """``become_user`` lands on sudo's command line: a login name, nothing a shell or sudo would read as more."""
    if not USER_NAME.match(value):
        raise ValueError("must be a user name (letters, digits, `_`, `.`, `-`; not starting with a digit, `.` or `-`)")
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must be an absolute path")
    return value


def _env_name(key: Any) -> Any:
    if not isinstance(key, str) or not ENV_NAME.match(key):
        raise ValueError(f"{key!r} is not a valid environment variable name")
    if SECRET_NAME.search(key):
        raise ValueError(f"{key} looks like a secret and unit files are world-readable: "
                         "list it in service.secrets (written into service.environment_file, mode 0600) instead")
    return key


def _env_value(value: Any) -> Any:
    if isinstance(value, bool | int | float):
        raise ValueError(f"quote the value ({value!r}) so YAML keeps it a string")
    return value


SafeStr = Annotated[str, AfterValidator(_no_control)]
# Checked per key and per value, so an error's location names the key and thus the layer that wrote it.
EnvName = Annotated[str, BeforeValidator(_env_name)]
EnvValue = Annotated[str, BeforeValidator(_env_value), AfterValidator(_no_control)]
Env = dict[EnvName, EnvValue]
AbsPath = Annotated[str, AfterValidator(_no_control), AfterValidator(_absolute)]
WritePolicy = Literal["write_back", "write_through", "write_through_selective"]
IoBackend = Literal["direct", "kernel", "kernel_ascend"]
MemLayout = Literal["layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"]


def _numeric(annotation: Any) -> bool:
    """A field typed int or float (optional or not)."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and kinds <= {int, float, type(None)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's true/false is not a count or a number of seconds (pydantic would read true as 1)."""
        if isinstance(value, bool) and info.field_name and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not {str(value).lower()}")
        return value


def _doc(description: str, default: Any = ..., *, shown: str | None = None, **constraints: Any) -> Any:
    """A field with its reference text (the JSON Schema and docs/inventory.md); ``shown``: a computed default."""
    extra = {"doc_default": shown} if shown else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


class Speculative(_Strict):
    """Speculative decoding flags (``--speculative-*``)."""

    algorithm: SafeStr | None = _doc("`--speculative-algorithm` (EAGLE, EAGLE3, NEXTN, ...)", None)
    draft_model_path: SafeStr | None = _doc("`--speculative-draft-model-path`", None)
    num_steps: int | None = _doc("`--speculative-num-steps`", None, gt=0)
    eagle_topk: int | None = _doc("`--speculative-eagle-topk`", None, gt=0)
    num_draft_tokens: int | None = _doc("`--speculative-num-draft-tokens`", None, gt=0)


class Disaggregation(_Strict):
    """Prefill/decode disaggregation (docs/topologies.md, "Prefill and decode"): the server's role and how its
    KV cache moves (``--disaggregation-*``)."""

    mode: Literal["prefill", "decode"] = _doc("`--disaggregation-mode`: the server's role")
    bootstrap_port: int | None = _doc("`--disaggregation-bootstrap-port`: where a prefill server's bootstrap "
                                      "server listens (decode servers fetch each request's KV through it); "
                                      "required for a prefill server", None, gt=0, lt=65536)
    transfer_backend: Literal["mooncake", "nixl", "ascend", "mori", "mooncake_tcp", "fake"] = _doc(
        "`--disaggregation-transfer-backend` (SGLang refuses `fake` on a prefill server)", "mooncake")
    ib_device: SafeStr | None = _doc("`--disaggregation-ib-device`: the InfiniBand device(s) the transfer uses",
                                     None, shown="the backend's choice")

    @model_validator(mode="after")
    def _prefill_needs(self) -> Disaggregation:
        if self.mode == "prefill" and self.bootstrap_port is None:
            raise ValueError("a prefill server needs bootstrap_port (the router sends it with every request)")
        if self.mode == "prefill" and self.transfer_backend == "fake":
            raise ValueError("transfer_backend fake: SGLang's prefill server does not support it")
        return self


class SGLang(_Strict):
    """``sglang.launch_server`` flags; anything not modelled goes in ``extra_args``."""

    model_path: SafeStr = _doc("`--model-path`")
    served_model_name: SafeStr | None = _doc("`--served-model-name`; also the `model` the gate sends", None)
    tp: int = _doc("`--tp-size`; also the default number of workers the gate expects", 1, gt=0)
    host: Annotated[str, AfterValidator(_bind_address)] = _doc(
        "`--host`: an IP address or `localhost`. The gate reaches the server through SSH at the address it "
        "binds: `0.0.0.0` at `127.0.0.1`, `::` at `::1`, a specific address at that address; a host name is "
        "refused", "127.0.0.1")
    port: int = _doc("`--port`; the gate talks to `<host>:<port>` on the host through SSH (a direct-tcpip "
                     "channel: the port need not be reachable from the controller)", 30000, gt=0, lt=65536)
    attention_backend: SafeStr | None = _doc("`--attention-backend`", None)
    speculative: Speculative = _doc("speculative decoding flags", Speculative(), shown="none")
    mem_fraction_static: float | None = _doc("`--mem-fraction-static`", None, gt=0, lt=1)
    context_length: int | None = _doc("`--context-length`", None, gt=0)
    trust_remote_code: bool = _doc("`--trust-remote-code`", False)
    disaggregation: Disaggregation | None = _doc("the server's prefill or decode role, below", None,
                                                 shown="none: a unified server (prefill and decode in one)")
    extra_args: list[SafeStr] = _doc("appended verbatim, one list item per argv word, for flags kdeploy does "
                                     "not model", [])


class HiCache(_Strict):
    """Hierarchical cache flags, emitted only when ``enabled``."""

    enabled: bool = _doc("`--enable-hierarchical-cache`; no hicache flag is emitted without it", False)
    ratio: float | None = _doc("`--hicache-ratio` (ignored when `size_gb` is set)", None, gt=0)
    size_gb: float | None = _doc("`--hicache-size` (GB per rank; wins over `ratio`)", None, gt=0)
    write_policy: WritePolicy | None = _doc("`--hicache-write-policy`", None)
    io_backend: IoBackend | None = _doc("`--hicache-io-backend`", None)
    mem_layout: MemLayout | None = _doc("`--hicache-mem-layout`", None)
    device_kv_gb_per_rank: float | None = _doc("device KV cache per rank in GB (10.42 for the Kimi-K2.5 service). "
                                               "Validated and stored; no flag, and no check uses it yet", None, gt=0)


class GatePrompt(_Strict):
    """One golden completion of the gate."""

    prompt: str = _doc("the prompt sent at temperature 0")
    expect: str = _doc("Python regular expression searched in the answer (checked to compile)", r"\bParis\b")

    @field_validator("expect")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class ParitySet(_Strict):
    """The golden set of the gate's ``parity`` phase (docs/gate.md, output parity)."""

    prompts: list[str] | None = _doc("prompts answered greedily by the release before and after the switch", None,
                                     shown="the gate's `prompts`", min_length=1)
    max_tokens: int = _doc("tokens generated per prompt", 8, gt=0, le=256)
    top_logprobs: int = _doc("most likely tokens whose logprobs are recorded at each position", 5, ge=1, le=20)
    match_tokens: int | None = _doc("leading positions whose greedy tokens must be the same", None, gt=0,
                                    shown="`max_tokens`")
    logprob_tolerance: float = _doc("largest difference allowed between a token's logprob before and after", 0.1,
                                    gt=0, le=10)


class AnalysisGate(_Strict):
    """Canary analysis: bounds on the canary's SGLang metrics relative to the baseline hosts (docs/gate.md)."""

    duration: float = _doc("seconds of the window over which canary and baseline metrics are compared", 60, gt=0,
                           le=WEEK)
    max_p99_ratio: float = _doc("largest canary/baseline ratio of the p99 latencies", 1.2, gt=0)
    max_error_rate: float = _doc("largest share of the canary's requests that may fail", 0.001, ge=0, le=1)
    min_throughput_ratio: float = _doc("smallest canary/baseline ratio of generated tokens per second per request",
                                       0.8, ge=0)
    min_accept_length_ratio: float = _doc("smallest canary/baseline ratio of the speculative accept length", 0.95,
                                          ge=0)
    interval: float = _doc("seconds between scrapes during the window (the live view and the JSON's series)", 5,
                           gt=0, le=3600)
    min_requests: int = _doc("requests each side must serve in the window for a verdict (fewer: no verdict; "
                             "docs/gate.md, Canary analysis)", 20, gt=0)

    def bounds(self) -> Bounds:
        """The limits as analysis.py takes them."""
        return Bounds(max_p99_ratio=self.max_p99_ratio, max_error_rate=self.max_error_rate,
                      min_throughput_ratio=self.min_throughput_ratio,
                      min_accept_length_ratio=self.min_accept_length_ratio, min_requests=self.min_requests)


class Gate(_Strict):
    """What a healthy deploy must show; ``workers`` defaults to the service's TP size."""

    workers: int | None = _doc("distinct worker processes that must log each marker (`--workers` overrides it "
                               "for one run)", None, gt=0, shown="`sglang.tp`")
    prompts: list[GatePrompt] = _doc("completions that must match, each `{prompt, expect}`",
                                     [GatePrompt(prompt="The capital of France is")],
                                     shown="one: 'The capital of France is', expect `\\bParis\\b`")
    max_tokens: int = _doc("`max_tokens` of each gate completion", 8, gt=0)
    markers: list[SafeStr] | None = _doc(
        "fixed strings each worker must log in the current run; overrides the payload's manifest (its config "
        "line is still checked); `[]` with a payload without a manifest skips the worker check", None,
        shown="what the payload's `kdeploy-gate.json` requires")
    ready_path: SafeStr = _doc("polled until it answers 200", "/health")
    parity: ParitySet | bool = _doc(
        "output parity against the release being replaced: greedy tokens and top-k logprobs of a golden set "
        "(a mapping), `true` for the payload manifest's set or the defaults, `false` to turn it off", True)
    timeout: float | None = _doc("seconds the gate may take in total (`--timeout` overrides it)", None, gt=0,
                                 le=WEEK, shown="`unit.timeout_start_sec`")
    poll_interval: float = _doc("seconds between polls of the unit state, readiness and markers", 0.5, gt=0, le=30)
    revert_after: float | None = _doc(
        "seconds after a switch at which the host goes back to its last confirmed release by itself unless "
        "kdeploy confirmed it (docs/push.md, provisional activation); keep it above the restart and gate time",
        None, gt=0, le=WEEK, shown="`unit.timeout_stop_sec + 60 + gate timeout + 60`")
    analysis: AnalysisGate | None = _doc("canary analysis of a rollout with `--canary N`: the canary's metrics "
                                         "against the baseline hosts' over a window (docs/gate.md)", None,
                                         shown="off")


class UnitSettings(_Strict):
    """systemd settings of the unit."""

    description: SafeStr | None = _doc("`Description=`", None, shown="`SGLang <served_model_name or name>`")
    user: SafeStr | None = _doc("`User=`", None, shown="none (root)")
    timeout_start_sec: int = _doc("`TimeoutStartSec=`; also the default gate timeout", 900, gt=0, le=WEEK)
    timeout_stop_sec: int = _doc("`TimeoutStopSec=`; a push waits up to this + 60 s for the old run to stop", 120,
                                 gt=0, le=WEEK)
    restart_sec: int = _doc("`RestartSec=`", 5, ge=0, le=WEEK)
    kill_mode: Literal["control-group", "mixed", "process"] = _doc("`KillMode=`", "mixed")
    limit_nofile: int = _doc("`LimitNOFILE=`", 1048576, gt=0, le=2**30)  # the kernel's fs.nr_open maximum


def _secret_env(value: str) -> str:
    if not ENV_NAME.match(value):
        raise ValueError(f"{value!r} is not a valid environment variable name")
    return value


class SecretSettings(_Strict):
    """Values written into ``environment_file`` by kdeploy (docs/inventory.md, secrets): read on the controller
    when a command runs, never stored in the inventory, the unit, the release or any output."""

    env: list[Annotated[str, AfterValidator(_secret_env)]] = _doc(
        "names of environment variables of the controller (a CI job's secret variables); each becomes a line "
        "`NAME=value` of the file; one that is not set fails before any host is touched (exit 2)", [])
    file: SafeStr | None = _doc("a local file of `NAME=value` lines (relative to the inventory file; `#` "
                                "comments; one pair of quotes around a whole value is removed)", None)

    @property
    def configured(self) -> bool:
        return bool(self.env) or self.file is not None


class Service(_Strict):
    """What runs on the host."""

    name: SafeStr = _doc("systemd unit name without `.service` (letters, digits, `:_.@-`); also the directory "
                         "name on the host")
    template: SafeStr = _doc("Jinja2 template of the unit (relative to the inventory file)",
                             "templates/sglang.service.j2")
    python: AbsPath = _doc("interpreter of the host's SGLang venv; `ExecStart` runs `<python> -m <module> ...`")
    module: SafeStr = _doc("dotted module name run with `-m`", "sglang.launch_server")
    payload: SafeStr = _doc("local directory shipped to the host; a bare name without `/` (e.g. `kdtree`) means "
                            "`kernels/<name>` next to the inventory", "kernels/kdtree")
    remote_root: AbsPath = _doc("releases live under `<remote_root>/<name>/` on the host", "/opt/kdeploy")
    keep_releases: int = _doc("releases kept on the host; older ones are pruned after each push (docs/push.md, "
                              "release pruning)", 5, ge=2)
    env: Env = _doc("`Environment=` lines of the unit: quoted string values, no secret-looking names (rules "
                    "below)", {})
    environment_file: AbsPath | None = _doc(
        "rendered as `EnvironmentFile=-<path>`; with `secrets` kdeploy writes it (root, 0600), without them put "
        "secrets there yourself, owned by root, mode 0600. A push checks that in preflight (exit 7 when it is "
        "missing without `secrets`, not root's, or readable by others: docs/push.md, checks)", None)
    secrets: SecretSettings = _doc("secrets kdeploy writes into `environment_file` (which must be set), below",
                                   SecretSettings(), shown="none")
    sglang: SGLang = _doc("launch flags, below")
    hicache: HiCache = _doc("hierarchical cache flags, below", HiCache(), shown="disabled")
    gate: Gate = _doc("what a healthy deploy must show, below", Gate(), shown="see below")
    unit: UnitSettings = _doc("systemd settings of the unit, below", UnitSettings(), shown="see below")
    lock_timeout: float = _doc(
        "seconds without a heartbeat from the controller after which the host ends its deploy lock's holder, so "
        "a partitioned or frozen controller frees the lock within that time (docs/push.md, locks); a controller "
        "that comes back after it stops touching the host (exit 3)", 30.0, ge=3, le=WEEK)
    on_first_deploy_failure: Literal["stop", "leave"] = _doc(
        "when the very first deploy of a service fails its gate there is nothing to roll back to: `stop` stops "
        "and disables the unit, `leave` leaves it running as it is; either way the result is `rollback_failed` "
        "(exit 5)", "stop")

    @field_validator("name")
    @classmethod
    def _unit_name(cls, value: str) -> str:
        if not UNIT_NAME.match(value) or value.endswith(".service"):
            raise ValueError("must be a systemd unit name without '.service' (letters, digits, ':_.@-')")
        return value

    @field_validator("module")
    @classmethod
    def _module(cls, value: str) -> str:
        if not MODULE.match(value):
            raise ValueError("must be a dotted Python module name")
        return value

    @model_validator(mode="after")
    def _secrets_need_a_file(self) -> Service:
        if self.secrets.configured and self.environment_file is None:
            raise ValueError("secrets need service.environment_file: the file on the host kdeploy writes them into")
        return self

    @property
    def workers(self) -> int:
        return self.gate.workers or self.sglang.tp

    @property
    def role(self) -> Literal["unified", "prefill", "decode"]:
        """The server's role behind a router: one that does both, or one half of a prefill/decode pair."""
        pd = self.sglang.disaggregation
        return pd.mode if pd else "unified"

    @model_validator(mode="after")
    def _ports_apart(self) -> Service:
        pd = self.sglang.disaggregation
        if pd and pd.bootstrap_port == self.sglang.port:
            raise ValueError(f"sglang.disaggregation.bootstrap_port {pd.bootstrap_port} is the server's own "
                             "sglang.port")
        return self

    @property
    def gate_timeout(self) -> float:
        return self.gate.timeout or float(self.unit.timeout_start_sec)


WORKER_URL_FIELDS = ("address", "port", "name")


def _router_url(value: str) -> str:
    """The router's API: ``http(s)://HOST:PORT`` with nothing after it (paths are the router's own)."""
    m = re.fullmatch(r"(https?)://([^/?#\s]+)/?", value)
    if not m:
        raise ValueError("must be http://HOST:PORT or https://HOST:PORT (the router's API, no path)")
    return value.rstrip("/")


def _worker_url(value: str) -> str:
    """A template the router knows the worker by; only ``{address}``, ``{port}`` and ``{name}``."""
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        raise ValueError(f"not a valid template: {exc}") from None
    unknown = [f for f in fields if f not in WORKER_URL_FIELDS]
    if unknown:
        raise ValueError(f"unknown placeholder {{{unknown[0]}}}: use {{address}}, {{port}} or {{name}}")
    if not re.match(r"https?://", value):
        raise ValueError("must start with http:// or https://")
    return value


def _api_key_env(value: str) -> str:
    if not ENV_NAME.match(value):
        raise ValueError(f"{value!r} is not a valid environment variable name")
    return value


class Router(_Strict):
    """The SGLang router (``sglang-router``) the host's server sits behind: a rollout drains the host from it
    before the restart and admits it again after the gate."""

    url: Annotated[str, AfterValidator(_no_control), AfterValidator(_router_url)] = _doc(
        "the router's API: `http://HOST:PORT` or `https://HOST:PORT`, no path")
    via: SafeStr | None = _doc("reach `url` from this host (an inventory host) through kdeploy's SSH connection; "
                               "no router port has to be open to the controller", None)
    worker_url: Annotated[str, AfterValidator(_no_control), AfterValidator(_worker_url)] = _doc(
        "how the router knows each host's server: `{address}` is the host's `address`, `{port}` its "
        "`service.sglang.port`, `{name}` its name; it must match the URL the router lists the worker under",
        "http://{address}:{port}")
    drain_timeout: float = _doc("seconds a drained host may take to finish its requests before the restart goes "
                                "ahead anyway", 120, gt=0, le=WEEK)
    url_from_host: Annotated[str, AfterValidator(_no_control), AfterValidator(_router_url)] | None = _doc(
        "the router's API as the hosts reach it, for a host's own re-admit (docs/router.md); set it when the "
        "hosts see the router at another address than the controller", None, shown="`url`")
    readmit_after: float | None = _doc(
        "seconds after a rollout drained a host at which the host re-registers itself with the router if the "
        "controller has not admitted it (or decided it stays out) by then, once it serves a confirmed release",
        None, gt=0, le=WEEK, shown="`drain_timeout` + the revert deadline + 60")
    min_serving: int = _doc("servers of each role (prefill, decode; or unified) that stay in the router at every "
                            "moment of a rollout: a plan that would take more out is refused (exit 7)", 1, ge=1)
    mode: Literal["regular", "pd"] = _doc(
        "how the router was launched: `pd` for `--pd-disaggregation` (it pairs prefill and decode servers and "
        "ignores regular ones), `regular` otherwise; its API does not say, so the inventory does", "regular")
    api_key_env: Annotated[str, AfterValidator(_api_key_env)] | None = _doc(
        "the name of an environment variable of the controller holding the router's API key (sent as "
        "`Authorization: Bearer`); the key itself never goes in the inventory", None)


def _hook_command(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty: leave the hook out, or set it to null to turn off one set at a wider level")
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    return value


HookCommand = Annotated[str, AfterValidator(_hook_command)]


class Hooks(_Strict):
    """Local commands the controller runs around a rollout (docs/hooks.md): each is run with `/bin/sh -c` in
    the inventory file's directory, with `KDEPLOY_*` variables saying what is happening."""

    pre_deploy: HookCommand | None = _doc(
        "push, rollback, set-env/set: runs once per command before any host is touched (hosts that share the "
        "command share one run, `KDEPLOY_HOSTS`); a non-zero exit or the timeout stops the whole run, every "
        "host untouched, `preflight_refused` (exit 7)", None)
    pre_host: HookCommand | None = _doc(
        "push, rollback, set-env/set: runs right before kdeploy changes the host (before its drain and switch); "
        "a non-zero exit or the timeout leaves the host untouched, `preflight_refused` (exit 7)", None)
    post_host: HookCommand | None = _doc(
        "runs once for every host of those commands when its outcome is known (`KDEPLOY_RESULT`); a failure "
        "is reported as a failed `post_host` phase and changes nothing else", None)
    post_rollout: HookCommand | None = _doc(
        "runs once after all hosts ended (`KDEPLOY_HOSTS`, `KDEPLOY_FAILED`, `KDEPLOY_EXIT_CODE`); hosts that "
        "share the same command share one run", None)
    timeout: float = _doc("seconds each hook may run before its whole process group is killed (a timed-out "
                          "`pre_host` refuses the host)", 60, gt=0, le=3600)


class HostConfig(_Strict):
    """One host with every layer merged in: what kdeploy acts on."""

    name: str = _doc("the host's name (its key under `hosts`)")
    address: Annotated[str, AfterValidator(_ssh_address)] = _doc(
        "IP address, DNS name or ssh_config `Host` alias that SSH connects to (letters, digits, `_.-`, not starting "
        "with `-` or `.`; host level only)")
    port: int = _doc("SSH port (not the SGLang port, that is `service.sglang.port`)", 22, gt=0, lt=65536)
    user: SafeStr = _doc("SSH user: root, or a user with passwordless sudo and `become: true` (docs/ssh.md, become)",
                         "root")
    become: bool = _doc("run every command on the host as `become_user` through `become_method` (Ansible's "
                        "`become`), for a `user` that is not root", False)
    become_user: Annotated[str, AfterValidator(_user_name)] = _doc("who the commands run as with `become`", "root")
    become_method: Literal["sudo", "doas"] = _doc("`sudo -n` or `doas -n`: one that asks for a password is refused "
                                                  "at connect, exit 3", "sudo")
    identity_file: SafeStr | None = _doc("private key (the SSH agent's keys are offered too); without it: "
                                         "ssh_config's `IdentityFile`s, else the usual `~/.ssh/id_*` keys", None)
    known_hosts: SafeStr | None = _doc("host keys are always checked against this file (docs/push.md, host keys)",
                                       None, shown="`~/.ssh/known_hosts`")
    connect_timeout: float = _doc("seconds for TCP connect, SSH banner and authentication", 10, gt=0, le=3600)
    proxy_jump: SafeStr | None = _doc("jump host(s): `[user@]host[:port]`, a comma list for several hops, or "
                                      "`none` (docs/ssh.md)", None)
    ssh_config: SafeStr | bool | None = _doc("the OpenSSH client config to read, or `false` for none; "
                                             "`--ssh-config PATH` and `KDEPLOY_SSH_CONFIG` override it", None,
                                             shown="`~/.ssh/config` + `/etc/ssh/ssh_config`")
    service: Service = _doc("what runs on the host (`service.name`, `service.python` and "
                            "`service.sglang.model_path` must be set at some level)")
    router: Router | None = _doc("the SGLang router in front of this host's server: drained before its "
                                 "restart, re-admitted after its gate (docs/router.md)", None)
    hooks: Hooks = _doc("local commands run on the controller before and after each host and after the "
                        "rollout, below (docs/hooks.md)", Hooks(), shown="none")

    @property
    def worker_url(self) -> str | None:
        """How the router knows this host's server (None: no router)."""
        if self.router is None:
            return None
        return self.router.worker_url.format(address=self.address, port=self.service.sglang.port, name=self.name)


class ServerSettings(_Strict):
    """One server that spans hosts (``servers.<name>``): SGLang's multi-node mode, one server whose TP ranks
    run on several nodes (docs/topologies.md)."""

    nodes: list[str] = _doc("the server's hosts in rank order: the first is the head (`--node-rank 0`, the only "
                            "node that answers HTTP), the next node_rank 1, ...", min_length=1)
    rendezvous_port: int | None = _doc("the TCP port the nodes meet at on the head: `--dist-init-addr "
                                       "<rendezvous_address>:<port>`; required with two nodes or more", None,
                                       gt=0, lt=65536)
    rendezvous_address: Annotated[str, AfterValidator(_ssh_address)] | None = _doc(
        "the head's address as the other nodes reach it", None, shown="the head's `address`")


@dataclass(frozen=True)
class Placement:
    """Where a host's run sits in its server: what the unit's multi-node flags and the node's gate say."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None


ONE_NODE = Placement()  # a single host: no multi-node flags, every rank its own


@dataclass(frozen=True)
class Server:
    """The unit of a restart: one SGLang server and its nodes in rank order. A host not named in ``servers``
    is a one-node server of its own, under its own name, so every command has one code path."""

    name: str
    nodes: tuple[str, ...]
    dist_init_addr: str | None = None  # HOST:PORT the nodes meet at; None for one node

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def spans(self) -> bool:
        """More than one node: the nodes restart, are gated and go back together."""
        return len(self.nodes) > 1

    def place(self, host: str) -> Placement:
        if not self.spans:
            return ONE_NODE
        return Placement(len(self.nodes), self.nodes.index(host), self.dist_init_addr)


# Keys allowed at each settings level (defaults, group, host): everything but the identity fields.
_LEVEL_EXTRA = {"groups": {"hosts"}, "hosts": {"address"}}
_NOT_AT_LEVEL = {"name", "address"}


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, HostConfig]
    groups: dict[str, list[str]]
    limit: tuple[str, ...] | None = None  # ``--limit``'s patterns: every TARGET is narrowed to them
    source: Path | None = None  # an Ansible inventory: what ``-i`` named (``path`` is then the service file)
    locator: typing.Callable[[str, tuple], str] | None = field(default=None, compare=False, repr=False)
    spanning: dict[str, Server] = field(default_factory=dict)  # ``servers:`` by name

    @functools.cached_property
    def owner(self) -> dict[str, str]:
        """A host of ``spanning`` -> its server's name."""
        return {n: s.name for s in self.spanning.values() for n in s.nodes}

    def server_of(self, host: str) -> Server:
        """The server ``host`` runs a node of: a declared one, else its own one-node server."""
        name = self.owner.get(host)
        return self.spanning[name] if name is not None else Server(host, (host,))

    def routed(self, host: str) -> bool:
        """Whether ``host``'s router knows it: it has a router and is its server's head (a follower's server
        answers through its head; only a dummy health check listens on the follower)."""
        return self.hosts[host].router is not None and self.server_of(host).head == host

    def result(self, host: str, listener: Any = None) -> HostResult:
        """A new report entry for ``host``, naming its server when that spans hosts and its role in a
        prefill/decode fleet."""
        server = self.server_of(host)
        ref = ServerRef(server.name, server.place(host).node_rank, server.nodes) if server.spans else None
        role = self.hosts[host].service.role
        return HostResult(host, listener=listener, server=ref, role=None if role == "unified" else role)

    def servers(self, names: list[str]) -> list[Server]:
        """The servers of ``names``, each once, in the order their first node comes."""
        seen: dict[str, Server] = {}
        for name in names:
            server = self.server_of(name)
            seen.setdefault(server.name, server)
        return list(seen.values())

    def whole(self, names: list[str], command: str) -> list[str]:
        """``names`` for a command that restarts: a server is restarted, gated and rolled back as one, so a
        selection of part of a server's nodes is refused, naming the server and its nodes."""
        chosen = set(names)
        touched = {self.owner[n] for n in names if n in self.owner}
        for server in (s for s in self.spanning.values() if s.name in touched):
            part = [n for n in server.nodes if n in chosen]
            if part and len(part) < len(server.nodes):
                raise InvalidInput(f"{command}: TARGET selects {', '.join(part)} of server {server.name} (nodes "
                                   f"{', '.join(server.nodes)}): its nodes restart together; select the server "
                                   f"({server.name}) or all of its nodes")
        return names

    def _selector(self) -> patterns.Selector:
        """Patterns name hosts, groups and servers (a server is the group of its nodes)."""
        return patterns.Selector(self.hosts, {**{s.name: list(s.nodes) for s in self.spanning.values()},
                                              **self.groups})

    def where(self, host: str, *key: str) -> str:
        """``file:line: key.path`` of the layer that set ``key`` for ``host`` (the most specific one), for an
        error about a value that is valid in itself (a payload directory that does not exist)."""
        if self.locator is not None:
            return self.locator(host, key)
        return f"{self.path}: hosts.{host}.{'.'.join(key)}"

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve(self, target: str | None) -> list[str]:
        """Host names for TARGET, a host pattern in Ansible's language (docs/inventory.md, TARGET), in inventory
        order, narrowed by the ``--limit`` of :meth:`subset`. ``None`` (the library's default) is ``all``; a
        blank TARGET is refused: ``kdeploy push "$UNSET"`` must not reach every host."""
        selector = self._selector()
        names = selector.select("all" if target is None else target)
        if self.limit is not None:
            allowed = set(selector.evaluate(self.limit, "--limit"))
            names = [n for n in names if n in allowed]
        return names

    def subset(self, limit: str | None) -> Inventory:
        """This inventory with every TARGET narrowed to the hosts ``limit`` names (``--limit``, as Ansible's
        ``--limit``; ``@FILE`` reads patterns from FILE, one a line). Checked here, before any host is touched."""
        if limit is None:
            return self
        parts = tuple(patterns.limit_parts(limit, lambda path: files.read_text(
            path, "--limit file", limit=files.LIST_BYTES, missing="--limit file not found (pass --limit @FILE)")))
        self._selector().evaluate(parts, "--limit")
        return replace(self, limit=parts)

    def local_path(self, value: str) -> Path:
        """Paths in the inventory (template, payload, keys) are relative to the inventory file."""
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def payload_dir(self, host: HostConfig) -> Path:
        payload = host.service.payload
        return self.local_path(payload if "/" in payload else f"kernels/{payload}")


_suggest = patterns.suggest
TOP_KEYS = (*ansible.KDEPLOY_KEYS, "servers")  # `servers` alone does not make a file a kdeploy inventory


def checked(document: Any, text: str, path: Path) -> CommentedMap:
    """The document ``ansible.detect`` parsed from ``text``, as :func:`parse_yaml` would return it (``text`` is
    parsed again only where it is no mapping: empty, or to report what is wrong with it)."""
    return document if isinstance(document, dict) else parse_yaml(text, path)


def load(path: Path | str = DEFAULT_INVENTORY, service: Path | str | None = None) -> Inventory:
    """A kdeploy inventory, or an Ansible one (any kind: docs/inventory.md) with the kdeploy service file
    ``service``."""
    path = Path(path)
    service_path = Path(service) if service is not None else None
    if ansible.is_source(path):
        ansible.require_service(path, service_path)  # before a script runs
        return replace(from_ansible(ansible.read_source(path), service_path), source=path)
    text = read_text(path)
    fmt, document = ansible.detect(path, text)
    if fmt is not None:
        ansible.require_service(path, service_path)
        return replace(from_ansible(ansible.read(path, text, fmt), service_path), source=path)
    raw = checked(document, text, path)
    if service is not None:
        if not set(map(str, raw)) <= set(ansible.KDEPLOY_KEYS):  # no kdeploy inventory either: its error says why
            parse(raw, path)
        raise service_without_ansible(path)
    return parse(raw, path)


def from_ansible(found: ansible.AnsibleInventory, service: Path | None, service_text: str | None = None) -> Inventory:
    """The kdeploy inventory of an Ansible inventory plus the service file (``service_text``: its content)."""
    return parse(*ansible.document(found, service, service_text))


def check_env(env: dict[str, str]) -> None:
    """``service.env`` entries checked as a load checks them, as given: YAML may write a value (one with U+0085)
    so that it reads back as another, which a check of the written file would then pass."""
    try:
        _ENV.validate_python(env)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidInput(f"{err['loc'][0]}: {_reason(err)}") from None


_ENV = TypeAdapter(Env)


def service_without_ansible(path: Path) -> InvalidInput:
    return InvalidInput(f"{path}: a kdeploy inventory carries its service under defaults: --service FILE (or "
                        "KDEPLOY_SERVICE) goes with an Ansible inventory only")


def parse(raw: dict, path: Path, locate: typing.Callable[[tuple], str] | None = None) -> Inventory:
    """Validate a raw inventory document; errors name file, line, key path and reason (``locate`` turns a key
    path into that ``file:line: key.path`` for a document not read from one YAML file)."""
    errors = _Errors(path, raw, locate)
    for key in raw:
        if key not in TOP_KEYS:
            errors.fail((key,), f"unknown key{_suggest(str(key), TOP_KEYS)}")
    defaults = _mapping(raw.get("defaults"), ("defaults",), errors)
    raw_groups = _mapping(raw.get("groups"), ("groups",), errors)
    raw_hosts = _mapping(raw.get("hosts"), ("hosts",), errors)
    if not raw_hosts:
        errors.fail(("hosts",), "no hosts defined")

    _check_keys(defaults, HostConfig, ("defaults",), errors, _NOT_AT_LEVEL)
    for name, host in raw_hosts.items():
        if not NAME.match(str(name)):
            errors.fail(("hosts", name), "host names use letters, digits and '_.-'")
        if name == "all":
            errors.fail(("hosts", name), "a host cannot be named 'all' (TARGET `all` is every host)")
        _mapping(host, ("hosts", name), errors)
        _check_keys(host, HostConfig, ("hosts", name), errors, {"name"})
    groups: dict[str, list[str]] = {}
    group_layers: dict[str, dict] = {}
    for name, group in raw_groups.items():
        at = ("groups", name)
        if name == "all" or name in raw_hosts:
            errors.fail(at, "a group cannot be named 'all' or like a host")
        if isinstance(group, list):
            group = {"hosts": group}
        group = _mapping(group, at, errors)
        members = group.get("hosts") or []
        if not isinstance(members, list):
            errors.fail((*at, "hosts"), "must be a list of host names")
        for member in members:
            if member not in raw_hosts:
                errors.fail((*at, "hosts"), f"unknown host {member!r}{_suggest(str(member), list(raw_hosts))}")
        layer = {k: v for k, v in group.items() if k != "hosts"}
        _check_keys(layer, HostConfig, at, errors, _NOT_AT_LEVEL)
        groups[str(name)] = [str(m) for m in members]
        group_layers[str(name)] = layer

    hosts: dict[str, HostConfig] = {}
    host_layers: dict[str, list[tuple[tuple, dict]]] = {}
    member_sets = {g: set(members) for g, members in groups.items()}  # no list scan per host and group
    for name, host in raw_hosts.items():
        layers = host_layers[str(name)] = [(("defaults",), defaults)]
        layers += [(("groups", g), group_layers[g]) for g in groups if name in member_sets[g]]
        layers.append((("hosts", name), host or {}))  # `ct200:` with nothing under it is an empty mapping
        merged: dict = {}
        for _, layer in layers:
            merged = _merge(merged, layer)
        merged["name"] = str(name)
        try:
            hosts[str(name)] = HostConfig.model_validate(merged)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = tuple(p for p in err["loc"] if p != "[key]")  # a dict key's error: name the key itself
            errors.fail(_source(loc, layers), _reason(err))
    for name, host in hosts.items():
        via = host.router.via if host.router else None
        if via is not None and via not in hosts:
            errors.fail(_source(("router", "via"), host_layers[name]),
                        f"unknown host {via!r}{_suggest(via, list(hosts))}: the router is reached through a host "
                        "of this inventory")
    spanning = _servers(_mapping(raw.get("servers"), ("servers",), errors), hosts, groups, errors)
    _roles(spanning, hosts, host_layers, errors)
    return Inventory(path=path, hosts=hosts, groups=groups, spanning=spanning,
                     locator=lambda host, key: errors.locate(_source(key, host_layers[host])))


# What every node of a server must agree on: one model, one payload, one launch (only the bind address and
# the unit's systemd settings may differ per node).
_AGREE = ("name", "payload", "template", "python", "module", "remote_root", "env", "sglang", "hicache")


def _servers(raw: dict, hosts: dict[str, HostConfig], groups: dict[str, list[str]],
             errors: _Errors) -> dict[str, Server]:
    """``servers:`` checked (file:line): known hosts, each in one server, TP divisible by the node count, nodes
    that agree, a rendezvous for every multi-node server and no two at one address and port."""
    out: dict[str, Server] = {}
    owner: dict[str, str] = {}
    meeting: dict[tuple[str, int], str] = {}
    for name, body in raw.items():
        at = ("servers", name)
        if not NAME.match(str(name)) or name == "all":
            errors.fail(at, "server names use letters, digits and '_.-' (not 'all')")
        if name in hosts or name in groups:
            errors.fail(at, f"a server cannot be named like a {'host' if name in hosts else 'group'} (TARGET "
                            "names all three)")
        body = _mapping(body, at, errors)
        _check_keys(body, ServerSettings, at, errors)
        try:
            settings = ServerSettings.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            errors.fail((*at, *err["loc"]), _reason(err))
        nodes = [str(n) for n in settings.nodes]
        for node in nodes:
            if node not in hosts:
                errors.fail((*at, "nodes"), f"unknown host {node!r}{_suggest(node, list(hosts))}")
            if node in owner:
                errors.fail((*at, "nodes"), f"{node} is a node of server {owner[node]} already: a host runs "
                                            "one server")
            owner[node] = str(name)
        head = hosts[nodes[0]]
        tp = head.service.sglang.tp
        for node in nodes[1:]:
            differs = next((k for k in _AGREE if _agreed(head.service, k) != _agreed(hosts[node].service, k)), None)
            if differs:
                errors.fail((*at, "nodes"), f"{node} differs from the head {head.name} in service.{differs}: the "
                                            "nodes of one server run one model, payload and launch")
        if tp % len(nodes):
            errors.fail((*at, "nodes"), f"service.sglang.tp {tp} is not divisible by {len(nodes)} nodes (each "
                                        "node runs tp / nodes ranks)")
        workers = head.service.gate.workers
        if workers is not None and workers % len(nodes):
            errors.fail((*at, "nodes"), f"service.gate.workers {workers} is not divisible by {len(nodes)} nodes")
        dist = None
        if len(nodes) > 1:
            if settings.rendezvous_port is None:
                errors.fail(at, f"rendezvous_port is required for a server of {len(nodes)} nodes (the head "
                                "listens there: --dist-init-addr)")
            address = settings.rendezvous_address or head.address
            key = (address, settings.rendezvous_port)
            if key in meeting:
                errors.fail((*at, "rendezvous_port"), f"{address}:{key[1]} is the rendezvous of server "
                                                      f"{meeting[key]} too")
            if settings.rendezvous_port == head.service.sglang.port:
                errors.fail((*at, "rendezvous_port"), f"{key[1]} is the head's service.sglang.port")
            meeting[key] = str(name)
            dist = f"[{address}]:{key[1]}" if ":" in address else f"{address}:{key[1]}"
        out[str(name)] = Server(str(name), tuple(nodes), dist)
    return out


def _roles(spanning: dict[str, Server], hosts: dict[str, HostConfig], layers: dict[str, list[tuple[tuple, dict]]],
           errors: _Errors) -> None:
    """Prefill/decode fleets checked as a whole: servers that share a router all take part in its mode (a PD
    router pairs prefill with decode and ignores regular workers; a regular one ignores prefill and decode),
    and a PD fleet has both roles. Servers without a router form one fleet of their own."""
    in_server = {n for s in spanning.values() for n in s.nodes}
    heads = [s.head for s in spanning.values()] + [h for h in hosts if h not in in_server]
    fleets: dict[str | None, list[HostConfig]] = {}
    for name in heads:
        host = hosts[name]
        fleets.setdefault(host.router.url if host.router else None, []).append(host)
    for url, members in fleets.items():
        roles = {h.service.role for h in members}
        first = members[0]
        if url is not None and first.router is not None:
            pd = first.router.mode == "pd"
            wrong = next((h for h in members if (h.service.role == "unified") == pd), None)
            if wrong is not None:
                where = ("router", "mode") if _has_any(layers[wrong.name], ("router", "mode")) else ("router",)
                why = ("it is in PD mode (router.mode: pd) and pairs prefill and decode servers only" if pd else
                       "it is not in PD mode: launch it with --pd-disaggregation and set router.mode: pd")
                errors.fail(_source(where, layers[wrong.name]),
                            f"{wrong.name}: a {wrong.service.role} server behind router {url}: {why}")
        if roles & {"prefill", "decode"} and not {"prefill", "decode"} <= roles:
            missing = ({"prefill", "decode"} - roles).pop()
            errors.fail(_source(("service", "sglang", "disaggregation", "mode"), layers[first.name]),
                        f"a prefill/decode fleet{f' behind {url}' if url else ''} without a {missing} server "
                        f"({', '.join(h.name for h in members)}): no request could complete")


def _has_any(layers: list[tuple[tuple, dict]], loc: tuple) -> bool:
    return any(_has(layer, loc) for _, layer in layers)


def _agreed(service: Service, key: str) -> Any:
    """``service.<key>`` as the nodes of a server must share it (the bind address is each node's own)."""
    value = getattr(service, key)
    return value.model_copy(update={"host": ""}) if key == "sglang" else value


class _Errors:
    def __init__(self, path: Path, raw: dict, locate: typing.Callable[[tuple], str] | None) -> None:
        self.path = path
        self.raw = raw
        self.locate = locate or self._locate

    def _locate(self, where: tuple) -> str:
        line = line_of(self.raw, where)
        return f"{self.path}{f':{line}' if line else ''}: {'.'.join(str(p) for p in where)}"

    def fail(self, where: tuple, reason: str) -> typing.NoReturn:
        raise InvalidInput(f"{self.locate(where)}: {reason}")


def _mapping(value: Any, where: tuple, errors: _Errors) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.fail(where, "must be a mapping")
    return value


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            model = _model_of(arg)
            if model:
                return model
    return None


def _check_keys(raw: Any, model: type[BaseModel], where: tuple, errors: _Errors,
                forbidden: set[str] = frozenset()) -> None:
    """Unknown keys fail with their full path and the closest valid key, at any level."""
    if not isinstance(raw, dict):
        return
    allowed = [k for k in model.model_fields if k not in forbidden]
    allowed += sorted(_LEVEL_EXTRA.get(where[0], set()) if len(where) <= 2 else set())
    for key, value in raw.items():
        if key not in allowed:
            errors.fail((*where, key), f"unknown key{_suggest(str(key), allowed)}")
        field = model.model_fields.get(key)
        sub = _model_of(field.annotation) if field else None
        if sub is not None:
            _check_keys(value, sub, (*where, key), errors)


def _merge(base: dict, layer: dict) -> dict:
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "env":
            out[key] = _merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _has(layer: Any, loc: tuple) -> bool:
    for key in loc:
        if not isinstance(layer, dict) or key not in layer:
            return False
        layer = layer[key]
    return True


def _source(loc: tuple, layers: list[tuple[tuple, dict]]) -> tuple:
    """The key path, in the file, of the most specific layer that set ``loc`` (or the nearest parent)."""
    for depth in range(len(loc), 0, -1):
        for prefix, layer in reversed(layers):
            if _has(layer, loc[:depth]):
                return (*prefix, *loc)
    return (*layers[-1][0], *loc)


def _reason(err: dict) -> str:
    if err["type"] == "missing":
        return "required setting is missing"
    if err["type"] == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"invalid value {err.get('input')!r}: expected one of {expected}"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg
