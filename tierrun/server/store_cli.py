"""``tierrun store`` (the root store) and ``tierrun proxy`` (a node front-end)."""

from __future__ import annotations

import argparse
import logging
import sys

from ..frontend import FrontEndConfig
from ..link.auth import load_token
from ..link.config import LinkConfig
from ..protocol import Limits
from .eventloop import run
from .proxy import serve_proxy
from .root import serve_root
from .service import ServiceConfig


def build_parser(prog: str, description: str, default_host: str | None, default_port: int) -> argparse.ArgumentParser:
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
    limits = Limits(
        max_key_bytes=args.max_key_bytes,
        max_value_bytes=args.max_value_bytes,
        max_keys_per_request=args.max_keys_per_request,
        max_request_bytes=args.max_request_bytes,
    )
    return FrontEndConfig(limits=limits, max_connections=args.max_connections)


def _config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        host=args.host, port=args.port, unix=args.unix, frontend=frontend_config(args),
        control_stdin=args.control_stdin, workers=getattr(args, "workers", 1),
        workers_for_namespaces_only=getattr(args, "workers_for", "all") == "namespaces",
    )


#: Where a store host's own node front-end listens for its agent and workers (as a
#: `tierrun proxy` does on other nodes: loopback only).
NODE_FRONTEND_HOST = "127.0.0.1"


def _announcer(name: str):
    def announce(line: str) -> None:
        print(f"tierrun {name} {line}", flush=True)

    return announce


def store_main(argv: list[str]) -> int:
    p = build_parser("tierrun store", "Run a key-value store that torch's TCPStore clients can use. "
                     "Node proxies link to it when it has a job token ($TIERRUN_TOKEN or $TIERRUN_TOKEN_FILE).",
                     None, 29500)
    p.add_argument("--workers", type=int, default=1,
                   help="front-end processes that parse client requests, sharing the port "
                   "(SO_REUSEPORT); with more than 1 the store's state lives in one more process")
    p.add_argument("--workers-for", choices=("all", "namespaces"), default="all",
                   help="what the --workers processes serve: every listener (default), or only "
                   "the namespace listeners opened through --control-stdin")
    p.add_argument("--node-frontend", action="store_true",
                   help="also be this host's node front-end (what `tierrun proxy` is on other "
                   "nodes), on the store in this process: listens on 127.0.0.1 (a free "
                   "port) and on --node-frontend-unix")
    p.add_argument("--node-frontend-unix", default=None, metavar="PATH",
                   help="the node front-end's Unix socket (@name: abstract)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers}: write 1 or more")
    token = load_token()
    node = None
    if args.node_frontend:
        node = ServiceConfig(host=NODE_FRONTEND_HOST, port=0, unix=args.node_frontend_unix,
                             frontend=frontend_config(args))
    logging.basicConfig(level=args.log_level.upper(), format="[tierrun store] %(levelname)s %(message)s")
    try:
        run(serve_root(_config(args), on_listening=_announcer("store"), token=token,
                       link_config=LinkConfig.from_env(), node_frontend=node))
    except OSError as e:
        print(f"tierrun store: cannot listen on {args.host or '*'}:{args.port}: {e.strerror or e}. "
              "Pick another --port, or stop whatever uses it.", file=sys.stderr)
        return 1
    return 0


def proxy_main(argv: list[str]) -> int:
    p = build_parser("tierrun proxy", "Run a node front-end: local clients in, one authenticated "
                     "link to the store host out. The job token comes from $TIERRUN_TOKEN or "
                     "$TIERRUN_TOKEN_FILE.", "127.0.0.1", 0)
    p.add_argument("--upstream", required=True, help="the store host, HOST:PORT")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--link-listen", default=None, metavar="HOST:PORT",
                   help="also take other front-ends' links here (a deeper tree: they link to this "
                   "proxy instead of the store host); HOST is an address of this node")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[tierrun proxy] %(levelname)s %(message)s")
    token = load_token()
    if token is None:
        print("tierrun proxy: no job token: set TIERRUN_TOKEN or TIERRUN_TOKEN_FILE to the token "
              "the store host was started with", file=sys.stderr)
        return 2
    host, _, port = args.upstream.rpartition(":")
    link_listen = None
    if args.link_listen:
        lhost, _, lport = args.link_listen.rpartition(":")
        link_listen = (lhost.strip("[]"), int(lport))
    try:
        return run(serve_proxy(_config(args), host.strip("[]"), int(port), token,
                               on_listening=_announcer("proxy"), connect_timeout=args.connect_timeout,
                               link_config=LinkConfig.from_env(), link_listen=link_listen))
    except Exception as e:  # one line for any start failure (refused, token, timeout)
        print(f"tierrun proxy: cannot link to the store host {args.upstream}: {e}", file=sys.stderr)
        return 1
