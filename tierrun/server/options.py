"""The command-line options every store process takes (``tierrun store``, ``tierrun proxy``
and the store's front-end processes): the parser, the configuration it gives, and the
arguments that give a front-end process the configuration of the store that starts it."""

from __future__ import annotations

import argparse

from ..frontend import FrontEndConfig
from ..protocol import Limits


def store_parser(prog: str, description: str, default_host: str | None, default_port: int) -> argparse.ArgumentParser:
    """A parser of the options every store process shares; each command adds its own."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default=default_host,
                   help=f"address to listen on (default: {default_host or 'all, dual-stack'})")
    p.add_argument("--port", type=int, default=default_port, help="TCP port (0 picks a free one)")
    p.add_argument("--unix", default=None, help="also listen on this Unix socket (@name: abstract)")
    d = Limits()
    p.add_argument("--max-key-bytes", type=int, default=d.max_key_bytes)
    p.add_argument("--max-value-bytes", type=int, default=d.max_value_bytes)
    p.add_argument("--max-keys-per-request", type=int, default=d.max_keys_per_request)
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--max-connections", type=int, default=FrontEndConfig().max_connections)
    p.add_argument("--control-stdin", action="store_true",
                   help="take commands on stdin (used by the launcher) and stop when stdin closes")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    return p


def frontend_config(args: argparse.Namespace) -> FrontEndConfig:
    """The client limits ``args`` (from a :func:`store_parser`) give."""
    limits = Limits(
        max_key_bytes=args.max_key_bytes,
        max_value_bytes=args.max_value_bytes,
        max_keys_per_request=args.max_keys_per_request,
        max_request_bytes=args.max_request_bytes,
    )
    return FrontEndConfig(limits=limits, max_connections=args.max_connections)


def frontend_arguments(config: FrontEndConfig, log_level: str) -> list[str]:
    """The arguments that make :func:`frontend_config` give ``config`` back, and the
    log level: how a store passes its own to the front-end processes it starts."""
    limits = config.limits
    return [
        "--max-key-bytes", str(limits.max_key_bytes),
        "--max-value-bytes", str(limits.max_value_bytes),
        "--max-keys-per-request", str(limits.max_keys_per_request),
        "--max-request-bytes", str(limits.max_request_bytes),
        "--max-connections", str(config.max_connections),
        "--log-level", log_level,
    ]
