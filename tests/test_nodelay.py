"""TCP_NODELAY on the store's accepted connections whatever the event loop: the
front-end's connection no longer sets it (``frontend.connection``), so the listener must
make sure the loop does (plain asyncio sets it only on sockets whose protocol is TCP;
a socket made with protocol 0 is accepted with protocol 0)."""

from __future__ import annotations

import asyncio
import socket

from tierrun.frontend.listen import tcp_listen_socket


def _accepted_nodelay(host: str | None) -> int:
    got: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            got.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def run() -> None:
        listener = tcp_listen_socket(host, 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)):
                for _ in range(100):
                    if got:
                        break
                    await asyncio.sleep(0.01)
        finally:
            server.close()

    asyncio.run(run())  # (plain asyncio, not uvloop: uvloop sets it on every TCP socket)
    assert got
    return got[0]


def test_connections_accepted_on_plain_asyncio_have_nodelay():
    assert _accepted_nodelay(None) != 0
    assert _accepted_nodelay("127.0.0.1") != 0
