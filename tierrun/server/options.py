"""The command-line options every store process takes (``tierrun store``, ``tierrun proxy``
and the store's front-end processes): the parser, the configuration it gives, and the
arguments that give a front-end process the configuration of the store that starts it."""

from __future__ import annotations

import argparse

from ..frontend import FrontEndConfig
from ..protocol import Limits
from . import open_files


def port(text: str) -> int:
    """A TCP port, 0-65535 (argparse's type: its error names the option)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port: write 0-65535 (0 picks a free one)")
    return value


def store_parser(prog: str, description: str, default_host: str | None, default_port: int,
                 holds_keys: bool = True) -> argparse.ArgumentParser:
    """A parser of the options every store process shares; each command adds its own.
    Without ``holds_keys`` (a proxy: the store host holds the keys), no store budgets:
    given one, argparse says it is not an option of that command instead of ignoring it."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default=default_host,
                   help=f"address to listen on (default: {default_host or 'all, dual-stack'})")
    p.add_argument("--port", type=port, default=default_port, help="TCP port (0 picks a free one)")
    p.add_argument("--unix", default=None, help="also listen on this Unix socket (@name: abstract)")
    d = Limits()
    p.add_argument("--max-key-bytes", type=int, default=d.max_key_bytes, help="longest key (default: %(default)s)")
    p.add_argument("--max-value-bytes", type=int, default=d.max_value_bytes,
                   help="longest value, an APPEND's result too (default: %(default)s)")
    p.add_argument("--max-keys-per-request", type=int, default=d.max_keys_per_request,
                   help="most keys in one request (default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request (default: %(default)s)")
    if holds_keys:
        p.add_argument("--max-store-bytes", type=int, default=None,
                       help="budget of the bytes of keys and values the store holds: a write past it is refused "
                       "and its client closed, as torch's server closes a client whose request fails (default: "
                       f"$TIERRUN_MAX_STORE_BYTES, else {d.max_store_bytes}, 1 GiB)")
        p.add_argument("--max-store-keys", type=int, default=None,
                       help="budget of keys, queues and queued values the store holds, as --max-store-bytes "
                       f"(default: $TIERRUN_MAX_STORE_KEYS, else {d.max_store_keys}; a LIST_KEYS of 1,000,000 "
                       "keys takes ~0.3 s on a 2-core VM)")
    p.add_argument("--max-reply-bytes", type=int, default=d.max_reply_bytes,
                   help="largest answer to one request (MULTI_GET, LIST_KEYS), checked before it is built "
                   "(default: %(default)s, 136 MiB)")
    p.add_argument("--max-unread-bytes", type=int, default=d.max_unread_bytes,
                   help="per client connection: most bytes of answers it has not read, counting those still "
                   "to come, before it is closed; past 1 MiB its requests wait until it reads (default: "
                   "%(default)s, 144 MiB)")
    p.add_argument("--max-unfinished-bytes", type=int, default=d.max_unfinished_bytes,
                   help="most bytes held for requests being received, all connections together: past it, the "
                   "connections whose unfinished requests began longest ago are closed until the total is "
                   "within it (default: %(default)s, 512 MiB)")
    p.add_argument("--max-unread-total-bytes", type=int, default=d.max_unread_total_bytes,
                   help="most bytes of answers not read by their clients, all connections together: past it, "
                   "the connections that stopped reading longest ago are closed (default: %(default)s, 512 MiB)")
    p.add_argument("--max-connections", type=int, default=FrontEndConfig().max_connections)
    p.add_argument("--control-stdin", action="store_true",
                   help="take commands on stdin (used by the launcher) and stop when stdin closes")
    p.add_argument("--agent-silence", type=float, default=0.0, metavar="SECONDS",
                   help="with --control-stdin: stop when nothing comes on stdin for this long (0: never)")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    return p


def frontend_config(args: argparse.Namespace) -> FrontEndConfig:
    """The client limits ``args`` (from a :func:`store_parser`) give."""
    limits = Limits(
        max_key_bytes=args.max_key_bytes,
        max_value_bytes=args.max_value_bytes,
        max_keys_per_request=args.max_keys_per_request,
        max_request_bytes=args.max_request_bytes,
        max_store_bytes=getattr(args, "max_store_bytes", Limits.max_store_bytes),
        max_store_keys=getattr(args, "max_store_keys", Limits.max_store_keys),
        max_reply_bytes=args.max_reply_bytes,
        max_unread_bytes=args.max_unread_bytes,
        max_unfinished_bytes=args.max_unfinished_bytes,
        max_unread_total_bytes=args.max_unread_total_bytes,
    )
    return FrontEndConfig(limits=limits, max_connections=args.max_connections,
                          max_connections_why=getattr(args, "max_connections_why", "--max-connections"))


def parse_store_args(p: argparse.ArgumentParser, argv: list[str], max_store_bytes: int | None = None,
                     max_store_keys: int | None = None) -> argparse.Namespace:
    """``p.parse_args(argv)``, the store's budgets not given as flags taken from the
    arguments here (``$TIERRUN_MAX_STORE_*``), else the defaults; exits with a usage
    error (status 2) naming the flag to change if the limits are inconsistent. Called
    once, at a store process's start: raises the process's open-files limit and keeps
    ``--max-connections`` below it (``open_files``)."""
    args = p.parse_args(argv)
    d = Limits()
    if getattr(args, "max_store_bytes", 0) is None:
        args.max_store_bytes = max_store_bytes or d.max_store_bytes
    if getattr(args, "max_store_keys", 0) is None:
        args.max_store_keys = max_store_keys or d.max_store_keys
    problem = frontend_config(args).limits.problem()
    if problem:
        p.error(problem)
    soft, keep = open_files.raise_limit(), open_files.kept()
    cap = open_files.connection_cap(args.max_connections, soft, keep)
    if cap < args.max_connections:
        args.max_connections = cap
        args.max_connections_why = (f"this process may open {soft:,} files and keeps {keep} for itself; raise the "
                                    "hard open-files limit, ulimit -Hn, to take more")
    return args


def frontend_arguments(config: FrontEndConfig, log_level: str) -> list[str]:
    """The arguments that make :func:`frontend_config` give ``config`` back, and the
    log level: how a store passes its own to the front-end processes it starts."""
    limits = config.limits
    return [
        "--max-key-bytes", str(limits.max_key_bytes),
        "--max-value-bytes", str(limits.max_value_bytes),
        "--max-keys-per-request", str(limits.max_keys_per_request),
        "--max-request-bytes", str(limits.max_request_bytes),
        "--max-store-bytes", str(limits.max_store_bytes),
        "--max-store-keys", str(limits.max_store_keys),
        "--max-reply-bytes", str(limits.max_reply_bytes),
        "--max-unread-bytes", str(limits.max_unread_bytes),
        "--max-unfinished-bytes", str(limits.max_unfinished_bytes),
        "--max-unread-total-bytes", str(limits.max_unread_total_bytes),
        "--max-connections", str(config.max_connections),
        "--log-level", log_level,
    ]
