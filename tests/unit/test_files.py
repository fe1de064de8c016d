"""kdeploy/core/files.py and its users: no input hangs kdeploy, fills its memory or reaches an internal error.

Each case runs the CLI in this process and asserts exit 2, exactly one ``kdeploy: <reason>`` line on stderr and
that it ended quickly: a group loop in every inventory source, unreadable paths (a mode-000 directory, read as
a user it refuses), documents nested past the bound, and files or program output without an end.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.core import files
from kdeploy.core.errors import InvalidInput

REPO = Path(__file__).resolve().parents[2]
SERVICE = f"""\
service:
  name: svc
  template: {REPO}/templates/sglang.service.j2
  payload: {REPO}/tests/data/testplugin
  python: /usr/bin/python3
  sglang: {{model_path: /models/m}}
"""
QUICK = 10.0  # seconds any of these may take (each is refused in well under one)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """``kdeploy ARGV`` exits 2 within QUICK seconds with one stderr line matching ``message``."""
    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < QUICK
    err = capsys.readouterr().err
    assert re.fullmatch(rf"kdeploy: {message}\n", err), err


def service(folder: Path) -> Path:
    path = folder / "service.yaml"
    path.write_text(SERVICE)
    return path


# 1. A group that is its own descendant: one check, at the line that closes the loop, for every source.

LIST_LOOP = '{"a": {"children": ["b"]}, "b": {"children": ["a"], "hosts": ["h1"]}}'


@pytest.mark.parametrize(("name", "text", "message"), [
    ("c.ini", "[a:children]\nb\n[b:children]\na\n[b]\nh1\n",
     r"c\.ini:4: group 'a' is its own descendant \(a > b > a\)"),
    ("self.ini", "[a:children]\na\n[a]\nh1\n", r"self\.ini:2: group 'a' is its own descendant \(a > a\)"),
    ("late.ini", "[a:children]\nb\n[c]\nh1\n[b:children]\nc\n[c:children]\na\n",
     r"late\.ini:8: group 'a' is its own descendant \(a > b > c > a\)"),
    ("all.ini", "[a:children]\nall\n[a]\nh1\n", r"all\.ini:2: group 'all' is its own descendant \(all > a > all\)"),
    ("c.yaml", "a:\n  children:\n    b:\n      children:\n        a:\n      hosts:\n        h1:\n",
     r"c\.yaml:5: group 'a' is its own descendant \(a > b > a\)"),
    ("c.json", LIST_LOOP, r"c\.json:1: group 'a' is its own descendant \(a > b > a\)"),
])
def test_a_group_loop_is_one_line_with_its_line(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    refused(capsys, ["render", "-i", str(tmp_path / name), "--service", str(service(tmp_path))], f".*{message}")


def test_a_group_loop_from_a_script_or_in_a_directory(tmp_path, capsys):
    script = tmp_path / "inv" / "fleet.py"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho '{LIST_LOOP}'\n")
    script.chmod(0o755)
    svc = str(service(tmp_path))
    refused(capsys, ["render", "-i", str(script), "--service", svc],
            r".*fleet\.py \(--list output\): group 'a' is its own descendant \(a > b > a\)")
    (tmp_path / "inv" / "more.ini").write_text("[b]\nh2\n")
    refused(capsys, ["render", "-i", str(script.parent), "--service", svc],
            r".*fleet\.py \(--list output\): group 'a' is its own descendant \(a > b > a\)")


def test_long_chains_and_shared_children_are_walked_once(tmp_path):
    """A chain of 1500 groups (past Python's recursion limit: no recursion to overflow) and 40 layers of two
    groups each the child of both groups above it (2^40 paths down, one walk each)."""
    chain = "".join(f"[g{i}:children]\ng{i + 1}\n" for i in range(1500)) + "[g1500]\nh1\n"
    diamond = "".join(f"[l{i}{s}:children]\nl{i + 1}a\nl{i + 1}b\n" for i in range(40) for s in "ab")
    diamond += "[l40a]\nh1\n[l40b]\nh2\n"
    for name, text in (("chain.ini", chain), ("diamond.ini", diamond)):
        (tmp_path / name).write_text(text)
        start = time.monotonic()
        assert cli.main(["render", "-i", str(tmp_path / name), "--service", str(service(tmp_path))]) == 0
        assert time.monotonic() - start < QUICK


# 2. Unreadable paths: one line naming the path and the reason, not `internal error: PermissionError`.

@pytest.fixture
def locked() -> Iterator[Path]:
    """A directory with a mode-000 directory ``locked`` in it (an inventory, a service file, a template, a
    group_vars directory there), read by a user that mode 000 refuses: root reads anything, so the test runs
    as nobody (seteuid) while it is root. The current directory is the top one."""
    top = Path(tempfile.mkdtemp(prefix="kdeploy-locked-"))
    top.chmod(0o755)
    inner = top / "locked"
    inner.mkdir()
    (top / "hosts.ini").write_text("[gpu]\ng1\n")
    (top / "service.yaml").write_text(SERVICE)
    (top / "templated.yaml").write_text(SERVICE.replace(f"{REPO}/templates/sglang.service.j2", "locked/unit.j2"))
    (top / "gv" / "group_vars").mkdir(parents=True)
    (top / "gv" / "hosts.ini").write_text("[gpu]\ng1\n")
    (top / "gv" / "group_vars" / "gpu").symlink_to(inner)
    for name in ("hosts.ini", "service.yaml", "unit.j2", "retry"):
        (inner / name).write_text((top / "hosts.ini").read_text())
    shutil.copy(REPO / "inventory.yaml", inner / "inventory.yaml")
    inner.chmod(0)
    cwd = Path.cwd()
    os.chdir(top)
    try:
        with _as_nobody():
            yield top
    finally:
        os.chdir(cwd)
        inner.chmod(0o755)
        shutil.rmtree(top)


@contextlib.contextmanager
def _as_nobody() -> Iterator[None]:
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.mark.parametrize(("argv", "message"), [
    (["render", "-i", "locked/inventory.yaml"], "locked/inventory.yaml: cannot read inventory: Permission denied"),
    (["render", "-i", "locked/hosts.ini", "--service", "service.yaml"],
     "locked/hosts.ini: cannot read inventory: Permission denied"),
    (["render", "-i", "locked", "--service", "service.yaml"],
     "locked: cannot read the inventory directory: Permission denied"),
    (["render", "-i", "hosts.ini", "--service", "locked/service.yaml"],
     "locked/service.yaml: cannot read service file: Permission denied"),
    (["render", "-i", str(REPO / "inventory.yaml"), "--limit", "@locked/retry"],
     "locked/retry: cannot read --limit file: Permission denied"),
    (["render", "-i", "hosts.ini", "--service", "templated.yaml"],
     "locked/unit.j2: cannot read unit template: Permission denied"),
])
def test_an_unreadable_path_is_one_line_naming_it(locked, capsys, argv, message):
    refused(capsys, argv, message)


def test_an_unreadable_group_vars_directory(locked, capsys):
    refused(capsys, ["render", "-i", "gv/hosts.ini", "--service", "service.yaml"],
            "gv/group_vars/gpu: cannot read variables directory: Permission denied")


def test_check_and_plan_with_an_unreadable_template_or_ssh_config(locked, capsys):
    assert cli.main(["check", "-i", "hosts.ini", "--service", "templated.yaml"]) == 2
    err = capsys.readouterr().err
    assert "locked/unit.j2: cannot read unit template: Permission denied" in err and "internal error" not in err
    assert cli.main(["plan", "all", "-i", "hosts.ini", "--service", "service.yaml", "--ssh-config",
                     "locked/config"]) == 2
    err = capsys.readouterr().err
    assert "locked/config: cannot read ssh_config: Permission denied" in err and "internal error" not in err


def test_every_read_names_the_path_and_its_reason(tmp_path):
    with pytest.raises(InvalidInput, match=r"nope: inventory not found$"):
        files.read_text(tmp_path / "nope", "inventory")
    with pytest.raises(InvalidInput, match=r": cannot read inventory: it is a directory$"):
        files.read_text(tmp_path, "inventory")
    (tmp_path / "bad").write_bytes(b"a\n\xff\n")
    with pytest.raises(InvalidInput, match=r"bad:2: inventory is not UTF-8 text"):
        files.read_text(tmp_path / "bad", "inventory")


# 3. Nesting: bounded where documents are parsed (YAML, JSON files, a program's JSON), named by file and line.

@pytest.mark.parametrize(("name", "text", "message"), [
    ("d.yaml", "defaults: " + "[" * 20000 + "]" * 20000 + "\n",
     r"d\.yaml:1: nested deeper than 64 levels"),
    ("d65.yaml", "defaults: " + "[" * 64 + "]" * 64 + "\n", r"d65\.yaml:1: nested deeper than 64 levels"),
    ("d.json", '{"g": {"hosts": ["h"], "vars": {"v": ' + "[" * 20000 + "]" * 20000 + "}}}",
     r"d\.json:1: nested deeper than 64 levels"),
    ("block.yaml", "defaults:\n" + "".join(f"{'  ' * (i + 1)}k{i}:\n" for i in range(70)),
     r"block\.yaml:65: nested deeper than 64 levels"),
])
def test_deep_nesting_is_refused_by_name(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    argv = ["render", "-i", str(tmp_path / name)] + (["--service", str(service(tmp_path))] if "json" in name else [])
    refused(capsys, argv, f".*{message}")


def test_deep_json_from_a_script_and_an_alias_bomb(tmp_path, capsys):
    script = tmp_path / "deep.py"
    script.write_text("#!/bin/sh\npython3 -c 'print(\"[\" * 20000 + \"]\" * 20000)'\n")
    script.chmod(0o755)
    refused(capsys, ["render", "-i", str(script), "--service", str(service(tmp_path))],
            r".*deep\.py --list \(inventory script\): nested deeper than 64 levels")
    lines = ["defaults:", "  l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "lol.yaml").write_text("\n".join([*lines, "hosts: {h: {address: x}}", ""]))
    refused(capsys, ["render", "-i", str(tmp_path / "lol.yaml")],
            r".*lol\.yaml:1: more than 4194304 values \(YAML aliases counted each time they are used\)")


def test_64_levels_are_read():
    assert files.parsed(lambda: [[[]] * 3] * 2, "x") == [[[]] * 3] * 2
    deep: list = []
    for _ in range(63):
        deep = [deep]
    assert files.parsed(lambda: deep, "x") is deep
    with pytest.raises(InvalidInput, match=r"^x: nested deeper than 64 levels$"):
        files.parsed(lambda: [deep], "x")


# 4. Reads have bounds: size, time, and files with no end (devices, FIFOs).

def test_dev_zero_is_refused_by_size(capsys):
    refused(capsys, ["render", "-i", "/dev/zero"], r"/dev/zero: inventory is larger than 64 MiB \(kdeploy's bound\)")
    refused(capsys, ["render", "-i", str(REPO / "inventory.yaml"), "--limit", "@/dev/zero"],
            r"/dev/zero: --limit file is larger than 1 MiB \(kdeploy's bound\)")


def test_a_fifo_without_a_writer_does_not_hang(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    refused(capsys, ["render", "-i", str(tmp_path / "fifo")], r".*fifo: hosts: no hosts defined")


def test_a_fifo_that_never_ends_is_refused_within_its_bound(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "WAIT", 0.5)
    keep = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that the writer's open does not wait for a reader
    writer = os.open(fifo, os.O_WRONLY)  # a writer that never writes nor closes
    try:
        with pytest.raises(InvalidInput, match=r"fifo: inventory did not end within 0\.5 s"):
            files.read_text(fifo, "inventory")
    finally:
        os.close(writer)
        os.close(keep)


def test_a_pipe_gives_its_content(tmp_path):
    read, write = os.pipe()
    os.write(write, b"[gpu]\ng1\n")
    os.close(write)
    assert files.read_text(Path(f"/dev/fd/{read}"), "inventory") == "[gpu]\ng1\n"
    os.close(read)


def test_a_script_that_prints_without_end_is_killed(tmp_path, capsys):
    script = tmp_path / "yes.sh"
    script.write_text("#!/bin/sh\nexec yes\n")
    script.chmod(0o755)
    refused(capsys, ["render", "-i", str(script), "--service", str(service(tmp_path))],
            r".*yes\.sh --list \(inventory script\): printed more than 64 MiB \(killed; kdeploy's bound\)")
