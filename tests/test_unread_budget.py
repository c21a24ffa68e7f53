"""A client connection's budget of unread answers, without sockets (issue 33, item 1):
what it owes a client that does not read (answers not read, held by an invalidation
round, still to come from upstream at their largest) stops its requests at
``REPLY_BUFFER``, and closes it past ``max_unread_bytes``."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvloop

from tierrun.core import StoreCore
from tierrun.frontend.connection import REPLY_BUFFER, ClientConnection
from tierrun.frontend.owed import WRITE_SLICE, write_answer
from tierrun.logs import FloodLog
from tierrun.protocol import Limits, Op
from tierrun.protocol.requests import encode_handshake, encode_request

MiB = 1 << 20


class Transport:
    """Keeps what is written (the client reads nothing until ``drain``)."""

    def __init__(self):
        self.buffered = 0
        self.written: list[bytes] = []
        self.reading = True
        self.closed = False

    def get_extra_info(self, name, default=None):
        return default

    def get_write_buffer_size(self):
        return self.buffered

    def is_closing(self):
        return self.closed

    def write(self, data):
        self.written.append(bytes(data))
        self.buffered += len(data)

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def is_reading(self):
        return self.reading

    def can_write_eof(self):
        return False  # (drop closes at once: see ClientConnection.drop's lingering close)

    def close(self):
        self.closed = True

    abort = close


class Deferring:
    """A proxy's upstream: every request is answered later (``answer``)."""

    def __init__(self):
        self.sent = []

    def execute(self, req, waiter):
        if req[0] == Op.CANCEL_WAIT:
            return b"\x01"
        self.sent.append(req)
        return None

    def forget(self, waiter):
        pass


class Gate:
    def __init__(self):
        self.closed = False
        self.held = []

    def emit(self, send, data):
        self.held.append((send, data)) if self.closed else send(data)

    def open(self):
        self.closed = False
        held, self.held = self.held, []
        for send, data in held:
            send(data)


class Owner:
    link_acceptor = None
    links_only = False
    unfinished = 0

    def __init__(self, upstream, limits=None, gate=None):
        self.upstream = upstream
        self.limits = limits or Limits()
        self.gate = gate
        self.unfinished_since = {}
        self.unread = 0
        self.unread_since = {}
        self.closed_log = FloodLog(logging.getLogger("tierrun.store"), "connections closed")

    def admit(self, conn):
        return True

    def release(self, conn):
        pass

    def became_link(self, conn):
        pass


def connect(upstream, limits=None, gate=None):
    conn = ClientConnection(Owner(upstream, limits, gate))
    transport = Transport()
    conn.connection_made(transport)
    return conn, transport


def read(conn, transport, n=None):
    """The client reads what was written (the kernel takes it all)."""
    transport.buffered = 0
    conn.resume_writing()


def test_pipelined_gets_through_a_proxy_go_up_one_at_a_time_while_the_client_does_not_read():
    upstream = Deferring()
    conn, transport = connect(upstream)
    conn.data_received(encode_handshake(1) + encode_request((Op.GET, b"big")) * 300)
    assert len(upstream.sent) == 1 and not transport.reading  # (a GET counts at 8 MiB: past REPLY_BUFFER)
    answer = (MiB).to_bytes(8, "little") + b"x" * MiB
    conn.wake(answer)
    assert len(upstream.sent) == 1  # (its answer is not read: still owed)
    for i in range(2, 5):
        read(conn, transport)
        assert len(upstream.sent) == i
        conn.wake(answer)
    assert transport.buffered == MiB + 8 and not transport.closed and not transport.reading


def test_a_torch_client_one_request_at_a_time_never_waits():
    upstream = Deferring()
    conn, transport = connect(upstream)
    conn.data_received(encode_handshake(1))
    for i in range(1, 50):
        conn.data_received(encode_request((Op.GET, b"big")))
        assert len(upstream.sent) == i and transport.reading
        conn.wake(b"\x05" + b"\x00" * 7 + b"hello")
        read(conn, transport)


def test_answers_held_by_an_invalidation_round_count():
    core, gate = StoreCore(), Gate()
    core.execute((Op.SET, b"v", b"x" * (100 * 1024)), object())
    conn, transport = connect(core, gate=gate)
    gate.closed = True  # (a round is open: every answer is held)
    conn.data_received(encode_handshake(1) + encode_request((Op.GET, b"v")) * 100)
    # (11 x 100 KiB > REPLY_BUFFER: the rest wait)
    assert sum(len(data) for _, data in gate.held) == 4 + 11 * (8 + 100 * 1024) and not transport.reading
    assert transport.buffered == 0
    gate.open()  # (the round is over: the held answers go, and the next requests run)
    assert transport.buffered > REPLY_BUFFER and not transport.reading
    for _ in range(10):  # (each read lets ~REPLY_BUFFER more through)
        read(conn, transport)
    assert sum(map(len, transport.written)) == 4 + 100 * (8 + 100 * 1024) and transport.reading


def test_a_client_owed_more_than_its_budget_is_closed():
    """Flow control keeps a client's answers within REPLY_BUFFER plus one answer; an
    answer past what was reserved for it (a stacked upstream's), past the budget: closed."""
    upstream = Deferring()
    limits = Limits(max_value_bytes=1024, max_reply_bytes=4096, max_unread_bytes=MiB + 4096)
    conn, transport = connect(upstream, limits)
    conn.data_received(encode_handshake(1) + encode_request((Op.GET, b"k")))
    conn.wake(b"\x00" * (MiB + 8192))
    assert transport.closed and conn.closed


def test_a_wake_while_requests_run_comes_after_their_answers():
    """A client pipelines GET, WAIT and the SET that wakes its own WAIT: the answers in
    torch's server's order (the GET's, then the WAIT's)."""
    core = StoreCore()
    core.execute((Op.SET, b"a", b"A"), object())
    conn, transport = connect(core)
    conn.data_received(encode_handshake(1) + encode_request((Op.GET, b"a")) + encode_request((Op.WAIT, (b"k",)))
                       + encode_request((Op.SET, b"k", b"v")) + encode_request((Op.CANCEL_WAIT,)))
    ping, get = (1).to_bytes(4, "little"), (1).to_bytes(8, "little") + b"A"
    assert b"".join(transport.written) == ping + get + b"\x00" + b"\x01"
    assert conn.owed() == transport.buffered  # (nothing reserved any more)


def test_reading_resumes_after_a_fence_raised_while_writing_was_paused():
    """(The oracle's: a client read an 8 MiB answer slowly; the request behind it was
    served while writing was paused, so its fence was up when writing resumed, and
    reading, stopped for the backlog, was never resumed: the client's next requests
    were never read.)"""
    upstream = Deferring()
    conn, transport = connect(upstream)
    conn.data_received(encode_handshake(1) + encode_request((Op.ADD, b"a", 1)) + encode_request((Op.DELETE_KEY, b"a")))
    assert len(upstream.sent) == 1 and not transport.reading  # (the DELETE waits behind the ADD's fence)
    conn.pause_writing()  # (the transport's buffer is past its high-water mark)
    conn.wake((1).to_bytes(8, "little"))  # the ADD's answer: the DELETE goes, writing still paused
    assert len(upstream.sent) == 2 and not transport.reading
    conn.resume_writing()  # (the DELETE's fence is up: nothing to serve)
    conn.wake((1).to_bytes(8, "little"))  # the DELETE's answer
    assert transport.reading
    conn.data_received(encode_request((Op.GET, b"a")))
    assert len(upstream.sent) == 3


def test_a_large_answer_is_written_in_slices_so_what_is_held_is_what_is_counted():
    """uvloop keeps a partly sent buffer whole until it is all sent, while its write
    buffer says only what is left: 50 clients not reading a 4 MiB answer each held
    ~200 MB counted as ~57. Written in slices (``write_answer``), what is held is what
    is counted, within a slice per connection."""
    def rss_mb() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) // 1024

    async def main() -> tuple[int, int]:
        transports: list[asyncio.Transport] = []

        class Keep(asyncio.Protocol):
            def connection_made(self, transport):
                transports.append(transport)

        server = await asyncio.get_running_loop().create_server(Keep, "127.0.0.1", 0)
        clients = []
        for _ in range(30):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(server.sockets[0].getsockname())
            clients.append(c)
        while len(transports) < len(clients):
            await asyncio.sleep(0.01)
        before = rss_mb()
        for t in transports:
            write_answer(t, b"x" * (4 * MiB))
        await asyncio.sleep(0.3)
        held, counted = rss_mb() - before, sum(t.get_write_buffer_size() for t in transports) // MiB
        for c in clients:
            c.close()
        server.close()
        return held, counted

    held, counted = uvloop.run(main())
    assert counted > 10 and held <= counted + 30 * WRITE_SLICE // MiB + 8, (held, counted)
