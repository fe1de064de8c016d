"""kdeploy/cli/schema.py: the --json contract, checked against real reports and the dataclasses they come from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

from kdeploy import __version__
from kdeploy.cli import app as cli
from kdeploy.cli import schema
from kdeploy.core.report import SCHEMA_VERSION, HostResult, Phase, Report, Result
from kdeploy.flows import views
from kdeploy.host import lock


def described(node: object, where: str = "") -> list[str]:
    """Every property of every object in the schema that has no description."""
    missing = []
    if isinstance(node, dict):
        for name, prop in node.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{where}.{name}")
        for key, value in node.items():
            missing += described(value, f"{where}.{key}" if key != "properties" else where)
    elif isinstance(node, list):
        for item in node:
            missing += described(item, where)
    return missing


def test_every_field_of_the_report_schema_is_described(capsys):
    assert cli.main(["schema", "report"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == schema.report_schema()
    assert described(printed) == []


@pytest.mark.parametrize(("doc", "source"), [
    (schema.PhaseDoc, Phase), (schema.PlanDoc, views.Plan), (schema.StatusDoc, views.StatusView),
    (schema.LockHolderDoc, lock.LockInfo),
])
def test_the_models_have_the_dataclasses_fields(doc, source):
    assert list(doc.model_fields) == [f.name for f in dataclasses.fields(source)]


def reports() -> list[Report]:
    plan = views.Plan(["a.py"], [], [], "--- a\n+++ b\n", True, True, ["unit changed"])
    status = views.StatusView("active", "running", "t", {"A": "1"}, {"result": "deployed"}, [])
    holder = lock.LockInfo("ci", "runner", 12, "t", "kdeploy push all", 99)
    hosts = [
        HostResult("h1", phases=[Phase("connect", True, 0.1, "root@h1:22")], release="r1").finish(Result.DEPLOYED),
        HostResult("h2", phases=[Phase("ready", False, 3.0, "no")], log=["line"], attempted="r2",
                   traceback="tb").finish(Result.ROLLED_BACK, "no"),
        HostResult("h3", details=plan).finish(Result.PLANNED),
        HostResult("h4", details=status).finish(Result.OK),
        HostResult("h5", details=views.History([{"result": "deployed"}])).finish(Result.OK),
        HostResult("h6", details=views.LockView("held", holder)).finish(Result.OK),
        HostResult("h7", restored=Result.RESTORED).finish(Result.ROLLED_BACK),
    ]
    edit = {"inventory": {"path": "i.yaml", "level": "defaults", "diff": "", "rolled_out_to": ["h1"],
                          "reverted": True, "conflicts": [], "restored_hosts": {"h1": Result.RESTORED}}}
    return [Report("push", hosts), Report("set-env", [], edit)]


@pytest.mark.parametrize("report", reports(), ids=["hosts", "set-env"])
def test_real_reports_validate_and_carry_the_versions(report):
    document = json.loads(json.dumps(report.as_json(), default=str))
    schema.ReportDoc.model_validate(document)  # extra keys forbidden: a new field needs its description
    assert (document["schema_version"], document["kdeploy_version"]) == (SCHEMA_VERSION, __version__)


REPO = Path(__file__).resolve().parents[2]


def test_the_inventory_schema_is_printed_committed_and_described(capsys):
    assert cli.main(["schema", "inventory"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == schema.inventory_schema()
    assert json.loads((REPO / "schemas" / "inventory.schema.json").read_text()) == printed, \
        "regenerate: kdeploy schema inventory > schemas/inventory.schema.json"
    assert described(printed) == []


def test_the_example_inventory_names_its_schema_and_validates():
    text = (REPO / "inventory.yaml").read_text()
    assert text.splitlines()[0] == "# yaml-language-server: $schema=schemas/inventory.schema.json"
    validator = jsonschema.Draft202012Validator(schema.inventory_schema())
    doc = YAML(typ="safe").load(text)
    assert list(validator.iter_errors(doc)) == []
    doc["defaults"]["service"]["sglang"]["tpp"] = 8
    doc["hosts"]["ct200"]["port"] = 0
    assert len(list(validator.iter_errors(doc))) == 2


def test_the_reference_tables_of_docs_inventory_are_the_models():
    text = (REPO / "docs" / "inventory.md").read_text()
    assert text.count("<!-- BEGIN generated:") == len(schema._TABLES)
    assert schema.update_reference(text) == text, "regenerate: python -m kdeploy.cli.schema docs/inventory.md"
