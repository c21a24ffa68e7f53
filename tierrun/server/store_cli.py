"""``tierrun store``: run a root store from the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from ..frontend import FrontEndConfig
from ..protocol import Limits
from .eventloop import run
from .root import RootConfig, serve_root


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierrun store",
        description="Run a key-value store that torch's TCPStore clients can use.",
    )
    p.add_argument("--host", default=None, help="address to listen on (default: all, dual-stack)")
    p.add_argument("--port", type=int, default=29500, help="TCP port (0 picks a free one)")
    p.add_argument("--unix", default=None, help="also listen on this Unix socket (@name: abstract)")
    d = Limits()
    p.add_argument("--max-key-bytes", type=int, default=d.max_key_bytes)
    p.add_argument("--max-value-bytes", type=int, default=d.max_value_bytes)
    p.add_argument("--max-keys-per-request", type=int, default=d.max_keys_per_request)
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--max-connections", type=int, default=FrontEndConfig().max_connections)
    p.add_argument(
        "--control-stdin",
        action="store_true",
        help="take commands on stdin (used by the launcher) and stop when stdin closes",
    )
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="[tierrun store] %(levelname)s %(message)s"
    )
    limits = Limits(
        max_key_bytes=args.max_key_bytes,
        max_value_bytes=args.max_value_bytes,
        max_keys_per_request=args.max_keys_per_request,
        max_request_bytes=args.max_request_bytes,
    )
    config = RootConfig(
        host=args.host,
        port=args.port,
        unix=args.unix,
        frontend=FrontEndConfig(limits=limits, max_connections=args.max_connections),
        control_stdin=args.control_stdin,
    )

    def announce(line: str) -> None:
        print(f"tierrun store {line}", flush=True)

    try:
        run(serve_root(config, on_listening=announce))
    except OSError as e:
        print(
            f"tierrun store: cannot listen on {args.host or '*'}:{args.port}: {e.strerror or e}. "
            "Pick another --port, or stop whatever uses it.",
            file=sys.stderr,
        )
        return 1
    return 0
