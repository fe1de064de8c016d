"""The bad-input corpus (tests/unit/badinput.py): every case ends in time with exit 2 and one clean line, or the
documented success. The cases cover every inventory source (kdeploy's YAML, Ansible INI, YAML, ``--list`` JSON,
scripts, directories), the options and their environment variables, and the other files kdeploy reads (service
files, templates, payloads, secrets files, ``--limit @FILE``, SSH configs); docs/cli.md (Errors) is the contract.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.unit.badinput import REPO, Case, Content, as_json, run_all

TEMPLATE = f"{REPO}/templates/sglang.service.j2"
PAYLOAD = f"{REPO}/tests/data/testplugin"
SERVICE_BODY = f"""\
  name: svc
  template: {TEMPLATE}
  payload: {PAYLOAD}
  python: /usr/bin/python3
  sglang:
    model_path: /models/m
"""
# A valid kdeploy inventory; {defaults}, {groups} and {hosts} take extra lines at each level.
INVENTORY = """\
defaults:
  service:
{service}{defaults}
groups:
  g:
    hosts: [h1]
{groups}
hosts:
  h1:
    address: 127.0.0.1
{hosts}"""
SERVICE_FILE = "service:\n" + SERVICE_BODY


def inventory(*, defaults: str = "", groups: str = "", hosts: str = "", service: str = SERVICE_BODY) -> str:
    indented = "".join("  " + line + "\n" for line in service.splitlines())
    return INVENTORY.format(service=indented, defaults=defaults, groups=groups, hosts=hosts)


def render(source: str = "inv.yaml", *extra: str, service: bool = False) -> tuple[str, ...]:
    return ("render", "all", "-i", source, *(("--service", "svc.yaml") if service else ()), *extra)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def locked_dir(path: Path) -> None:
    """A directory holding the file its name ends in, then mode 000: only root reads through it."""
    path.mkdir()
    (path / "inv.yaml").write_text(inventory())
    (path / "svc.yaml").write_text(SERVICE_FILE)
    (path / "hosts.ini").write_text("h1 ansible_host=127.0.0.1\n")
    (path / "ssh_config").write_text("Host *\n  Port 22\n")
    (path / "unit.j2").write_text(Path(TEMPLATE).read_text())
    path.chmod(0)


def sparse(size: int) -> callable:
    """A file of ``size`` bytes that takes no disk (a sparse file): a size bound must refuse it unread."""
    def write(path: Path) -> None:
        with path.open("wb") as fh:
            fh.truncate(size)
    return write


def unreadable(text: str) -> callable:
    def write(path: Path) -> None:
        path.write_text(text)
        path.chmod(0)
    return write


def deep_yaml(depth: int) -> str:
    return "defaults: " + "[" * depth + "]" * depth + "\n"


def deep_json(depth: int) -> str:
    return '{"all": {"vars": {"x": ' + "[" * depth + "]" * depth + "}}}"


def script(output: str, *, sleep: float = 0, code: int = 0, host_output: str = "{}") -> str:
    """An executable inventory script: ``--list`` prints ``output``, ``--host H`` prints ``host_output``."""
    return f"""#!/bin/sh
sleep {sleep}
if [ "$1" = "--host" ]; then printf '%s' '{host_output}'; exit {code}; fi
cat <<'EOF'
{output}
EOF
exit {code}
"""


def kdeploy_yaml_cases() -> list[Case]:
    bad = {
        "empty-file": "",
        "only-comment": "# nothing\n",
        "top-level-list": "- a\n- b\n",
        "top-level-scalar": "hello\n",
        "yaml-syntax": "defaults: [\n",
        "yaml-tab-indent": "defaults:\n\tuser: root\n",
        "duplicate-key": inventory().replace("hosts:\n  h1:", "hosts:\n  h1:\n    address: 1.2.3.4\n  h1:"),
        "unknown-top-key": inventory() + "hostz: {}\n",
        "unknown-service-key": inventory(defaults="    tpp: 8\n"),
        "host-body-scalar": inventory(hosts="  h2: 5\n"),
        "host-without-address": inventory(hosts="  h2: {}\n"),
        "address-empty": inventory(hosts="  h2: {address: ''}\n"),
        "address-with-space": inventory(hosts="  h2: {address: 'a b'}\n"),
        "address-newline": inventory(hosts='  h2: {address: "a\\nb"}\n'),
        "address-dash-option": inventory(hosts="  h2: {address: '-oProxyCommand=x'}\n"),
        "port-zero": inventory(hosts="  h2: {address: 1.2.3.4, port: 0}\n"),
        "port-huge": inventory(hosts="  h2: {address: 1.2.3.4, port: 70000}\n"),
        "port-string": inventory(hosts="  h2: {address: 1.2.3.4, port: ssh}\n"),
        "port-bool": inventory(hosts="  h2: {address: 1.2.3.4, port: true}\n"),
        "port-float": inventory(hosts="  h2: {address: 1.2.3.4, port: 22.5}\n"),
        "tp-zero": inventory(service=SERVICE_BODY + "  tp: 0\n"),
        "tp-bool": inventory(service=SERVICE_BODY + "  tp: true\n"),
        "tp-negative": inventory(service=SERVICE_BODY + "  tp: -8\n"),
        "keep-releases-one": inventory(service=SERVICE_BODY + "keep_releases: 1\n"),
        "unit-name-slash": inventory(service=SERVICE_BODY.replace("name: svc", "name: a/b")),
        "unit-name-newline": inventory(service=SERVICE_BODY.replace("name: svc", 'name: "a\\nb"')),
        "unit-name-dot-service": inventory(service=SERVICE_BODY.replace("name: svc", "name: a.service")),
        "python-relative": inventory(service=SERVICE_BODY.replace("/usr/bin/python3", "python3")),
        "model-path-newline": inventory(service=SERVICE_BODY.replace("/models/m", '"/models/m\\nExecStartPre=/x"')),
        "env-value-newline": inventory(service=SERVICE_BODY + 'env: {A: "1\\nExecStartPre=/bin/x"}\n'),
        "env-name-bad": inventory(service=SERVICE_BODY + "env: {'A B': '1'}\n"),
        "env-name-equals": inventory(service=SERVICE_BODY + "env: {'A=B': '1'}\n"),
        "env-value-list": inventory(service=SERVICE_BODY + "env: {A: [1, 2]}\n"),
        "env-a-list": inventory(service=SERVICE_BODY + "env: [A=1]\n"),
        "env-secret-name": inventory(service=SERVICE_BODY + "env: {HF_TOKEN: abc}\n"),
        "extra-args-newline": inventory(service=SERVICE_BODY + '  extra_args: ["--x\\ny"]\n'),
        "extra-args-scalar": inventory(service=SERVICE_BODY + "  extra_args: --x\n"),
        "sglang-host-name": inventory(service=SERVICE_BODY + "  host: example.com\n"),
        "sglang-port-zero": inventory(service=SERVICE_BODY + "  port: 0\n"),
        "mem-fraction-one": inventory(service=SERVICE_BODY + "  mem_fraction_static: 1.5\n"),
        "gate-expect-bad-regex": inventory(service=SERVICE_BODY + "gate: {prompts: [{prompt: p, expect: '('}]}\n"),
        "gate-timeout-nan": inventory(service=SERVICE_BODY + "gate: {timeout: .nan}\n"),
        "gate-timeout-inf": inventory(service=SERVICE_BODY + "gate: {timeout: .inf}\n"),
        "gate-workers-zero": inventory(service=SERVICE_BODY + "gate: {workers: 0}\n"),
        "gate-markers-newline": inventory(service=SERVICE_BODY + 'gate: {markers: ["a\\nb"]}\n'),
        "parity-max-tokens-huge": inventory(service=SERVICE_BODY + "gate: {parity: {max_tokens: 100000}}\n"),
        "analysis-error-rate-2": inventory(service=SERVICE_BODY + "gate: {analysis: {max_error_rate: 2}}\n"),
        "analysis-min-requests-bool": inventory(service=SERVICE_BODY + "gate: {analysis: {min_requests: true}}\n"),
        "unit-timeout-negative": inventory(service=SERVICE_BODY + "unit: {timeout_start_sec: -1}\n"),
        "unit-kill-mode-bad": inventory(service=SERVICE_BODY + "unit: {kill_mode: none}\n"),
        "unit-user-newline": inventory(service=SERVICE_BODY + 'unit: {user: "a\\nb"}\n'),
        "secrets-without-file": inventory(service=SERVICE_BODY + "secrets: {env: [TOKEN]}\n"),
        "secrets-env-bad-name": inventory(service=SERVICE_BODY + "environment_file: /etc/x\n"
                                          "secrets: {env: ['A-B']}\n"),
        "secrets-env-unset": inventory(service=SERVICE_BODY + "environment_file: /etc/x\n"
                                       "secrets: {env: [KDEPLOY_CORPUS_UNSET]}\n"),
        "router-url-path": inventory(defaults="  router: {url: 'http://r:1/x'}\n"),
        "router-url-newline": inventory(defaults='  router: {url: "http://r:1\\n"}\n'),
        "router-worker-url-field": inventory(defaults="  router: {url: 'http://r:1', worker_url: 'http://{x}'}\n"),
        "router-worker-url-brace": inventory(defaults="  router: {url: 'http://r:1', worker_url: 'http://{'}\n"),
        "router-api-key-env-bad": inventory(defaults="  router: {url: 'http://r:1', api_key_env: 'a b'}\n"),
        "hooks-empty": inventory(defaults="  hooks: {pre_host: ' '}\n"),
        "hooks-timeout-zero": inventory(defaults="  hooks: {timeout: 0}\n"),
        "become-method-su": inventory(hosts="  h2: {address: 1.2.3.4, become_method: su}\n"),
        "become-user-bad": inventory(hosts="  h2: {address: 1.2.3.4, become_user: 'a b'}\n"),
        "connect-timeout-zero": inventory(hosts="  h2: {address: 1.2.3.4, connect_timeout: 0}\n"),
        "group-unknown-host": inventory(groups="  g2:\n    hosts: [nope]\n"),
        "group-hosts-scalar": inventory(groups="  g2:\n    hosts: h1\n"),
        "group-named-all": inventory(groups="  all:\n    hosts: [h1]\n"),
        "group-name-clash-host": inventory(groups="  h1:\n    hosts: [h1]\n"),
        "address-at-group": inventory(groups="  g2:\n    hosts: [h1]\n    address: 1.2.3.4\n"),
        "name-at-host": inventory(hosts="    name: other\n"),
        "yaml-anchor-bomb": "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)),
        "yaml-binary": b"\x00\x01\x02\xff\xfe",
        "yaml-bad-utf8": b"defaults:\n  user: \xff\xfe\n",
        "yaml-python-tag": "defaults: !!python/object/apply:os.system ['true']\n",
        "yaml-unknown-tag": "defaults: !foo bar\n",
        "deep-yaml": deep_yaml(20000),
        "yaml-merge-chain": "m0: &m0 {k0: 1}\n" + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}\n"
                                                           for i in range(1, 6000)),
        "env-value-c1-csi": inventory(service=SERVICE_BODY + 'env: {A: "\\x9b2J"}\n'),
        "env-value-bidi": inventory(service=SERVICE_BODY + 'env: {A: "ok\\u202eevil"}\n'),
        "deep-yaml-mapping": "defaults: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
    }
    cases = [Case(f"kdeploy-yaml-{name}", render(), {"inv.yaml": text}) for name, text in bad.items()]
    cases += [
        Case("kdeploy-yaml-unknown-key-named", render(), {"inv.yaml": inventory(defaults="    tpp: 8\n")},
             mentions=("inv.yaml:", "tpp")),
        Case("kdeploy-yaml-valid", render(), {"inv.yaml": inventory()}, expect="ok", stdout="# ---- h1 ----"),
        Case("kdeploy-yaml-template-missing", render(),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "nope.j2"))}),
        Case("kdeploy-yaml-template-syntax", render(),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "unit.j2")), "unit.j2": "{% if %}\n"}),
        Case("kdeploy-yaml-template-undefined", render(),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "unit.j2")),
              "unit.j2": "[Service]\nExecStart={{ nope.field }}\n"}),
        Case("kdeploy-yaml-template-binary", render(),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "unit.j2")), "unit.j2": b"\xff\xfe\x00"}),
        Case("kdeploy-yaml-template-is-dir", render(),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "{d}")), }),
        # a FIFO with no writer reads as empty: render prints the empty unit, check refuses it
        Case("kdeploy-yaml-template-fifo", ("check", "all", "-i", "inv.yaml"),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "unit.j2")), "unit.j2": fifo},
             expect="report", timeout=10),
    ]
    return cases


def ansible_cases() -> list[Case]:
    ini = {
        "cycle": "[a:children]\nb\n[b:children]\na\n[b]\nh1\n",
        "self-cycle": "[a:children]\na\n[a]\nh1\n",
        "long-cycle": "".join(f"[g{i}:children]\ng{(i + 1) % 30}\n" for i in range(30)) + "[g0]\nh1\n",
        "bad-section": "[a:weird]\nh1\n",
        "unclosed-section": "[a\nh1\n",
        "range-open": "[a]\nh[1:]\n",
        "range-reversed": "[a]\nh[9:1]\n",
        "range-huge": "[a]\nh[0:99999999]\n",
        "range-overflow": "[a]\nh[0:99999999999999999999999]\n",
        "range-step-zero": "[a]\nh[1:9:0]\n",
        "line-5-mb": "[a]\nh1 x=" + "a" * 5_000_000 + "\n",
        "range-letters-mixed": "[a]\nh[a:9]\n",
        "vars-without-group": "[a:vars]\nx=1\n",
        "var-no-equals": "[a]\nh1 ansible_host\n",
        "host-port-bad": "[a]\nh1:port\n",
        "host-port-huge": "[a]\nh1:99999\n",
        "ansible-port-bad": "[a]\nh1 ansible_port=abc\n",
        "ansible-host-space": "[a]\nh1 ansible_host='a b'\n",
        "ansible-host-empty": "[a]\nh1 ansible_host=''\n",
        "become-bad": "[a]\nh1 ansible_become=maybe\n",
        "binary": "\x00\x01[a]\n",
        "unbalanced-quote": "[a]\nh1 ansible_user='abc\n",
        "kdeploy-var-bad": "[a]\nh1 kdeploy_connect_timeout=abc\n",
    }
    cases = [Case(f"ansible-ini-{name}", render("hosts.ini", service=True),
                  {"hosts.ini": text, "svc.yaml": SERVICE_FILE}) for name, text in ini.items()]
    yaml = {
        "cycle": "all:\n  children:\n    a:\n      children:\n        b:\n          children:\n            a: {}\n",
        "typo-children": "all:\n  chilren:\n    a:\n      hosts:\n        h1: {}\n",
        "typo-hosts": "all:\n  children:\n    a:\n      hots:\n        h1: {}\n",
        "group-a-list": "all:\n  children: [a]\n",
        "vars-a-list": "all:\n  vars: [a]\n  hosts:\n    h1: {}\n",
        "deep": "all:\n  vars:\n    x: " + "[" * 20000 + "]" * 20000 + "\n",
        "vault": "all:\n  hosts:\n    h1:\n      ansible_user: !vault |\n        $ANSIBLE_VAULT;1.1;AES256\n"
                 "        6162\n",
        "port-string": "all:\n  hosts:\n    h1:\n      ansible_port: ssh\n",
    }
    cases += [Case(f"ansible-yaml-{name}", render("hosts.yml", service=True),
                   {"hosts.yml": text, "svc.yaml": SERVICE_FILE}) for name, text in yaml.items()]
    cases += [
        Case("ansible-yaml-typo-named", render("hosts.yml", service=True),
             {"hosts.yml": yaml["typo-children"], "svc.yaml": SERVICE_FILE}, mentions=("chilren",)),
        Case("ansible-yaml-unsafe", render("hosts.yml", service=True),
             {"hosts.yml": "all:\n  hosts:\n    h1:\n      ansible_host: !unsafe '127.0.0.1'\n"
                           "      ansible_user: !unsafe 'u'\n", "svc.yaml": SERVICE_FILE},
             expect="ok", stdout="# ---- h1 ----"),
        Case("ansible-yaml-unsafe-in-group-vars", render("inv", service=True),
             {"inv/hosts.yml": "all:\n  hosts:\n    h1: {}\n",
              "inv/group_vars/all.yml": "ansible_user: !unsafe 'deploy'\n", "svc.yaml": SERVICE_FILE},
             expect="ok", stdout="User=" if False else "# ---- h1 ----"),
    ]
    listing = {
        "cycle": {"_meta": {"hostvars": {}}, "a": {"children": ["b"]}, "b": {"children": ["a"], "hosts": ["h1"]}},
        "self-cycle": {"_meta": {"hostvars": {}}, "a": {"children": ["a"], "hosts": ["h1"]}},
        "hosts-not-list": {"_meta": {"hostvars": {}}, "a": {"hosts": "h1"}},
        "hostvars-not-dict": {"_meta": {"hostvars": {"h1": 5}}, "a": {"hosts": ["h1"]}},
        "meta-not-dict": {"_meta": [], "a": {"hosts": ["h1"]}},
        "group-scalar": {"a": 5},
        "top-list": ["h1"],
        "port-nested": {"_meta": {"hostvars": {"h1": {"ansible_port": {"a": 1}}}}, "a": {"hosts": ["h1"]}},
        "host-name-newline": {"_meta": {"hostvars": {}}, "a": {"hosts": ["h1\nkdeploy: forged"]}},
        "user-vault": {"_meta": {"hostvars": {"h1": {"ansible_user": {"__ansible_vault": "$ANSIBLE_VAULT;1.1"}}}},
                       "a": {"hosts": ["h1"]}},
    }
    cases += [Case(f"ansible-list-{name}", render("list.json", service=True),
                   {"list.json": as_json(data), "svc.yaml": SERVICE_FILE}) for name, data in listing.items()]
    unsafe = {"_meta": {"hostvars": {"h1": {"ansible_host": {"__ansible_unsafe": "127.0.0.1"},
                                            "ansible_user": {"__ansible_unsafe": "u"}}}}, "g": {"hosts": ["h1"]}}
    cases += [
        Case("ansible-list-deep", render("list.json", service=True),
             {"list.json": deep_json(20000), "svc.yaml": SERVICE_FILE}),
        Case("ansible-list-bad-json", render("list.json", service=True),
             {"list.json": '{"a": {"hosts": ["h1"]', "svc.yaml": SERVICE_FILE}),
        Case("ansible-list-unsafe", render("list.json", service=True),
             {"list.json": as_json(unsafe), "svc.yaml": SERVICE_FILE}, expect="ok", stdout="# ---- h1 ----"),
        Case("ansible-list-unsafe-script", render("inv.py", service=True),
             {"inv.py": script(as_json(unsafe)), "svc.yaml": SERVICE_FILE}, expect="ok", stdout="# ---- h1 ----"),
    ]
    scripts = {
        "exit-1": script("{}", code=1),
        "garbage": script("not json"),
        "empty-output": script(""),
        "cycle": script(as_json(listing["cycle"])),
        "deep": script(deep_json(20000)),
        "top-list": script('["h1"]'),
        "slow": script("{}", sleep=30),
        "host-call-fails": script(as_json({"a": {"hosts": ["h1"]}}), host_output="nope"),
    }
    env = {"KDEPLOY_INVENTORY_TIMEOUT": "2"}
    cases += [Case(f"ansible-script-{name}", render("inv.py", service=True),
                   {"inv.py": text, "svc.yaml": SERVICE_FILE}, env=env) for name, text in scripts.items()]
    cases += [
        Case("ansible-script-huge-output", render("inv.py", service=True),
             {"inv.py": "#!/bin/sh\nexec cat /dev/zero\n", "svc.yaml": SERVICE_FILE}, env=env, timeout=20),
        Case("ansible-script-no-meta-many-hosts", render("inv.py", service=True),
             {"inv.py": "#!/bin/sh\nif [ \"$1\" = --host ]; then sleep 0.2; echo '{}'; exit 0; fi\n"
                        "echo '" + as_json({"g": {"hosts": [f"h{i}" for i in range(30)]}}) + "'\n",
              "svc.yaml": SERVICE_FILE}, env={"KDEPLOY_INVENTORY_TIMEOUT": "5"}, expect="ok",
             stdout="# ---- h29 ----", timeout=30),
        Case("ansible-dir-empty", render("inv", service=True), {"inv/.keep": "", "svc.yaml": SERVICE_FILE}),
        Case("ansible-dir-bad-group-vars", render("inv", service=True),
             {"inv/hosts.ini": "h1\n", "inv/group_vars/all.yml": "a: [\n", "svc.yaml": SERVICE_FILE}),
        Case("ansible-dir-group-vars-list", render("inv", service=True),
             {"inv/hosts.ini": "h1\n", "inv/group_vars/all.yml": "- a\n", "svc.yaml": SERVICE_FILE}),
        Case("ansible-dir-host-vars-deep", render("inv", service=True),
             {"inv/hosts.ini": "h1\n", "inv/host_vars/h1.yml": deep_yaml(20000), "svc.yaml": SERVICE_FILE}),
        Case("ansible-without-service", render("hosts.ini"), {"hosts.ini": "h1\n"}),
        Case("ansible-service-missing", render("hosts.ini", service=True), {"hosts.ini": "h1\n"}),
        Case("ansible-service-bad-yaml", render("hosts.ini", service=True),
             {"hosts.ini": "h1\n", "svc.yaml": "service: [\n"}),
        Case("ansible-service-unknown-key", render("hosts.ini", service=True),
             {"hosts.ini": "h1\n", "svc.yaml": SERVICE_FILE + "  tpp: 1\n"}),
        Case("ansible-service-deep", render("hosts.ini", service=True),
             {"hosts.ini": "h1\n", "svc.yaml": deep_yaml(20000)}),
        Case("ansible-service-fifo", render("hosts.ini", service=True), {"hosts.ini": "h1\n", "svc.yaml": fifo},
             timeout=10),
        Case("ansible-service-with-kdeploy-inventory", render(service=True),
             {"inv.yaml": inventory(), "svc.yaml": SERVICE_FILE}),
    ]
    return cases


def path_cases() -> list[Case]:
    nl = "inv\nkdeploy: FORGED line"
    esc = "inv\x1b[2Jx"
    return [
        Case("path-missing", render("nope.yaml")),
        Case("path-is-dir-without-inventory", render("d"), {"d/.keep": ""}),
        Case("path-dev-zero", render("/dev/zero"), timeout=20),
        Case("path-dev-null", render("/dev/null")),
        Case("path-fifo", render("pipe"), {"pipe": fifo}, timeout=10),
        Case("path-newline-missing", render(nl)),
        Case("path-newline-present", render(nl), {nl: "hosts: [\n"}),
        Case("path-escape", render(esc)),
        Case("env-inventory-newline", ("render", "all"), env={"KDEPLOY_INVENTORY": nl}),
        Case("env-inventory-escape", ("render", "all"), env={"KDEPLOY_INVENTORY": esc}),
        Case("env-inventory-missing", ("render", "all"), env={"KDEPLOY_INVENTORY": "nope.yaml"}),
        Case("env-service-missing", ("render", "all", "-i", "hosts.ini"), {"hosts.ini": "h1\n"},
             env={"KDEPLOY_SERVICE": "nope.yaml"}),
        Case("env-service-newline", ("render", "all", "-i", "hosts.ini"), {"hosts.ini": "h1\n"},
             env={"KDEPLOY_SERVICE": nl}),
        Case("default-inventory-missing", ("render", "all")),
        Case("unprivileged-inventory-locked-dir", render("locked/inv.yaml"), {"locked": locked_dir}, unprivileged=True),
        Case("unprivileged-inventory-unreadable", render(), {"inv.yaml": unreadable(inventory())}, unprivileged=True),
        Case("unprivileged-ini-locked-dir", render("locked/hosts.ini", service=True),
             {"locked": locked_dir, "svc.yaml": SERVICE_FILE}, unprivileged=True),
        Case("unprivileged-service-locked-dir", ("render", "all", "-i", "hosts.ini", "--service", "locked/svc.yaml"),
             {"locked": locked_dir, "hosts.ini": "h1\n"}, unprivileged=True),
        Case("unprivileged-template-locked-dir", ("check", "all", "-i", "inv.yaml"),
             {"locked": locked_dir, "inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "locked/unit.j2"))},
             unprivileged=True, expect="report"),
        Case("unprivileged-render-template-locked-dir", render(),
             {"locked": locked_dir, "inv.yaml": inventory(service=SERVICE_BODY.replace(TEMPLATE, "locked/unit.j2"))},
             unprivileged=True),
        Case("unprivileged-ssh-config-locked-dir",
             ("plan", "all", "-i", "inv.yaml", "--ssh-config", "locked/ssh_config"),
             {"locked": locked_dir, "inv.yaml": inventory()}, unprivileged=True, expect="report"),
        Case("unprivileged-ssh-config-env-locked-dir", ("plan", "all", "-i", "inv.yaml"),
             {"locked": locked_dir, "inv.yaml": inventory()}, env={"KDEPLOY_SSH_CONFIG": "locked/ssh_config"},
             unprivileged=True, expect="report"),
        Case("unprivileged-limit-file-locked-dir", render("inv.yaml", "--limit", "@locked/inv.yaml"),
             {"locked": locked_dir, "inv.yaml": inventory()}, unprivileged=True),
        Case("unprivileged-ansible-dir-unreadable-file", render("inv", service=True),
             {"inv/hosts.ini": "h1\n", "inv/more.ini": unreadable("h2\n"), "svc.yaml": SERVICE_FILE},
             unprivileged=True),
        Case("unprivileged-group-vars-unreadable", render("inv", service=True),
             {"inv/hosts.ini": "h1\n", "inv/group_vars/all.yml": unreadable("x: 1\n"), "svc.yaml": SERVICE_FILE},
             unprivileged=True),
        # The SSH config is read per host (the inventory may name one per host): a bad one is that host's report.
        Case("ssh-config-missing", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "nope"),
             {"inv.yaml": inventory()}, expect="report", mentions=("nope",)),
        Case("ssh-config-dev-zero", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "/dev/zero"),
             {"inv.yaml": inventory()}, expect="report", timeout=20),
        Case("ssh-config-fifo", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "pipe"),
             {"inv.yaml": inventory(), "pipe": fifo}, expect="report", timeout=10, mentions=("not a regular file",)),
        Case("ssh-config-sparse-3g", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "big"),
             {"inv.yaml": inventory(), "big": sparse(3 << 30)},
             expect="report", mentions=("larger than",)),
        Case("ssh-config-bad-line", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "cfg"),
             {"inv.yaml": inventory(), "cfg": "Host *\n  Port notaport\n"}, expect="report"),
        Case("ssh-config-include-loop", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "cfg"),
             {"inv.yaml": inventory(), "cfg": "Include {d}/cfg\nHost *\n  Port 22\n"}, expect="report"),
        Case("ssh-config-newline-name", ("plan", "all", "-i", "inv.yaml", "--ssh-config", "x\nkdeploy: FORGED"),
             {"inv.yaml": inventory()}, expect="report"),
        Case("ssh-config-inventory-missing", ("plan", "all", "-i", "inv.yaml"),
             {"inv.yaml": inventory(hosts="    ssh_config: nope\n")}, expect="report", mentions=("nope",)),
        Case("unprivileged-junit-in-locked-dir", ("push", "all", "-i", "inv.yaml", "--junit", "locked/r.xml"),
             {"locked": locked_dir, "inv.yaml": inventory()}, unprivileged=True, mentions=("--junit",)),
        Case("unprivileged-junit-below-locked-dir", ("push", "all", "-i", "inv.yaml", "--junit", "locked/a/r.xml"),
             {"locked": locked_dir, "inv.yaml": inventory()}, unprivileged=True, mentions=("--junit",)),
        Case("limit-file-missing", render("inv.yaml", "--limit", "@nope"), {"inv.yaml": inventory()}),
        Case("limit-file-dev-zero", render("inv.yaml", "--limit", "@/dev/zero"), {"inv.yaml": inventory()},
             timeout=20),
        Case("limit-file-fifo", render("inv.yaml", "--limit", "@pipe"), {"inv.yaml": inventory(), "pipe": fifo},
             timeout=10),
        Case("limit-file-binary", render("inv.yaml", "--limit", "@lim"), {"inv.yaml": inventory(), "lim": b"\xff\x00"}),
        Case("limit-file-ok", render("inv.yaml", "--limit", "@lim"), {"inv.yaml": inventory(), "lim": "h1\n"},
             expect="ok", stdout="# ---- h1 ----"),
        Case("secrets-file-missing", ("check", "all", "-i", "inv.yaml"),
             {"inv.yaml": inventory(service=SERVICE_BODY + "environment_file: /etc/x\nsecrets: {file: nope}\n")}),
    ]


def option_cases() -> list[Case]:
    inv = {"inv.yaml": inventory()}
    push = ("push", "all", "-i", "inv.yaml")
    cases = {
        "canary-negative": (*push, "--canary", "-1"),
        "canary-word": (*push, "--canary", "x"),
        "canary-too-many": (*push, "--canary", "5"),
        "parallel-zero": (*push, "--parallel", "0"),
        "parallel-word": (*push, "--parallel", "x"),
        "batch-word": (*push, "--batch", "x"),
        "batch-zero": (*push, "--batch", "0"),
        "batch-percent-over": (*push, "--batch", "150%"),
        "batch-negative": (*push, "--batch", "-2"),
        "max-fail-word": (*push, "--max-fail", "lots"),
        "max-fail-percent-bad": (*push, "--max-fail", "%"),
        "analysis-bad": (*push, "--canary", "1", "--analysis", "5 minutes"),
        "analysis-without-canary": (*push, "--analysis", "5m"),
        "analysis-zero": (*push, "--canary", "1", "--analysis", "0s"),
        "timeout-zero": (*push, "--timeout", "0"),
        "timeout-nan": (*push, "--timeout", "nan"),
        "timeout-inf": (*push, "--timeout", "inf"),
        "lock-wait-negative": (*push, "--lock-wait", "-1"),
        "lock-wait-word": (*push, "--lock-wait", "soon"),
        "workers-zero": ("verify", "all", "-i", "inv.yaml", "--workers", "0"),
        "unknown-option": (*push, "--frobnicate"),
        "missing-target": ("push", "-i", "inv.yaml"),
        "missing-option-value": (*push, "--batch"),
        "unknown-command": ("pushh", "all"),
        "target-bad-regex": ("render", "~(", "-i", "inv.yaml"),
        "target-empty": ("render", "", "-i", "inv.yaml"),
        "target-newline": ("render", "h1\nkdeploy: FORGED", "-i", "inv.yaml"),
        "limit-bad-regex": ("render", "all", "-i", "inv.yaml", "--limit", "~["),
        "junit-to-dir": (*push, "--junit", "{d}"),
        "json-with-bad-inventory": ("push", "all", "-i", "nope.yaml", "--json"),
        "history-n-zero": ("history", "all", "-i", "inv.yaml", "-n", "0"),
        "logs-lines-negative": ("logs", "all", "-i", "inv.yaml", "--lines", "-5"),
        "logs-run-bad": ("logs", "all", "-i", "inv.yaml", "--run", "older"),
        "logs-grep-bad-regex": ("logs", "all", "-i", "inv.yaml", "--grep", "("),
        "exec-no-command": ("exec", "all", "-i", "inv.yaml"),
        "exec-timeout-zero": ("exec", "all", "-i", "inv.yaml", "--timeout", "0", "--", "true"),
        "rollback-to-bad": ("rollback", "all", "-i", "inv.yaml", "--to", "../../etc"),
        "rollback-to-newline": ("rollback", "all", "-i", "inv.yaml", "--to", "a\nb"),
        "rollback-to-empty": ("rollback", "all", "-i", "inv.yaml", "--to", ""),
        "target-range-overflow": ("render", "x[0:99999999999999999999999]", "-i", "inv.yaml"),
        "set-env-c1-value": ("set-env", "A=\x9b2J", "-i", "inv.yaml"),
        "set-env-bidi-value": ("set-env", "A=ok\u202eevil", "-i", "inv.yaml"),
        "set-env-no-equals": ("set-env", "A", "-i", "inv.yaml"),
        "set-env-bad-name": ("set-env", "A B=1", "-i", "inv.yaml"),
        "set-env-empty-name": ("set-env", "=1", "-i", "inv.yaml"),
        "set-env-newline-value": ("set-env", "A=1\nExecStartPre=/bin/x", "-i", "inv.yaml"),
        "set-env-secret-name": ("set-env", "HF_TOKEN=abc", "-i", "inv.yaml"),
        "set-env-unset-bad": ("set-env", "--unset", "A B", "-i", "inv.yaml"),
        "set-env-target-unknown": ("set-env", "A=1", "--target", "nope", "-i", "inv.yaml"),
        "set-unknown-setting": ("set", "foo.bar=1", "-i", "inv.yaml"),
        "set-bad-value": ("set", "hicache.ratio=abc", "-i", "inv.yaml"),
        "set-no-equals": ("set", "hicache.ratio", "-i", "inv.yaml"),
        "set-negative": ("set", "hicache.ratio=-1", "-i", "inv.yaml"),
        "show-completion-bad-shell": ("--show-completion", "tcsh"),
        "lock-release-missing-target": ("lock", "release", "-i", "inv.yaml"),
        "router-bad-action": ("router", "flush", "all", "-i", "inv.yaml"),
        "schema-bad": ("schema", "nope"),
        "sandbox-bad-hosts": ("sandbox", "up", "--hosts", "0"),
        "sandbox-hosts-not-multiple": ("sandbox", "up", "--hosts", "3", "--nodes-per-server", "2"),
        "sandbox-bad-nodes-per-server": ("sandbox", "up", "--nodes-per-server", "0"),
        "sandbox-pd-one-server": ("sandbox", "up", "--pd", "--hosts", "2", "--nodes-per-server", "2"),
    }
    result = [Case(f"option-{name}", argv, inv) for name, argv in cases.items()]
    env_cases = {
        "parallel-word": {"KDEPLOY_PARALLEL": "x"},
        "parallel-zero": {"KDEPLOY_PARALLEL": "0"},
        "parallel-newline": {"KDEPLOY_PARALLEL": "1\nkdeploy: FORGED"},
        "lock-wait-word": {"KDEPLOY_LOCK_WAIT": "soon"},
        "lock-wait-negative": {"KDEPLOY_LOCK_WAIT": "-5"},
        "inventory-timeout-word": {"KDEPLOY_INVENTORY_TIMEOUT": "abc"},
        "inventory-timeout-negative": {"KDEPLOY_INVENTORY_TIMEOUT": "-1"},
        "inventory-timeout-nan": {"KDEPLOY_INVENTORY_TIMEOUT": "nan"},
    }
    for name, env in env_cases.items():
        argv = ("push", "all", "-i", "inv.py", "--service", "svc.yaml")
        files = {"inv.py": script(as_json({"_meta": {"hostvars": {}}, "g": {"hosts": ["h1"]}})),
                 "svc.yaml": SERVICE_FILE, **inv}
        result.append(Case(f"env-{name}", argv, files, env=env, mentions=(next(iter(env)),)))
    result += [
        Case("env-ssh-config-missing", ("plan", "all", "-i", "inv.yaml"), inv, env={"KDEPLOY_SSH_CONFIG": "nope"},
             expect="report", mentions=("nope",)),
        Case("option-parallel-names-option", (*push, "--parallel", "x"), inv, mentions=("--parallel",)),
        Case("option-help", ("push", "-h"), expect="ok", stdout="--canary"),
        Case("option-version", ("--version",), expect="ok", stdout="kdeploy "),
        Case("option-target-unknown", ("render", "nope*", "-i", "inv.yaml"), inv, mentions=("nope*",)),
        Case("option-target-empty-group-is-ok", ("render", "g2", "-i", "inv.yaml"),
             {"inv.yaml": inventory(groups="  g2:\n    hosts: []\n")}, expect="ok"),
        Case("option-schema-report", ("schema", "report"), expect="ok", stdout='"$schema"'),
    ]
    return result


def check_cases() -> list[Case]:
    """``check`` reports findings per host: exit 2, and a planted name cannot add a line of its own."""
    evil = "evil\ninv.yaml:1: FAKE finding"

    def payload_with(name: str) -> callable:
        def write(path: Path) -> None:
            path.mkdir()
            (path / "kdtree_plugin.py").write_text("x = 1\n")
            (path / name).write_text("")
            (path / name).chmod(0)
        return write

    def deep_payload(path: Path) -> None:
        for _ in range(1500):  # deeper than Python's recursion limit, within PATH_MAX
            path.mkdir()
            path = path / "d"
        path.with_name("x.py").write_text("x = 1\n")

    def unreadable_in_payload(kind: str) -> callable:
        def write(path: Path) -> None:
            (path / "sub").mkdir(parents=True)
            (path / "sub" / "x.py").write_text("x = 1\n")
            (path / "sub" if kind == "dir" else path / "sub" / "x.py").chmod(0)
        return write

    def payload(name: str, content: Content) -> dict[str, Content]:
        return {"inv.yaml": inventory(service=SERVICE_BODY.replace(PAYLOAD, "{d}/pl")), "pl": content}

    check = ("check", "all", "-i", "inv.yaml")
    return [
        Case("check-payload-nested-1500-deep", check, payload("pl", deep_payload), expect="ok"),
        Case("check-payload-unreadable-file", check, payload("pl", unreadable_in_payload("file")), expect="report",
             unprivileged=True, mentions=("x.py",)),
        Case("check-payload-unreadable-dir", check, payload("pl", unreadable_in_payload("dir")), expect="report",
             unprivileged=True, mentions=("sub",)),
        Case("check-evil-payload-name", ("check", "all", "-i", "inv.yaml"),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(PAYLOAD, "{d}/pl")), "pl": payload_with(evil)},
             expect="report", unprivileged=True),
        Case("check-evil-payload-dir", ("check", "all", "-i", "inv.yaml"),
             {"inv.yaml": inventory(service=SERVICE_BODY.replace(PAYLOAD, '"./nope\\nkdeploy: FAKE"'))},
             expect="report"),
    ]


CASES = [*kdeploy_yaml_cases(), *ansible_cases(), *path_cases(), *option_cases(), *check_cases()]


def test_the_corpus_is_large_and_its_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 150


@pytest.fixture(scope="module")
def outcomes():
    root = Path(tempfile.mkdtemp(prefix="kdeploy-corpus-"))
    try:
        yield run_all(CASES, root / "cases", parallel=max(2, os.cpu_count() or 2)), root / "cases"
    finally:  # shutil.rmtree recurses: the 1500-deep payload is more than Python's stack takes
        subprocess.run(["chmod", "-R", "u+rwX", root], check=False)
        subprocess.run(["rm", "-rf", root], check=True)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcomes):
    done, root = outcomes
    problems = done[case.id].problems(case, root / case.id)
    assert not problems, "; ".join(problems)
