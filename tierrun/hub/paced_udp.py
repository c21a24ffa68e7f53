"""A UDP endpoint that reads its datagrams in paced batches while they come often: the
store host's LOOKUP port, which takes one datagram per node of a store tree as the
nodes start.

Datagrams of a start-up arrive one by one, spread over the seconds the nodes take to
start; read as they come (``loop.create_datagram_endpoint``), each costs the store
host a wake-up of its own, most of a datagram's cost (~100 us here, against ~10 us
to check and answer it). So the endpoint has two modes:

- *watching* (idle, or datagrams far apart): the loop watches the socket and a
  datagram is read as it comes, one wake-up each, as before; no timer runs, so an
  idle endpoint costs nothing;
- *polling* (entered when a datagram comes within ``pace`` seconds of the last read):
  the socket is left unwatched, and read every ``pace`` seconds on a timer, all that
  came meanwhile in one wake-up; back to watching after a read that finds nothing.

So a burst of N datagrams over T seconds costs about T / pace wake-ups (plus one
empty read at its end) instead of N, and a datagram waits at most ``pace`` (while
fewer than ``MAX_PER_WAKEUP`` come per ``pace``; past that, the rest wait their turn).

Worst case per wake-up: ``MAX_PER_WAKEUP`` datagrams (then the loop runs its other
work and comes back after ``pace``), so a flood of datagrams, which cost an HMAC each,
takes at most that many per ``pace`` of the store host's time; the rest wait in the
kernel's buffer or are dropped there, as the network would drop them (requesters
resend). Answers are sent at once, never queued: one the socket cannot take now is
dropped, and its requester resends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from time import monotonic

log = logging.getLogger("tierrun.store")

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
        self._poll: asyncio.TimerHandle | None = None  # (polling: the next read)
        self._last_read = -float("inf")  # (monotonic) when the socket was last read
        self.wakeups = 0  # reads of the socket so far (each a wake-up of the store host)
        protocol.connection_made(self)  # type: ignore[arg-type]
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        """Watching: a datagram came. Read what the socket holds; if the last read was
        less than ``pace`` ago, datagrams come often: poll instead of watching."""
        now = monotonic()
        self._read()
        if self._pace > 0 and not self._closed and now - self._last_read < self._pace:
            self._loop.remove_reader(self._sock.fileno())
            self._poll = self._loop.call_later(self._pace, self._polled)
        self._last_read = now

    def _polled(self) -> None:
        """Polling: read what came during the pace; poll again if anything did, else
        watch again."""
        self._poll = None
        if self._closed:
            return
        self._last_read = monotonic()
        n = self._read()
        if self._closed:
            return
        if n:
            self._poll = self._loop.call_later(self._pace, self._polled)
        else:
            self._loop.add_reader(self._sock.fileno(), self._readable)

    def _read(self) -> int:
        """Read up to MAX_PER_WAKEUP datagrams; how many. O(datagrams read)."""
        self.wakeups += 1
        sock, received = self._sock, self._protocol.datagram_received
        n = 0
        while n < MAX_PER_WAKEUP:
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM_READ)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # (an ICMP error for an answer sent: its requester resends)
                n += 1
                continue
            n += 1
            try:
                received(data, addr)
            except Exception:  # (one datagram's bug, or no memory for it: the port keeps serving)
                log.exception("a datagram from %s could not be handled", addr[0])
            if self._closed:
                break
        return n

    # -- the transport's side the protocol uses ---------------------------------------

    def sendto(self, data: bytes, addr: tuple) -> None:
        """Send now, or drop (the socket's buffer is full: as the network would)."""
        if not self._closed:
            try:
                self._sock.sendto(data, addr)
            except OSError:
                pass

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poll is not None:
            self._poll.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._protocol.connection_lost(None)
