"""The core's end of links: authenticates front-ends and executes their batches.

A batch is executed atomically and in order (the core is single-threaded and the whole
batch runs in one callback), and all its answers leave in one REPLIES frame. Deferred
answers (WAIT, BARRIER) woken during one loop iteration leave together: one frame per
link, however many waiters a write released.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from ..core import StoreCore, StoreError
from ..frontend.namespace import NamespacedUpstream
from ..link import auth
from ..link.frames import (
    AUTH, BATCH, CLOSE, FAILED, OK, OPEN, REQUEST, FrameDecoder, LinkError,
    decode_batch, encode_replies,
)
from ..protocol import ProtocolError, RequestParser
from ..protocol.opcodes import NO_REPLY_OPS

log = logging.getLogger("tierrun.store")


class RemoteClient:
    """A client of a front-end, as the core sees it: the waiter of its deferred replies."""

    __slots__ = ("link", "upstream", "pending_rid")

    def __init__(self, link: LinkServerConnection, upstream) -> None:
        self.link = link
        self.upstream = upstream
        self.pending_rid = 0

    def wake(self, reply: bytes) -> None:
        self.link.queue_wake(self.pending_rid, reply)


class LinkStats:
    def __init__(self) -> None:
        self.links = 0  # open now
        self.links_accepted = 0
        self.batches = 0
        self.operations = 0


class LinkServerConnection(asyncio.Protocol):
    def __init__(self, core: StoreCore, token: bytes | None, stats: LinkStats, peer: str) -> None:
        self._core = core
        self._token = token
        self._stats = stats
        self._peer = peer
        self._decoder = FrameDecoder()
        self._nonce = secrets.token_bytes(auth.NONCE)
        self._ready = False
        self._clients: dict[int, RemoteClient] = {}
        self._parser = RequestParser(numbering="2.2")
        self._wakes: list[tuple[int, int, bytes]] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        transport.write(auth.hello(self._nonce))

    def data_received(self, data: bytes) -> None:
        try:
            for ftype, payload in self._decoder.feed(data):
                if not self._ready:
                    self._authenticate(ftype, payload)
                elif ftype == BATCH:
                    self._execute(payload)
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
        except (LinkError, ProtocolError) as e:
            log.warning("closing link from %s: %s", self._peer, e)
            assert self._transport is not None
            self._transport.write(auth.error(str(e)))
            self._transport.close()

    def _authenticate(self, ftype: int, payload: bytes) -> None:
        if ftype != AUTH:
            raise LinkError("expected AUTH")
        if self._token is None:
            raise LinkError("this store accepts no links (it was started without a job token)")
        assert self._transport is not None
        self._transport.write(auth.check_auth(self._token, self._nonce, payload))
        self._ready = True
        self._stats.links += 1
        self._stats.links_accepted += 1
        log.info("link from %s authenticated", self._peer)

    def _execute(self, payload: bytes) -> None:
        stats = self._stats
        stats.batches += 1
        replies: list[tuple[int, int, bytes]] = []
        clients = self._clients
        parse = self._parser.parse_one
        for e in decode_batch(payload):
            if e.kind == REQUEST:
                client = clients.get(e.client)
                if client is None:
                    raise LinkError(f"request for unknown client {e.client}")
                req = parse(e.data)
                stats.operations += 1
                try:
                    reply = client.upstream.execute(req, client)
                except StoreError as err:
                    replies.append((e.rid, FAILED, str(err).encode()))
                    continue
                if reply is not None:
                    replies.append((e.rid, OK, reply))
                elif req[0] not in NO_REPLY_OPS:
                    client.pending_rid = e.rid
            elif e.kind == OPEN:
                ns = e.data
                upstream = NamespacedUpstream(self._core, ns + b"/") if ns else self._core
                clients[e.client] = RemoteClient(self, upstream)
            elif e.kind == CLOSE:
                client = clients.pop(e.client, None)
                if client is not None:
                    client.upstream.forget(client)
        if replies:
            assert self._transport is not None
            self._transport.write(encode_replies(replies))

    def queue_wake(self, rid: int, reply: bytes) -> None:
        if not self._wakes:
            asyncio.get_running_loop().call_soon(self._flush_wakes)
        self._wakes.append((rid, OK, reply))

    def _flush_wakes(self) -> None:
        wakes, self._wakes = self._wakes, []
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(encode_replies(wakes))

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ready:
            self._stats.links -= 1
            log.info("link from %s closed", self._peer)
        for client in self._clients.values():
            client.upstream.forget(client)
        self._clients.clear()
