"""A UDP endpoint that reads its datagrams in paced batches: the store host's LOOKUP
port, which takes one datagram per node of a store tree as the nodes start.

Datagrams of a start-up arrive one by one, spread over the seconds the nodes take to
start; read as they come (``loop.create_datagram_endpoint``), each costs the store
host a wake-up of its own, most of a datagram's cost (~100 us here, against ~10 us
to check and answer it). So after each read the endpoint stops watching its socket
for ``pace`` seconds: what arrives meanwhile waits in the socket's receive buffer and
is read in the next wake-up, however many nodes sent it. A lone datagram is read at
once (nothing is paced while none came within ``pace``); one that follows another
waits at most ``pace``. An idle endpoint costs nothing: no timer runs while nothing
arrives.

Worst case per wake-up: ``MAX_PER_WAKEUP`` datagrams (then the loop runs its other
work and comes back after ``pace``), so a flood of datagrams, which cost an HMAC each,
takes at most that many per ``pace`` of the store host's time; the rest wait in the
kernel's buffer or are dropped there, as the network would drop them (requesters
resend). Answers are sent at once, never queued: one the socket cannot take now is
dropped, and its requester resends.
"""

from __future__ import annotations

import asyncio
import socket

#: Datagrams read in one wake-up at most.
MAX_PER_WAKEUP = 256
#: The largest datagram read (a LOOKUP is far smaller; a larger one is not a LOOKUP).
MAX_DATAGRAM_READ = 1 << 16


class PacedDatagramEndpoint:
    """Drives an ``asyncio.DatagramProtocol`` (``connection_made`` with this endpoint as
    its transport, ``datagram_received``, ``connection_lost``) from a bound,
    non-blocking UDP socket. ``pace`` 0: every datagram read as it comes."""

    def __init__(self, sock: socket.socket, protocol: asyncio.DatagramProtocol, pace: float) -> None:
        self._sock = sock
        self._protocol = protocol
        self._pace = pace
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._resume: asyncio.TimerHandle | None = None  # (paced: when reading starts again)
        self.wakeups = 0  # reads of the socket so far (each a wake-up of the store host)
        protocol.connection_made(self)  # type: ignore[arg-type]
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        """Read what the socket holds (up to MAX_PER_WAKEUP datagrams); then, paced,
        stop reading for ``pace`` seconds. O(datagrams read)."""
        sock, received = self._sock, self._protocol.datagram_received
        self.wakeups += 1
        for _ in range(MAX_PER_WAKEUP):
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM_READ)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # (an ICMP error for an answer sent: its requester resends)
                continue
            received(data, addr)
            if self._closed:
                return
        if self._pace > 0 and not self._closed:
            self._loop.remove_reader(sock.fileno())
            self._resume = self._loop.call_later(self._pace, self._read_again)

    def _read_again(self) -> None:
        self._resume = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._readable)

    # -- the transport's side the protocol uses ---------------------------------------

    def sendto(self, data: bytes, addr: tuple) -> None:
        """Send now, or drop (the socket's buffer is full: as the network would)."""
        if not self._closed:
            try:
                self._sock.sendto(data, addr)
            except OSError:
                pass

    def get_write_buffer_size(self) -> int:
        return 0  # (nothing is ever queued)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._protocol.connection_lost(None)
