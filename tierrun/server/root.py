"""The root store: the core plus a front-end, in its own event loop.

``tierrun store`` runs one; :class:`~tierrun.server.process.StoreProcess` starts one
in a child process from Python.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core import StoreCore
from ..frontend import FrontEnd, FrontEndConfig
from ..frontend.listen import DEFAULT_BACKLOG, describe, tcp_listen_socket, unix_listen_socket

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


async def serve_root(
    config: RootConfig,
    on_listening: Callable[[list[str]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set, or until SIGINT/SIGTERM when ``stop`` is None.

    ``on_listening`` gets a description of every listening socket (``tcp [::]:29500``,
    ``unix @name``) once all accept connections. Raises ``OSError`` if a bind fails.
    """
    core = StoreCore()
    frontend = FrontEnd(core, config.frontend)
    sockets = [tcp_listen_socket(config.host, config.port, config.backlog)]
    if config.unix:
        sockets.append(unix_listen_socket(config.unix, config.backlog))
    for sock in sockets:
        await frontend.listen(sock)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if on_listening is not None:
        on_listening([describe(s) for s in sockets])
    try:
        await stop.wait()
    finally:
        await frontend.close()
        log.info(
            "store stopped: %d keys, %d operations, %d connections accepted",
            core.num_keys,
            core.operations,
            frontend.accepted,
        )
