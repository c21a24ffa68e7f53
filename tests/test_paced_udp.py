"""The store host's paced UDP endpoint (``hub.paced_udp``): datagrams far apart are read
as they come; once they come often, those of each pace are read together; a flood is
read at most MAX_PER_WAKEUP at a time; answers go at once; closing stops it cleanly."""

from __future__ import annotations

import asyncio
import socket
import time

from tierrun.hub import paced_udp
from tierrun.hub.paced_udp import PacedDatagramEndpoint


class Echo(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.transport = None
        self.received: list[tuple[float, bytes]] = []
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.received.append((time.monotonic(), data))
        self.transport.sendto(b"echo " + data, addr)

    def connection_lost(self, exc) -> None:
        self.lost = True


def _serve(protocol: asyncio.DatagramProtocol, pace: float) -> tuple[PacedDatagramEndpoint, tuple]:
    """An endpoint driving ``protocol`` on a new loopback UDP socket, and its address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return PacedDatagramEndpoint(sock, protocol, pace), sock.getsockname()


def _client() -> socket.socket:
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    client.setblocking(False)
    return client


async def _answers(client: socket.socket, n: int, timeout: float = 5.0) -> list[bytes]:
    out: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(out) < n and loop.time() < deadline:
        try:
            out.append(client.recv(1 << 16))
        except BlockingIOError:
            await asyncio.sleep(0.002)
    return out


def test_datagrams_far_apart_are_read_as_they_come_and_those_coming_often_in_paced_batches():
    async def main():
        echo = Echo()
        endpoint, where = _serve(echo, pace=0.3)
        with _client() as client:
            for data in (b"a", b"b"):  # (the first ever, then one within the pace: both at once)
                t0 = time.monotonic()
                client.sendto(data, where)
                assert await _answers(client, 1) == [b"echo " + data]
                assert time.monotonic() - t0 < 0.2
            assert endpoint.wakeups == 2  # (now polling: datagrams come often)
            for data in (b"c", b"d", b"e"):
                client.sendto(data, where)
            assert sorted(await _answers(client, 3)) == [b"echo c", b"echo d", b"echo e"]
            times = [t for t, _ in echo.received]
            assert times[2] - times[1] >= 0.25 and times[4] - times[2] < 0.05  # (one read, a pace on)
            assert endpoint.wakeups == 3
            await asyncio.sleep(0.7)  # (the next poll finds nothing: watching again)
            assert endpoint.wakeups == 4
            t1 = time.monotonic()
            client.sendto(b"f", where)
            assert await _answers(client, 1) == [b"echo f"]
            assert time.monotonic() - t1 < 0.2 and endpoint.wakeups == 5
            await asyncio.sleep(0.7)  # (far apart from the last: no polling, no timer)
            assert endpoint.wakeups == 5
        endpoint.close()
        assert echo.lost and endpoint.is_closing()
        endpoint.close()  # (twice: nothing more)

    asyncio.run(main())


def test_a_flood_is_read_at_most_max_per_wakeup_datagrams_at_a_time():
    async def main():
        echo = Echo()
        endpoint, where = _serve(echo, pace=0.05)
        n = paced_udp.MAX_PER_WAKEUP * 2 + 10
        with _client() as client:
            for i in range(n):
                client.sendto(b"%d" % i, where)
            answers = await _answers(client, n)  # (none read before: the loop had no turn)
        assert len(answers) == n and len(echo.received) == n
        assert endpoint.wakeups >= 3  # (256 + 256 + 10, each read a pace apart)
        endpoint.close()

    asyncio.run(main())


def test_unpaced_every_datagram_is_read_as_it_comes():
    async def main():
        echo = Echo()
        endpoint, where = _serve(echo, pace=0)
        with _client() as client:
            for data in (b"a", b"b"):
                t0 = time.monotonic()
                client.sendto(data, where)
                assert await _answers(client, 1) == [b"echo " + data]
                assert time.monotonic() - t0 < 0.2
        endpoint.close()

    asyncio.run(main())


def test_a_datagram_whose_handling_fails_leaves_the_port_serving_the_others(caplog):
    """A bug (or no memory) handling one datagram, in either mode, must not stop the
    endpoint: a store host whose LOOKUP port went deaf would leave every later node of
    a tree waiting out its UDP wait."""

    class Failing(Echo):
        def datagram_received(self, data, addr):
            if data.startswith(b"bad"):
                raise RuntimeError("a bug")
            super().datagram_received(data, addr)

    async def main():
        echo = Failing()
        endpoint, where = _serve(echo, pace=0.05)
        with _client() as client:
            client.sendto(b"bad1", where)  # (watching)
            client.sendto(b"a", where)
            assert await _answers(client, 1) == [b"echo a"]
            for data in (b"bad2", b"b", b"bad3", b"c"):  # (polling now)
                client.sendto(data, where)
            assert sorted(await _answers(client, 2)) == [b"echo b", b"echo c"]
            await asyncio.sleep(0.3)
            client.sendto(b"d", where)
            assert await _answers(client, 1) == [b"echo d"]
        endpoint.close()

    asyncio.run(main())
    assert sum("could not be handled" in r.message for r in caplog.records) == 3


def test_an_answer_the_socket_cannot_take_now_is_dropped_not_queued(caplog):
    """A flood of replayed LOOKUPs (recorded, with forged sources) while the socket's
    send buffer is full: asyncio's and uvloop's transports queue what they cannot send,
    without bound; the endpoint drops it, as the network would (requesters resend), and
    goes on serving."""

    class Full(socket.socket):
        full = True

        def sendto(self, data, addr):  # type: ignore[override]
            if self.full:
                raise BlockingIOError("the send buffer is full")
            return super().sendto(data, addr)

    async def main():
        echo = Echo()
        sock = Full(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        endpoint = PacedDatagramEndpoint(sock, echo, pace=0)
        where = sock.getsockname()
        with _client() as client:
            client.sendto(b"a", where)
            assert await _answers(client, 1, timeout=0.3) == []  # (dropped)
            assert [d for _, d in echo.received] == [b"a"]
            sock.full = False
            client.sendto(b"b", where)
            assert await _answers(client, 1) == [b"echo b"]
        endpoint.close()

    asyncio.run(main())
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]  # (dropped quietly)
