"""What the root store and the node proxy share: listeners, namespaces, control.

With ``control_stdin`` the parent (the launcher's agent) controls the process through
stdin, one command per line, and the process stops when stdin closes, so it never
outlives the agent that supervises it:

    namespace NAME  ->  "namespace NAME listening on tcp port PORT": a new listener
                        whose clients see only the keys under NAME/
    stats           ->  "stats {json}": counters (connections, links, batches, merges)
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ..frontend import FrontEnd, FrontEndConfig, Upstream
from ..frontend.listen import DEFAULT_BACKLOG, describe, tcp_listen_socket, unix_listen_socket

log = logging.getLogger("tierrun.store")


@dataclass
class ServiceConfig:
    #: Address to listen on; None listens on every address (dual-stack).
    host: str | None = None
    port: int = 29500
    #: Unix socket path, or ``@name`` for a Linux abstract socket.
    unix: str | None = None
    backlog: int = DEFAULT_BACKLOG
    frontend: FrontEndConfig = field(default_factory=FrontEndConfig)
    #: Read control commands from stdin; stop when it closes.
    control_stdin: bool = False


class Service:
    def __init__(
        self,
        config: ServiceConfig,
        make_upstream: Callable[[str], Upstream],
        stats: Callable[[], dict],
        announce: Callable[[str], None],
        link_acceptor: Callable[[str], asyncio.Protocol] | None = None,
    ) -> None:
        self.config = config
        self.make_upstream = make_upstream
        self.stats = stats
        self.announce = announce
        self.main = FrontEnd(make_upstream(""), config.frontend, link_acceptor)
        self.frontends = [self.main]
        self.namespaces: dict[str, int] = {}

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Listen, then serve until ``stop`` is set (or SIGINT/SIGTERM when it is None)."""
        config = self.config
        sockets = [tcp_listen_socket(config.host, config.port, config.backlog)]
        if config.unix:
            sockets.append(unix_listen_socket(config.unix, config.backlog))
        for sock in sockets:
            await self.main.listen(sock, config.backlog)
        if stop is None:
            stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for sock in sockets:
            self.announce(f"listening on {describe(sock)}")
        control = asyncio.ensure_future(self._read_control(stop)) if config.control_stdin else None
        try:
            await stop.wait()
        finally:
            if control is not None:
                control.cancel()
            final = {**self.client_stats(), **self.stats()}
            for frontend in self.frontends:
                await frontend.close()
            self.announce("stats " + json.dumps(final))

    async def open_namespace(self, name: str) -> int:
        if name not in self.namespaces:
            frontend = FrontEnd(self.make_upstream(name), self.config.frontend)
            sock = tcp_listen_socket(self.config.host, 0, self.config.backlog)
            await frontend.listen(sock, self.config.backlog)
            self.frontends.append(frontend)
            self.namespaces[name] = sock.getsockname()[1]
        return self.namespaces[name]

    def client_stats(self) -> dict:
        return {
            "clients_accepted": sum(f.accepted for f in self.frontends),
            "clients_open": sum(len(f.connections) for f in self.frontends),
            "clients_refused": sum(f.refused for f in self.frontends),
        }

    async def _read_control(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            words = line.decode().split()
            if len(words) == 2 and words[0] == "namespace":
                port = await self.open_namespace(words[1])
                self.announce(f"namespace {words[1]} listening on tcp port {port}")
            elif words == ["stats"]:
                self.announce("stats " + json.dumps({**self.client_stats(), **self.stats()}))
            elif words:
                log.warning("unknown control command %r", line.decode().strip())
        stop.set()  # the supervising agent is gone
