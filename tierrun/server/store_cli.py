"""The store processes' commands: ``tierrun store`` (the root store), ``tierrun proxy`` (a
node front-end) and ``tierrun store-frontend`` (internal: a front-end process of
``tierrun store --workers N``). The edge: ``tierrun.cli`` alone imports this module.
Each command reads the environment once (``tierrun.settings``), after its arguments."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

from ..frontend import FrontEndConfig
from ..frontend.listen import ListenError
from ..settings import FRONTEND_TOKEN, TOKEN_FILE, Settings, SettingsError, take_frontend_token
from .control import Event, format_event
from .eventloop import run
from .frontend_pool import FrontEndStartError
from .frontend_process import serve_frontend_process
from .options import frontend_config, parse_store_args, store_parser
from .proxy import serve_proxy
from .root import serve_root
from .service import ServiceConfig


def _config(args: argparse.Namespace, frontend: FrontEndConfig | None = None) -> ServiceConfig:
    return ServiceConfig(
        host=args.host, port=args.port, unix=args.unix, frontend=frontend or frontend_config(args),
        control_stdin=args.control_stdin, agent_silence=args.agent_silence, workers=getattr(args, "workers", 1),
        workers_for_namespaces_only=getattr(args, "workers_for", "all") == "namespaces",
        links_only=getattr(args, "links_only", False),
    )


#: Where a store host's own node front-end listens for its agent and workers (as a
#: `tierrun proxy` does on other nodes: loopback only).
NODE_FRONTEND_HOST = "127.0.0.1"


def _announcer(process: str) -> Callable[[Event], None]:
    def announce(event: Event) -> None:
        print(format_event(process, event), flush=True)

    return announce


def _settings(command: str) -> Settings | None:
    """The environment's settings; None (after saying why on stderr) if it holds
    something unusable."""
    try:
        return Settings.from_env()
    except SettingsError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None


def _add_token_fd(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-fd", type=int, default=None, metavar="FD",
                   help="read the job token from this file descriptor to its end, then close it "
                   "(how the launcher hands it over: a pipe, never the environment); instead of "
                   "$TIERRUN_TOKEN / $TIERRUN_TOKEN_FILE")


def _job_token(command: str, args: argparse.Namespace, settings: Settings) -> tuple[bytes | None, bool]:
    """The job token (``--token-fd``, else the environment's) and whether it could be
    read; when it could not, says why on stderr. Blocks until the writer of
    ``--token-fd`` closes it."""
    try:
        if args.token_fd is not None:
            with open(args.token_fd, "rb") as pipe:
                return pipe.read(), True
        return settings.job_token(), True
    except (OSError, SettingsError) as e:
        where = f"--token-fd {args.token_fd}" if args.token_fd is not None else f"${TOKEN_FILE}"
        print(f"{command}: cannot read the job token from {where}: {e}", file=sys.stderr)
        return None, False


def store_main(argv: list[str]) -> int:
    p = store_parser("tierrun store", "Run a key-value store that torch's TCPStore clients can use. "
                     "Node proxies link to it when it has a job token (--token-fd, $TIERRUN_TOKEN or "
                     "$TIERRUN_TOKEN_FILE).",
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
    _add_token_fd(p)
    p.add_argument("--links-only", action="store_true",
                   help="the public port takes only node links (needs a job token): torch-protocol "
                   "clients there are refused (what the launcher does for tiered jobs, whose "
                   "store host's own clients use its --node-frontend)")
    if "-h" in argv or "--help" in argv:
        p.parse_args(argv)  # (help, whatever the environment holds)
    settings = _settings("tierrun store")
    if settings is None:
        return 2
    args = parse_store_args(p, argv, settings.max_store_bytes, settings.max_store_keys)
    if args.workers < 1:
        p.error(f"--workers {args.workers}: write 1 or more")
    token, ok = _job_token("tierrun store", args, settings)
    if not ok:
        return 2
    if args.links_only and not token:
        print("tierrun store: --links-only takes links only, and links need a job token: set "
              "TIERRUN_TOKEN or TIERRUN_TOKEN_FILE", file=sys.stderr)
        return 2
    node = None
    frontend = frontend_config(args)  # (one for both: they share this process's open files)
    if args.node_frontend:
        node = ServiceConfig(host=NODE_FRONTEND_HOST, port=0, unix=args.node_frontend_unix, frontend=frontend)
    logging.basicConfig(level=args.log_level.upper(), format="[tierrun store] %(levelname)s %(message)s")
    try:
        run(serve_root(_config(args, frontend), on_listening=_announcer("store"), token=token or None,
                       link_config=settings.link, node_frontend=node))
    except (ListenError, FrontEndStartError, OSError) as e:  # (each names what failed)
        print(f"tierrun store: {e}", file=sys.stderr)
        return 1
    return 0


def proxy_main(argv: list[str]) -> int:
    p = store_parser("tierrun proxy", "Run a node front-end: local clients in, one authenticated "
                     "link to the store host out. The job token comes from --token-fd, $TIERRUN_TOKEN "
                     "or $TIERRUN_TOKEN_FILE.", "127.0.0.1", 0, holds_keys=False)
    p.add_argument("--upstream", required=True, help="the store host, HOST:PORT")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--link-listen", default=None, metavar="HOST:PORT",
                   help="also take other front-ends' links here (a deeper tree: they link to this "
                   "proxy instead of the store host); HOST is an address of this node")
    p.add_argument("--link-source", default=None, metavar="HOST",
                   help="the local address the link leaves from (default: the system's choice); "
                   "the store host counts unauthenticated connections per source address")
    _add_token_fd(p)
    args = parse_store_args(p, argv)
    logging.basicConfig(level=args.log_level.upper(), format="[tierrun proxy] %(levelname)s %(message)s")
    settings = _settings("tierrun proxy")
    if settings is None:
        return 2
    token, ok = _job_token("tierrun proxy", args, settings)
    if not ok:
        return 2
    if not token:
        print("tierrun proxy: no job token: set TIERRUN_TOKEN or TIERRUN_TOKEN_FILE to the token "
              "the store host was started with", file=sys.stderr)
        return 2
    host, port = _host_port(p, "--upstream", args.upstream)
    link_listen = _host_port(p, "--link-listen", args.link_listen) if args.link_listen else None
    try:
        return run(serve_proxy(_config(args), host, port, token,
                               on_listening=_announcer("proxy"), connect_timeout=args.connect_timeout,
                               link_config=settings.link, link_listen=link_listen, link_source=args.link_source))
    except (ListenError, TimeoutError) as e:  # (its own sockets; a store host it could not reach, named)
        print(f"tierrun proxy: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # one line for any start failure (refused, token, timeout)
        print(f"tierrun proxy: cannot link to the store host {args.upstream}: {e}", file=sys.stderr)
        return 1


def _host_port(p: argparse.ArgumentParser, flag: str, value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) of ``flag``; a usage error (exit 2) otherwise."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        p.error(f"{flag} {value}: write HOST:PORT")
    return host.strip("[]"), int(port)


def store_frontend_main(argv: list[str]) -> int:
    p = store_parser("tierrun store-frontend", "internal: a front-end process of `tierrun store "
                     "--workers N`", None, 0)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--links-only", action="store_true")
    args = parse_store_args(p, argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[tierrun store front-end {os.getpid()}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    token = take_frontend_token()
    if not token:
        print(f"tierrun store-frontend: no ${FRONTEND_TOKEN}; this process is started by `tierrun store`",
              file=sys.stderr)
        return 2
    settings = _settings("tierrun store-frontend")
    if settings is None:
        return 2
    channel = socket.socket(fileno=args.channel_fd)
    link_sock = socket.socket(fileno=args.link_fd)
    return run(serve_frontend_process(channel, link_sock, token, frontend_config(args), settings.link,
                                      links_only=args.links_only))
