"""``kdeploy sandbox``: the lab's commands, plugged into kdeploy's CLI through the ``kdeploy.plugins`` entry point.

kdeploy gives these commands its conventions (``-h``, the global options, one-line errors); the lab's modules are
imported when a command runs (rich too), so ``kdeploy --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kdeploy.core.errors import InvalidInput

sandbox_app = typer.Typer(help="Local test hosts with real systemd, sshd and journald.")
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout; human text on stderr.")]
InstanceOpt = Annotated[int, typer.Option("--instance", min=0, max=9, help="Sandbox number (0-9), for several.")]


@sandbox_app.command("up")
def sandbox_up(hosts: Annotated[int, typer.Option("--hosts", min=1, max=200, help="How many hosts.")] = 2,
               inventory_out: Annotated[Path, typer.Option("--inventory-out", help="Where to write the inventory.")]
               = Path(".sandbox/inventory.yaml"), instance: InstanceOpt = 0,
               bastion: Annotated[bool, typer.Option("--bastion", help="Add a jump host; the others answer "
                                                     "only through it.")] = False,
               host_certs: Annotated[bool, typer.Option("--host-certs", help="Sign every host key with a "
                                                        "sandbox CA; known_hosts trusts only the CA.")] = False,
               router: Annotated[bool, typer.Option("--router", help="Also run the real SGLang router on one "
                                                    "extra host (docs/router.md).")] = False,
               pd: Annotated[bool, typer.Option("--pd", help="Prefill/decode: half the servers prefill, half decode, "
                                                "behind the real router in PD mode (implies --router).")] = False,
               light: Annotated[bool, typer.Option("--light", help="Scale runs: no SGLang venv in the hosts; the "
                                                   "inventory's service is the reference server at tp=1.")]
               = False,
               become_user: Annotated[str | None, typer.Option(
                   "--become-user", metavar="NAME", help="Root may not log in over SSH; NAME logs in and has "
                   "passwordless sudo; the inventory gets `user: NAME` and `become: true`.")] = None,
               nodes_per_server: Annotated[int, typer.Option(
                   "--nodes-per-server", metavar="K", min=1, max=200, help="Servers that span K hosts each (a "
                   "`servers:` section, tp K times a host's); --hosts must be a multiple of K.")] = 1) -> None:
    """Boot local hosts (systemd-nspawn) and write an inventory for them."""
    from rich.console import Console

    from kdeploy_lab import demo, sandbox, sandbox_router

    router = router or pd
    if pd and hosts // nodes_per_server < 2:
        raise InvalidInput(f"sandbox up: --pd needs two servers at least (one prefill, one decode): --hosts {hosts} "
                           f"with --nodes-per-server {nodes_per_server} make {hosts // nodes_per_server}")
    if hosts % nodes_per_server:  # before the boot: checked again on writing, by then the hosts would be wasted
        raise InvalidInput(f"sandbox up: --hosts {hosts} is not a multiple of --nodes-per-server {nodes_per_server}")
    box = sandbox.Sandbox(instance=instance, sglang=False if light else None)
    service = demo.light_service() if light else demo.demo_service()
    box.check_requirements()
    started = time.monotonic()
    if router and bastion:
        raise InvalidInput("sandbox up: --router with --bastion is not supported (the router's API would sit "
                           "behind the jump host)")
    booted = box.up(hosts + 1 if router else hosts, bastion=bastion, host_certs=host_certs, become_user=become_user)
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    if router:
        try:
            url = sandbox_router.install(box, booted[-1], pd=pd)
            sandbox_router.write_inventory(box, inventory_out, service, booted[-1], url, nodes_per_server, pd)
        except BaseException:
            box.down()
            raise
        err.print(f"router{' in PD mode' if pd else ''} on {booted[-1].name}: {url} (first push: "
                  "--router-add-missing)")
    else:
        box.write_inventory(inventory_out, service, nodes_per_server)
    err.print(f"{len(booted)} hosts up in {time.monotonic() - started:.1f}s: "
              + ", ".join(f"{h.name}={h.address}" for h in booted))
    if nodes_per_server > 1:
        nodes = [h.name for h in booted[:hosts]]
        err.print(f"servers of {nodes_per_server} nodes (the first is the head, rendezvous port "
                  f"{sandbox.RENDEZVOUS_PORT}): " + ", ".join(
                      f"s{i // nodes_per_server + 1}=" + "+".join(nodes[i:i + nodes_per_server])
                      for i in range(0, hosts, nodes_per_server)))
    err.print(f"inventory: {inventory_out}   ssh: ssh -F {box.ssh_config_path} {booted[0].name}")


@sandbox_app.command("status")
def sandbox_status(as_json: JsonOpt = False, instance: InstanceOpt = 0) -> None:
    """Show the sandbox hosts and whether each one's systemd is running."""
    from rich.console import Console
    from rich.table import Table

    from kdeploy_lab import sandbox

    rows = sandbox.Sandbox(instance=instance).status()
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="sandbox", title_justify="left")
    for col in ("name", "address", "running", "link", "system"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(c)) for c in ("name", "address", "running", "link", "system")))
    Console(stderr=True).print(table if rows else "no sandbox running")


@sandbox_app.command("reboot")
def sandbox_reboot(host: Annotated[str, typer.Argument(help="The sandbox host to reset, e.g. h1.")],
                   instance: InstanceOpt = 0) -> None:
    """Hard-reset one host (its processes are killed, it boots again; /etc, /srv and /opt are kept)."""
    from rich.console import Console

    from kdeploy_lab import sandbox

    box = sandbox.Sandbox(instance=instance)
    box.check_requirements()
    started = time.monotonic()
    box.reboot(host)
    Console(stderr=True).print(f"{host} rebooted in {time.monotonic() - started:.1f}s")


@sandbox_app.command("down")
def sandbox_down(instance: InstanceOpt = 0) -> None:
    """Stop every sandbox host and remove everything it created."""
    from rich.console import Console

    from kdeploy_lab import sandbox

    box = sandbox.Sandbox(instance=instance)
    box.check_requirements()
    box.down()
    Console(stderr=True).print("sandbox down")
