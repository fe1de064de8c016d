"""Render a host's systemd unit from the inventory.

The launch command and the environment are built here as data (argv list, env dict) and quoted by
systemd's own rules, so the template only lays them out and no value can break out of its line.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jinja2

from kdeploy.core import files
from kdeploy.core.errors import InvalidInput
from kdeploy.core.inventory import ONE_NODE, HostConfig, Inventory, Placement, Service
from kdeploy.core.layout import current_path, service_dir

_BARE = re.compile(r"[A-Za-z0-9_./:=,+@-]+\Z")


def unit_filename(service: Service) -> str:
    return f"{service.name}.service"


def launch_argv(service: Service, place: Placement = ONE_NODE) -> list[str]:
    """The ExecStart argv: ``<python> -m <module>`` plus SGLang's flags (HiCache only when enabled; the
    multi-node flags only for a node of a server that spans hosts, ``--tp-size`` being the server's total)."""
    sg = service.sglang
    argv = [service.python, "-m", service.module, "--model-path", sg.model_path]
    if sg.served_model_name:
        argv += ["--served-model-name", sg.served_model_name]
    argv += ["--tp-size", str(sg.tp), "--host", sg.host, "--port", str(sg.port)]
    if place.nnodes > 1:
        assert place.dist_init_addr is not None
        argv += ["--nnodes", str(place.nnodes), "--node-rank", str(place.node_rank),
                 "--dist-init-addr", place.dist_init_addr]
    if sg.attention_backend:
        argv += ["--attention-backend", sg.attention_backend]
    spec = sg.speculative
    for flag, value in (("algorithm", spec.algorithm), ("draft-model-path", spec.draft_model_path),
                        ("num-steps", spec.num_steps), ("eagle-topk", spec.eagle_topk),
                        ("num-draft-tokens", spec.num_draft_tokens)):
        if value is not None:
            argv += [f"--speculative-{flag}", str(value)]
    if sg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if sg.context_length is not None:
        argv += ["--context-length", str(sg.context_length)]
    if sg.trust_remote_code:
        argv.append("--trust-remote-code")
    pd = sg.disaggregation
    if pd is not None:
        argv += ["--disaggregation-mode", pd.mode, "--disaggregation-transfer-backend", pd.transfer_backend]
        if pd.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(pd.bootstrap_port)]
        if pd.ib_device is not None:
            argv += ["--disaggregation-ib-device", pd.ib_device]
    hc = service.hicache
    if hc.enabled:
        argv.append("--enable-hierarchical-cache")
        if hc.size_gb is not None:
            argv += ["--hicache-size", str(hc.size_gb)]
        elif hc.ratio is not None:
            argv += ["--hicache-ratio", str(hc.ratio)]
        for flag, value in (("write-policy", hc.write_policy), ("io-backend", hc.io_backend),
                            ("mem-layout", hc.mem_layout)):
            if value is not None:
                argv += [f"--hicache-{flag}", value]
    return argv + list(sg.extra_args)


def unit_env(service: Service) -> dict[str, str]:
    """Environment of the unit: the payload's ``current`` release first on PYTHONPATH, then the user's."""
    env = {"PYTHONUNBUFFERED": "1", **service.env}
    env["PYTHONPATH"] = ":".join(p for p in (current_path(service), service.env.get("PYTHONPATH")) if p)
    return dict(sorted(env.items()))


def quote_exec_arg(arg: str) -> str:
    """Quote one ExecStart word: specifiers (%) and variable expansion ($) are escaped."""
    if _BARE.match(arg):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def unit_value(value: str, where: str) -> str:
    """A value systemd reads verbatim to the end of its line (Description=, User=, WorkingDirectory=, ...),
    with specifiers escaped (``%`` -> ``%%``).

    Such lines are not unquoted, so nothing else can be escaped: blanks around the value (systemd strips
    them) and a trailing backslash (it continues the line into the next directive) are refused.
    """
    if value != value.strip(" ") or value.endswith("\\"):
        raise InvalidInput(f"{where} {value!r}: blanks at either end or a trailing backslash cannot be written "
                           "on a unit line")
    return value.replace("%", "%%")


def quote_env_assignment(name: str, value: str) -> str:
    """One Environment= assignment; systemd does not expand $ there, but it does expand % specifiers."""
    escaped = f"{name}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{escaped}"'


_ENVIRONMENT = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                  trim_blocks=True, lstrip_blocks=True, autoescape=False)


@functools.lru_cache(maxsize=32)
def _template(source: str) -> jinja2.Template:
    """Compiled once per template text, not once per host (the same template serves a whole fleet)."""
    return _ENVIRONMENT.from_string(source)


def render_unit(inventory: Inventory, host: HostConfig) -> str:
    """The unit text; every inventory value in it is escaped or quoted for the line it lands on."""
    service = host.service
    path = inventory.local_path(service.template)
    try:
        template = _template(files.read_text(path, "unit template"))
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidInput(f"{path}:{exc.lineno}: unit template: {exc.message}") from None

    def value(text: str | None, key: str) -> str | None:
        return None if text is None else unit_value(text, f"{host.name}: service.{key}")

    place = inventory.server_of(host.name).place(host.name)
    description = (value(service.unit.description, "unit.description")
                   or value(f"SGLang {service.sglang.served_model_name or service.name}", "sglang.served_model_name"))
    try:
        return template.render(
            host=host,
            service=service,
            unit=service.unit,
            description=description,
            user=value(service.unit.user, "unit.user"),
            environment_file=value(service.environment_file, "environment_file"),
            environment=[quote_env_assignment(k, v) for k, v in unit_env(service).items()],
            exec_start=" ".join(quote_exec_arg(a) for a in launch_argv(service, place)),
            place=place,
            working_directory=value(service_dir(service), "remote_root"),
            template_name=Path(service.template).name,
        )
    except jinja2.TemplateError as exc:  # an undefined name or attribute, a filter's own error
        line = _template_line(exc)
        raise InvalidInput(f"{path}{f':{line}' if line else ''}: unit template for {host.name}: "
                           f"{exc.message or type(exc).__name__}") from None


def _template_line(exc: BaseException) -> int | None:
    """The template line an error was raised at: jinja2 rewrites the traceback so that the template's own
    frames carry its line numbers (the file name of a template made from a string is ``<template>``)."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
