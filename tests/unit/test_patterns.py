"""kdeploy/core/patterns.py: host patterns in Ansible's language.

The parity test takes ansible-core's own InventoryManager (a dev dependency: ``get_hosts`` is what
``ansible PATTERN --list-hosts`` and ``--limit`` evaluate) as the reference on an INI inventory that kdeploy
reads too; the other tests pin kdeploy's own rules (typos, ranges, order, completion).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.core import inventory, patterns
from kdeploy.core.errors import InvalidInput
from tests.unit.test_ansible import SERVICE  # kdeploy's part of an Ansible fleet

HOSTS_INI = """\
bastion
[gpu]
gpu[01:16]
[a100]
gpu[01:08]
[h100]
gpu[09:16]
[canary]
gpu05
[edge]
edge-a.example.com
edge-b.example.com
[prod:children]
gpu
edge
[empty]
"""
# (TARGET, --limit): what Ansible selects, kdeploy selects
PARITY = [
    ("all", None), ("*", None), ("al*", None), ("gpu", None), ("prod", None), ("gpu0*", None),
    ("gpu0*:!gpu03", None), ("gpu0*,!gpu03", None), ("a100:h100", None), ("a100,h100", None),
    ("gpu:&a100", None), ("gpu:!a100", None), ("prod:!gpu:!edge-b.example.com", None), ("!a100", None),
    ("&h100", None), ("gpu1?", None), ("~gpu1[0-2]", None), ("~edge-.*", None), ("edge-*.example.com", None),
    ("gpu[0]", None), ("gpu[-1]", None), ("h100[1:3]", None), ("a100[6:]", None), ("gpu05", None),
    ("gpu:!a100:&canary", None), ("canary:h100", None), ("*.example.com", None), ("ungrouped", None),
    ("gpu:!gpu1*", None), ("empty", None), ("gpu:&edge", None),
    ("all", "gpu0*:!gpu03"), ("gpu", "h100"), ("prod", "edge,bastion"), ("gpu1*", "!gpu12"), ("a100", "canary"),
    ("gpu, a100 ,h100", None), ("gpu01 gpu02", None),
]
# Every pair of these parts under every operator, as TARGET and as --limit of `all`.
ATOMS = ["gpu", "a100", "h100", "canary", "edge", "prod", "bastion", "gpu0*", "gpu1?", "~gpu1[0-2]",
         "edge-a.example.com", "*.example.com", "h100[1:3]", "gpu[0]", "empty"]
PAIRS = [(f"{a}{op}{b}", None) for a in ATOMS for b in ATOMS for op in (":", ":&", ":!", ",!")]
PAIRS += [("all", f"{a}:!{b}") for a in ATOMS for b in ATOMS]


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Path]:
    path, service = tmp_path / "hosts.ini", tmp_path / "service.yaml"
    path.write_text(HOSTS_INI)
    service.write_text(SERVICE)
    return path, service


def ansible_selects(path: Path, cases: list[tuple[str, str | None]]) -> list[list[str]]:
    """ansible-core's InventoryManager.get_hosts for each (pattern, limit), as ``ansible -l`` evaluates them."""
    home = path.parent / ".ansible"
    home.mkdir(exist_ok=True)
    (home / "ansible.cfg").write_text("")
    code = ("import json, sys\nfrom ansible.inventory.manager import InventoryManager\n"
            "from ansible.parsing.dataloader import DataLoader\n"
            "m = InventoryManager(loader=DataLoader(), sources=[sys.argv[1]])\nout = []\n"
            "for pattern, limit in json.loads(sys.argv[2]):\n"
            "    m.subset(limit)\n    out.append([h.name for h in m.get_hosts(pattern)])\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, "ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
           "ANSIBLE_CONFIG": str(home / "ansible.cfg")}
    done = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(cases)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_patterns_select_what_ansible_selects(fleet):
    path, service = fleet
    loaded = inventory.load(path, service)
    reference = ansible_selects(path, PARITY + PAIRS)
    for (pattern, limit), expected in zip(PARITY + PAIRS, reference, strict=True):
        got = loaded.subset(limit).resolve(pattern)
        assert set(got) == set(expected), (pattern, limit)
        assert got == [h for h in loaded.hosts if h in set(expected)], (pattern, limit)  # inventory order
    assert sum(map(len, reference)) > 2000 and sum(not r for r in reference) > 50  # full and empty answers
    # The reference is what the `ansible` command itself lists.
    home = path.parent / ".ansible"
    env = {**os.environ, "ANSIBLE_HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
           "ANSIBLE_CONFIG": str(home / "ansible.cfg")}
    listed = subprocess.run([str(Path(sys.executable).with_name("ansible")), "all", "-i", str(path), "--list-hosts",
                             "--limit", "gpu0*:!gpu03"], capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[2:] == reference[PARITY.index(("all", "gpu0*:!gpu03"))]


HOSTS = [f"gpu{n:02d}" for n in range(1, 9)] + ["web1", "web2"]
GROUPS = {"gpu": HOSTS[:8], "a100": HOSTS[:4], "web": ["web2", "web1"], "empty": []}


@pytest.mark.parametrize(("pattern", "expected"), [
    ("gpu0*:!gpu03", ["gpu01", "gpu02", "gpu04", "gpu05", "gpu06", "gpu07", "gpu08"]),
    ("web,gpu01", ["gpu01", "web1", "web2"]),  # inventory order, not the pattern's
    ("!a100:web1", ["web1"]),  # ! applies after every union, whatever the order written
    ("gpu:!a100:&~gpu0[6-9]", ["gpu06", "gpu07", "gpu08"]),
    ("gpu0[2:4]", ["gpu02", "gpu03", "gpu04"]),  # 'gpu0' names nothing: the inventory's host range (Ansible: none)
    ("a100:!gpu0[1:3]", ["gpu04"]),
    ("a100[1:2]", ["gpu02", "gpu03"]),  # a group: Ansible's subscript, positions 1 to 2
    ("web[0]", ["web1"]),  # positions count in inventory order
    ("web1:web2", ["web1", "web2"]),
    ("empty", []),
    ("a100:&web", []),
    ("all:!all", []),
])
def test_select(pattern, expected):
    assert patterns.Selector(HOSTS, GROUPS).select(pattern) == expected


@pytest.mark.parametrize(("pattern", "message"), [
    ("gpu3", r"^target 'gpu3': no such host or group \(did you mean 'gpu03'\?\)$"),
    ("all:!gpu033", r"^target 'gpu033': no such host or group \(did you mean 'gpu03'\?\)$"),
    ("gpx0*", r"^target 'gpx0\*': no such host or group"),
    ("gpx[09:12]", r"^target 'gpx\[09:12\]': no such host or group"),
    ("~gpu(", r"^target '~gpu\(': not a valid regular expression"),
    ("a100[7]", r"^target 'a100\[7\]': no host at that position \(4 matched\)$"),
    ("", r"^target '' is blank"),
    ("  ", r"^target '  ' is blank"),
    ("gpu01,", r"^target 'gpu01,': empty name in comma list$"),
    ("gpu01:!", r"names nothing after '!'"),
    # ansible-core drops an unmatched bracket: '~[' would be '~', every host
    ("~[", r"^target '~\[': an unmatched '\[' or '\]'$"),
    ("gpu01:gpu0[", r"an unmatched"),
    ("gpu01]", r"an unmatched"),
])
def test_bad_patterns_are_one_line(pattern, message):
    with pytest.raises(InvalidInput, match=message) as err:
        patterns.Selector(HOSTS, GROUPS).select(pattern)
    assert "\n" not in str(err.value)


def test_a_range_that_is_also_a_subscript_is_refused():
    """``gpu[01:04]`` with a group ``gpu``: Ansible reads positions 1-4 (gpu02-gpu05), a reader expects the hosts
    gpu01-gpu04; kdeploy refuses to guess."""
    with pytest.raises(InvalidInput, match=r"'gpu\[01:04\]' is ambiguous: 'gpu' names a group or host, so Ansible "
                                           r"reads the brackets as positions in its hosts \(gpu02, gpu03, gpu04, "
                                           r"gpu05\), not the host range \(gpu01, gpu02, gpu03, gpu04\)"):
        patterns.Selector(HOSTS, GROUPS).select("gpu[01:04]")
    # no host gpu0..gpu3: only Ansible's reading names hosts
    assert patterns.Selector(HOSTS, GROUPS).select("gpu[0:3]") == ["gpu01", "gpu02", "gpu03", "gpu04"]
    # both readings name the same hosts: no doubt
    assert patterns.Selector(["n0", "n1", "n2"], {"n": ["n0", "n1", "n2"]}).select("n[1:2]") == ["n1", "n2"]
    with pytest.raises(InvalidInput, match="ambiguous"):
        patterns.Selector(["n1", "n2", "n3"], {"n": ["n1", "n2", "n3"]}).select("n[1:2]")


@pytest.mark.parametrize(("pattern", "parts"), [
    ("a:b", ["a", "b"]), ("a,b", ["a", "b"]), ("gpu[01:16]", ["gpu[01:16]"]), ("gpu[01:16]:!gpu03",
                                                                              ["gpu[01:16]", "!gpu03"]),
    ("10.0.0.1", ["10.0.0.1"]), ("::1", ["::1"]), ("fe80::1:2", ["fe80::1:2"]), ("host:22", ["host:22"]),
    ("a:&b:!c", ["a", "&b", "!c"]), ("~gpu.*:!x", ["~gpu.*", "!x"]), (" a , b ", ["a", "b"]),
])
def test_split_as_ansible_splits(pattern, parts):
    assert patterns.split(pattern) == parts


def test_limit_narrows_every_target_and_reads_files(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text("defaults:\n  service: {name: s, python: /usr/bin/python3, sglang: {model_path: /m}}\n"
                    "groups:\n  a100: [gpu01, gpu02]\nhosts:\n" + "".join(f"  {h}: {{address: {h}}}\n"
                                                                           for h in HOSTS))
    loaded = inventory.load(path)
    assert loaded.subset("a100").resolve("gpu0*") == ["gpu01", "gpu02"]
    assert loaded.subset("!gpu01").resolve("a100") == ["gpu02"]
    assert loaded.subset("web*").resolve("a100") == []
    retry = tmp_path / "retry"
    retry.write_text("gpu02\n\nweb1\n")
    assert loaded.subset(f"@{retry}").resolve("all") == ["gpu02", "web1"]
    with pytest.raises(InvalidInput, match=r"^--limit 'gpu3': no such host or group"):
        loaded.subset("gpu3")
    with pytest.raises(InvalidInput, match=r"^--limit '' is blank"):
        loaded.subset("")
    with pytest.raises(InvalidInput, match=r"nope: --limit file not found \(pass --limit @FILE\)"):
        loaded.subset(f"@{tmp_path / 'nope'}")


@pytest.mark.parametrize(("incomplete", "expected"), [
    ("gp", ["gpu", "gpu01", "gpu02"]),
    ("gpu0*:!gpu0", ["gpu0*:!gpu01", "gpu0*:!gpu02"]),
    ("a100,gp", ["a100,gpu", "a100,gpu01", "a100,gpu02"]),
    ("gpu01:&", ["gpu01:&all", "gpu01:&a100", "gpu01:&gpu", "gpu01:&gpu02"]),
])
def test_completion_completes_the_last_part(incomplete, expected):
    assert patterns.complete(incomplete, ["all", "a100", "gpu", "gpu01", "gpu02"]) == expected


def test_cli_renders_a_pattern_and_says_when_none_matched(fleet, capsys):
    """The done-when of issue 26: `kdeploy render 'gpu0*:!gpu03'` renders the right hosts."""
    path, service = fleet
    args = ["-i", str(path), "--service", str(service)]
    assert cli.main(["render", "gpu0*:!gpu03", *args]) == 0
    rendered = [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("# ---- ")]
    assert rendered == ["gpu01", "gpu02", "gpu04", "gpu05", "gpu06", "gpu07", "gpu08", "gpu09"]
    assert cli.main(["render", "prod", "--limit", "h100:!gpu1*", *args]) == 0
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("# ----")] == [
        "gpu09"]
    assert cli.main(["render", "a100:&h100", *args]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == "kdeploy: no hosts matched 'a100:&h100'\n"
    assert cli.main(["render", "gpu0*:!gpu3", *args]) == 2
    assert capsys.readouterr().err.startswith("kdeploy: target 'gpu3': no such host or group (did you mean ")
    assert cli.main(["history", "all", "--limit", "20", *args]) == 2  # --limit is a pattern; entries are -n
    assert "--limit '20': no such host or group" in capsys.readouterr().err


def test_every_host_command_takes_limit():
    """--limit is on every command that takes a TARGET (and on set-env/set, whose --target is a file level)."""
    import typer.main

    group = typer.main.get_command(cli.app)
    missing = []
    for name, command in group.commands.items():
        subs = command.commands.items() if hasattr(command, "commands") else [(None, command)]
        for sub, cmd in subs:
            params = {p.name for p in cmd.params}
            if ("target" in params or name in ("set-env", "set")) and "limit" not in params:
                missing.append(f"{name} {sub or ''}".strip())
    assert missing == []


def test_completion_of_a_pattern_from_the_shell(fleet, monkeypatch, capsys):
    path, service = fleet
    monkeypatch.setenv("_KDEPLOY_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", f"kdeploy push -i {path} --service {service} gpu0*:!gpu1")
    monkeypatch.setenv("COMP_CWORD", "6")
    assert cli.main([]) == 0
    assert capsys.readouterr().out.split() == [f"gpu0*:!gpu{n}" for n in range(10, 17)]
    monkeypatch.setenv("COMP_WORDS", f"kdeploy status -i {path} --service {service} all --limit a10")
    monkeypatch.setenv("COMP_CWORD", "8")
    assert cli.main([]) == 0
    assert capsys.readouterr().out.split() == ["a100"]


@pytest.mark.parametrize("pattern", ["h[0:99999999]", "h[0:999][0:999]", "h[0:99999999999999999999999]"])
def test_a_host_range_stands_for_at_most_max_range_hosts(pattern):
    with pytest.raises(ValueError, match=f"more than {patterns.MAX_RANGE} hosts"):
        patterns.expand_ranges(pattern)
    assert len(patterns.expand_ranges(f"h[1:{patterns.MAX_RANGE}]")) == patterns.MAX_RANGE
