"""The ``kdeploy`` command: a thin Typer layer over :mod:`kdeploy.flows.fleet` and friends.

Every failure ends as one line on stderr and a documented exit code; ``--debug`` adds the traceback.
With ``--json`` the only thing on stdout is one JSON document. Every start (``--help``, each TAB of completion)
declares the whole command line, so this module imports only Typer and light modules at the top; what a command
needs (the inventory's models, the flows and SSH, rich) it imports when it runs.
"""

import importlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer import completion as typer_completion
from typer.core import TyperCommand, TyperGroup
from typer.models import CommandFunctionType

from kdeploy import __version__
from kdeploy.cli import progress
from kdeploy.core.defaults import DEFAULT_INVENTORY, DEFAULT_PARALLEL, WEEK, Run
from kdeploy.core.errors import ExitCode, InvalidInput, KdeployError
from kdeploy.core.report import HostResult, Listener, Report
from kdeploy.core.text import one_line

# Quoted where used, without `from __future__ import annotations`: Typer would evaluate every command's annotations
# from their text at every start (~10 ms).
if TYPE_CHECKING:
    from rich.console import Group as Stack
    from rich.table import Table
    from typer._click import Command as ClickCommand

    from kdeploy.core import inventory as inv
    from kdeploy.core.policy import Policy
    from kdeploy.flows import settings
    from kdeploy.flows.options import Options


@dataclass
class Flags:
    """The global options of this invocation, wherever they stood on the line (set while click parses)."""

    debug: bool = False
    quiet: bool = False
    verbose: int = 0
    ssh_config: str | None = None


_flags = Flags()
# Typer's click: its own copy in recent Typer (typer._click, whose package exports little), else the click package
_CLICK = typer.BadParameter.__module__.rpartition(".")[0]
click_errors = importlib.import_module(f"{_CLICK}.exceptions")
click_core = importlib.import_module(f"{_CLICK}.core")
_ssh_log = logging.getLogger("kdeploy.ssh")
_ssh_log.propagate = False  # the CLI prints its records itself (-v), once


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (a test's capture, a CI log), one line per record."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(one_line(self.format(record)) + "\n")  # -vv's whole command too: its newlines as \n


_ssh_log.addHandler(_stderr_handler := _Stderr())
_stderr_handler.setFormatter(logging.Formatter("kdeploy: ssh %(message)s"))


def _global(ctx: typer.Context, param: typer.CallbackParam, value: object) -> None:
    """A global option's value, at the group's level or the command's: ``-v`` counts at both."""
    if not value or ctx.resilient_parsing:
        return
    if param.name == "verbose":
        _flags.verbose += int(value)  # type: ignore[call-overload]
        _ssh_log.setLevel(logging.DEBUG if _flags.verbose > 1 else logging.INFO)
    else:
        setattr(_flags, str(param.name), value)


def _global_options(
        verbose: Annotated[int, typer.Option(
            "--verbose", "-v", count=True, expose_value=False, callback=_global, show_default=False,
            help="Show each SSH step: what it runs, how long it took, its exit status (-vv: the whole command).")]
        = 0,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", expose_value=False, callback=_global,
                                            help="Print only failures and the summary.")] = False,
        ssh_config: Annotated[str | None, typer.Option(
            "--ssh-config", metavar="FILE", expose_value=False, callback=_global, show_default=False,
            help="OpenSSH client config to resolve hosts with (wins over KDEPLOY_SSH_CONFIG and the inventory's "
                 "ssh_config).")] = None,
        debug: Annotated[bool, typer.Option("--debug", expose_value=False, callback=_global,
                                            help="Show tracebacks of internal errors.")] = False) -> None:
    """Declares the global options once; every command and group takes them (:class:`Command`, :class:`Group`)."""


_holder = typer.Typer(add_completion=False)
_holder.command()(_global_options)
# Accepted by every command and group, before or after the subcommand (`kdeploy push all -v`).
GLOBAL_OPTIONS = tuple(typer.main.get_command(_holder).params)
CONTEXT = {"help_option_names": ["-h", "--help"]}


class Command(TyperCommand):
    """A kdeploy command: its own options, then the global ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = [*self.params, *GLOBAL_OPTIONS]


class Group(TyperGroup):
    """A kdeploy command group: the global options before its subcommand too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = [*self.params, *GLOBAL_OPTIONS]


class Root(Group):
    """``kdeploy`` itself, whose plugin groups (:func:`_add_plugins`) join its commands only when a word on the line is
    not a built-in command, or when help or completion lists the commands: reading the installed distributions'
    entry points and importing a plugin would otherwise be a good part of every ``kdeploy push -h`` and TAB."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plugged = False

    def _plug(self) -> None:
        if not self.plugged:
            self.plugged = True
            plugins = App(rich_markup_mode=self.rich_markup_mode)
            _add_plugins(plugins)
            for name, command in typer.main.get_group(plugins).commands.items():
                self.commands.setdefault(name, command)

    def list_commands(self, ctx: typer.Context) -> list[str]:
        self._plug()
        return super().list_commands(ctx)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> "ClickCommand | None":
        if cmd_name not in self.commands:
            self._plug()
        return super().get_command(ctx, cmd_name)


class App(typer.Typer):
    """Typer whose commands are :class:`Command` and groups :class:`Group` (``-h``, the global options)."""

    def __init__(self, *, cls: type[TyperGroup] = Group, **kwargs: Any) -> None:
        super().__init__(cls=cls, no_args_is_help=True, context_settings=CONTEXT, **kwargs)

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = None,
                context_settings: dict[str, Any] | None = None,
                **kwargs: Any) -> Callable[[CommandFunctionType], CommandFunctionType]:
        return super().command(name, cls=cls or Command, context_settings={**CONTEXT, **(context_settings or {})},
                               **kwargs)


# Command groups other distributions plug in: entry points of this group, each a typer.Typer named by the group's
# word. The lab (lab/, distribution kdeploy-lab) adds `sandbox` this way, so no product module imports it.
PLUGIN_GROUP = "kdeploy.plugins"
# The plugins the docs promise, with how to get each; without it, its word says so (exit 2) instead of "No such
# command".
KNOWN_PLUGINS = {"sandbox": ("local test hosts (the lab)",
                             "pip install 'kdeploy[lab]' (from a source tree: pip install . ./lab)")}


def _add_plugins(parent: typer.Typer) -> None:
    """Adds every installed plugin group with kdeploy's conventions (-h, the global options); a known one that is
    not installed becomes a command that tells how to install it."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    for name, ep in found.items():
        plugin: typer.Typer = ep.load()
        for info in plugin.registered_commands:
            info.cls = Command if info.cls in (None, TyperCommand) else info.cls
            info.context_settings = {**CONTEXT, **(info.context_settings or {})}
        parent.add_typer(plugin, name=name, cls=Group, no_args_is_help=True, context_settings=CONTEXT)
    for name, (what, how) in KNOWN_PLUGINS.items():
        if name not in found:
            _add_missing(parent, name, what, how)


def _add_missing(parent: typer.Typer, name: str, what: str, how: str) -> None:
    """A command that says how to install the plugin: its help (``-h`` anywhere after it, exit 0) tells, and any
    use of it is exit 2 with that line."""
    def missing() -> None:
        raise InvalidInput(f"{name}: {what} is not installed: {how}")

    parent.command(name, help=f"Not installed: {what}. {how}",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(missing)


app = App(cls=Root, pretty_exceptions_enable=False, add_completion=False,
          help="Ship SGLang extensions and serving configs to GPU hosts; prove every deploy healthy.")
lock_app = App(help="Inspect or clear the per-service deploy lock.")
router_app = App(help="Hosts' membership in their SGLang router, by hand.")
app.add_typer(lock_app, name="lock")
app.add_typer(router_app, name="router")
schema_app = App(help="Print the JSON Schemas of kdeploy's contracts.")
app.add_typer(schema_app, name="schema")


def complete_target(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of TARGET and ``--limit``: ``all``, the inventory's groups and hosts that complete the
    pattern's last part (after its last ``,`` or ``:``, keeping a ``!`` or ``&``)."""
    from kdeploy.core import inventory as inv
    from kdeploy.core import patterns

    path = ctx.params.get("inventory") or os.environ.get("KDEPLOY_INVENTORY") or DEFAULT_INVENTORY
    service = ctx.params.get("service") or os.environ.get("KDEPLOY_SERVICE")
    try:
        loaded = inv.load(Path(path), service)
    except (KdeployError, OSError):
        return []
    return patterns.complete(incomplete, ["all", *sorted(loaded.groups), *sorted(loaded.hosts)])


_PATTERN_HELP = "host pattern: host | group | all | a,b | 'gpu0*' | 'a:&b' | 'a:!b' | '~regex'"
Target = Annotated[str, typer.Argument(help=_PATTERN_HELP, show_default=False, autocompletion=complete_target)]
OptTarget = Annotated[str, typer.Argument(help=_PATTERN_HELP, autocompletion=complete_target)]
LimitOpt = Annotated[str | None, typer.Option("--limit", "-l", autocompletion=complete_target,
                                              help="Only the hosts of TARGET this pattern also names (as Ansible's "
                                                   "--limit; @FILE: patterns from FILE).", show_default=False)]
InventoryOpt = Annotated[Path, typer.Option("--inventory", "-i", envvar="KDEPLOY_INVENTORY",
                                            help="Inventory: kdeploy's file, or any Ansible one (file, script, "
                                                 "directory, plugin config).")]
ServiceOpt = Annotated[Path | None, typer.Option("--service", envvar="KDEPLOY_SERVICE", dir_okay=False,
                                                 help="kdeploy service file for an Ansible inventory.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout; human text on stderr.")]
JunitOpt = Annotated[Path | None, typer.Option("--junit", help="Also write a JUnit XML report (one testcase per host).",
                                               dir_okay=False)]
AcceptOpt = Annotated[bool, typer.Option("--accept-new-host-keys", help="Trust and record unknown host keys.")]
ParallelOpt = Annotated[int, typer.Option("--parallel", min=1, envvar="KDEPLOY_PARALLEL",
                                          help="Hosts worked on at once.")]
WorkersOpt = Annotated[int | None, typer.Option("--workers", min=1, help="TP workers that must show each marker.")]
TimeoutOpt = Annotated[float | None, typer.Option("--timeout", min=0.1, max=WEEK,
                                                  help="Gate timeout in seconds.")]
LockWaitOpt = Annotated[float, typer.Option("--lock-wait", min=0, max=WEEK,
                                            envvar="KDEPLOY_LOCK_WAIT", help="Wait this long for a held lock.")]
CanaryOpt = Annotated[int, typer.Option("--canary", min=0, help="Hosts that go first, alone, and must pass.")]
BatchOpt = Annotated[str | None, typer.Option("--batch", help="N or N%: hosts restarting at once (default: "
                                                              "--parallel; behind a router: 1).", show_default=False)]
MaxFailOpt = Annotated[str | None, typer.Option("--max-fail", help="N or N%: failures tolerated before new batches "
                                                                   "stop (default: no limit).", show_default=False)]
AnalysisOpt = Annotated[str | None, typer.Option(
    "--analysis", metavar="DURATION", show_default=False,
    help="With --canary: compare the canary's SGLang metrics with the hosts not yet deployed for DURATION (90, 30s, "
         "5m, 1h) before the rest go; the canary is rolled back (exit 4) when they do not hold up.")]
def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"kdeploy {__version__}\n")
        raise typer.Exit(0)


SHELLS = ("bash", "zsh", "fish")


def _completion(ctx: typer.Context, param: typer.CallbackParam, shell: str | None) -> None:
    """``--show-completion SHELL`` prints the script SHELL sources; ``--install-completion SHELL`` installs it."""
    if shell is None or ctx.resilient_parsing:
        return
    if shell not in SHELLS:
        raise typer.BadParameter(f"{shell!r}: one of {', '.join(SHELLS)}", ctx, param)
    if param.name == "show_completion":
        sys.stdout.write(completion_script(shell))
    else:
        installed, path = typer_completion.install(shell=shell, prog_name="kdeploy",
                                                   complete_var=COMPLETE_VAR)
        sys.stderr.write(f"{installed} completion installed in {path}; it takes effect in a new shell\n")
    raise typer.Exit(0)


COMPLETE_VAR = "_KDEPLOY_COMPLETE"


def completion_script(shell: str) -> str:
    """The completion script of ``shell`` (bash, zsh or fish), ending in a newline."""
    return typer_completion.get_completion_script(prog_name="kdeploy", complete_var=COMPLETE_VAR,
                                                  shell=shell).rstrip("\n") + "\n"


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print kdeploy's version and exit.")] = False,
         show_completion: Annotated[str | None, typer.Option(
             "--show-completion", metavar="SHELL", callback=_completion, is_eager=True, expose_value=False,
             help="Print the completion script of SHELL (bash, zsh, fish).")] = None,
         install_completion: Annotated[str | None, typer.Option(
             "--install-completion", metavar="SHELL", callback=_completion, is_eager=True, expose_value=False,
             help="Install the completion script of SHELL (bash, zsh, fish).")] = None) -> None:
    """Ship SGLang extensions and serving configs to GPU hosts; prove every deploy healthy.

    Off a terminal (or with CI=true or NO_COLOR) the output is plain lines, one per host and phase.
    The global options (-v, -q, --ssh-config, --debug, -h) go anywhere on the line.
    """


def _policy(canary: int, batch: str | None, max_fail: str | None, analysis: str | None = None) -> "Policy":
    """The rollout policy of push, set-env, set and rollback; its syntax checked before anything else is read (its
    fit to the hosts selected is checked once they are known: ``Policy.check``)."""
    from kdeploy.core.policy import Policy
    from kdeploy.flows import canary as canary_analysis

    policy = Policy(canary, batch, max_fail, None if analysis is None else canary_analysis.parse_duration(analysis))
    policy.check(0)
    return policy


def _check_writable(path: Path, option: str) -> None:
    """A report file is checked before any host is touched: after a deploy it would be too late to say so."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInput(f"{option} {path}: cannot create its directory: {exc.strerror}") from None
    try:
        usable = not path.is_dir() and os.access(path.parent, os.W_OK) and (
            not path.exists() or os.access(path, os.W_OK))
    except OSError as exc:  # a directory on the way that cannot be searched
        raise InvalidInput(f"{option} {path}: cannot look at it: {exc.strerror}") from None
    if not usable:
        raise InvalidInput(f"{option} {path}: not a writable file")


class Ui:
    """Human output on stderr (a live view when it is a TTY, plain lines in CI), JSON on stdout, JUnit to a file."""

    def __init__(self, as_json: bool, junit: Path | None = None) -> None:
        from rich.console import Console

        if junit is not None:
            _check_writable(junit, "--junit")
        self.as_json, self.junit, self.quiet = as_json, junit, _flags.quiet
        self.started, self.clock = datetime.now(UTC), time.monotonic()
        # -v writes lines of its own to stderr: a live view would draw over them
        self.plain = _flags.verbose > 0 or progress.plain_wanted(os.environ, progress.is_terminal(sys.stderr))
        self.err = (Console(stderr=True, highlight=False, force_terminal=False, color_system=None, no_color=True,
                            width=160, soft_wrap=True) if self.plain else Console(stderr=True, highlight=False))
        self.live_state: dict[str, tuple[str, float]] = {}
        self.lock = threading.Lock()

    def listener(self, host: str, phase: str, status: str) -> None:
        with self.lock:
            if status == "start":
                self.live_state[host] = (phase, time.monotonic())
            elif phase == "done":
                self.live_state[host] = (status, time.monotonic())

    def _live_table(self) -> "Table":
        from rich.table import Table

        table = Table(box=None, show_header=False)
        now = time.monotonic()
        with self.lock:
            for host, (phase, since) in self.live_state.items():
                table.add_row(host, phase, f"{now - since:5.1f}s")
        return table

    def run(self, fn: Callable[[Listener], Report]) -> Report:
        if self.plain or self.quiet:
            return progress.PlainLog(self.err.file, quiet=self.quiet, starts=_flags.verbose > 0).run(fn)
        from rich.console import Group as Stack
        from rich.live import Live

        from kdeploy.flows import canary as canary_analysis

        view = canary_analysis.LiveView(self.listener)

        def draw() -> "Table | Stack":
            window = view.render()
            return self._live_table() if window is None else Stack(self._live_table(), window)

        with Live(self._live_table(), console=self.err, refresh_per_second=8, transient=True, get_renderable=draw):
            return fn(view)

    def table(self, title: str, *columns: str) -> "Table":
        """A table in the TTY's box drawing, or in plain columns for a CI log."""
        from rich.table import Table

        table = Table(title=title, title_justify="left", **({"box": None} if self.plain else {}))
        for col in columns:
            table.add_column(col, overflow="fold")
        return table

    def line(self, text: str) -> None:
        """One line of a command's view, as :func:`one_line` writes it (no markup read from it)."""
        self.err.print(one_line(text), markup=False)

    def heading(self, text: str) -> None:
        if self.plain:
            self.line(f"== {text}")
        else:
            self.err.rule(cell(text))

    def report(self, report: Report, extra: Callable[[Report], None] | None = None, *, table: bool = True,
               inventory: "inv.Inventory | None" = None) -> None:
        """JSON and JUnit, the per-command ``extra`` view, the per-host results (always for a failed host), summary.

        ``--quiet`` leaves out the extra view and every host that ended well; so does a command's own view
        (``extra`` without ``table``: history, status, lock, probe, check, verify's phases), which already shows
        each host, so a host that ended well gets no second line (on a TTY as in a CI log).
        """
        if self.junit:  # before the JSON: a write that still fails must not follow a document that says ok
            from kdeploy.cli import junit

            services = {name: h.service.name for name, h in inventory.hosts.items()} if inventory else {}
            try:
                self.junit.write_text(junit.build(report, services, started=self.started,
                                                  seconds=time.monotonic() - self.clock))
            except OSError as exc:  # checked writable at the start: a disk that filled since
                raise InvalidInput(f"--junit {self.junit}: cannot write it: {exc.strerror}") from None
        if self.as_json:
            sys.stdout.write(json.dumps(report.as_json(), indent=2, default=str) + "\n")
        if extra and not self.quiet:
            extra(report)
        only_failed = self.quiet or (extra is not None and not table)
        hosts = [host for host in report.hosts if not (only_failed and host.ok)]
        if self.plain or self.quiet:
            for host in hosts:
                self.line(progress.host_line(host))
                self._log(host)
        elif table or not report.ok:
            self._table(report.command, hosts)
        self.err.print(progress.summary_line(report), markup=False)

    def _log(self, host: HostResult) -> None:
        for line in host.log:
            self.line(f"  {host.host} | {line}")
        if host.router == "out":
            self.err.print(f"  {host.host} | OUT of its router: `kdeploy router admit {host.host}` puts it back",
                           markup=False)

    def _table(self, command: str, hosts: list[HostResult]) -> None:
        table = self.table(f"kdeploy {command}", "host", "result", "release", "phase", "seconds", "detail")
        for host in hosts:
            last = host.failed_phase() or (host.phases[-1] if host.phases else None)
            seconds = sum(p.seconds for p in host.phases)
            colour = "green" if host.ok else "red"
            table.add_row(cell(progress.host_name(host)), f"[{colour}]{host.result}[/]", cell(host.release or "-"),
                          last.name if last else "-", f"{seconds:.1f}",
                          cell(host.error or (last.detail if last else "")))
        self.err.print(table)
        for host in hosts:
            self._log(host)


def _phases_table(ui: Ui, report: Report) -> None:
    for host in report.hosts:
        table = ui.table(f"{host.host} ({host.result})", "phase", "ok", "seconds", "detail")
        table.box = None
        for p in host.phases:
            table.add_row(p.name, "[green]ok[/]" if p.ok else "[red]FAIL[/]", f"{p.seconds:.2f}", cell(p.detail))
        ui.err.print(table)


def cell(text: str) -> str:
    """A table cell (or rule) from a string kdeploy does not choose: one line, no rich markup read from it."""
    from rich.markup import escape

    return escape(one_line(text))


def _exit(report: Report) -> None:
    raise typer.Exit(report.exit_code)


def _load(path: Path, service: Path | None, target: str | None = None, limit: str | None = None) -> "inv.Inventory":
    """The inventory narrowed to ``--limit``; TARGET is checked here, before anything else (exit 2), and a
    selection of no host is said (the command then acts on none and exits 0, as for an empty group)."""
    from kdeploy.core import inventory as inv

    loaded = inv.load(path, service).subset(limit)
    if target is not None and not loaded.resolve(target):
        say(f"no hosts matched {target!r}{f' with --limit {limit!r}' if limit else ''}")
    return loaded


@app.command()
def render(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY,
           service: ServiceOpt = None, limit: LimitOpt = None) -> None:
    """Print each host's rendered systemd unit."""
    from kdeploy.core.render import render_unit

    loaded = _load(inventory, service, target, limit)
    for name in loaded.resolve(target):
        server = loaded.server_of(name)
        place = f" (server {server.name}, node {server.nodes.index(name)} of {len(server.nodes)})" \
            if server.spans else ""
        sys.stdout.write(f"# ---- {name}{place} ----\n{render_unit(loaded, loaded.hosts[name])}")


def _options(**kw: object) -> "Options":
    from kdeploy.flows.options import Options

    return Options(**{k: v for k, v in kw.items() if v is not None}, ssh_config=_flags.ssh_config)


_SECRET_NAME = re.compile(r"token|secret|passw|credential|key", re.IGNORECASE)


def command_line(ctx: typer.Context) -> str:
    """The command being run, as the lock and history record it on every host.

    Built from kdeploy's own parsed arguments, never from ``sys.argv`` (a wrapper calling kdeploy may hold
    secrets in its own argv): subcommand, arguments and the options not left at their default, with the
    value of an option or a ``KEY=VALUE`` argument whose name looks secret shown as ``***``.
    """
    words = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        values = [str(v) for v in (value if isinstance(value, list | tuple) else [value]) if v is not None]
        if param.param_type_name == "argument":
            for word in values:
                key, sep, _ = word.partition("=")
                words.append(f"{shlex.quote(key)}=***" if sep and _SECRET_NAME.search(key) else shlex.quote(word))
        elif value not in (None, False, [], ()) and value != param.default:
            flag = max(param.opts, key=len)
            words += [flag] if value is True else [
                w for v in values for w in (flag, "***" if _SECRET_NAME.search(param.name) else shlex.quote(v))]
    return " ".join(words)


@app.command()
def push(ctx: typer.Context, target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
         service: ServiceOpt = None,
         as_json: JsonOpt = False, junit_path: JunitOpt = None, accept_new_host_keys: AcceptOpt = False,
         parallel: ParallelOpt = DEFAULT_PARALLEL,
         no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the health gate.")] = False,
         force_restart: Annotated[bool, typer.Option("--force-restart", help="Restart even if unchanged.")] = False,
         dry_run: Annotated[bool, typer.Option("--dry-run", help="Same as `kdeploy plan`.")] = False,
         lock_wait: LockWaitOpt = 0, workers: WorkersOpt = None, timeout: TimeoutOpt = None,
         skip_preflight: Annotated[bool, typer.Option("--skip-preflight", help="Skip the preflight checks.")] = False,
         canary: CanaryOpt = 0, batch: BatchOpt = None, max_fail: MaxFailOpt = None, analysis: AnalysisOpt = None,
         router_add_missing: Annotated[bool, typer.Option(
             "--router-add-missing", help="Register hosts the router does not know after their deploy.")] = False,
         accept_parity_change: Annotated[bool, typer.Option(
             "--accept-parity-change",
             help="The served model changes: take its answers as the new parity reference.")] = False,
         limit: LimitOpt = None) -> None:
    """Ship the payload and unit, restart, gate; roll back by itself when the gate fails."""
    from kdeploy.flows import fleet

    if dry_run:
        _plan(target, inventory, service, as_json, accept_new_host_keys, parallel, limit)
        return
    ui = Ui(as_json, junit_path)
    opts = _options(accept_new_host_keys=accept_new_host_keys, verify=not no_verify, force_restart=force_restart,
                    lock_wait=lock_wait, workers=workers, timeout=timeout,
                    policy=_policy(canary, batch, max_fail, analysis), skip_preflight=skip_preflight,
                    router_add_missing=router_add_missing,
                    accept_parity_change=accept_parity_change, command=command_line(ctx))
    loaded = _load(inventory, service, target, limit)
    report = ui.run(lambda listener: fleet.push(loaded, target, opts, parallel=parallel, listener=listener))
    ui.report(report, inventory=loaded)
    _exit(report)


def _plan(target: str, inventory: Path, service: Path | None, as_json: bool, accept: bool, parallel: int,
          limit: str | None) -> None:
    from kdeploy.flows import fleet
    from kdeploy.flows.views import Plan

    ui = Ui(as_json)
    loaded = _load(inventory, service, target, limit)
    report = fleet.push(loaded, target, _options(accept_new_host_keys=accept), dry_run=True, parallel=parallel)

    def show(rep: Report) -> None:
        for host in rep.hosts:
            plan = host.details
            if not isinstance(plan, Plan):
                continue
            ui.heading(f"{host.host}: restart={'yes' if plan.restart else 'no'} "
                       f"daemon-reload={'yes' if plan.daemon_reload else 'no'}")
            for reason in plan.reasons:
                ui.line(f"  because: {reason}")
            for paths, sign in ((plan.add, "+"), (plan.change, "~"), (plan.remove, "-")):
                for path in paths:
                    ui.line(f"  {sign} {path}")
            for line in plan.unit_diff.splitlines():  # the host's unit may hold anything
                ui.line(line)

    ui.report(report, show)
    _exit(report)


@app.command()
def plan(target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
         service: ServiceOpt = None, as_json: JsonOpt = False,
         accept_new_host_keys: AcceptOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
         limit: LimitOpt = None) -> None:
    """Show what a push would change (unit diff, files, reload/restart); changes nothing."""
    _plan(target, inventory, service, as_json, accept_new_host_keys, parallel, limit)


@app.command()
def verify(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY,
           service: ServiceOpt = None, as_json: JsonOpt = False,
           junit_path: JunitOpt = None, workers: WorkersOpt = None, timeout: TimeoutOpt = None,
           accept_new_host_keys: AcceptOpt = False,
           parity: Annotated[bool, typer.Option(
               "--parity", help="Also compare the answers with the release's parity record.")] = False,
           parallel: ParallelOpt = DEFAULT_PARALLEL, limit: LimitOpt = None) -> None:
    """Run the health gate against what runs now (exit 4 when unhealthy); changes nothing."""
    from kdeploy.flows import fleet

    ui = Ui(as_json, junit_path)
    opts = _options(workers=workers, timeout=timeout, accept_new_host_keys=accept_new_host_keys, parity=parity)
    loaded = _load(inventory, service, target, limit)
    report = ui.run(lambda listener: fleet.verify(loaded, target, opts, parallel=parallel, listener=listener))
    ui.report(report, lambda rep: _phases_table(ui, rep), table=False, inventory=loaded)
    _exit(report)


@app.command()
def rollback(ctx: typer.Context, target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
             service: ServiceOpt = None,
             as_json: JsonOpt = False, junit_path: JunitOpt = None,
             to: Annotated[str | None, typer.Option("--to", help="Release id (default: the previous one).")] = None,
             lock_wait: LockWaitOpt = 0, accept_new_host_keys: AcceptOpt = False,
             parallel: ParallelOpt = DEFAULT_PARALLEL, canary: CanaryOpt = 0, batch: BatchOpt = None,
             max_fail: MaxFailOpt = None, limit: LimitOpt = None) -> None:
    """Re-activate an older release and its unit, restart and gate."""
    from kdeploy.flows import fleet

    ui = Ui(as_json, junit_path)
    from kdeploy.core.release import check_name

    opts = _options(to_release=None if to is None else check_name(to, "--to"), lock_wait=lock_wait,
                    accept_new_host_keys=accept_new_host_keys, policy=_policy(canary, batch, max_fail),
                    command=command_line(ctx))
    loaded = _load(inventory, service, target, limit)
    report = ui.run(lambda listener: fleet.rollback(loaded, target, opts, parallel=parallel, listener=listener))
    ui.report(report, inventory=loaded)
    _exit(report)


@app.command()
def probe(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY,
          service: ServiceOpt = None, as_json: JsonOpt = False,
          accept_new_host_keys: AcceptOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
          limit: LimitOpt = None) -> None:
    """What each host's service python offers the payload: SGLang version, plugin loader, hooks, registry."""
    from kdeploy.core.probe import ProbeReport
    from kdeploy.flows import fleet

    ui = Ui(as_json)
    loaded = _load(inventory, service, target, limit)
    report = fleet.probe(loaded, target, _options(accept_new_host_keys=accept_new_host_keys), parallel=parallel)

    def show(rep: Report) -> None:
        for host in rep.hosts:
            if isinstance(host.details, ProbeReport):
                ui.line(f"{host.host}: {host.details.summary()}")

    ui.report(report, show, table=False)
    _exit(report)


@app.command()
def history(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY,
            service: ServiceOpt = None, as_json: JsonOpt = False,
            last: Annotated[int, typer.Option("--last", "-n", min=1, help="Entries per host.")] = 20,
            accept_new_host_keys: AcceptOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
            limit: LimitOpt = None) -> None:
    """Show each host's deploy history."""
    from rich.text import Text

    from kdeploy.core.history import columns as history_columns
    from kdeploy.flows import fleet
    from kdeploy.flows.views import History

    ui = Ui(as_json)
    report = fleet.history(_load(inventory, service, target, limit), target,
                           _options(history_limit=last, accept_new_host_keys=accept_new_host_keys), parallel=parallel)

    def show(rep: Report) -> None:
        table = ui.table("deploy history", "host", "time", "user", "controller", "release", "result", "seconds")
        for host in rep.hosts:
            for rec in host.details.records if isinstance(host.details, History) else []:
                table.add_row(host.host, *(Text(one_line(col)) for col in history_columns(rec)))  # the host's file
        ui.err.print(table)

    ui.report(report, show, table=False)
    _exit(report)


def _edit(command: str, inventory: Path, service: Path | None, make: Callable[[], "settings.Edit"], ui: Ui,
          no_apply: bool, accept: bool, parallel: int, lock_wait: float, line: str, limit: str | None,
          policy: "Policy") -> None:
    """Make, check, write and roll out an edit under the lock of the file it edits (the inventory, or the service
    file of an Ansible inventory); a second kdeploy waits or exits 6. ``--limit``: the rollout goes to the changed
    hosts it names only; the others keep their config until a push (``status`` shows their drift)."""
    from kdeploy.core import ansible
    from kdeploy.flows import fleet, settings

    if service is None and ansible.is_source(inventory):  # a directory or a script: there is no file to lock
        ansible.require_service(inventory, None)
    with settings.locked(service or inventory, lock_wait, f"kdeploy {command}", service is not None):
        edit = make()  # under the lock: from the file as the previous edit left it
        if not edit.changed:
            ui.err.print("inventory already says so: nothing to change")
            ui.report(Report(command, []), table=False)
            return
        local = fleet.check_edit(edit)
        outside: list[str] = []
        if limit is not None:
            allowed = set(edit.new.subset(limit).resolve("all"))
            outside = [name for name in local if name not in allowed]
            local = {name: step for name, step in local.items() if name in allowed}
            if outside:
                ui.line(f"outside --limit {limit!r}, not rolled out (they drift until `kdeploy push`): "
                        f"{', '.join(outside)}")
        if not no_apply:
            # before the diff: a refused rollout shows no change it will not make
            fleet.check_rollout(edit.new, list(local), command, policy)
        for diff_line in edit.diff().splitlines():  # lines of the inventory file: what it holds may be anything
            ui.line(diff_line)
        if no_apply:
            settings.write(edit)
            report = Report(command, [], {"inventory": {"path": str(edit.path), "level": edit.level,
                                                        "diff": edit.diff(), "rolled_out_to": [], "reverted": False}})
            ui.err.print(f"{edit.path} updated at {edit.level}; not rolled out (--no-apply): run `kdeploy push all`")
        else:
            opts = _options(accept_new_host_keys=accept, lock_wait=lock_wait, command=line, policy=policy)
            report = ui.run(lambda listener: fleet.apply_edit(edit, local, command, opts, parallel=parallel,
                                                              listener=listener))
            facts = report.extra["inventory"]
            if not facts["rolled_out_to"] and not outside:
                ui.err.print("no host's unit changed: nothing to roll out")
            elif facts["reverted"]:
                ui.err.print(f"[red]rollout failed or interrupted: the edit of {edit.path} was REVERTED[/]; hosts "
                             f"that took it were pushed the old config again: "
                             f"{', '.join(f'{h} {r}' for h, r in facts.get('restored_hosts', {}).items()) or 'none'}")
            for conflict in facts.get("conflicts", []):
                ui.err.print(f"[red]not reverted:[/] {cell(conflict)}", soft_wrap=True)  # one line each
    ui.report(report, table=bool(report.hosts), inventory=edit.new)
    _exit(report)


ScopeOpt = Annotated[str | None, typer.Option("--target", "-t", help="Host or group to write at (default: defaults).")]
NoApplyOpt = Annotated[bool, typer.Option("--no-apply", help="Only edit the inventory; do not roll out.")]
EditLockWaitOpt = Annotated[float, typer.Option("--lock-wait", min=0, max=WEEK, envvar="KDEPLOY_LOCK_WAIT",
                                                help="Wait this long for the inventory's and the hosts' locks.")]


@app.command("set-env")
def set_env(ctx: typer.Context,
            assignments: Annotated[list[str] | None, typer.Argument(help="KEY=VALUE ...", show_default=False)] = None,
            unset: Annotated[list[str] | None, typer.Option("--unset", help="Remove KEY at the scope.")] = None,
            target: ScopeOpt = None, no_apply: NoApplyOpt = False, inventory: InventoryOpt = DEFAULT_INVENTORY,
            service: ServiceOpt = None,
            as_json: JsonOpt = False, junit_path: JunitOpt = None, accept_new_host_keys: AcceptOpt = False,
            parallel: ParallelOpt = DEFAULT_PARALLEL, lock_wait: EditLockWaitOpt = 0,
            canary: CanaryOpt = 0, batch: BatchOpt = None, max_fail: MaxFailOpt = None,
            analysis: AnalysisOpt = None, limit: LimitOpt = None) -> None:
    """Set or unset service environment flags in the inventory and roll them out (gated, reverted on failure)."""
    from kdeploy.flows import settings

    pairs = dict(settings.split_assignment(a) for a in assignments or [])
    if not pairs and not unset:
        raise InvalidInput("set-env: give KEY=VALUE or --unset KEY")
    _edit("set-env", inventory, service, lambda: settings.set_env(inventory, pairs, list(unset or []), target, service),
          Ui(as_json, junit_path), no_apply, accept_new_host_keys, parallel, lock_wait, command_line(ctx), limit,
          _policy(canary, batch, max_fail, analysis))


@app.command("set")
def set_(ctx: typer.Context,
         assignments: Annotated[list[str], typer.Argument(help="PATH=VALUE, e.g. hicache.ratio=4.0",
                                                          show_default=False)],
         target: ScopeOpt = None, no_apply: NoApplyOpt = False, inventory: InventoryOpt = DEFAULT_INVENTORY,
         service: ServiceOpt = None,
         as_json: JsonOpt = False, junit_path: JunitOpt = None, accept_new_host_keys: AcceptOpt = False,
         parallel: ParallelOpt = DEFAULT_PARALLEL, lock_wait: EditLockWaitOpt = 0,
         canary: CanaryOpt = 0, batch: BatchOpt = None, max_fail: MaxFailOpt = None,
         analysis: AnalysisOpt = None, limit: LimitOpt = None) -> None:
    """Change typed service settings (hicache.ratio=4.0, gate.workers=8, ...) and roll them out."""
    from kdeploy.flows import settings

    pairs = dict(settings.split_assignment(a) for a in assignments)
    _edit("set", inventory, service, lambda: settings.set_values(inventory, pairs, target, service),
          Ui(as_json, junit_path), no_apply, accept_new_host_keys, parallel, lock_wait, command_line(ctx), limit,
          _policy(canary, batch, max_fail, analysis))


@app.command()
def status(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY,
           service: ServiceOpt = None, as_json: JsonOpt = False,
           accept_new_host_keys: AcceptOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
           limit: LimitOpt = None) -> None:
    """One row per host: state, uptime, release, env flags in effect, last deploy, drift."""
    from kdeploy.flows import fleet
    from kdeploy.flows.views import StatusView

    ui = Ui(as_json)
    loaded = _load(inventory, service, target, limit)
    report = fleet.status(loaded, target, _options(accept_new_host_keys=accept_new_host_keys), parallel=parallel)

    def show(rep: Report) -> None:
        routed = any(host.router for host in rep.hosts)
        columns = ("host", "state", "since", "release", "env", "last deploy", "drift", "router")
        table = ui.table("kdeploy status", *columns[:8 if routed else 7])
        for host in rep.hosts:
            st = host.details
            if not isinstance(st, StatusView):
                continue
            last = st.last_deploy
            deployed = cell(f"{last.get('time')} {last.get('result')} by {last.get('user')}") if last else "-"
            drifted = "[red]" + cell("; ".join(st.drift)) + "[/]" if st.drift else "[green]none[/]"
            router = [{"in": "[green]in[/]", "out": "[red]OUT[/]"}.get(host.router or "", "?")] if routed else []
            table.add_row(host.host, cell(f"{st.active}/{st.sub}"), cell(st.since or "-"), cell(host.release or "-"),
                          cell(" ".join(f"{k}={v}" for k, v in st.env.items())) or "-", deployed, drifted, *router)
        ui.err.print(table)

    ui.report(report, show, table=False)
    _exit(report)


def _lock(target: str, inventory: Path, service: Path | None, as_json: bool, release: bool, force: bool,
          parallel: int, limit: str | None) -> None:
    from kdeploy.flows import fleet
    from kdeploy.flows.views import LockView

    ui = Ui(as_json)
    report = fleet.lock(_load(inventory, service, target, limit), target, _options(force=force), release=release,
                        parallel=parallel)

    def show(rep: Report) -> None:
        for host in rep.hosts:
            if isinstance(host.details, LockView):
                who = host.details.holder.describe() if host.details.holder else ""
                ui.line(f"{host.host}: {host.details.state} {who}")

    ui.report(report, show, table=False)
    _exit(report)


@lock_app.command("status")
def lock_status(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY, service: ServiceOpt = None,
                as_json: JsonOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
                limit: LimitOpt = None) -> None:
    """Who holds each host's deploy lock (free / held / stale)."""
    _lock(target, inventory, service, as_json, False, False, parallel, limit)


@lock_app.command("release")
def lock_release(target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
                 service: ServiceOpt = None, as_json: JsonOpt = False,
                 force: Annotated[bool, typer.Option("--force", help="Also end a LIVE holder.")] = False,
                 parallel: ParallelOpt = DEFAULT_PARALLEL, limit: LimitOpt = None) -> None:
    """Clear a stale lock (with --force, end a live holder too)."""
    _lock(target, inventory, service, as_json, True, force, parallel, limit)


@app.command("logs")
def logs_(target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY, service: ServiceOpt = None,
          lines: Annotated[int, typer.Option("--lines", "-n", min=0, help="Last N lines per host (0: all).")] = 50,
          grep: Annotated[str | None, typer.Option("--grep", "-g", help="Only lines matching this extended "
                                                                        "regular expression (grep -E).")] = None,
          since: Annotated[str | None, typer.Option("--since", help="As journalctl --since: '1 hour ago', "
                                                                    "'2026-12-01 02:00', 'today'.")] = None,
          run: Annotated[Run, typer.Option("--run", help="Only the current or the previous run of the "
                                                         "service.")] = Run.ALL,
          follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow every host at once (Ctrl-C ends).")]
          = False,
          accept_new_host_keys: AcceptOpt = False, limit: LimitOpt = None) -> None:
    """The service's journal on each host, every line prefixed by its host."""
    from kdeploy.flows import logs

    query = logs.LogQuery(lines=lines, grep=grep, since=since, run=run, follow=follow)
    query.check()
    loaded = _load(inventory, service, target, limit)
    stop = threading.Event()

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        results = logs.run(loaded, loaded.resolve(target), query, _options(accept_new_host_keys=accept_new_host_keys),
                           emit, stop)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) is how -f ends: the channels close, journalctl with them
        stop.set()
        say("interrupted")
        raise typer.Exit(130) from None
    for host in results:
        if not host.ok:
            say(f"{host.host}: {host.result}: {host.error}")
    _exit(Report("logs", results))


@app.command()
def check(target: OptTarget = "all", inventory: InventoryOpt = DEFAULT_INVENTORY, service: ServiceOpt = None,
          as_json: JsonOpt = False, limit: LimitOpt = None) -> None:
    """Check everything a push needs that the controller can see, without SSH: units (and systemd-analyze
    verify), payloads and their gate manifests, secrets set, hook scripts (docs/check.md)."""
    from kdeploy.flows import check as checks

    ui = Ui(as_json)
    report = checks.run(_load(inventory, service, target, limit), target)

    def show(rep: Report) -> None:
        for finding, hosts in checks.findings(rep):
            ui.line(f"{finding} [{' '.join(hosts)}]")

    ui.report(report, show, table=False)
    _exit(report)


@app.command("exec")
def exec_(target: Target,
          command: Annotated[list[str], typer.Argument(help="The command, after `--`: its words are joined by "
                                                            "spaces and run by /bin/sh on each host (as ssh does).",
                                                       show_default=False)],
          inventory: InventoryOpt = DEFAULT_INVENTORY, service: ServiceOpt = None, as_json: JsonOpt = False,
          accept_new_host_keys: AcceptOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL,
          timeout: Annotated[float | None, typer.Option("--timeout", min=0.1, max=WEEK,
                                                        help="Stop the command on a host that runs it longer "
                                                             "than this (seconds; default: no limit).",
                                                        show_default=False)] = None,
          no_become: Annotated[bool, typer.Option(
              "--no-become", help="Run it as the SSH user even where the inventory sets become (default: as "
                                  "become_user, like every command).")] = False,
          limit: LimitOpt = None) -> None:
    """Run a command on each host (`kdeploy exec all -- nvidia-smi -L`): its output prefixed by host,
    exit 0 only if it exited 0 everywhere (docs/exec.md)."""
    from kdeploy.flows import execute

    ui = Ui(as_json)
    loaded = _load(inventory, service, target, limit)

    def show(result: HostResult) -> None:
        out, err = execute.lines(result)
        if not as_json:
            sys.stdout.write("".join(line + "\n" for line in out))
            sys.stdout.flush()
        sys.stderr.write("".join(line + "\n" for line in err) if not as_json else "")
        sys.stderr.flush()

    report = execute.run(loaded, target, command, _options(accept_new_host_keys=accept_new_host_keys),
                         parallel=parallel, timeout=timeout, on_done=show, become=not no_become)
    ui.report(report, table=False)
    _exit(report)


@schema_app.command("report")
def schema_report() -> None:
    """The JSON Schema of the --json report."""
    from kdeploy.cli import schema

    sys.stdout.write(json.dumps(schema.report_schema(), indent=2) + "\n")


@schema_app.command("inventory")
def schema_inventory() -> None:
    """The JSON Schema of the inventory file (for editors: see docs/inventory.md)."""
    from kdeploy.cli import schema

    sys.stdout.write(json.dumps(schema.inventory_schema(), indent=2) + "\n")


def _router(action: str, target: str, inventory: Path, service: Path | None, as_json: bool, accept: bool,
            limit: str | None) -> None:
    from kdeploy.flows import fleet

    ui = Ui(as_json)
    loaded = _load(inventory, service, target, limit)
    report = ui.run(lambda listener: fleet.router(loaded, target, action, _options(accept_new_host_keys=accept),
                                                  listener=listener))
    ui.report(report)
    _exit(report)


@router_app.command("admit")
def router_admit(target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
                 service: ServiceOpt = None, as_json: JsonOpt = False,
                 accept_new_host_keys: AcceptOpt = False, limit: LimitOpt = None) -> None:
    """Register hosts' servers in their router again and wait until it lists them healthy."""
    _router("admit", target, inventory, service, as_json, accept_new_host_keys, limit)


@router_app.command("drain")
def router_drain(target: Target, inventory: InventoryOpt = DEFAULT_INVENTORY,
                 service: ServiceOpt = None, as_json: JsonOpt = False,
                 accept_new_host_keys: AcceptOpt = False, limit: LimitOpt = None) -> None:
    """Take hosts' servers out of their router (new requests go to the others)."""
    _router("drain", target, inventory, service, as_json, accept_new_host_keys, limit)


def say(message: str) -> None:
    """One ``kdeploy: <message>`` line on stderr, whatever the message holds (:func:`one_line`)."""
    sys.stderr.write(f"kdeploy: {one_line(message)}\n")


# pydantic's errors for the values Typer checks, in click's words (with the value before them)
_VALUE_ERRORS = {"int_parsing": "is not a valid integer", "int_from_float": "is not a valid integer",
                 "float_parsing": "is not a valid number", "greater_than_equal": "is below the minimum {ge:g}",
                 "less_than_equal": "is above the maximum {le:g}"}


def usage_message(exc: click_errors.UsageError) -> str:
    """A click usage error as the one line kdeploy prints: what it is about (a bad value: the option, and its
    variable when the value came from there, as ``--parallel (KDEPLOY_PARALLEL)``; else the command), then why."""
    from pydantic import ValidationError  # here: a usage error is no reason to import it for every --help

    why = exc.message.removeprefix("Value error, ").rstrip(".")
    if isinstance(exc, click_errors.BadParameter) and not isinstance(exc, click_errors.MissingParameter) and exc.param:
        param = exc.param
        about = max(param.opts, key=len) if param.param_type_name == "option" else param.human_readable_name
        if (exc.ctx and param.name and isinstance(param.envvar, str)
                and exc.ctx.get_parameter_source(param.name) is click_core.ParameterSource.ENVIRONMENT):
            about += f" ({param.envvar})"
        cause = exc.__cause__
        first = cause.errors()[0] if isinstance(cause, ValidationError) and cause.errors() else None
        if first is not None:
            said, value = _VALUE_ERRORS.get(first["type"]), repr(first["input"])
            if said:
                why = f"{value} {said.format(**first.get('ctx', {}))}"
            elif value not in why:
                why = f"{value}: {why}"
        return f"{about}: {why}"
    command = exc.ctx.command_path.removeprefix("kdeploy").strip() if exc.ctx else ""
    why = exc.format_message().rstrip(".")
    why = why[:1].lower() + why[1:]
    return f"{command}: {why}" if command else why


def main(argv: list[str] | None = None) -> int:
    """Entry point: maps every error to one line and the documented exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    _flags.__init__()  # type: ignore[misc]  # a fresh invocation (tests call main() many times)
    _ssh_log.setLevel(logging.WARNING)
    typer_completion.completion_init()  # Typer's bash/zsh/fish completion classes (add_completion=False above)
    # A CI cancel or `kill` sends SIGTERM: stop the way Ctrl-C does (staging cleaned, batch finished, exit 130).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    # --help in a CI log: click's plain text, not rich's boxes.
    app.rich_markup_mode = None if progress.plain_wanted(os.environ, progress.is_terminal(sys.stderr)) else "rich"
    try:
        # not standalone: click's usage errors come here (as exceptions) instead of its three lines of usage
        code = app(args=args, prog_name="kdeploy", complete_var=COMPLETE_VAR, standalone_mode=False)
    except SystemExit as exc:  # shell completion exits by itself
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except click_errors.NoArgsIsHelpError as exc:  # `kdeploy`, `kdeploy lock`: the help, as click gives it
        exc.show()
        return exc.exit_code
    except click_errors.UsageError as exc:
        say(usage_message(exc))
        return int(ExitCode.INVALID)
    except click_errors.ClickException as exc:
        say(exc.format_message())
        return exc.exit_code
    except KdeployError as exc:
        if _flags.debug:
            traceback.print_exc()
        say(str(exc))
        return int(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        say("interrupted")
        return 130
    except Exception as exc:
        if _flags.debug:
            traceback.print_exc()
        say(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the trace)")
        return int(ExitCode.INTERNAL)
    return code if isinstance(code, int) else 0
