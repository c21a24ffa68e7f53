"""A front-end: the listeners and client connections in front of one upstream."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from ..logs import FloodLog
from ..protocol import Limits
from .connection import ClientConnection
from .contracts import Gate, LinkAcceptor, Upstream
from .listen import DEFAULT_BACKLOG

log = logging.getLogger("tierrun.store")


class OpenConnections:
    """The connections all of a process's front-ends hold, together (they share its
    open files, ``server.open_files``): one object shared through their config."""

    __slots__ = ("count", "refused")

    def __init__(self) -> None:
        self.count = 0
        self.refused = 0


@dataclass
class FrontEndConfig:
    limits: Limits = field(default_factory=Limits)
    #: Connections beyond this are closed as soon as they are accepted (clients and
    #: links alike).
    max_connections: int = 65536
    #: What sets ``max_connections``, for the line that refuses a connection past it.
    max_connections_why: str = "--max-connections"
    #: What counts against ``max_connections``: every front-end made with this config
    #: (or a copy of it), together.
    open_connections: OpenConnections = field(default_factory=OpenConnections, compare=False, repr=False)
    #: Who may connect on a Unix socket (SO_PEERCRED's uid): by default this process's
    #: user (the agent's, for the stores it starts) and root. Others are refused.
    unix_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid(), 0}))


class FrontEnd:
    """Accepts torch clients on any number of listening sockets."""

    def __init__(
        self,
        upstream: Upstream,
        config: FrontEndConfig | None = None,
        link_acceptor: LinkAcceptor | None = None,
        gate: Gate | None = None,
        links_only: bool = False,
    ) -> None:
        """``link_acceptor(transport, peer, rest, on_closed)``, if given, takes over a
        connection that turned out to be a front-end's link (on the store host's public
        port); ``rest`` is what was read after the link's first byte. ``gate``: holds
        answers while the store's invalidation rounds run (the core's process only).
        ``links_only`` (with ``link_acceptor``): torch-protocol clients are refused."""
        self.upstream = upstream
        self.gate = gate
        self.link_acceptor = link_acceptor
        self.links_only = links_only and link_acceptor is not None
        self.config = config or FrontEndConfig()
        self.limits = self.config.limits
        self.unix_uids = self.config.unix_uids
        self.connections: set[ClientConnection] = set()
        self.accepted = 0
        self.unfinished = 0  # bytes held for requests being received (see ClientConnection)
        self.unfinished_since: dict[ClientConnection, None] = {}  # (their connections, oldest first)
        self.unread = 0  # bytes of answers its clients have not read (see ClientConnection)
        self.unread_since: dict[ClientConnection, None] = {}  # (their connections, paused longest first)
        self.refused = 0
        self.closed_log = FloodLog(log, "connections closed for what their clients did")
        self._refused_log = FloodLog(log, "connections refused (too many open)")
        #: Connections that turned out to be links, still open (counted as connections).
        self.links_open = 0
        self._servers: list[asyncio.AbstractServer] = []

    def admit(self, conn: ClientConnection) -> bool:
        """Count ``conn``; False past ``max_connections`` (clients and links of every
        front-end sharing this one's config, together). O(1)."""
        shared = self.config.open_connections
        if shared.count >= self.config.max_connections:
            self.refused += 1
            shared.refused += 1
            self._refused_log.warning("refusing connection from %s: %d connections open (the limit: %s); %d refused "
                                      "so far", conn.peer, shared.count, self.config.max_connections_why,
                                      shared.refused)
            return False
        shared.count += 1
        self.accepted += 1
        self.connections.add(conn)
        return True

    def release(self, conn: ClientConnection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.config.open_connections.count -= 1

    def became_link(self, conn: ClientConnection) -> Callable[[], None]:
        """``conn`` turned out to be a front-end's link: it is not a client after all,
        but counts against ``max_connections`` until the returned callable is called
        (once, when the link's connection is gone)."""
        self.connections.discard(conn)
        self.accepted -= 1
        self.links_open += 1
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.links_open -= 1
                self.config.open_connections.count -= 1

        return release

    async def listen(self, sock: socket.socket, backlog: int = DEFAULT_BACKLOG) -> None:
        """Serve clients on an already bound and listening socket. asyncio listens again
        with its own backlog (100 unless told): pass the socket's, or a connect storm
        overflows the accept queue and clients hang in SYN retries."""
        loop = asyncio.get_running_loop()
        factory = lambda: ClientConnection(self)  # noqa: E731
        if sock.family == socket.AF_UNIX:
            server = await loop.create_unix_server(factory, sock=sock, backlog=backlog)
        else:
            server = await loop.create_server(factory, sock=sock, backlog=backlog)
        self._servers.append(server)

    def stop_listening(self) -> None:
        """Accept no more connections (the listening sockets close); those accepted
        stay until they close."""
        for server in self._servers:
            server.close()

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
