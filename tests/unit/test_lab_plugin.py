"""The lab is a distribution of its own (issue 30): the product's wheel holds no lab code, no kdeploy module imports
it, and `kdeploy sandbox` comes from its entry point, or says how to install it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import typer.main

from kdeploy.cli import app as cli

REPO = Path(__file__).resolve().parents[2]


def _wheel(source: Path, parts: tuple[str, ...], tmp_path: Path) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of ``parts`` of ``source`` (a stale build/ in the tree must not leak in)."""
    tree = tmp_path / "src"
    for part in parts:
        if (source / part).is_dir():
            shutil.copytree(source / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            tree.mkdir(exist_ok=True)
            shutil.copy(source / part, tree / part)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(tree)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def test_the_product_wheel_holds_no_lab_code(tmp_path: Path) -> None:
    names = _wheel(REPO, ("pyproject.toml", "README.md", "kdeploy"), tmp_path).namelist()
    packages = {n.split("/")[0] for n in names}
    assert packages == {"kdeploy", "kdeploy-0.1.0.dist-info"}, packages
    assert "kdeploy/cli/app.py" in names
    assert not [n for n in names if "lab" in Path(n).parts or "refserver" in n or "sandbox" in n]


def test_the_lab_wheel_plugs_sandbox_into_kdeploy(tmp_path: Path) -> None:
    wheel = _wheel(REPO / "lab", ("pyproject.toml", "kdeploy_lab"), tmp_path)
    assert {n.split("/")[0] for n in wheel.namelist()} == {"kdeploy_lab", "kdeploy_lab-0.1.0.dist-info"}
    assert "kdeploy_lab/refserver.py" in wheel.namelist()  # copied into the hosts' venvs by the sandbox
    entry = wheel.read("kdeploy_lab-0.1.0.dist-info/entry_points.txt").decode()
    assert f"[{cli.PLUGIN_GROUP}]\nsandbox = kdeploy_lab.cli:sandbox_app" in entry
    metadata = wheel.read("kdeploy_lab-0.1.0.dist-info/METADATA").decode()
    assert "Requires-Dist: kdeploy==0.1.0" in metadata


def test_no_product_module_imports_the_lab() -> None:
    for path in sorted((REPO / "kdeploy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "kdeploy_lab" or n.startswith("kdeploy.lab")], path


def test_sandbox_comes_from_the_installed_lab() -> None:
    root = typer.main.get_command(cli.app)
    assert "sandbox" in root.list_commands(typer.Context(root))  # listed (help, completion), loaded on demand
    sandbox = root.get_command(typer.Context(root), "sandbox")
    assert set(sandbox.commands) == {"up", "status", "reboot", "down"}
    assert {c.callback.__module__ for c in sandbox.commands.values()} == {"kdeploy_lab.cli"}


HINT = "pip install 'kdeploy[lab]' (from a source tree: pip install . ./lab)"


@pytest.fixture
def no_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    """kdeploy as installed without the lab: no plugin entry point."""
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])


@pytest.mark.parametrize("argv", [["sandbox"], ["sandbox", "up", "--hosts", "2"], ["sandbox", "-v", "status"]])
def test_without_the_lab_sandbox_says_how_to_install_it(argv: list[str], no_lab: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kdeploy: sandbox: local test hosts (the lab) is not installed: {HINT}\n"


@pytest.mark.parametrize("argv", [["sandbox", "-h"], ["sandbox", "--help"], ["sandbox", "down", "-h"]])
def test_without_the_lab_sandbox_help_is_help_with_the_install_hint(argv: list[str], no_lab: None,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Usage: kdeploy sandbox ")
    assert "Not installed: local test hosts (the lab)." in captured.out
    assert HINT in " ".join(captured.out.split())
    assert captured.err == ""


def test_an_installed_lab_outside_a_source_tree_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-editable lab run elsewhere would write an inventory whose template and payload are not there."""
    from kdeploy.core.errors import InvalidInput
    from kdeploy_lab import demo

    assert (demo.project_dir() / "templates" / "sglang.service.j2").is_file()  # this checkout (editable)
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "site-packages" / "kdeploy_lab" / "demo.py"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput, match=r"no kdeploy source tree here .* run the lab from a kdeploy checkout"):
        demo.demo_service()
