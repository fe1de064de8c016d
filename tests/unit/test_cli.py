"""kdeploy/cli/app.py: the command line the lock and history record on every host."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated

import pytest
import typer

from kdeploy.cli import app as cli
from kdeploy.core.inventory import load
from kdeploy.core.report import HostResult, Report
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


def test_history_says_gated_only_for_the_release_a_confirm_kept_after_its_gate():
    """``gated`` in a history line: the confirm that kept the release that runs came after its gate, whatever the
    result says since (the fault campaign found a host that passed and was confirmed, then ended ``failed`` when
    its router was down). Not for a confirm without a gate (--no-verify), nor once the host went elsewhere."""
    from kdeploy.core import provisional
    from kdeploy.core.gatespec import gate_spec
    from kdeploy.core.step import RunResult
    from kdeploy.flows.switch import Node, confirm

    class Confirming:
        def ask(self, step, stdin=None):
            return step.parse(RunResult(0, "CONFIRMED RECORDED\n", ""))

    host = load(INVENTORY).hosts["ct200"]
    spec = gate_spec(host.service, None)

    def line(result: HostResult, gated: bool) -> dict:
        node = Node(Confirming(), host, result, provisional.new_pending("R1", "R2", 60), spec, spec)  # type: ignore[arg-type]
        confirm(node, node.pending, gated=gated)
        text = finish_command(host, result, time.monotonic(), [], command="kdeploy push all")
        return json.loads(re.search(r"'(\{.*\})'", text)[1])

    assert line(HostResult("ct200", release="R2").finish("failed", "router down"), True)["gated"] == "R2"
    assert line(HostResult("ct200", release="R2").finish("deployed"), False)["gated"] is None  # --no-verify
    assert line(HostResult("ct200", release="R1").finish("rolled_back", "canary"), True)["gated"] is None
