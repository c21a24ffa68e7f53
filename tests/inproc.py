"""A root core and node front-end links in one event loop, without sockets: the link's
frames travel through in-memory transports, so tests drive batching and coalescing
deterministically."""

import asyncio

from tierrun.frontend.link_upstream import LinkUpstream
from tierrun.server.link_server import LinkServer, core_upstreams


class Client:
    def __init__(self):
        self.replies = []

    def wake(self, reply):
        self.replies.append(reply)

    def drop(self, reason):
        self.replies.append(("dropped", reason))


class Pipe(asyncio.Transport):
    """An in-memory transport between the two protocol ends."""

    def __init__(self, peer_protocol_getter):
        super().__init__()
        self._peer = peer_protocol_getter
        self._closing = False

    def write(self, data):
        asyncio.get_running_loop().call_soon(lambda: self._peer().data_received(bytes(data)))

    def is_closing(self):
        return self._closing

    def close(self):
        self._closing = True


async def linked(upstream, config=None):
    """A front-end link to ``upstream`` through in-memory pipes; returns it and the
    upstream's link statistics. ``upstream``: a core, or another front-end's link (a
    stacked front-end, as in a deeper tree)."""
    if isinstance(upstream, LinkUpstream):
        server = LinkServer(lambda ns: upstream.view(ns.decode()), b"tok")
    else:
        server = LinkServer(core_upstreams(upstream), b"tok")
    link = LinkUpstream(b"tok", on_lost=lambda reason: None, config=config)
    conn = link.connection()
    server_end = server.accept("test")
    server_end.connection_made(Pipe(lambda: conn))
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
