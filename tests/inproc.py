"""A root core and node front-end links in one event loop, without sockets: the link's
frames travel through in-memory transports, so tests drive batching and coalescing
deterministically."""

import asyncio
import struct
import weakref

from tierrun.tier import LinkUpstream
from tierrun.hub.reply_gate import ReplyGate, break_watches
from tierrun.hub.link_server import LinkServer
from tierrun.hub.session import core_upstreams

_gates = weakref.WeakKeyDictionary()  # core -> the invalidation rounds of all its links


def gate_of(upstream):
    """The one gate of every link to ``upstream`` (a core or a front-end's link), as the
    root and a proxy have one LinkServer for all."""
    gate = _gates.get(upstream)
    if gate is None:
        gate = _gates[upstream] = ReplyGate()
        upstream.on_watches_broken = break_watches  # (a core's, or a relaying front-end's)
    return gate


class _HeldWaiter:
    """A root client's deferred answers, held while a round is open (as ClientConnection's)."""

    def __init__(self, client, gate):
        self.client, self.gate = client, gate

    def wake(self, reply):
        if self.gate.closed:
            self.gate.emit(self.client.wake, reply)
        else:
            self.client.wake(reply)

    def drop(self, reason):
        self.client.drop(reason)


class RootFrontEnd:
    """The root's own front-end, as its clients see it: the core's answers, held while
    an invalidation round is open (what ClientConnection does with the gate)."""

    def __init__(self, core):
        self.core, self.gate = core, gate_of(core)
        self._waiters = {}

    def execute(self, req, client):
        waiter = self._waiters.get(client)
        if waiter is None:
            waiter = self._waiters[client] = _HeldWaiter(client, self.gate)
        reply = self.core.execute(req, waiter)
        if reply is not None and self.gate.closed:
            self.gate.emit(client.wake, reply)
            return None
        return reply

    def forget(self, client):
        self.core.forget(self._waiters.pop(client, None))


def value(v: bytes) -> bytes:
    """A GET answer."""
    return struct.pack("<Q", len(v)) + v


class Client:
    def __init__(self):
        self.replies = []

    def wake(self, reply):
        self.replies.append(reply)

    def drop(self, reason):
        self.replies.append(("dropped", reason))


class Pipe(asyncio.Transport):
    """An in-memory transport between the two protocol ends: what is written arrives
    ``delay`` loop turns later (in order), so links of different delays race."""

    def __init__(self, peer_protocol_getter, delay=0):
        super().__init__()
        self._peer = peer_protocol_getter
        self._closing = False
        self._delay = delay

    def write(self, data):
        data = bytes(data)
        loop = asyncio.get_running_loop()

        def hop(left):
            if left:
                loop.call_soon(hop, left - 1)
            else:
                self._peer().data_received(data)

        loop.call_soon(hop, self._delay)

    def is_closing(self):
        return self._closing

    def close(self):
        self._closing = True

    def abort(self):
        self._closing = True


async def linked(upstream, config=None, delay=0):
    """A front-end link to ``upstream`` through in-memory pipes; returns it and the
    upstream's link statistics. ``upstream``: a core, or another front-end's link (a
    stacked front-end, as in a deeper tree); ``delay``: loop turns the upstream's frames
    take to arrive."""
    if isinstance(upstream, LinkUpstream):
        server = LinkServer(lambda ns: upstream.view(ns.decode()), b"tok", lease=upstream.lease_left,
                            gate=gate_of(upstream))
    else:
        server = LinkServer(core_upstreams(upstream), b"tok", gate=gate_of(upstream),
                            drop_watches=upstream.drop_watches_of)
    link = LinkUpstream(b"tok", on_lost=lambda reason: None, config=config)
    conn = link.connection()
    server_end = server.accept("test")
    server_end.connection_made(Pipe(lambda: conn, delay))
    conn.connection_made(Pipe(lambda: server_end))
    # the magic byte is consumed by the root's sniffer, which this test has not
    server_feed = server_end.data_received
    first = [True]

    def strip_magic(data):
        if first[0]:
            first[0] = False
            data = data[1:]
        if data:
            server_feed(data)

    server_end.data_received = strip_magic
    await asyncio.wait_for(link.ready, 5)
    return link, server.stats


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)
