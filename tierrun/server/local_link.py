"""A link inside one process: the store host's own node front-end to its core.

The store host's agent and workers go through a node front-end like every node's: the
core sees links only, and their requests are batched and merged alike. But that
front-end runs in the store's process, so its link needs no socket: frames pass from one
end to the other through the event loop (one callback each), with no system call and
no wake-up of another process. The protocol is the link's own (handshake, session,
heartbeats, watches), so the core cannot tell this link from a remote one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..frontend.link_upstream import LinkUpstream
from ..link.config import LinkConfig
from .link_server import LinkServer


class _LoopTransport(asyncio.Transport):
    """One direction of the pair: ``write`` hands the bytes to the peer protocol's
    ``data_received`` on the next loop turn, in order; closing either end closes both."""

    def __init__(self, loop: asyncio.AbstractEventLoop, own: asyncio.Protocol, peer: asyncio.Protocol) -> None:
        super().__init__()
        self._loop = loop
        self._own = own  # the protocol that writes here
        self._peer = peer
        self._closing = False
        self.other: _LoopTransport | None = None  # the reverse direction

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closing:
            self._loop.call_soon(self._deliver, bytes(data))

    def _deliver(self, data: bytes) -> None:
        if not self._closing:
            self._peer.data_received(data)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Both ends see the connection lost (after what was written so far)."""
        if not self._closing:
            self._loop.call_soon(self._lost)

    abort = close

    def _lost(self) -> None:
        for end in (self, self.other):
            if end is not None and not end._closing:
                end._closing = True
                end._own.connection_lost(None)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def link_in_process(links: LinkServer, token: bytes, on_lost: Callable[[str], None],
                          config: LinkConfig | None = None, timeout: float = 10.0) -> LinkUpstream:
    """A front-end's upstream linked to ``links`` (the core's) in this process. Blocks
    until the session is open (one handshake, a few loop turns); raises LinkError if
    ``token`` is refused. ``on_lost`` is called if the link ends (the store is stopping)."""
    loop = asyncio.get_running_loop()
    link = LinkUpstream(token, on_lost, config)
    client = link.connection()
    server = links.accept("this node's front-end", sniffed=False)
    to_server, to_client = _LoopTransport(loop, client, server), _LoopTransport(loop, server, client)
    to_server.other, to_client.other = to_client, to_server
    server.connection_made(to_client)
    client.connection_made(to_server)
    await asyncio.wait_for(asyncio.shield(client.established), timeout)
    return link
