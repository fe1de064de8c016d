"""A command's report as JUnit XML, for the test views of GitLab, Jenkins and GitHub reporters.

One ``<testsuite>`` per command (inside ``<testsuites>``), one ``<testcase>`` per host (``classname`` =
service, ``name`` = host); a host that did not end well gets a ``<failure>`` naming its failed phase and
that phase's detail. The schema GitLab and Jenkins read (Jenkins' junit-10.xsd, checked in the tests) has
no properties on a testcase, so the phases are the suite's properties (``<host>.<phase>``) and the
testcase's system-out.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping
from datetime import datetime

from kdeploy import __version__
from kdeploy.core.report import HostResult, Phase, Report, Result
from kdeploy.core.text import one_line


def _body(lines: list[str]) -> str:
    """Lines of an element's text, each one line (a test view shows them as written; XML 1.0 cannot hold ESC)."""
    return "\n".join(one_line(line) for line in lines)


def _phase_value(phase: Phase) -> str:
    return one_line(f"{'ok' if phase.ok else 'FAIL'} {phase.seconds:.3f}s {phase.detail}".strip())


def _testcase(host: HostResult, service: str) -> ET.Element:
    case = ET.Element("testcase", name=host.host, classname=service,
                      time=f"{sum(p.seconds for p in host.phases):.3f}")
    if host.result == Result.SKIPPED:
        ET.SubElement(case, "skipped", message=one_line(host.error or "skipped"))
    elif not host.ok:
        failed = host.failed_phase()
        where = failed.name if failed else "-"
        detail = host.error or (failed.detail if failed else "")
        failure = ET.SubElement(case, "failure", type=str(host.result), message=one_line(f"{where}: {detail}"))
        failure.text = _body([f"result: {host.result}", f"phase: {where}", f"detail: {detail}", *host.log])
    out = [f"{p.name} {_phase_value(p)}" for p in host.phases]
    out.append(f"result: {host.result}; release: {host.release or '-'}")
    ET.SubElement(case, "system-out").text = _body(out)
    return case


def build(report: Report, services: Mapping[str, str], *, started: datetime, seconds: float) -> str:
    """The JUnit document for ``report``; ``services`` maps each host to its service (the testcase classname)."""
    failures = sum(1 for h in report.hosts if not h.ok and h.result != Result.SKIPPED)
    skipped = sum(1 for h in report.hosts if h.result == Result.SKIPPED)
    suite = ET.Element("testsuite", name=f"kdeploy {report.command}", tests=str(len(report.hosts)),
                       failures=str(failures), errors="0", skipped=str(skipped), time=f"{seconds:.3f}",
                       timestamp=started.isoformat(timespec="seconds"))
    props = ET.SubElement(suite, "properties")
    for name, value in (("command", report.command), ("exit_code", str(report.exit_code)),
                        ("kdeploy_version", __version__)):
        ET.SubElement(props, "property", name=name, value=value)
    for host in report.hosts:
        for phase in host.phases:
            ET.SubElement(props, "property", name=f"{host.host}.{phase.name}", value=_phase_value(phase))
    for host in report.hosts:
        suite.append(_testcase(host, services.get(host.host, "kdeploy")))
    root = ET.Element("testsuites", name="kdeploy", tests=suite.get("tests", "0"), failures=str(failures),
                      errors="0", time=f"{seconds:.3f}")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
