"""One torch client connection on a front-end: bytes in, requests to the upstream.

This is the store's request path, the hottest code in tierrun: one ``feed`` of the
parser per read, one upstream call per request, one ``write`` per read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Protocol

from ..core import StoreError
from ..link.frames import LINK_MAGIC
from ..protocol import Limits, Op, ProtocolError, RequestParser
from ..protocol.replies import encode_u32
from .contracts import Gate, LinkAcceptor, Upstream

log = logging.getLogger("tierrun.store")

_PING = Op.PING
#: Bytes of replies gathered from one read before checking that the client reads them.
REPLY_BUFFER = 1 << 20


class ConnectionOwner(Protocol):
    """What a connection needs of the front-end that accepted it (``FrontEnd``)."""

    upstream: Upstream
    limits: Limits
    link_acceptor: LinkAcceptor | None
    gate: Gate | None
    #: Refuse torch-protocol clients: only links (a tiered job's store host's public port).
    links_only: bool
    #: Who may connect on a Unix socket (SO_PEERCRED's uid).
    unix_uids: frozenset[int]

    def admit(self, conn: ClientConnection) -> bool:
        """Count ``conn`` as a client; False: refused (it is closed at once)."""

    def release(self, conn: ClientConnection) -> None:
        """``conn`` closed."""

    def became_link(self, conn: ClientConnection) -> Callable[[], None]:
        """``conn`` turned out to be a front-end's link: it is not a client after all,
        but counts as a connection until the returned callable is called."""


class ClientConnection(asyncio.Protocol):
    """Speaks the torch protocol with one client; answers PING itself.

    Closing rules: invalid input or a failed request closes this connection with one
    log line naming the peer and the reason; nothing else is affected. When the
    client stops reading its replies, we stop reading its requests and answering those
    already read (flow control: one read may carry thousands of GETs of a large value),
    so a slow client holds about ``REPLY_BUFFER`` bytes of replies here, plus its
    requests.
    """

    __slots__ = ("_frontend", "_upstream", "_parser", "_transport", "peer", "closed", "_sniff", "_gate",
                 "_backlog", "_writing_paused")

    def __init__(self, frontend: ConnectionOwner) -> None:
        self._frontend = frontend
        self._upstream = frontend.upstream
        self._parser = RequestParser(frontend.limits)
        self._transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        # On a port that also takes links, the first byte tells a link from a torch client.
        self._sniff = frontend.link_acceptor is not None
        self._gate = frontend.gate
        self._backlog: list = []  # requests read, not yet answered: the client is not reading
        self._writing_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peer = f"{peer[0]}:{peer[1]}"
        elif sock is not None and sock.family == socket.AF_UNIX:
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            self.peer = f"unix pid {pid}"
            allowed = self._frontend.unix_uids
            if uid not in allowed:
                log.warning("refusing connection from unix pid %d: it runs as uid %d; only uid(s) %s may use "
                            "this store's Unix socket", pid, uid, ", ".join(map(str, sorted(allowed))))
                self.closed = True
                transport.abort()
                return
        if not self._frontend.admit(self):
            self.closed = True
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._sniff:
            self._sniff = False
            if data[0] == LINK_MAGIC:
                self._become_link(data[1:])
                return
            if self._frontend.links_only:
                self.drop("a torch-protocol client, refused: this tiered job's store host takes only node "
                          "links on this port (its agents and workers use their node's store front-end); "
                          "allow such clients with --rdzv_conf store_public_clients=true (`tierrun store`: "
                          "without --links-only)")
                return
        try:
            requests = self._parser.feed(data)
        except ProtocolError as e:
            self.drop(f"invalid request: {e}")
            return
        if not requests:
            return
        if self._backlog:
            self._backlog += requests
            return
        self._serve(requests)

    def _serve(self, requests: list) -> None:
        """Answer ``requests`` in order; past ``REPLY_BUFFER`` bytes of replies while the
        client does not read them, keep the rest for ``resume_writing``."""
        execute = self._upstream.execute
        out = []
        size = 0
        try:
            for i, req in enumerate(requests):
                if req[0] == _PING:
                    out.append(encode_u32(req[1]))
                    continue
                reply = execute(req, self)
                if reply is not None:
                    out.append(reply)
                    size += len(reply)
                    if size > REPLY_BUFFER:
                        self._write(out)
                        out, size = [], 0
                        if self._writing_paused and i + 1 < len(requests):
                            self._backlog = requests[i + 1 :]
                            return
        except StoreError as e:
            self._write(out)
            self.drop(f"{Op(req[0]).name} failed: {e}")
            return
        if out:
            self._write(out)

    def _become_link(self, rest: bytes) -> None:
        acceptor = self._frontend.link_acceptor
        assert acceptor is not None and self._transport is not None
        release = self._frontend.became_link(self)
        self.closed = True
        acceptor(self._transport, self.peer, rest, release)

    def _write(self, out: list[bytes]) -> None:
        if out and not self.closed:
            data = out[0] if len(out) == 1 else b"".join(out)
            gate = self._gate
            if gate is not None and gate.closed:
                gate.emit(self._send, data)
                return
            assert self._transport is not None
            self._transport.write(data)

    def wake(self, reply: bytes) -> None:
        self._write([reply])

    def _send(self, data: bytes) -> None:
        if not self.closed:
            assert self._transport is not None
            self._transport.write(data)

    def drop(self, reason: str) -> None:
        """Close this connection because of something the client did; log one line."""
        if self.closed:
            return
        log.warning("closing connection from %s: %s", self.peer, reason)
        self.closed = True
        assert self._transport is not None
        self._transport.close()

    def pause_writing(self) -> None:
        assert self._transport is not None
        self._writing_paused = True
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        assert self._transport is not None
        self._writing_paused = False
        if self._backlog and not self.closed:
            backlog, self._backlog = self._backlog, []
            self._serve(backlog)
        if not self.closed and not self._backlog and not self._writing_paused:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._upstream.forget(self)
        self._frontend.release(self)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()
