"""The ``tierrun`` command: ``tierrun store …`` runs a store; anything else launches a job."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "store":
        from .server.store_cli import main as store_main

        return store_main(argv[1:])
    from .launcher.cli import main as launch_main

    return launch_main(argv)
