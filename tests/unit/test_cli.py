"""kdeploy/cli/app.py: the command line the lock and history record on every host."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import pytest
import typer

from kdeploy.cli import app as cli
from kdeploy.core.inventory import load
from kdeploy.core.report import HostResult, Phase, Report
from kdeploy.flows import fleet
from kdeploy.flows.options import Options, recorded_command
from kdeploy.flows.record import finish_command
from kdeploy.host import lock

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "inventory.yaml"
WRAPPER_ARGV = ["deploy_wrapper.py", "--vault-token", "s3cret"]


@pytest.fixture
def captured(monkeypatch) -> list[Options]:
    """The Options the CLI hands to fleet.push / fleet.rollback, which do nothing here."""
    seen: list[Options] = []

    def fake(inventory, target, opts, **kw) -> Report:
        seen.append(opts)
        return Report("push", [])

    monkeypatch.setattr(fleet, "push", fake)
    monkeypatch.setattr(fleet, "rollback", fake)
    monkeypatch.setattr("sys.argv", WRAPPER_ARGV)
    monkeypatch.chdir(REPO)                        # the default inventory.yaml is the example
    return seen


@pytest.mark.parametrize(("argv", "recorded"), [
    (["push", "all"], "kdeploy push all"),
    (["push", "ct200,kimi", "--lock-wait", "5", "--canary", "1", "--no-verify", "--batch", "25%", "--json",
      "--debug"], "kdeploy push ct200,kimi --json --no-verify --lock-wait 5.0 --canary 1 --batch 25%"),
    (["rollback", "ct200", "--to", "20261206T020000.000Z-1a2b3c4d", "-i", str(INVENTORY), "-l", "ct200 kimi"],
     f"kdeploy rollback ct200 --inventory {INVENTORY} --to 20261206T020000.000Z-1a2b3c4d --limit 'ct200 kimi'"),
])
def test_the_cli_records_its_own_command_not_sys_argv(captured, capsys, argv, recorded):
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert [o.command for o in captured] == [recorded]


def test_secret_looking_values_are_masked():
    app = typer.Typer()
    seen = []

    @app.command()
    def deploy_(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument()],
                api_token: Annotated[str | None, typer.Option("--api-token")] = None,
                db_password: Annotated[str | None, typer.Option("--db-password")] = None,
                ssh_key: Annotated[list[str] | None, typer.Option("--ssh-key")] = None,
                name: Annotated[str, typer.Option("--name")] = "default",
                force: Annotated[bool, typer.Option("--force")] = False) -> None:
        seen.append(cli.command_line(ctx))

    @app.command()
    def other() -> None:
        pass

    app(["deploy-", "A=1", "HF_TOKEN=hf_x", "b c", "--api-token", "t0k", "--db-password", "pw", "--ssh-key", "k1",
         "--ssh-key", "k2", "--name", "n n", "--force"], prog_name="kdeploy", standalone_mode=False)
    assert seen == ["kdeploy deploy- A=1 HF_TOKEN=*** 'b c' --api-token *** --db-password *** --ssh-key *** "
                    "--ssh-key *** --name 'n n' --force"]


def test_a_library_call_records_the_library_call_not_sys_argv(monkeypatch):
    """A wrapper script that calls the library API must not put its own argv (a token) on every host."""
    monkeypatch.setattr("sys.argv", WRAPPER_ARGV)
    host = load(INVENTORY).hosts["ct200"]
    command = recorded_command(Options(), "push")
    assert command == "kdeploy push (library)"
    assert recorded_command(Options(command="kdeploy push all"), "push") == "kdeploy push all"
    finish = finish_command(host, HostResult("ct200").finish("deployed"), time.monotonic(), [],
                                   command=command)
    script = lock.holder_script("/opt/kdeploy/svc", lock.holder_info(command))
    for text in (finish, script):
        assert '"command":"kdeploy push (library)"' in text.replace('\\"', '"').replace(": ", ":")
        assert "s3cret" not in text


def test_history_says_gated_only_after_a_gate_and_a_confirm():
    """``gated`` in a history line: the gate passed and the switch was confirmed, whatever the result says (the
    fault campaign found a host that passed and was confirmed, then ended ``failed`` when its router was down)."""
    from kdeploy.flows.record import gate_passed

    def host(*phases: tuple[str, bool]) -> HostResult:
        result = HostResult("ct200")
        for name, ok in phases:
            result.phases.append(Phase(name, ok, 0.1, ""))
        return result

    assert gate_passed(host(("activate", True), ("ready", True), ("workers", True), ("confirm", True),
                            ("admit", False)))
    assert gate_passed(host(("ready", False), ("rollback ready", True), ("rollback confirm", True)))
    assert not gate_passed(host(("activate", True), ("confirm", True)))  # --no-verify: confirmed, not gated
    assert not gate_passed(host(("ready", True), ("workers", True), ("confirm", False)))
    assert not gate_passed(host(("stage", True)))
