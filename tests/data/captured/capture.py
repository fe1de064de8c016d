"""Capture REAL systemctl / journalctl output for the parser tests in tests/unit/test_systemd.py.

The unit tests only read the files this writes; they never need a sandbox. Re-run (as root) after a
systemd upgrade or a change to the commands kdeploy sends, then review the diff of tests/data/captured/:

    sudo .venv/bin/python tests/data/captured/capture.py

It boots one sandbox host (instance 7, so it never meets the session fleet 0/1 or the integration
tests' 8/9), installs a few small units, drives them into the states the gate must recognise, and
saves what kdeploy's own command builders (``systemd.show_command`` / ``systemd.journal_command``)
print for them. The host is always torn down.

Files written:

* ``show_running.txt``      ``kdcap-run``: active/running (Restart=on-failure), after its children logged
* ``show_failed.txt``       ``kdcap-fail``: ``exit 3``, no Restart= -> failed / exit-code
* ``show_auto_restart.txt`` ``kdcap-loop``: ``exit 1``, Restart=on-failure RestartSec=30, seen in auto-restart
* ``show_restart_limit.txt`` ``kdcap-burst``: restarts quickly until the start limit -> failed, NRestarts=3
                            (systemd 252 keeps Result=exit-code here, not start-limit-hit)
* ``show_not_found.txt``    ``kdcap-nope``: no such unit
* ``restart_followed.txt``  ``systemd.follow_command`` on ``kdcap-slow`` once its stop and start were queued
                            (its run takes 2 s to stop after TERM):
                            saw it deactivating, then its new run
* ``restart_timed_out.txt`` the same with a 1 s timeout: the wait gives up while the old run still stops
* ``journal_running.jsonl`` journal of kdcap-run's invocation (``journal_command(id)``)
* ``journal_running_grep.jsonl`` the same through ``journal_command(id, grep=[markers..., RANK_LINE])``
* ``journal_failed.jsonl``  journal of kdcap-fail's invocation
* ``environment.txt``       ``systemctl show kdcap-env -p Environment --value``; its unit's Environment= lines
                            were rendered by ``render.quote_env_assignment`` from ``tricky.json``'s ``env``
* ``journal_env.jsonl``     kdcap-env's output: the argv (ExecStart rendered by ``render.quote_exec_arg``)
                            and environment its process really received, as one JSON line
* ``tricky.json``           the inputs: ``env`` and ``argv``
* ``units/*.service``       the unit files as installed
* ``state_pending.txt``     ``state.state_script(with_history=True)`` of a service pushed twice (the test plugin),
                            then switched to a third release by a controller that never confirmed it
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from kdeploy.cli import app as cli  # noqa: E402
from kdeploy.core import inventory, provisional, state, systemd  # noqa: E402
from kdeploy.core.render import quote_env_assignment, quote_exec_arg  # noqa: E402
from kdeploy.core.report import HostResult  # noqa: E402
from kdeploy.flows import fleet, push, session, switch  # noqa: E402
from kdeploy.flows.options import Options  # noqa: E402
from kdeploy_lab.demo import demo_service, project_dir  # noqa: E402
from kdeploy_lab.sandbox import Sandbox  # noqa: E402

DEFAULT_MARKERS = ("[kdtree] defrag Tier-0", "[kdtree] installed verify override")

INSTANCE = 7
HOST = "h1"
RANK_LINE = "Load weight end."  # kdeploy.host.gate.RANK_LINE (not imported: gate pulls in httpx/paramiko)

TRICKY_ENV = {
    "SPACES": "a b  c ",
    "DQUOTE": 'say "hi"',
    "SQUOTE": "it's",
    "BACKSLASH": "C:\\dir\\new",
    "TRAILING_BACKSLASH": "x\\",
    "PERCENT": "100% %n %%",
    "DOLLAR": "$HOME ${USER} $$",
    "EQUALS": "a=b=c",
    "UNICODE": "héllo ✓ 日本",
    "SEMICOLON": "a;b",
    "HASH": "#not a comment",
    "EMPTY": "",
}
TRICKY_ARGV = ["plain", "with space", 'dq"x', "sq'x", "back\\slash", "50%", "%n", "$HOME", "${X}", "$$",
               ";", "a=b", "héllo ✓", "--flag=va lue", "", "end\\"]

# Four "TP workers" (child shells, each with its own pid) log a rank line and the default markers, then
# the main process sleeps: the shape of SGLang's output that the gate's marker check reads.
# One line: quote_exec_arg has no escape for a newline (the inventory never lets one through).
RUN_SCRIPT = "; ".join([
    "echo hello",
    'echo "[x TP3] Load weight end."',
    "for r in 0 1 2 3; do sh -c 'echo \"[2025-01-01 00:00:00 TP$1] Load weight end. type=X pid=$$\"; "
    + "; ".join(f"echo \"{m} pid=$$\"" for m in DEFAULT_MARKERS) + "' worker $r & done",
    "wait",
    "exec sleep 1000",
])
ENV_PROGRAM = ("import json, os, sys; "
               "print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
               + repr(sorted(TRICKY_ENV)) + "}}, ensure_ascii=True))")


def exec_start(argv: list[str]) -> str:
    return " ".join(quote_exec_arg(a) for a in argv)


def unit(body: str) -> str:
    return f"[Unit]\nDescription=kdeploy capture\n\n[Service]\n{body}\n"


UNITS = {
    "kdcap-run.service": unit(f"Type=simple\nExecStart={exec_start(['/bin/sh', '-c', RUN_SCRIPT])}\n"
                              "Restart=on-failure"),
    "kdcap-fail.service": unit("Type=simple\nExecStart=/bin/sh -c 'echo bye; exit 3'"),
    "kdcap-loop.service": unit("Type=simple\nExecStart=/bin/sh -c 'echo looping; exit 1'\n"
                               "Restart=on-failure\nRestartSec=30"),
    "kdcap-burst.service": ("[Unit]\nDescription=kdeploy capture\nStartLimitIntervalSec=60\nStartLimitBurst=3\n\n"
                            "[Service]\nType=simple\nExecStart=/bin/sh -c 'exit 1'\nRestart=on-failure\n"
                            "RestartSec=100ms\n"),
    "kdcap-slow.service": unit("Type=simple\nExecStart=/bin/sh -c 'trap \"sleep 2; exit 0\" TERM; "
                               "while :; do sleep 0.1; done'"),
    "kdcap-env.service": unit(
        "Type=oneshot\nRemainAfterExit=yes\n"
        + "".join(f"Environment={quote_env_assignment(k, v)}\n" for k, v in TRICKY_ENV.items())
        + f"ExecStart={exec_start(['/usr/bin/python3', '-c', ENV_PROGRAM, *TRICKY_ARGV])}"),
}


def main() -> None:
    box = Sandbox(instance=INSTANCE)
    try:
        box.up(1)
        capture(box)
        capture_state(box)
    finally:
        box.down()


def capture_state(box: Sandbox) -> None:
    """Two confirmed pushes, then a third switched (armed for an hour) and left unconfirmed."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    payload = tmp / "payload"
    shutil.copytree(HERE.parent / "testplugin", payload)
    service = demo_service(project_dir(), sglang=False, name="kdcap", payload=str(payload), env={},
                           gate={"workers": 8, "poll_interval": 0.25, "markers": ["[kdeploy-testplugin] loaded"],
                                 "timeout": 60})
    path = tmp / "inventory.yaml"
    box.write_inventory(path, service)
    for rev in ("1", "2"):
        (payload / "rev.txt").write_text(rev)
        assert cli.main(["push", HOST, "-i", str(path)]) == 0
    (payload / "rev.txt").write_text("3")
    inv = inventory.load(path)
    host = inv.hosts[HOST]
    step = push.HostPush(inv, host, fleet.prepare(inv, [HOST])[HOST], Options(), HostResult(HOST),
                           threading.Event())
    step.prepare()
    assert step.state is not None and step.at.staged
    pending = provisional.new_pending(step.state.confirmed, step.at.staged, 3600)
    with session.connect(inv, host, step.result, Options().reach) as remote:
        node = switch.Node(remote, host, step.result, pending, step.local.spec, step.local.spec)
        switch.switch(node, step.at.staged, step.at.decision.install_unit, pending)
    out = box.exec(HOST, ["sh", "-c", state.state_script(host, with_history=True)]).stdout
    (HERE / "state_pending.txt").write_text(out)
    print(f"wrote state_pending.txt ({len(out)} chars)")


def capture(box: Sandbox) -> None:
    def sh(command: str, check: bool = True) -> str:
        return box.exec(HOST, ["/bin/sh", "-c", command], check=check).stdout

    def wait(what: str, predicate, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.1)

    def show(name: str) -> str:
        return sh(systemd.show_command(name))

    def state(name: str) -> systemd.UnitState:
        return systemd.parse_show(show(name))

    def restart(unit: str, timeout: float) -> str:
        """What an activation queues (the stop, then the restart), then the restart phase's follow."""
        old = systemd.parse_old_run(sh(f"{systemd.stop_command(unit)}; {systemd.restart_command(unit)}"))
        return sh(systemd.follow_command(unit, old, timeout, 0.1))

    def save(name: str, text: str) -> None:
        path = HERE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(HERE)} ({len(text)} chars)")

    for name, text in UNITS.items():
        box.exec(HOST, ["/bin/sh", "-c", f"cat > /etc/systemd/system/{name}"], input=text)
        save(f"units/{name}", text)
    sh("systemctl daemon-reload")
    sh("systemctl start kdcap-run kdcap-env kdcap-slow; "
       "systemctl start --no-block kdcap-fail kdcap-loop kdcap-burst")

    run = wait("kdcap-run running", lambda: (s := state("kdcap-run.service")).running and s)
    journal = systemd.journal_command(run.invocation)
    wait("kdcap-run's workers", lambda: sh(journal).count(RANK_LINE) >= 5 and sh(journal))
    save("show_running.txt", show("kdcap-run.service"))
    save("journal_running.jsonl", sh(journal))
    save("journal_running_grep.jsonl",
         sh(systemd.journal_command(run.invocation, grep=[*DEFAULT_MARKERS, RANK_LINE])))

    fail = wait("kdcap-fail failed", lambda: (s := state("kdcap-fail.service")).active == "failed" and s)
    save("show_failed.txt", show("kdcap-fail.service"))
    wait("kdcap-fail's journal", lambda: "bye" in sh(systemd.journal_command(fail.invocation)))
    save("journal_failed.jsonl", sh(systemd.journal_command(fail.invocation)))

    wait("kdcap-loop in auto-restart", lambda: state("kdcap-loop.service").sub == "auto-restart")
    save("show_auto_restart.txt", show("kdcap-loop.service"))

    wait("kdcap-burst start limit", lambda: (s := state("kdcap-burst.service")).active == "failed" and s.n_restarts)
    save("show_restart_limit.txt", show("kdcap-burst.service"))

    save("show_not_found.txt", show("kdcap-nope.service"))

    save("restart_followed.txt", restart("kdcap-slow.service", 30))
    wait("kdcap-slow running", lambda: state("kdcap-slow.service").running)
    save("restart_timed_out.txt", restart("kdcap-slow.service", 1))

    env = state("kdcap-env.service")
    save("environment.txt", sh("systemctl show kdcap-env.service -p Environment --value"))
    wait("kdcap-env's output", lambda: "argv" in sh(systemd.journal_command(env.invocation)))
    save("journal_env.jsonl", sh(systemd.journal_command(env.invocation)))
    save("tricky.json", json.dumps({"env": TRICKY_ENV, "argv": TRICKY_ARGV}, indent=2, ensure_ascii=False) + "\n")
    print("units:", shlex.join(UNITS))


if __name__ == "__main__":
    main()
