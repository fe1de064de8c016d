"""kdeploy/core/render.py: the unit file, the launch argv, systemd quoting, and systemd's own verdict on the result."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
from pathlib import Path

import pytest

from kdeploy.core.errors import InvalidInput
from kdeploy.core.inventory import HostConfig, Inventory, load
from kdeploy.core.render import (
    current_path,
    launch_argv,
    quote_env_assignment,
    quote_exec_arg,
    render_unit,
    service_dir,
    unit_env,
    unit_filename,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests/data/golden"
CAPTURED = REPO / "tests/data/captured"
SYSTEMD_ANALYZE = Path("/usr/bin/systemd-analyze")
needs_analyze = pytest.mark.skipif(not SYSTEMD_ANALYZE.exists(), reason="needs /usr/bin/systemd-analyze")


@pytest.fixture(scope="module")
def inv() -> Inventory:
    return load(REPO / "inventory.yaml")


def with_service(host: HostConfig, **update: object) -> HostConfig:
    return host.model_copy(update={"service": host.service.model_copy(update=update)})


def with_hicache(host: HostConfig, **update: object) -> HostConfig:
    return with_service(host, hicache=host.service.hicache.model_copy(update=update))


# --- golden units -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ct200", "ct201"])
def test_golden_unit(inv, name):
    """Golden files were written once from render_unit and read line by line; a change must be deliberate:
    regenerate with `kdeploy render <host> --inventory inventory.yaml` (minus the `# ----` header line)."""
    rendered = render_unit(inv, inv.hosts[name])
    golden = (GOLDEN / f"{name}.service").read_text()
    diff = "".join(difflib.unified_diff(golden.splitlines(True), rendered.splitlines(True), "golden", "rendered"))
    assert rendered == golden, diff


def test_golden_content_spot_checks():
    """What the golden files must say, so a wrong golden file cannot hide a wrong renderer."""
    ct200 = (GOLDEN / "ct200.service").read_text()
    ct201 = (GOLDEN / "ct201.service").read_text()
    assert 'Environment="KDTREE_VERIFY=on"\n' in ct200 and "KDTREE" not in ct201
    assert 'Environment="PYTHONPATH=/opt/kdeploy/sglang-k26-ddtree/current"\n' in ct200
    assert "--enable-hierarchical-cache" in ct201 and "hicache" not in ct200
    assert "WorkingDirectory=/opt/kdeploy/sglang-kimi\n" in ct201
    assert "EnvironmentFile=-/etc/kdeploy/sglang.env\n" in ct201
    for text, name in ((ct200, "sglang-k26-ddtree"), (ct201, "sglang-kimi")):
        assert f"SyslogIdentifier={name}\n" in text
        assert "\nRestart=on-failure\n" in text and "\nKillMode=mixed\n" in text
        assert text.endswith("[Install]\nWantedBy=multi-user.target\n")
        assert text.count("ExecStart=") == 1


# --- the launch argv ---------------------------------------------------------------------------------------


def test_launch_argv_order(inv):
    assert launch_argv(inv.hosts["ct201"].service) == [
        "/opt/sglang/venv/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/models/Kimi-K2.5-INT4", "--served-model-name", "kimi-k2.5",
        "--tp-size", "8", "--host", "127.0.0.1", "--port", "30000",
        "--attention-backend", "flashinfer",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/Kimi-K2.5-EAGLE3",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--mem-fraction-static", "0.88", "--trust-remote-code",
        "--enable-hierarchical-cache", "--hicache-ratio", "4.0", "--hicache-write-policy", "write_through",
        "--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first",
    ]


def test_launch_argv_minimal_and_extra_args_last(inv):
    host = inv.hosts["ct200"]
    sg = host.service.sglang.model_copy(update={"served_model_name": None, "attention_backend": None,
                                                "trust_remote_code": False, "context_length": 4096,
                                                "extra_args": ["--log-level", "debug"]})
    argv = launch_argv(with_service(host, sglang=sg, module="my.launcher").service)
    assert argv == ["/opt/sglang/venv/bin/python", "-m", "my.launcher", "--model-path", "/models/Kimi-K2.6",
                    "--tp-size", "8", "--host", "127.0.0.1", "--port", "30000", "--context-length", "4096",
                    "--log-level", "debug"]


def test_hicache_flags_only_when_enabled(inv):
    ct200, ct201 = inv.hosts["ct200"], inv.hosts["ct201"]
    assert not any("hicache" in a or "hierarchical" in a for a in launch_argv(ct200.service))
    # settings present but not enabled: no flags at all
    disabled = with_hicache(ct201, enabled=False)
    assert disabled.service.hicache.ratio == 4.0
    assert not any("hicache" in a or "hierarchical" in a for a in launch_argv(disabled.service))
    # enabled with nothing else: only the switch
    bare = with_service(ct200, hicache=type(ct200.service.hicache)(enabled=True))
    assert [a for a in launch_argv(bare.service) if "hicache" in a or "hierarchical" in a] == [
        "--enable-hierarchical-cache"]


def test_hicache_size_wins_over_ratio(inv):
    host = with_hicache(inv.hosts["ct201"], size_gb=64.0)
    argv = launch_argv(host.service)
    assert "--hicache-ratio" not in argv
    i = argv.index("--hicache-size")
    assert argv[i + 1] == "64.0"
    assert argv.index("--enable-hierarchical-cache") < i < argv.index("--hicache-write-policy")
    unit = render_unit(inv, host)
    assert "--hicache-size 64.0" in unit and "--hicache-ratio" not in unit


# --- environment -----------------------------------------------------------------------------------------


def test_unit_env(inv):
    ct200 = inv.hosts["ct200"]
    assert unit_env(ct200.service) == {
        "KDTREE_DEFRAG_SORT": "1", "KDTREE_NSPLIT": "64", "KDTREE_VERIFY": "on",
        "PYTHONPATH": "/opt/kdeploy/sglang-k26-ddtree/current", "PYTHONUNBUFFERED": "1"}
    assert list(unit_env(ct200.service)) == sorted(unit_env(ct200.service))
    user = with_service(ct200, env={"PYTHONPATH": "/extra", "PYTHONUNBUFFERED": "0"})
    env = unit_env(user.service)
    assert env["PYTHONPATH"] == "/opt/kdeploy/sglang-k26-ddtree/current:/extra"   # the release first
    assert env["PYTHONUNBUFFERED"] == "0"                                            # the user's wins


def test_paths(inv):
    svc = with_service(inv.hosts["ct200"], remote_root="/srv/k/").service
    assert service_dir(svc) == "/srv/k/sglang-k26-ddtree"
    assert current_path(svc) == "/srv/k/sglang-k26-ddtree/current"
    assert unit_filename(svc) == "sglang-k26-ddtree.service"


# --- quoting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arg", "quoted"), [
    ("/opt/venv/bin/python", "/opt/venv/bin/python"),
    ("--flag=a,b:c+d@e", "--flag=a,b:c+d@e"),
    ("with space", '"with space"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("it's", '"it\'s"'),
    ("back\\slash", '"back\\\\slash"'),
    ("50%", '"50%%"'),
    ("%n", '"%%n"'),
    ("$HOME", '"$$HOME"'),
    ("${X}$$", '"$${X}$$$$"'),
    ("", '""'),
    (";", '";"'),
])
def test_quote_exec_arg(arg, quoted):
    assert quote_exec_arg(arg) == quoted


@pytest.mark.parametrize(("name", "value", "quoted"), [
    ("A", "plain", '"A=plain"'),
    ("A", "a b", '"A=a b"'),
    ("A", 'say "hi"', '"A=say \\"hi\\""'),
    ("A", "C:\\dir", '"A=C:\\\\dir"'),
    ("A", "100%", '"A=100%%"'),
    ("A", "$HOME", '"A=$HOME"'),       # Environment= does not expand $: left alone
    ("A", "a=b", '"A=a=b"'),
    ("A", "", '"A="'),
])
def test_quote_env_assignment(name, value, quoted):
    assert quote_env_assignment(name, value) == quoted


def captured_tricky() -> tuple[dict, dict]:
    tricky = json.loads((CAPTURED / "tricky.json").read_text())
    lines = [json.loads(line) for line in (CAPTURED / "journal_env.jsonl").read_text().splitlines()]
    received = [json.loads(r["MESSAGE"]) for r in lines if r["MESSAGE"].startswith("{")]
    assert len(received) == 1
    return tricky, received[0]


def test_quoting_round_trips_through_real_systemd():
    """A real systemd (tests/data/captured/capture.py) ran a unit whose ExecStart and Environment= lines
    were quoted by these functions: the process received exactly the original values."""
    tricky, received = captured_tricky()
    assert received["argv"] == tricky["argv"]
    assert received["env"] == tricky["env"]
    # tricky enough to matter
    assert {"", "$$", "50%", ";", 'dq"x', "end\\"} <= set(tricky["argv"])
    assert any("%" in v for v in tricky["env"].values()) and any("\\" in v for v in tricky["env"].values())


def test_captured_unit_is_what_the_quoting_renders_today():
    """The capture proves something about today's code only if today's code renders the same unit lines."""
    tricky, _ = captured_tricky()
    unit = (CAPTURED / "units/kdcap-env.service").read_text()
    for name, value in tricky["env"].items():
        assert f"Environment={quote_env_assignment(name, value)}\n" in unit
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith(" " + " ".join(quote_exec_arg(a) for a in tricky["argv"]))


# --- systemd-analyze verify ------------------------------------------------------------------------------


def analyze(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SYSTEMD_ANALYZE), "verify", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)


@needs_analyze
@pytest.mark.parametrize("name", ["ct200", "ct201"])
def test_systemd_analyze_verify_accepts_rendered_unit(inv, tmp_path, name):
    # verify checks that ExecStart's binary exists on THIS machine: point it at one that does
    host = with_service(inv.hosts[name], python="/usr/bin/python3")
    path = tmp_path / unit_filename(host.service)
    path.write_text(render_unit(inv, host))
    proc = analyze(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""      # verify only warns (exit 0) on unknown keys: silence is the real pass


@needs_analyze
def test_systemd_analyze_verify_accepts_tricky_values(inv, tmp_path):
    host = inv.hosts["ct201"]
    sg = host.service.sglang.model_copy(update={"model_path": "/models/my model 100% $HOME \"q\" \\x",
                                                "extra_args": ["--x", "a;b", "", "%%"]})
    host = with_service(host, python="/usr/bin/python3", sglang=sg, env={"A": 'x "y" 50% $Z \\ ;'})
    path = tmp_path / unit_filename(host.service)
    path.write_text(render_unit(inv, host))
    proc = analyze(path)
    assert (proc.returncode, proc.stderr) == (0, "")


def with_percent(host: HostConfig) -> HostConfig:
    """Every value that lands verbatim on a unit line, with systemd specifiers in it."""
    unit = host.service.unit.model_copy(update={"description": "GPU 100% %n \"q\" %%", "user": "svc%u"})
    return with_service(host, python="/usr/bin/python3", unit=unit, remote_root="/srv/k%i 50%",
                        environment_file="/etc/kd/50%.env")


def test_specifiers_are_escaped_on_every_unit_line(inv):
    text = render_unit(inv, with_percent(inv.hosts["ct201"]))
    assert '\nDescription=GPU 100%% %%n "q" %%%%\n' in text
    assert "\nUser=svc%%u\n" in text
    assert "\nEnvironmentFile=-/etc/kd/50%%.env\n" in text
    assert "\nWorkingDirectory=/srv/k%%i 50%%/sglang-kimi\n" in text
    assert '"PYTHONPATH=/srv/k%%i 50%%/sglang-kimi/current"' in text
    default = with_service(inv.hosts["ct201"], sglang=inv.hosts["ct201"].service.sglang.model_copy(
        update={"served_model_name": "kimi 100%"}))
    assert "\nDescription=SGLang kimi 100%%\n" in render_unit(inv, default)


@pytest.mark.parametrize(("update", "where"), [
    ({"description": "ends in a backslash\\"}, "service.unit.description"),
    ({"description": " padded"}, "service.unit.description"),
    ({"user": "svc "}, "service.unit.user"),
])
def test_values_systemd_cannot_carry_verbatim_are_refused(inv, update, where):
    """systemd strips blanks around a value and a trailing backslash continues the line into the next one."""
    host = inv.hosts["ct200"]
    host = with_service(host, unit=host.service.unit.model_copy(update=update))
    with pytest.raises(InvalidInput, match=rf"ct200: {re.escape(where)} .*cannot be written on a unit line"):
        render_unit(inv, host)


@needs_analyze
def test_systemd_analyze_verify_accepts_specifiers_in_every_value(inv, tmp_path):
    host = with_percent(inv.hosts["ct201"])
    path = tmp_path / unit_filename(host.service)
    path.write_text(render_unit(inv, host))
    proc = analyze(path)
    # its only remark names the user exactly as the inventory wrote it: the specifier was not expanded
    assert (proc.returncode, proc.stderr) == (
        0, "Accepting user/group name 'svc%u', which does not match strict user/group name rules.\n")


@needs_analyze
def test_systemd_analyze_verify_can_fail(inv, tmp_path):
    host = with_service(inv.hosts["ct200"], python="/usr/bin/python3")
    text = render_unit(inv, host).replace("KillSignal=SIGTERM\n", "KillSignal=SIGTERM\nBogusDirective=1\n")
    path = tmp_path / unit_filename(host.service)
    path.write_text(text)
    proc = analyze(path)
    assert "Unknown key 'BogusDirective'" in proc.stderr
    # and the ExecStart check is real: the inventory's python does not exist here
    missing = tmp_path / "missing" / unit_filename(host.service)
    missing.parent.mkdir()
    missing.write_text(render_unit(inv, inv.hosts["ct200"]))
    proc = analyze(missing)
    assert proc.returncode != 0 and "/opt/sglang/venv/bin/python" in proc.stderr


# --- the template --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "error"), [
    ("[Service]\nExecStart={{ exec_start }}\nUser={{ no_such_variable }}\n", r"ct200: 'no_such_variable' is undefined"),
    ("[Service]\nUser={{ unit.no_such_attribute }}\n", "has no attribute 'no_such_attribute'"),
    ("[Service]\n{% if %}\n", r"bad.service.j2:2: unit template: Expected an expression"),
    ("[Service]\nUser={{ host.name | no_such_filter }}\n", r"bad.service.j2:2: unit template: No filter named"),
])
def test_a_broken_template_is_invalid_input(inv, tmp_path, text, error):
    """A mistake in the user's template is theirs to fix (exit 2, with the file and line), not a crash."""
    template = tmp_path / "bad.service.j2"
    template.write_text(text)
    host = with_service(inv.hosts["ct200"], template=str(template))
    with pytest.raises(InvalidInput, match=error) as exc:
        render_unit(inv, host)
    assert exc.value.exit_code == 2


def test_a_template_that_is_not_utf8_is_invalid_input(inv, tmp_path):
    template = tmp_path / "latin1.service.j2"
    template.write_bytes("[Unit]\nDescription=caf\u00e9\n".encode("latin-1"))
    with pytest.raises(InvalidInput, match=r"latin1\.service\.j2:2: unit template is not UTF-8 text"):
        render_unit(inv, with_service(inv.hosts["ct200"], template=str(template)))


def test_template_relative_to_inventory_and_missing(inv, tmp_path):
    (tmp_path / "t.j2").write_text("X={{ host.name }} {{ template_name }}\n")
    moved = Inventory(path=tmp_path / "inventory.yaml", hosts=inv.hosts, groups=inv.groups)
    host = with_service(inv.hosts["ct201"], template="t.j2")
    assert render_unit(moved, host) == "X=ct201 t.j2\n"
    with pytest.raises(InvalidInput, match=r"nope\.j2: unit template not found"):
        render_unit(moved, with_service(host, template="nope.j2"))


def test_user_and_description(inv):
    host = inv.hosts["ct200"]
    settings = host.service.unit.model_copy(update={"user": "sglang", "description": "My server"})
    text = render_unit(inv, with_service(host, unit=settings, environment_file=None))
    assert "\nUser=sglang\n" in text and "\nDescription=My server\n" in text
    assert "EnvironmentFile" not in text
