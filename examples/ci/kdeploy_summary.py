"""A kdeploy JSON report (``--json``) as a Markdown job summary: GitHub Actions shows ``$GITHUB_STEP_SUMMARY`` on
the run's page, so a deploy's hosts and failed phases are read there without downloading the artifact.

Usage: ``python3 kdeploy_summary.py reports/kdeploy.json >> "$GITHUB_STEP_SUMMARY"``. Standard library only (it
runs with the runner's python3); a missing or unreadable report (kdeploy stopped before printing one) is said in
the summary, not raised: the deploy step's exit status is what fails the job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cell(text: object) -> str:
    """One Markdown table cell: no line breaks, no column separators."""
    return " ".join(str(text).split()).replace("|", "\\|")


def summary(report: dict) -> str:
    counts = ", ".join(f"{name} {n}" for name, n in report["summary"].items() if name != "hosts")
    mark = "passed" if report["ok"] else "FAILED"
    lines = [f"### kdeploy {report['command']}: {mark}, exit code {report['exit_code']}", "",
             f"{report['summary'].get('hosts', len(report['hosts']))} hosts: {counts or 'none'}", "",
             "| host | result | release | last phase | seconds | detail |", "| --- | --- | --- | --- | ---: | --- |"]
    for host in report["hosts"]:
        phases = host["phases"]
        failed = next((p for p in phases if not p["ok"]), phases[-1] if phases else None)
        seconds = sum(p["seconds"] for p in phases)
        detail = host["error"] or (failed["detail"] if failed else "")
        lines.append(f"| {cell(host['host'])} | {cell(host['result'])} | {cell(host['release'] or '')} | "
                     f"{cell(failed['name'] if failed else '')} | {seconds:.1f} | {cell(detail)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: kdeploy_summary.py REPORT.json\n")
        return 2
    path = Path(argv[0])
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        sys.stdout.write(f"### kdeploy: no report\n\n{cell(path)}: {cell(exc)}\n")
        return 0
    sys.stdout.write(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
