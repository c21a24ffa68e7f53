"""What the root store and the node proxy share: listeners, namespaces, control.

With ``control_stdin`` the parent (the launcher's agent) controls the process through
stdin and the process stops when stdin closes, so it never outlives the agent that
supervises it; ``control`` describes the commands and the lines that answer them. A
root store that also runs its node's front-end (``node``, another Service) takes that
front-end's commands too, and its stats carry the node front-end's under
"node_frontend".
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..frontend import FrontEnd, FrontEndConfig, Upstream
from ..frontend.contracts import LinkAcceptor
from ..frontend.listen import (
    DEFAULT_BACKLOG, UnixFile, describe, remove_unix_file, tcp_listen_socket, udp_socket_beside, unix_listen_socket,
)
from ..hub.reply_gate import ReplyGate
from .control import (
    CloseNamespace, Event, Listening, NamespaceListening, OpenNamespace, SendStats, Stats, parse_command,
)
from .frontend_pool import FrontEndPool, Listener


class Closable(Protocol):
    def close(self) -> None: ...


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
    #: With ``control_stdin``: stop when nothing (a command, or a blank line: the agent's
    #: keepalive) came on stdin for this many seconds, its agent frozen or hung; 0: never.
    agent_silence: float = 0.0
    #: Front-end processes on the public port (root store only); 1: this process serves
    #: clients itself; N > 1: N child processes do, sharing the port (SO_REUSEPORT).
    workers: int = 1
    #: With ``workers`` > 1: this process keeps serving the public port itself, the
    #: worker processes serve only namespace listeners (the launcher's choice: its agents
    #: and node links stay on the core process, its training workers are spread).
    workers_for_namespaces_only: bool = False
    #: The public port takes links only: torch-protocol clients there are refused (a
    #: tiered job's store host: its own node's clients use its node front-end).
    links_only: bool = False


class Service:
    def __init__(
        self,
        config: ServiceConfig,
        make_upstream: Callable[[str], Upstream],
        stats: Callable[[], dict],
        announce: Callable[[Event], None],
        link_acceptor: LinkAcceptor | None = None,
        pool: FrontEndPool | None = None,
        gate: ReplyGate | None = None,
        node: Service | None = None,
        datagrams: Callable[[socket.socket], Closable] | None = None,
    ) -> None:
        """With ``pool``, the pool's processes serve the listeners; this one only
        adopts the links they hand over. ``gate``: the store's invalidation rounds,
        which hold this process's answers to clients too. ``node``: the store host's
        own node front-end, served along (started, controlled, stopped) with this one.
        ``datagrams``: what serves a UDP socket bound beside the public port (a store
        host's LOOKUPs: ``hub.lookup_datagrams``), given it if that UDP port is free."""
        self.config = config
        self.make_upstream = make_upstream
        self.stats = stats
        self.announce = announce
        self.gate = gate
        self.main = FrontEnd(make_upstream(""), config.frontend, link_acceptor, gate, links_only=config.links_only)
        self.frontends = [self.main]
        self.namespaces: dict[str, int] = {}
        self._namespace_frontends: dict[str, FrontEnd] = {}
        self._unix_files: list[UnixFile] = []  # removed when the service stops
        self.pool = pool
        self.node = node
        self._datagrams = datagrams
        self._udp: Closable | None = None

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Listen, then serve until ``stop`` is set (or SIGINT/SIGTERM when it is None)."""
        if stop is None:
            stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # (before saying where it listens: a
            loop.add_signal_handler(sig, stop.set)  # parent may stop it at once)
        if self.node is not None:  # (first: once the store says where it listens, all is up)
            await self.node.listen()
        await self.listen()
        control = asyncio.ensure_future(self._read_control(stop)) if self.config.control_stdin else None
        try:
            await stop.wait()
        finally:
            if control is not None:
                control.cancel()
            final = await self.all_stats()
            if self.node is not None:
                await self.node.close()
            await self.close()
            self.announce(Stats(final))

    async def listen(self) -> None:
        """Open the listeners and say where (``Listening`` events)."""
        config = self.config
        pool = self.pool
        pooled = pool is not None and not config.workers_for_namespaces_only
        sockets = [tcp_listen_socket(config.host, config.port, config.backlog, reuse_port=pooled)]
        if config.unix:
            unix, owned = unix_listen_socket(config.unix, config.backlog)
            sockets.append(unix)
            self._unix_files.append(owned)
        described = [describe(sock) for sock in sockets]
        if self._datagrams is not None:
            await self._listen_udp(sockets[0])
        if pooled:
            await pool.start([self._pool_listener("", s) for s in sockets])
        else:
            for sock in sockets:
                await self.main.listen(sock, config.backlog)
            if pool is not None:
                await pool.start([])
        for address in described:
            self.announce(Listening(address))

    async def _listen_udp(self, tcp: socket.socket) -> None:
        assert self._datagrams is not None
        try:
            udp = udp_socket_beside(tcp)
        except OSError as e:  # (its requesters use TCP: slower for this host, not wrong)
            log.warning("no LOOKUPs over UDP on port %d (%s): nodes will use TCP", tcp.getsockname()[1], e)
            return
        self._udp = self._datagrams(udp)

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        for frontend in self.frontends:
            await frontend.close()
        if self.pool is not None:
            await self.pool.close()
        for owned in self._unix_files:
            remove_unix_file(owned)
        self._unix_files.clear()

    async def open_namespace(self, name: str) -> int:
        if name not in self.namespaces:
            config = self.config
            sock = tcp_listen_socket(config.host, 0, config.backlog, reuse_port=self.pool is not None)
            self.namespaces[name] = sock.getsockname()[1]
            if self.pool is not None:
                self.pool.listen(self._pool_listener(name, sock))
            else:
                frontend = FrontEnd(self.make_upstream(name), config.frontend, gate=self.gate)
                await frontend.listen(sock, config.backlog)
                self.frontends.append(frontend)
                self._namespace_frontends[name] = frontend
        return self.namespaces[name]

    def close_namespace(self, name: str) -> None:
        """Stop listening for namespace ``name`` (its round is over): its port is
        free again; the clients it has keep their connections until they close (the
        round's workers, stopped by their agents). Unknown names: nothing."""
        if self.namespaces.pop(name, None) is None:
            return
        if self.pool is not None:
            self.pool.unlisten(name)
        else:
            self._namespace_frontends.pop(name).stop_listening()

    def _pool_listener(self, namespace: str, first: socket.socket) -> Listener:
        """``first`` goes to the first process; later ones get new sockets on its port."""
        if first.family == socket.AF_UNIX:
            return Listener(namespace, lambda: first, shared=True)
        spare = [first]
        host, port = self.config.host, first.getsockname()[1]
        return Listener(namespace, lambda: spare.pop() if spare else
                        tcp_listen_socket(host, port, self.config.backlog, reuse_port=True))

    async def all_stats(self) -> dict:
        clients = {
            "clients_accepted": sum(f.accepted for f in self.frontends),
            "clients_open": sum(len(f.connections) for f in self.frontends),
            "clients_refused": sum(f.refused for f in self.frontends),
        }
        if self.pool is not None:
            clients = await self.pool.stats()
        if self.node is not None:
            return {**clients, **self.stats(), "node_frontend": await self.node.all_stats()}
        return {**clients, **self.stats()}

    async def _read_control(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        silence = self.config.agent_silence or None
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), silence)
            except asyncio.TimeoutError:
                log.error("its agent wrote nothing on its control pipe for %g s (frozen or hung): stopping", silence)
                break
            if not line:
                break
            try:
                command = parse_command(line.decode())
            except ValueError as e:
                log.warning("%s", e)
                continue
            if isinstance(command, SendStats):
                self.announce(Stats(await self.all_stats()))
            elif isinstance(command, OpenNamespace) and not command.node:
                port = await self.open_namespace(command.name)
                self.announce(NamespaceListening(command.name, port))
            elif isinstance(command, OpenNamespace) and self.node is not None:
                port = await self.node.open_namespace(command.name)
                self.node.announce(NamespaceListening(command.name, port))
            elif isinstance(command, CloseNamespace) and not command.node:
                self.close_namespace(command.name)
            elif isinstance(command, CloseNamespace) and self.node is not None:
                self.node.close_namespace(command.name)
            elif command is not None:
                log.warning("no node front-end here: ignored control command %r", line.decode().strip())
        stop.set()  # the supervising agent is gone
