"""What a kdeploy start costs (issue 39 item 17): `--help`, `--version`, `push -h`, TAB completion and `render all`
on a 200-host inventory, each a fresh process as the shell starts it, against the floors under them (the
interpreter, `import typer`, a bare Typer command).

    .venv/bin/python bench/startup.py [--runs 40] [--baseline DIR] [--out bench/results/startup.json]

Cases run round-robin (one of each, then again), so a burst of load on the shared machine hits every case alike;
each case's median and min wall time are reported, with the modules in `sys.modules` when it exits and which heavy
ones it imported. kdeploy runs as the `kdeploy` script next to this python (else `python -m kdeploy`), from a
temporary directory. `--baseline DIR` measures another checkout's kdeploy in the same rounds (e.g. a `git worktree`
of an older commit), its code first on PYTHONPATH as this checkout's is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOSTS = 200
# What a start should not import unless its command needs it (the CLI imports them inside its commands).
HEAVY = ("paramiko", "pydantic", "jinja2", "httpx", "ruamel.yaml", "rich", "importlib.metadata", "kdeploy.flows.fleet",
         "kdeploy.core.inventory", "kdeploy_lab.cli")
FLOOR_COMMAND = """
import typer
app = typer.Typer()
@app.command()
def hello(name: str = "x", count: int = 1) -> None:
    pass
app(["--name", "a"], standalone_mode=False)
"""
# The modules of a run: what is in sys.modules when it ends (kdeploy ends with os._exit; -X importtime would miss
# what importlib.import_module imports, such as a plugin).
SAY_MODULES = "import sys; sys.stderr.write('\\nMODULES ' + ' '.join(sys.modules) + '\\n')"
KDEPLOY_SAYING_MODULES = f"""
import os, sys
exit_ = os._exit
def say_and_exit(code):
    {SAY_MODULES}
    sys.stderr.flush()
    exit_(code)
os._exit = say_and_exit
sys.argv = ["kdeploy", *sys.argv[1:]]
from kdeploy.__main__ import main
main()
"""


def inventory(directory: Path) -> Path:
    """A 200-host kdeploy inventory (two groups, a service name and model per host) rendering the repo's template."""
    hosts = "".join(f"  gpu{i:03d}:\n    address: 10.2.{i // 250}.{i % 250 + 1}\n    service:\n"
                    f"      name: sglang-{i:03d}\n      sglang: {{model_path: /models/m{i % 4}, served_model_name: "
                    f"m{i % 4}}}\n" for i in range(HOSTS))
    even, odd = ([f"gpu{i:03d}" for i in range(start, HOSTS, 2)] for start in (0, 1))
    path = directory / "inventory.yaml"
    path.write_text(f"defaults:\n  service:\n    template: {REPO}/templates/sglang.service.j2\n"
                    f"    payload: {REPO}/kernels/kdtree\n    python: /opt/sglang/venv/bin/python\n"
                    f"    sglang: {{tp: 8, trust_remote_code: true}}\n"
                    f"groups:\n  kimi:\n    hosts: [{', '.join(even)}]\n  ddtree:\n    hosts: [{', '.join(odd)}]\n"
                    f"    service:\n      env: {{KDTREE_VERIFY: 'on'}}\nhosts:\n{hosts}")
    return path


def cases(inv: Path) -> dict[str, tuple[str | None, list[str], dict[str, str]]]:
    """Each case: python code to run (None: kdeploy), kdeploy's arguments, and the extra environment (completion's
    variables)."""

    def complete(words: str) -> tuple[None, list[str], dict[str, str]]:
        cword = len(words.split()) - (0 if words.endswith(" ") else 1)
        return None, [], {"_KDEPLOY_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}

    return {
        "python -c pass": ("pass", [], {}),
        "import typer": ("import typer", [], {}),
        "a bare Typer command": (FLOOR_COMMAND, [], {}),
        "kdeploy --version": (None, ["--version"], {}),
        "kdeploy --help": (None, ["--help"], {}),
        "kdeploy push -h": (None, ["push", "-h"], {}),
        "TAB: kdeploy pu": complete("kdeploy pu"),
        "TAB: kdeploy push --can": complete("kdeploy push --can"),
        f"TAB: kdeploy push -i INV{HOSTS} gpu01": complete(f"kdeploy push -i {inv} gpu01"),
        f"kdeploy render all -i INV{HOSTS}": (None, ["render", "all", "-i", str(inv)], {}),
    }


def command(code: str | None, args: list[str], *, say_modules: bool = False) -> list[str]:
    """The command line of a case: its code, or kdeploy as a shell starts it (or, saying its modules, in-line)."""
    if code is not None:
        return [sys.executable, "-c", f"{code}\n{SAY_MODULES}" if say_modules else code]
    if say_modules:
        return [sys.executable, "-c", KDEPLOY_SAYING_MODULES, *args]
    script = Path(sys.executable).with_name("kdeploy")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "kdeploy", *args]


def env_for(tree: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a run: ``tree``'s kdeploy and lab first on the path, plain output (no TTY here anyway)."""
    path = os.pathsep.join(p for p in (str(tree), str(tree / "lab"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str]:
    """Wall and CPU (user + sys) seconds of one run, and its stderr; it must succeed. CPU moves less than wall
    when other jobs share the cores."""
    started = time.perf_counter()
    with subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as child:
        assert child.stderr is not None
        err = child.stderr.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"{argv[-3:]}: exit {child.returncode}: {err[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime, err


def modules(argv: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    *_, err = run(argv, env, cwd)
    return err.rsplit("\nMODULES ", 1)[1].split()


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()


def measure(trees: dict[str, Path], inv: Path, runs: int) -> dict[str, dict[str, dict[str, object]]]:
    """Every case of every tree, ``runs`` rounds of one run each (after one untimed warm-up round)."""
    todo = [(label, tree, name, case) for label, tree in trees.items() for name, case in cases(inv).items()
            if label == "current" or case[0] is None]
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {(label, name): [] for label, _, name, _ in todo}
    for round_ in range(runs + 1):
        for label, tree, name, (code, args, extra) in todo:
            wall, cpu, _ = run(command(code, args), env_for(tree, extra), inv.parent)
            if round_:
                samples[label, name].append((wall, cpu))
    out: dict[str, dict[str, dict[str, object]]] = {label: {} for label in trees}
    for label, tree, name, (code, args, extra) in todo:
        found = modules(command(code, args, say_modules=True), env_for(tree, extra), inv.parent)
        walls, cpus = zip(*samples[label, name], strict=True)
        out[label][name] = {"median_s": round(statistics.median(walls), 4), "min_s": round(min(walls), 4),
                            "max_s": round(max(walls), 4), "cpu_median_s": round(statistics.median(cpus), 4),
                            "cpu_min_s": round(min(cpus), 4), "runs": len(walls), "modules": len(found),
                            "heavy": [m for m in HEAVY if m in found]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="timed rounds (default 40)")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in the same rounds")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/startup.json")
    args = parser.parse_args()
    trees = {"current": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(trees, inventory(Path(tmp)), args.runs)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
            "typer": version("typer"), "cpus": os.cpu_count(), "runs": args.runs, "hosts": HOSTS,
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.monotonic() - started, 1),
            "trees": {label: {"path": str(tree), "commit": git(tree, "rev-parse", "--short", "HEAD"),
                              "dirty": bool(git(tree, "status", "--porcelain", "--", "kdeploy", "lab"))}
                      for label, tree in trees.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")  # first: `| head` may end the table
    width = max(len(name) for name in results["current"])
    print(f"{'':<{width}}  " + "  ".join(f"{label:^36}" for label in trees))
    print(f"{'case':<{width}}  " + "  ".join(f"{'wall med/min s':>15} {'CPU med/min s':>13} {'mods':>5}"
                                            for _ in trees))
    for name in results["current"]:
        row = [f"{name:<{width}}"]
        for label in trees:
            got = results[label].get(name)
            row.append(f"{got['median_s']:>7.3f}/{got['min_s']:<7.3f} {got['cpu_median_s']:>6.3f}/"
                       f"{got['cpu_min_s']:<6.3f} {got['modules']:>5}" if got else f"{'-':>36}")
        print("  ".join(row))
    for name, got in results["current"].items():
        print(f"{name}: imports {', '.join(got['heavy']) or 'none of ' + ', '.join(HEAVY[:6])}")
    print(f"load average {meta['load_before']} -> {meta['load_after']}, {meta['seconds']} s")


if __name__ == "__main__":
    main()
