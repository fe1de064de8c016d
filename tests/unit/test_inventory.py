"""kdeploy/core/inventory.py: loading, layered precedence, target resolution, and one-line errors for bad files."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from kdeploy.cli import app as cli
from kdeploy.core.analysis import Bounds
from kdeploy.core.errors import ExitCode, InvalidInput
from kdeploy.core.inventory import load

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "inventory.yaml"
# kdeploy: <file>:<line>: <key.path>: <reason>
ERROR_LINE = re.compile(r"kdeploy: (?P<file>[^:]+):(?P<line>\d+): (?P<key>[^:\s]+): (?P<reason>.+)\Z")

# A small valid inventory: every bad case below is this with one thing changed, the bad line marked `# <-`.
BASE = """\
defaults:
  service:
    python: /usr/bin/python3
    sglang:
      tp: 8
groups:
  ddtree:
    hosts: [ct200]
    service:
      env:
        KDTREE_VERIFY: "on"
hosts:
  ct200:
    address: 10.0.0.1
    service:
      name: svc-a
      sglang:
        model_path: /models/a
  ct201:
    address: 10.0.0.2
    service:
      name: svc-b
      sglang:
        model_path: /models/b
"""


def host_a(extra: str) -> str:
    """BASE with ``extra`` (lines at service level, 6 spaces in) added to host ct200's service."""
    return BASE.replace("      name: svc-a", "      name: svc-a\n" + extra)


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def render_cli(path: Path, capsys: pytest.CaptureFixture[str], target: str = "all") -> tuple[int, str]:
    """`kdeploy render` through the real entry point: (exit code, the one stderr line)."""
    rc = cli.main(["render", target, "--inventory", str(path)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return rc, lines[0]


def marked_line(text: str) -> int:
    """1-based number of the line marked `# <-`."""
    lines = textwrap.dedent(text).splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("# <-")]
    assert len(hits) == 1, "mark exactly one line"
    return hits[0]


# --- the example inventory ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example():
    return load(EXAMPLE)


def test_example_hosts_and_groups(example):
    assert list(example.hosts) == ["ct200", "ct201"]
    assert example.groups == {"kimi": ["ct200", "ct201"], "ddtree": ["ct200"]}
    assert example.hosts["ct200"].address == "10.1.230.171"
    assert example.hosts["ct201"].service.name == "sglang-kimi"
    assert example.base_dir == REPO


def test_example_precedence(example):
    ct200, ct201 = example.hosts["ct200"], example.hosts["ct201"]
    # group ddtree (ct200 only) brings the env; ct201 is not in it
    assert ct200.service.env == {"KDTREE_VERIFY": "on", "KDTREE_NSPLIT": "64", "KDTREE_DEFRAG_SORT": "1"}
    assert ct201.service.env == {}
    # hicache is set on host ct201 only
    assert ct201.service.hicache.enabled is True
    assert ct201.service.hicache.ratio == 4.0
    assert ct200.service.hicache.enabled is False
    # defaults reach both hosts, merged deeply with the host's own service.sglang
    for host in (ct200, ct201):
        assert host.user == "root" and host.port == 22
        assert host.service.sglang.tp == 8 and host.service.sglang.trust_remote_code is True
        assert host.service.python == "/opt/sglang/venv/bin/python"
        assert host.service.workers == 8
    assert ct200.service.sglang.attention_backend == "kdtree"
    assert ct201.service.sglang.attention_backend == "flashinfer"
    assert ct201.service.sglang.speculative.num_draft_tokens == 4


def test_precedence_host_over_group_over_defaults(tmp_path):
    path = write(tmp_path, """\
        defaults:
          service:
            python: /usr/bin/python3
            env: {A: d, B: d}
            sglang: {port: 1001, tp: 2, extra_args: [--from-defaults]}
        groups:
          g:
            hosts: [h1, h2]
            service:
              env: {B: g, C: g}
              sglang: {port: 1002}
        hosts:
          h1:
            address: a1
            service:
              name: s1
              env: {C: h}
              sglang: {model_path: /m, port: 1003, extra_args: [--from-host]}
          h2:
            address: a2
            service: {name: s2, sglang: {model_path: /m}}
          h3:
            address: a3
            service: {name: s3, sglang: {model_path: /m}}
        """)
    inv = load(path)
    h1, h2, h3 = (inv.hosts[n].service for n in ("h1", "h2", "h3"))
    assert (h1.sglang.port, h2.sglang.port, h3.sglang.port) == (1003, 1002, 1001)
    assert h1.sglang.tp == h2.sglang.tp == h3.sglang.tp == 2          # deep merge keeps the defaults' tp
    assert h1.env == {"A": "d", "B": "g", "C": "h"}                    # env merges key by key
    assert h2.env == {"A": "d", "B": "g", "C": "g"}
    assert h3.env == {"A": "d", "B": "d"}
    assert h1.sglang.extra_args == ["--from-host"]                     # lists are replaced, not appended
    assert h3.sglang.extra_args == ["--from-defaults"]


def test_become_is_off_by_default_and_layers_like_any_connection_key(tmp_path):
    text = BASE.replace("defaults:\n", "defaults:\n  user: deploy\n  become: yes\n").replace(
        "    address: 10.0.0.2", "    address: 10.0.0.2\n    become: false")
    hosts = load(write(tmp_path, text)).hosts
    assert (hosts["ct200"].user, hosts["ct200"].become, hosts["ct200"].become_user,
            hosts["ct200"].become_method) == ("deploy", True, "root", "sudo")
    assert not hosts["ct201"].become
    assert not load(write(tmp_path, BASE)).hosts["ct200"].become


def test_gate_analysis_is_off_by_default_and_gives_its_bounds(tmp_path):
    hosts = load(write(tmp_path, host_a("      gate: {analysis: {duration: 8, max_p99_ratio: 1.5}}"))).hosts
    assert hosts["ct201"].service.gate.analysis is None
    analysis = hosts["ct200"].service.gate.analysis
    assert analysis.duration == 8
    assert analysis.bounds() == Bounds(max_p99_ratio=1.5, max_error_rate=0.001, min_throughput_ratio=0.8,
                                       min_accept_length_ratio=0.95, min_requests=20)


def test_bad_lower_layer_value_overridden_by_host_is_fine(tmp_path):
    text = BASE.replace("    sglang:\n      tp: 8\n", "    sglang:\n      tp: 0\n")
    text = text.replace("model_path: /models/a", "model_path: /models/a\n        tp: 4")
    text = text.replace("model_path: /models/b", "model_path: /models/b\n        tp: 2")
    inv = load(write(tmp_path, text))
    assert [h.service.sglang.tp for h in inv.hosts.values()] == [4, 2]


# --- target resolution ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "hosts"), [
    ("ct200", ["ct200"]),
    ("ct201", ["ct201"]),
    ("ddtree", ["ct200"]),
    ("kimi", ["ct200", "ct201"]),
    ("all", ["ct200", "ct201"]),
    (None, ["ct200", "ct201"]),
    (None, ["ct200", "ct201"]),
    ("ct201,ct200", ["ct200", "ct201"]),          # inventory order, not argument order
    ("kimi,ct200,ddtree", ["ct200", "ct201"]),    # deduplicated
    (" ct201 , ddtree ", ["ct200", "ct201"]),
    ("ddtree,ct201", ["ct200", "ct201"]),
])
def test_resolve(example, target, hosts):
    assert example.resolve(target) == hosts


def test_resolve_unknown_suggests(example):
    with pytest.raises(InvalidInput, match=r"target 'ct2000': no such host or group \(did you mean 'ct200'\?\)"):
        example.resolve("ct2000")
    with pytest.raises(InvalidInput, match=r"did you mean 'ddtree'\?"):
        example.resolve("ct200,ddtre")
    with pytest.raises(InvalidInput) as exc:
        example.resolve("zzzzzz")
    assert "did you mean" not in str(exc.value)
    assert exc.value.exit_code == ExitCode.INVALID


@pytest.mark.parametrize("target", ["", " ", "\t"])
def test_resolve_refuses_a_blank_target(example, target):
    """`kdeploy push "$UNSET_VARIABLE"` must not act on every host."""
    with pytest.raises(InvalidInput, match="is blank") as exc:
        example.resolve(target)
    assert exc.value.exit_code == ExitCode.INVALID


def test_resolve_empty_name_in_list(example):
    with pytest.raises(InvalidInput, match="empty name in comma list"):
        example.resolve("ct200,,ct201")


def test_unknown_target_through_cli(capsys):
    rc, line = render_cli(EXAMPLE, capsys, target="ct2000")
    assert rc == 2
    assert line == "kdeploy: target 'ct2000': no such host or group (did you mean 'ct200'?)"


def test_render_cli_ok(capsys):
    assert cli.main(["render", "ddtree", "--inventory", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ---- ct200 ----\n")
    assert "ct201" not in out


def test_paths_relative_to_inventory(example, tmp_path):
    assert example.local_path("templates/x.j2") == REPO / "templates/x.j2"
    assert example.local_path("/abs/x") == Path("/abs/x")
    assert example.payload_dir(example.hosts["ct200"]) == REPO / "kernels/kdtree"


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0", "::", "10.1.2.3", "fe80::1%eth0", "localhost"])
def test_sglang_host_accepts_ip_literals_and_localhost(tmp_path, bind):
    text = BASE.replace("model_path: /models/a", f"model_path: /models/a\n        host: '{bind}'")
    assert load(write(tmp_path, text)).hosts["ct200"].service.sglang.host == bind


@pytest.mark.parametrize("address", ["10.0.0.1", "fe80::1", "fe80::1%eth0", "gpu-07", "gpu_07.example.com.", "h1"])
def test_address_takes_a_name_an_ip_literal_or_an_ssh_config_alias(tmp_path, address):
    text = BASE.replace("address: 10.0.0.1", f"address: '{address}'")
    assert load(write(tmp_path, text)).hosts["ct200"].address == address


ADDRESS = "is no host name, IP address or ssh_config Host alias"


@pytest.mark.parametrize("address", ["''", "' '", "'a b'", "'-oProxyCommand=x'", "'.x'", "'root@h1'", "'h1:2222'",
                                     "'[::1]'", '"h1\\t"', "'h1;id'", "'$(id)'", '"h1\\u2028"'])
def test_check_refuses_an_address_ssh_would_refuse_or_misread(tmp_path, capsys, address):
    """Empty, blank, an ssh option, user@host, host:port, shell or control characters: refused at load (`kdeploy
    check` included), naming the line, not at connect."""
    text = BASE.replace("address: 10.0.0.1", f"address: {address}  # <-")
    path = write(tmp_path, text)
    assert cli.main(["check", "-i", str(path)]) == ExitCode.INVALID
    match = ERROR_LINE.match(capsys.readouterr().err.removesuffix("\n"))
    assert match and match["key"] == "hosts.ct200.address" and ADDRESS in match["reason"], match
    assert int(match["line"]) == marked_line(text)


# --- bad files: one line `<file>:<line>: <key.path>: <reason>`, exit code 2 --------------------------------

BAD = [
    pytest.param(BASE.replace("      tp: 8", "      tp: true  # <-"), "defaults.service.sglang.tp",
                 "expected a number, not true", id="bool-for-a-count"),
    pytest.param(BASE.replace("      tp: 8", "      tp: 8\n    gate: {analysis: {min_requests: true}}  # <-"),
                 "defaults.service.gate.analysis.min_requests", "expected a number, not true",
                 id="bool-for-min-requests"),
    pytest.param(
        BASE.replace("model_path: /models/a", "model_path: /models/a\n        tpp: 3  # <-"),
        "hosts.ct200.service.sglang.tpp", "unknown key (did you mean 'tp'?)", id="unknown-key-host-sglang"),
    pytest.param("host: {}  # <-\n" + BASE, "host", "unknown key (did you mean 'hosts'?)", id="unknown-top-level"),
    pytest.param(BASE.replace("defaults:\n  service:", "defaults:\n  servise:  # <-"),
                 "defaults.servise", "unknown key (did you mean 'service'?)", id="unknown-key-defaults"),
    pytest.param(BASE.replace("    service:\n      env:", "    servce:  # <-\n      env:"),
                 "groups.ddtree.servce", "unknown key (did you mean 'service'?)", id="unknown-key-group"),
    pytest.param(BASE.replace("      tp: 8", "      tp: 8\n      speculative: {algo: EAGLE}  # <-"),
                 "defaults.service.sglang.speculative.algo", "unknown key (did you mean 'algorithm'?)",
                 id="unknown-key-deep"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  address: 1.2.3.4  # <-\n"),
                 "defaults.address", "unknown key", id="address-only-per-host"),
    pytest.param(host_a("      hicache: {write_policy: write-back}  # <-"),
                 "hosts.ct200.service.hicache.write_policy",
                 "invalid value 'write-back': expected one of 'write_back', 'write_through' or "
                 "'write_through_selective'", id="enum-write-policy"),
    pytest.param(host_a("      hicache: {io_backend: nvme}  # <-"),
                 "hosts.ct200.service.hicache.io_backend",
                 "invalid value 'nvme': expected one of 'direct', 'kernel' or 'kernel_ascend'", id="enum-io-backend"),
    pytest.param(host_a("      hicache: {mem_layout: rows}  # <-"),
                 "hosts.ct200.service.hicache.mem_layout",
                 "invalid value 'rows': expected one of 'layer_first', 'page_first', 'page_first_direct', "
                 "'page_first_kv_split' or 'page_head'", id="enum-mem-layout"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  become_method: su  # <-\n"),
                 "defaults.become_method", "invalid value 'su': expected one of 'sudo' or 'doas'", id="become-method"),
    pytest.param(BASE.replace("    address: 10.0.0.2", "    address: 10.0.0.2\n    become_user: '-u root'  # <-"),
                 "hosts.ct201.become_user", "must be a user name", id="become-user"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  become: maybe  # <-\n"),
                 "defaults.become", "Input should be a valid boolean", id="become-not-bool"),
    pytest.param(host_a("      hicache: {ratio: 0}  # <-"),
                 "hosts.ct200.service.hicache.ratio", "Input should be greater than 0", id="ratio-zero"),
    pytest.param(host_a("      hicache: {ratio: -1.5}  # <-"),
                 "hosts.ct200.service.hicache.ratio", "Input should be greater than 0", id="ratio-negative"),
    pytest.param(host_a("      hicache: {ratio: .inf}  # <-"),
                 "hosts.ct200.service.hicache.ratio", "Input should be a finite number", id="ratio-inf"),
    pytest.param(host_a("      gate: {revert_after: .inf}  # <-"),
                 "hosts.ct200.service.gate.revert_after", "Input should be a finite number", id="revert-after-inf"),
    pytest.param(host_a("      gate: {timeout: .nan}  # <-"),
                 "hosts.ct200.service.gate.timeout", "Input should be a finite number", id="gate-timeout-nan"),
    pytest.param(host_a("      gate: {revert_after: 1e300}  # <-"),  # systemd-run refused it: a false exit 5
                 "hosts.ct200.service.gate.revert_after", "Input should be less than or equal to 604800",
                 id="revert-after-huge"),
    pytest.param(host_a("      unit: {timeout_stop_sec: 99999999999999999999}  # <-"),
                 "hosts.ct200.service.unit.timeout_stop_sec", "Input should be less than or equal to 604800",
                 id="timeout-stop-huge"),
    pytest.param(BASE.replace('        KDTREE_VERIFY: "on"', '        KDTREE_VERIFY: "on"\n        1BAD: "x"  # <-'),
                 "groups.ddtree.service.env.1BAD", "'1BAD' is not a valid environment variable name",
                 id="env-name-invalid"),
    pytest.param(BASE.replace('KDTREE_VERIFY: "on"', 'KDTREE_VERIFY: "on\\nExecStartPre=/bin/evil"  # <-'),
                 "groups.ddtree.service.env.KDTREE_VERIFY",
                 "contains a newline or control character (it would corrupt the unit file)", id="env-value-newline"),
    pytest.param(BASE.replace('KDTREE_VERIFY: "on"', 'KDTREE_VERIFY: "a\\tb"  # <-'),
                 "groups.ddtree.service.env.KDTREE_VERIFY",
                 "contains a newline or control character (it would corrupt the unit file)", id="env-value-tab"),
    pytest.param(BASE.replace('KDTREE_VERIFY: "on"', 'KDTREE_VERIFY: "a\\x7fb"  # <-'),
                 "groups.ddtree.service.env.KDTREE_VERIFY",
                 "contains a newline or control character (it would corrupt the unit file)", id="env-value-del"),
    pytest.param(BASE.replace("model_path: /models/b", 'model_path: "/models/b\\n[Service]"  # <-'),
                 "hosts.ct201.service.sglang.model_path",
                 "contains a newline or control character (it would corrupt the unit file)", id="model-path-newline"),
    pytest.param(BASE.replace("model_path: /models/b", "model_path: /models/b\n        extra_args:\n"
                              '          - --ok\n          - "x\\ny"  # <-'),
                 "hosts.ct201.service.sglang.extra_args.1",
                 "contains a newline or control character (it would corrupt the unit file)", id="extra-args-newline"),
    pytest.param(BASE.replace('KDTREE_VERIFY: "on"', 'KDTREE_VERIFY: "a\\u2028b"  # <-'),
                 "groups.ddtree.service.env.KDTREE_VERIFY",
                 "contains the line separator U+2028 (the unit file would not read back as written)",
                 id="env-value-line-separator"),
    pytest.param(BASE.replace("model_path: /models/b", 'model_path: "/models/b\\N"  # <-'),
                 "hosts.ct201.service.sglang.model_path",
                 "contains the line separator U+0085 (the unit file would not read back as written)",
                 id="model-path-next-line"),
    pytest.param(host_a('      unit: {description: "a\\Pb"}  # <-'),
                 "hosts.ct200.service.unit.description",
                 "contains the line separator U+2029 (the unit file would not read back as written)",
                 id="description-paragraph-separator"),
    pytest.param(BASE.replace("model_path: /models/a", "model_path: /models/a\n        host: gpu01.example.com  # <-"),
                 "hosts.ct200.service.sglang.host",
                 "must be an IP address (127.0.0.1, 0.0.0.0, ::, an address of the host) or 'localhost'",
                 id="sglang-host-name"),
    pytest.param(BASE.replace('        KDTREE_VERIFY: "on"', '        HF_TOKEN: "hf_abc"  # <-'),
                 "groups.ddtree.service.env.HF_TOKEN",
                 "HF_TOKEN looks like a secret and unit files are world-readable: list it in service.secrets "
                 "(written into service.environment_file, mode 0600) instead", id="env-secret"),
    pytest.param(BASE.replace('        KDTREE_VERIFY: "on"', '        KDTREE_NSPLIT: 64  # <-'),
                 "groups.ddtree.service.env.KDTREE_NSPLIT", "quote the value (64) so YAML keeps it a string",
                 id="env-unquoted-int"),
    pytest.param(BASE.replace('        KDTREE_VERIFY: "on"', '        KDTREE_VERIFY: true  # <-'),
                 "groups.ddtree.service.env.KDTREE_VERIFY", "quote the value (True) so YAML keeps it a string",
                 id="env-unquoted-bool"),
    pytest.param(BASE.replace("    python: /usr/bin/python3\n", "    payload: kdtree\n").replace(
        "  ct200:\n    address: 10.0.0.1\n    service:", "  ct200:\n    address: 10.0.0.1\n    service:  # <-"),
        "hosts.ct200.service.python", "required setting is missing", id="missing-python"),
    pytest.param(BASE.replace("        model_path: /models/a", "        port: 8000").replace(
        "    service:\n      name: svc-a\n      sglang:", "    service:\n      name: svc-a\n      sglang:  # <-"),
        "hosts.ct200.service.sglang.model_path", "required setting is missing", id="missing-model-path"),
    pytest.param(BASE.replace("  ct200:\n    address: 10.0.0.1\n", "  ct200:  # <-\n    port: 22\n"),
                 "hosts.ct200.address", "required setting is missing", id="missing-address"),
    pytest.param(BASE + "  ct202:  # <-\n", "hosts.ct202.address", "required setting is missing",
                 id="empty-host-entry"),
    pytest.param(BASE.replace("    hosts: [ct200]", "    hosts: [ct2000]  # <-"),
                 "groups.ddtree.hosts", "unknown host 'ct2000' (did you mean 'ct200'?)", id="group-unknown-host"),
    pytest.param(BASE.replace("  ddtree:\n", "  ct201:  # <-\n"),
                 "groups.ct201", "a group cannot be named 'all' or like a host", id="group-named-like-host"),
    pytest.param(BASE.replace("  ddtree:\n", "  all:  # <-\n"),
                 "groups.all", "a group cannot be named 'all' or like a host", id="group-named-all"),
    pytest.param(BASE.replace("    python: /usr/bin/python3", "    python: venv/bin/python  # <-"),
                 "defaults.service.python", "must be an absolute path", id="relative-python"),
    pytest.param(BASE.replace("      name: svc-a", "      name: svc-a.service  # <-"),
                 "hosts.ct200.service.name",
                 "must be a systemd unit name without '.service' (letters, digits, ':_.@-')", id="unit-name-suffix"),
    pytest.param(BASE.replace("      name: svc-b", '      name: "a b"  # <-'),
                 "hosts.ct201.service.name",
                 "must be a systemd unit name without '.service' (letters, digits, ':_.@-')", id="unit-name-space"),
    pytest.param(host_a("      gate: {analysis: {duration: 0}}  # <-"),
                 "hosts.ct200.service.gate.analysis.duration", "Input should be greater than 0", id="analysis-zero"),
    pytest.param(host_a("      gate: {analysis: {max_error_rate: 2}}  # <-"),
                 "hosts.ct200.service.gate.analysis.max_error_rate", "Input should be less than or equal to 1",
                 id="analysis-rate"),
    pytest.param(host_a("      gate: {prompts: [{prompt: x, expect: '(('}]}  # <-"),
                 "hosts.ct200.service.gate.prompts.0.expect", "not a valid regular expression", id="gate-bad-regex"),
    pytest.param(BASE.replace("    hosts: [ct200]\n", "    hosts: ct200  # <-\n"),
                 "groups.ddtree.hosts", "must be a list of host names", id="group-hosts-not-list"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  router: {url: 10.0.0.9:30080}  # <-\n"),
                 "defaults.router.url", "must be http://HOST:PORT or https://HOST:PORT", id="router-url-no-scheme"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  router: {url: 'http://r:1/workers'}  # <-\n"),
                 "defaults.router.url", "must be http://HOST:PORT or https://HOST:PORT", id="router-url-path"),
    pytest.param(BASE.replace("    hosts: [ct200]\n",
                              "    hosts: [ct200]\n    router: {url: 'http://r:1', via: ct2}  # <-\n"),
                 "groups.ddtree.router.via", "unknown host 'ct2' (did you mean", id="router-via-unknown"),
    pytest.param(BASE.replace("defaults:\n",
                              "defaults:\n  router: {url: 'http://r:1', worker_url: 'http://{ip}:1'}  # <-\n"),
                 "defaults.router.worker_url", "unknown placeholder {ip}", id="router-worker-url-field"),
    pytest.param(BASE.replace("  ct201:\n    address: 10.0.0.2\n",
                              "  ct201:\n    address: 10.0.0.2\n"
                              "    router: {url: 'http://r:1', drain_timeout: 0}  # <-\n"),
                 "hosts.ct201.router.drain_timeout", "Input should be greater than 0", id="router-drain-timeout"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  router: {url: 'http://r:1', api_key_env: 'a-b'}  # <-\n"),
                 "defaults.router.api_key_env", "'a-b' is not a valid environment variable name", id="router-key-env"),
    pytest.param(BASE.replace("defaults:\n", "defaults:\n  router: {url: 'http://r:1', api_key: x}  # <-\n"),
                 "defaults.router.api_key", "unknown key (did you mean 'api_key_env'?)", id="router-api-key-inline"),
    pytest.param(BASE.replace("  ct201:\n    address: 10.0.0.2",
                              "  ct201: just-a-string  # <-\n  x:\n    address: 10.0.0.2"),
                 "hosts.ct201", "must be a mapping", id="host-not-mapping"),
    pytest.param(BASE.replace("  ct201:\n    address: 10.0.0.2", "  all:  # <-\n    address: 10.0.0.2"),
                 "hosts.all", "a host cannot be named 'all'", id="host-named-all"),
]


@pytest.mark.parametrize(("text", "keypath", "reason"), BAD)
def test_bad_inventory_one_line(tmp_path, capsys, text, keypath, reason):
    path = write(tmp_path, text)
    rc, line = render_cli(path, capsys)
    assert rc == 2
    match = ERROR_LINE.match(line)
    assert match, line
    assert match["file"] == str(path)
    assert match["key"] == keypath
    assert match["reason"].startswith(reason), line
    assert int(match["line"]) == marked_line(text), line


def test_bad_inventory_raises_invalid_input(tmp_path):
    """The same errors from the library: InvalidInput with the invalid-input exit code."""
    path = write(tmp_path, BASE.replace("tp: 8", "tp: 0"))
    with pytest.raises(InvalidInput) as exc:
        load(path)
    assert exc.value.exit_code == ExitCode.INVALID
    assert str(exc.value) == f"{path}:5: defaults.service.sglang.tp: Input should be greater than 0"


# --- precedence of errors: the layer where the bad value was written -------------------------------------

LAYERS = [
    pytest.param(  # the host has env too
        BASE.replace('        KDTREE_VERIFY: "on"', '        KDTREE_VERIFY: "on"\n        HF_TOKEN: "x"  # <-')
        .replace("      name: svc-a", "      name: svc-a\n      env: {OTHER: ok}"),
        "groups.ddtree.service.env.HF_TOKEN", "HF_TOKEN looks like a secret", id="group-even-when-host-sets-section"),
    pytest.param(
        BASE.replace("    service:\n      env:", "    service:\n      hicache:\n        ratio: 0  # <-\n      env:")
        .replace("      name: svc-a", "      name: svc-a\n      hicache: {enabled: true}"),
        "groups.ddtree.service.hicache.ratio", "Input should be greater than 0", id="group-nested-value"),
    pytest.param(
        BASE.replace("    service:\n      env:", "    service:\n      hicache: {ratio: 2}\n      env:")
        .replace("      name: svc-a", "      name: svc-a\n      hicache: {ratio: 0}  # <-"),
        "hosts.ct200.service.hicache.ratio", "Input should be greater than 0", id="host-overrides-with-bad-value"),
    pytest.param(BASE.replace("      tp: 8", "      tp: 8\n      port: 70000  # <-"),
                 "defaults.service.sglang.port", "Input should be less than 65536", id="defaults"),
]


@pytest.mark.parametrize(("text", "keypath", "reason"), LAYERS)
def test_error_names_the_layer_where_the_bad_value_was_written(tmp_path, capsys, text, keypath, reason):
    test_bad_inventory_one_line(tmp_path, capsys, text, keypath, reason)


# --- files that are not inventories: one line each, exit 2 ({path}: the file; patterns are full matches) -----


def _bytes(data: bytes):
    def make(tmp_path: Path) -> Path:
        path = tmp_path / "inventory.yaml"
        path.write_bytes(data)
        return path

    return make


NOT_INVENTORIES = [
    # the scanner stops at the first line it cannot continue: the one after the unclosed bracket
    pytest.param(_bytes(BASE.replace("    hosts: [ct200]", "    hosts: [ct200").encode()),
                 r"{path}:9: invalid YAML: .+", id="invalid-yaml-names-the-line"),
    pytest.param(_bytes(b"hosts:\n\tct200: {}\n"), r"{path}:2: invalid YAML: .+", id="tab-indentation"),
    pytest.param(lambda tmp_path: tmp_path / "nope.yaml", r"{path}: inventory not found \(pass --inventory PATH\)",
                 id="missing-file"),
    pytest.param(_bytes("# fleet\n# caf\u00e9\nhosts: {}\n".encode("latin-1")),
                 r"{path}:2: inventory is not UTF-8 text \(.+", id="not-utf8"),
    pytest.param(lambda tmp_path: tmp_path, r"{path}: an Ansible inventory has no kdeploy service: .+",
                 id="directory-is-an-ansible-inventory-directory"),
    *(pytest.param(_bytes(text.encode()), r"{path}: the inventory must be a mapping with defaults/groups/hosts",
                   id=f"non-mapping-{n}") for n, text in enumerate(["- a\n- b\n", "just a string\n", "42\n"])),
    *(pytest.param(_bytes(text.encode()), r"{path}(:\d+)?: hosts: no hosts defined", id=f"no-hosts-{n}")
      for n, text in enumerate(["", "# only a comment\n", "defaults: {}\n"])),
]


@pytest.mark.parametrize(("make", "pattern"), NOT_INVENTORIES)
def test_not_an_inventory_one_line(tmp_path, capsys, make, pattern):
    path = make(tmp_path)
    rc, line = render_cli(path, capsys)
    assert rc == 2
    assert re.fullmatch("kdeploy: " + pattern.replace("{path}", re.escape(str(path))), line), line


def test_router_layers_and_worker_url(tmp_path):
    text = BASE.replace("defaults:\n", "defaults:\n  router: {url: 'http://127.0.0.1:30080/', via: ct201}\n").replace(
        "    hosts: [ct200]\n", "    hosts: [ct200]\n    router: {drain_timeout: 30, worker_url: 'http://{name}.lan:{port}'}\n")
    inv = load(write(tmp_path, text))
    a, b = inv.hosts["ct200"], inv.hosts["ct201"]
    assert a.router is not None and b.router is not None
    assert a.router.url == "http://127.0.0.1:30080" and a.router.via == "ct201" and a.router.drain_timeout == 30
    assert a.worker_url == "http://ct200.lan:30000"
    assert b.router.drain_timeout == 120 and b.worker_url == "http://10.0.0.2:30000"
    assert load(write(tmp_path, BASE, "plain.yaml")).hosts["ct200"].worker_url is None
