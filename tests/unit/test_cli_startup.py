"""A start of kdeploy imports what its command needs (issue 39 item 17): `--help`, `--version`, `COMMAND -h` and TAB
completion import none of the inventory's models, the flows, SSH, templates or rich; a command imports them when it
runs. The time this saves is measured in bench/startup.py, not here."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kdeploy.cli import progress

REPO = Path(__file__).resolve().parents[2]
# Imported only by the commands that use them (pydantic: the inventory's models; Typer itself imports it to parse
# an option's value, so only a start that parses none is free of it).
HEAVY = ("paramiko", "jinja2", "httpx", "ruamel.yaml", "rich", "kdeploy.flows", "kdeploy.core.inventory",
         "kdeploy.ssh", "kdeploy.host")


# kdeploy as its script starts it, saying the modules it holds as it ends (with os._exit: no atexit handler runs).
RUN = """
import os, sys
exit_ = os._exit
os._exit = lambda code: (print("\\n" + " ".join(sys.modules), file=sys.stderr, flush=True), exit_(code))
sys.argv = ["kdeploy", *sys.argv[1:]]
from kdeploy.__main__ import main
main()
"""


def _imported(args: list[str], **env: str) -> set[str]:
    """The modules a start of ``kdeploy ARGS`` imports, off a terminal (help in plain text, without rich)."""
    path = os.pathsep.join([str(REPO), str(REPO / "lab"), os.environ.get("PYTHONPATH", "")])
    plain = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    done = subprocess.run([sys.executable, "-c", RUN, *args], cwd=REPO, text=True, capture_output=True, timeout=60,
                          env={**plain, "PYTHONPATH": path, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stderr.splitlines()[-1].split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY))


def test_importing_the_cli_imports_no_heavy_module() -> None:
    code = ("import sys; import kdeploy.cli.app; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('paramiko', 'pydantic', 'jinja2', 'httpx', 'ruamel', 'rich', 'kdeploy_lab')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])})
    assert done.stdout.split() == []


@pytest.mark.parametrize("args", [["--help"], ["--version"]], ids=" ".join)
def test_help_and_version_import_no_heavy_module_nor_pydantic(args: list[str]) -> None:
    modules = _imported(args)
    assert _heavy(modules) == [] and "pydantic" not in modules


@pytest.mark.parametrize(("args", "env"), [
    (["push", "-h"], {}),
    (["lock", "release", "-h"], {}),
    ([], {"_KDEPLOY_COMPLETE": "complete_bash", "COMP_WORDS": "kdeploy pu", "COMP_CWORD": "1"}),
    ([], {"_KDEPLOY_COMPLETE": "complete_bash", "COMP_WORDS": "kdeploy push --can", "COMP_CWORD": "2"}),
], ids=["push -h", "lock release -h", "TAB command", "TAB option"])
def test_a_commands_help_and_completion_import_no_heavy_module(args: list[str], env: dict[str, str]) -> None:
    modules = _imported(args, **env)
    assert _heavy(modules) == []
    if args:  # a built-in command's word: the plugins are neither looked up nor loaded
        assert "kdeploy_lab.cli" not in modules


def test_a_plugin_is_loaded_when_named_and_its_command_imports_what_it_needs() -> None:
    modules = _imported(["sandbox", "-h"])
    assert "kdeploy_lab.cli" in modules and "kdeploy_lab.sandbox" not in modules and _heavy(modules) == []


def test_completing_a_target_loads_the_inventory() -> None:
    modules = _imported([], _KDEPLOY_COMPLETE="complete_bash", COMP_WORDS="kdeploy push ct2", COMP_CWORD="2")
    assert "kdeploy.core.inventory" in modules and "paramiko" not in modules


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1"}, {"FORCE_COLOR": ""}, {"TTY_COMPATIBLE": "1"},
                                 {"TTY_COMPATIBLE": "0", "FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "yes"}],
                         ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "no variable")
@pytest.mark.parametrize("tty", [True, False], ids=["tty", "pipe"])
def test_is_terminal_decides_as_rich_does(env: dict[str, str], tty: bool) -> None:
    """The plain-or-rich choice of help is made without rich: it must be the choice rich's Console makes."""
    if tty:
        main, other = os.openpty()
        stream = open(other, "w")  # noqa: SIM115  # closed below with its pair
    else:
        stream = io.StringIO()
    try:
        assert progress.is_terminal(stream, env) == Console(file=stream, _environ=env).is_terminal
    finally:
        if tty:
            stream.close()
            os.close(main)
