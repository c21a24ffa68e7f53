"""The ``tierrun`` command: ``tierrun store …`` runs a store, ``tierrun timeline FILE``
draws a wire-up timeline; anything else launches a job."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("store", "proxy"):
        from .server import store_cli

        command = store_cli.store_main if argv[0] == "store" else store_cli.proxy_main
        return command(argv[1:])
    if argv and argv[0] == "store-frontend":  # internal: started by `tierrun store --workers N`
        from .server import store_cli

        return store_cli.store_frontend_main(argv[1:])
    if argv and argv[0] == "timeline":
        from .report import timeline

        return timeline.main(argv[1:])
    from .launcher.cli import main as launch_main

    return launch_main(argv)
