"""kdeploy: ship SGLang kernel extensions and serving configs to GPU hosts over SSH, and prove every deploy healthy.

The library API is :mod:`kdeploy.flows.fleet` (push, verify, rollback, history, lock over many hosts) on top of
:mod:`kdeploy.core.inventory`; the ``kdeploy`` CLI is a thin layer over it.
"""

__version__ = "0.1.0"
