"""The root store: the core plus its front-ends, in its own event loop.

``tierrun store`` runs one; :class:`~tierrun.server.process.StoreProcess` starts one
in a child process from Python. With ``control_stdin`` the parent (the launcher's
agent) controls it through stdin, one command per line, and the store stops when
stdin closes, so it never outlives the agent that supervises it:

    namespace NAME   ->  "namespace NAME listening on tcp [::]:PORT"
                          a new listener whose clients see only keys under NAME/
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core import StoreCore
from ..frontend import FrontEnd, FrontEndConfig
from ..frontend.listen import DEFAULT_BACKLOG, describe, tcp_listen_socket, unix_listen_socket
from ..frontend.namespace import NamespacedUpstream

log = logging.getLogger("tierrun.store")


@dataclass
class RootConfig:
    #: Address to listen on; None listens on every address (dual-stack).
    host: str | None = None
    port: int = 29500
    #: Unix socket path, or ``@name`` for a Linux abstract socket.
    unix: str | None = None
    backlog: int = DEFAULT_BACKLOG
    frontend: FrontEndConfig = field(default_factory=FrontEndConfig)
    #: Read control commands from stdin; stop when it closes.
    control_stdin: bool = False


class _Root:
    def __init__(self, config: RootConfig, announce: Callable[[str], None]) -> None:
        self.config = config
        self.core = StoreCore()
        self.frontends = [FrontEnd(self.core, config.frontend)]
        self.namespaces: dict[str, int] = {}
        self.announce = announce

    async def open_namespace(self, name: str) -> int:
        if name not in self.namespaces:
            frontend = FrontEnd(NamespacedUpstream(self.core, name.encode() + b"/"), self.config.frontend)
            sock = tcp_listen_socket(self.config.host, 0, self.config.backlog)
            await frontend.listen(sock)
            self.frontends.append(frontend)
            self.namespaces[name] = sock.getsockname()[1]
        return self.namespaces[name]

    async def read_control(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            words = line.decode().split()
            if len(words) == 2 and words[0] == "namespace":
                port = await self.open_namespace(words[1])
                self.announce(f"namespace {words[1]} listening on tcp port {port}")
            elif words:
                log.warning("unknown control command %r", line.decode().strip())
        stop.set()  # the supervising agent is gone


async def serve_root(
    config: RootConfig,
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set, or until SIGINT/SIGTERM when ``stop`` is None.

    ``on_listening`` gets one line per listening socket (``listening on tcp [::]:29500``)
    once all accept connections. Raises ``OSError`` if a bind fails.
    """
    announce = on_listening or (lambda line: None)
    root = _Root(config, announce)
    sockets = [tcp_listen_socket(config.host, config.port, config.backlog)]
    if config.unix:
        sockets.append(unix_listen_socket(config.unix, config.backlog))
    for sock in sockets:
        await root.frontends[0].listen(sock)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    for sock in sockets:
        announce(f"listening on {describe(sock)}")
    control = asyncio.ensure_future(root.read_control(stop)) if config.control_stdin else None
    try:
        await stop.wait()
    finally:
        if control is not None:
            control.cancel()
        for frontend in root.frontends:
            await frontend.close()
        log.info(
            "store stopped: %d keys, %d operations, %d connections accepted",
            root.core.num_keys,
            root.core.operations,
            sum(f.accepted for f in root.frontends),
        )
