"""One of the store host's front-end processes (``tierrun store --workers N``, N > 1).

It parses torch clients on listening sockets the core process hands it (its own
SO_REUSEPORT socket on the public port, so the kernel spreads new connections over the
processes) and forwards their requests in coalesced batches over a link to the core,
like a node proxy. A node's link that lands on it is handed to the core process,
connection and all, so links never depend on a front-end process.

It talks to the core process over two socket pairs it inherits:

- the *link*: a link session (link/frames.py) authenticated with a token of its own,
  which it finds in its environment (``settings.frontend_process_env``);
- the *channel* (SOCK_SEQPACKET, one message per datagram, file descriptors attached):
    core -> here   ``L`` + namespace, with a listening socket: serve it
                   ``U`` + namespace: stop listening for it (its round is over)
                   ``S``: send your counters
    here -> core   ``H`` + bytes read after the link's first byte, with the connection
                   ``S`` + JSON counters

It exits when the channel or the link closes (the core process is gone or stopping);
SIGINT is ignored (a Ctrl-C at a terminal reaches the core process, which stops it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable

from ..frontend import FrontEnd, FrontEndConfig
from ..tier import LinkUpstream, PlanLimits
from ..frontend.listen import DEFAULT_BACKLOG
from ..link.config import LinkConfig

log = logging.getLogger("tierrun.store")

LISTEN, UNLISTEN, STATS, HAND_OFF = b"L", b"U", b"S", b"H"
#: A connection of a links-only port, handed over before its first byte was read.
HAND_OFF_UNREAD = b"h"
#: Largest channel message (the bytes a link sent before its handshake are tiny).
MAX_MESSAGE = 1 << 16


async def serve_frontend_process(channel: socket.socket, link_sock: socket.socket, token: bytes,
                                 config: FrontEndConfig, link_config: LinkConfig, links_only: bool = False) -> int:
    """Serve until the core process closes the channel (0) or the link is lost (3).
    ``links_only``: the public port's torch-protocol clients are refused."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    lost: list[str] = []

    def on_lost(reason: str) -> None:
        lost.append(reason)
        stop.set()

    link = LinkUpstream(token, on_lost, link_config, limits=PlanLimits.of(config.limits))  # (no address: not retried)
    await loop.create_connection(link.connection, sock=link_sock)
    await asyncio.wait_for(link.ready, link_config.heartbeat_timeout)
    frontends: list[FrontEnd] = []
    by_namespace: dict[str, FrontEnd] = {}

    def hand_off(transport: asyncio.Transport, peer: str, rest: bytes | None, release: Callable[[], None]) -> None:
        sock = transport.get_extra_info("socket")
        try:  # the kernel passes the connection itself; closing ours leaves it open
            socket.send_fds(channel, [HAND_OFF_UNREAD if rest is None else HAND_OFF + rest], [sock.fileno()])
        except OSError as e:
            log.warning("could not hand the link from %s to the core process: %s", peer, e)
        transport.abort()
        release()  # (the core process counts it from now on)

    def on_channel() -> None:
        try:
            msg, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, 1)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        if not msg:
            stop.set()
            return
        kind, body = msg[:1], msg[1:]
        if kind == LISTEN and fds:
            frontend = FrontEnd(link.view(body.decode()), config, None if body else hand_off,
                                links_only=links_only and not body)
            frontends.append(frontend)
            if body:
                by_namespace[body.decode()] = frontend
            asyncio.ensure_future(frontend.listen(socket.socket(fileno=fds[0]), DEFAULT_BACKLOG))
        elif kind == UNLISTEN:
            closing = by_namespace.pop(body.decode(), None)
            if closing is not None:
                closing.stop_listening()
        elif kind == STATS:
            counters = {
                "clients_accepted": sum(f.accepted for f in frontends),
                "clients_open": sum(len(f.connections) for f in frontends),
                "clients_refused": sum(f.refused for f in frontends),
                **link.stats.as_dict(),
            }
            channel.send(STATS + json.dumps(counters).encode())
        else:
            for fd in fds:
                os.close(fd)

    channel.setblocking(False)
    loop.add_reader(channel.fileno(), on_channel)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(channel.fileno())
        for frontend in frontends:
            await frontend.close()
        link.close()
    if lost:
        log.error("store front-end process %d: link to the core process lost: %s", os.getpid(), lost[0])
        return 3
    return 0

