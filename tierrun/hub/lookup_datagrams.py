"""LOOKUPs over UDP at the store host: a node of a store tree reads where its parent
takes links with one datagram, where a TCP LOOKUP (``hub.link_connection``) costs the
store host a connection (accept, read, write, close: ~200-400 us of its CPU here, one
per node of the tree; ``bench/short_connections.py``).

The datagram is the LOOKUP frame a TCP LOOKUP sends after the link's first byte
(``link.auth.lookup``: the job token's HMAC over the requester's nonce and the key), and
the answers are the frames a TCP LOOKUP would get, each in a datagram of its own:
FOUND once the key is set, or PENDING (the HMAC of the nonce: the store host heard it and
knows the token) while it is not. The requester resends while it waits (a datagram may
be lost); a resend of a LOOKUP already waiting is answered PENDING again, not waited on
twice, and a resend of one already answered (its FOUND crossed it) gets the same FOUND
again, not a second lookup.

Trust: nothing is answered before the LOOKUP's HMAC is verified, so a datagram from a
host without the job token (or a spoofed one) gets no answer and costs one HMAC; an
answer is never more than twice the size of the LOOKUP it answers (a larger value is
refused with an ERROR that sends its requester to TCP), so a recorded LOOKUP replayed
with a forged source cannot amplify traffic much. Waiting LOOKUPs are
bounded (``MAX_WAITING``; past it the oldest is forgotten: its requester resends or falls
back to TCP), and each is forgotten 1-2 x ``FORGET_AFTER`` seconds after its last resend (its
WAIT at the store goes with it). Answers are never queued unsent: one the socket cannot
take now is dropped, as the network would drop it (``hub.paced_udp``), and its requester
resends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic

from ..frontend.contracts import Upstream
from ..link import auth
from ..link.frames import LINK_MAGIC, LOOKUP, HANDSHAKE_MAX_FRAME, LinkError
from ..logs import FloodLog
from .lookup import LookupAnswer

log = logging.getLogger("tierrun.store")

#: LOOKUPs waiting for their key at once, at most (a node each, in a tree).
MAX_WAITING = 1 << 15
#: A waiting LOOKUP not resent for this long (seconds) is forgotten.
FORGET_AFTER = 10.0
#: The largest answer sent in a datagram (no IP fragments on any path), and at most twice
#: the LOOKUP's size: a larger one is refused with an ERROR that sends its requester to TCP.
MAX_DATAGRAM = 1200


class LookupDatagrams(asyncio.DatagramProtocol):
    """The store host's UDP endpoint for LOOKUPs, on the port of its links (read in
    paced batches: ``hub.paced_udp``)."""

    def __init__(self, token: bytes, upstream: Upstream, max_key_bytes: int,
                 counted: Callable[[], None] = lambda: None) -> None:
        self._token = token
        self._upstream = upstream
        self._max_key = max_key_bytes
        self._counted = counted  # (a LOOKUP answered: the store's stats)
        self._transport: asyncio.DatagramTransport | None = None
        #: nonce -> (its answer's waiter, where to answer, when last heard); oldest first.
        self._waiting: dict[bytes, tuple[LookupAnswer, tuple, float]] = {}
        #: nonce -> (the answer sent, when); oldest first: for resends that crossed it.
        self._answered: dict[bytes, tuple[bytes, float]] = {}
        self._sweep: asyncio.TimerHandle | None = None  # (while some wait: forgets the stale)
        self._failed_log = FloodLog(log, "LOOKUPs over UDP failed")

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        """One LOOKUP: verified (else ignored, unanswered), then answered FOUND if its
        key is set, else PENDING, and FOUND once it is. O(len(data))."""
        if len(data) < 6 or len(data) > HANDSHAKE_MAX_FRAME or data[0] != LINK_MAGIC or data[5] != LOOKUP:
            return
        if int.from_bytes(data[1:5], "little") != len(data) - 5:
            return
        try:
            nonce, key = auth.check_lookup(self._token, data[6:])
        except LinkError:
            return  # (not from a holder of the token: no answer at all)
        if len(key) > self._max_key:  # (authenticated: TCP will say why)
            self._send(auth.error("the key is over the store's limit: ask over TCP"), addr)
            return
        now = monotonic()
        done = self._answered.get(nonce)
        if done is not None:  # (a resend that crossed its answer)
            self._send(done[0], addr)
            return
        waiting = self._waiting
        known = waiting.pop(nonce, None)
        if known is not None:  # (a resend: it still waits, and is answered PENDING again)
            waiting[nonce] = (known[0], addr, now)
            self._send(auth.pending(self._token, nonce), addr)
            return
        self._forget_stale(now)

        def send(answer: bytes) -> None:
            entry = waiting.pop(nonce, None)
            frame = auth.found(self._token, nonce, answer)
            if len(frame) > min(MAX_DATAGRAM, 2 * len(data)):
                frame = auth.error("the answer is too large for a datagram: ask over TCP")
            else:
                self._counted()
            self._answered[nonce] = (frame, monotonic())
            self._send(frame, addr if entry is None else entry[1])

        def fail(reason: str) -> None:
            entry = waiting.pop(nonce, None)
            self._failed_log.warning("a LOOKUP over UDP from %s failed: %s", addr[0], reason)
            self._send(auth.error("the LOOKUP failed: ask over TCP"), addr if entry is None else entry[1])

        answer = LookupAnswer(self._upstream, key, send, fail)
        waiting[nonce] = (answer, addr, now)
        answer.start()
        if nonce in waiting and not answer.done:  # (not answered at once)
            self._send(auth.pending(self._token, nonce), addr)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(FORGET_AFTER, self._swept)

    def _swept(self) -> None:
        self._sweep = None
        self._forget_stale(monotonic())
        if self._waiting or self._answered:
            self._sweep = asyncio.get_running_loop().call_later(FORGET_AFTER, self._swept)

    def _forget_stale(self, now: float) -> None:
        """Forget the LOOKUPs not resent within FORGET_AFTER and the answers older than
        that, and the oldest of either past MAX_WAITING. O(1) amortized: the oldest are
        first."""
        waiting = self._waiting
        while waiting:
            nonce, (answer, _, heard) = next(iter(waiting.items()))
            if len(waiting) < MAX_WAITING and now - heard < FORGET_AFTER:
                break
            del waiting[nonce]
            answer.cancel()
        answered = self._answered
        while answered:
            nonce, (_, sent) = next(iter(answered.items()))
            if len(answered) < MAX_WAITING and now - sent < FORGET_AFTER:
                break
            del answered[nonce]

    def _send(self, frame: bytes, addr: tuple) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.sendto(frame, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # (an ICMP error for an answer: its requester resends, or uses TCP)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for answer, _, _ in self._waiting.values():
            answer.cancel()
        self._waiting.clear()
