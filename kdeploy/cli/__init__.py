"""The ``kdeploy`` command (``app``: a thin Typer layer over ``kdeploy.flows``), its live progress, its
JUnit report and the JSON schema of its ``--json`` document (``python -m kdeploy.cli.schema``)."""
