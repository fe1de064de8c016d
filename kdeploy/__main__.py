"""The ``kdeploy`` command and ``python -m kdeploy``."""

import sys


def main() -> int:
    # paramiko.config imports invoke (~70 ms of every start) only for ssh_config "Match exec", which
    # kdeploy never reads. Only the command's own process opts out; the library leaves sys.modules alone.
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]
    from kdeploy.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
