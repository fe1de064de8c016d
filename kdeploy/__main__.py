"""The ``kdeploy`` command and ``python -m kdeploy``.

Start-up and exit are a fixed cost of every command (a no-op push to 8 hosts should take under a
second), so the command's own process skips what it never uses; the library leaves all of this alone.
"""

import contextlib
import os
import sys


def main() -> int:
    # paramiko.config imports invoke (~70 ms) only for ssh_config "Match exec", which kdeploy never reads.
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
    # pydantic scans every installed distribution for plugins (~40 ms) on the first model it builds.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")
    from kdeploy.cli.app import main as cli_main

    code = cli_main()
    # By now every host is released and every file written; tearing down ~400 modules would add ~0.1 s.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
