"""What a front-end owes one client connection: the budget of its unread answers.

A client that does not read its answers must not make the store host (or a proxy) hold
them without end, whether they are answered at once, later (a WAIT woken by another
client's SET, every answer through a proxy) or held back by an invalidation round. So
each connection counts what it owes its client:

- bytes written to the client and not yet taken by its socket (the transport's buffer);
- bytes of answers held for it while an invalidation round runs (``hub.reply_gate``);
- for every request sent upstream and not yet answered, the largest answer it may
  bring back (:func:`largest_answer`: a GET's is a value's, 8 MiB by default), plus
  :data:`REQUEST_RESERVE` for what the request itself holds upstream (a waiter, a ticket).

The connection executes a client's next request only while it owes at most
``REPLY_BUFFER`` (flow control: it stops reading meanwhile; a torch client, which has
one request outstanding at a time, never waits for it), and closes a client that it
owes more than ``Limits.max_unread_bytes``. Since every request is counted at its
largest answer before it leaves, what one connection makes the store host hold is
bounded by ``REPLY_BUFFER`` plus one answer, however many requests the client pipelines.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..protocol import Limits, Op, Request

#: Bytes a deferred request keeps reserved besides its answer: its state upstream.
REQUEST_RESERVE = 128
#: Answers longer than this are written in slices of it (see ``write_answer``).
WRITE_SLICE = 256 << 10


def write_answer(transport: Any, data: bytes) -> None:
    """Write ``data`` to a client, a large answer in slices: uvloop keeps a buffer it has
    partly sent whole until all of it is sent, while its write buffer (what the budgets
    count) says only what is left, so an 8 MiB answer the kernel took 4 MiB of held 8 MiB
    counted as 4. Sliced, what the transport keeps is what it counts, within a slice.
    O(len(data)): a copy of a large answer."""
    if len(data) <= WRITE_SLICE:
        transport.write(data)
    else:
        for start in range(0, len(data), WRITE_SLICE):
            transport.write(data[start:start + WRITE_SLICE])

_VALUE_ANSWERS = frozenset({Op.GET, Op.QUEUE_POP, Op.COMPARE_SET})
#: Answered with one byte (STOP_WAITING, READY/NOT_READY): counted apart from the
#: rest, since a WAIT's answer may come after later requests' answers.
_ONE_BYTE = frozenset({Op.WAIT, Op.BARRIER, Op.CHECK})


def largest_answer(req: Request, limits: Limits) -> int:
    """The largest answer ``req`` may get, from the store's limits. O(1)."""
    op = req[0]
    if op in _VALUE_ANSWERS:
        return 16 + limits.max_value_bytes
    if op == Op.MULTI_GET:
        return min(limits.max_reply_bytes, len(req[1]) * (8 + limits.max_value_bytes))
    if op == Op.LIST_KEYS:
        return limits.max_reply_bytes
    if op in _ONE_BYTE:
        return 1
    return 8  # ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN, CANCEL_WAIT, PING


class Owed:
    """The answers a connection is still to write for requests sent upstream, and the
    bytes held for it by an invalidation round. Answers of one connection's requests
    come back in order, but a WAIT's or BARRIER's (one byte) may come after later
    ones: those are counted apart, and so are CHECK's (one byte too). O(1) per request
    and per answer."""

    __slots__ = ("reserved", "_answers", "_checks", "waits", "held")

    def __init__(self) -> None:
        self.reserved = 0  # bytes reserved for answers still to come
        self._answers: deque[int] = deque()  # reservations of the others, in order
        self._checks = 0  # CHECK answers still to come
        self.waits = 0  # WAIT and BARRIER answers still to come
        self.held = 0  # bytes held by the reply gate for this connection

    def sent(self, req: Request, limits: Limits) -> int:
        """``req`` went upstream and its answer will come later: reserve it; returns
        the bytes reserved."""
        op = req[0]
        if op in _ONE_BYTE:
            if op == Op.CHECK:
                self._checks += 1
            else:
                self.waits += 1
            size = 1 + REQUEST_RESERVE
        else:
            size = largest_answer(req, limits) + REQUEST_RESERVE
            self._answers.append(size)
        self.reserved += size
        return size

    def answered(self, answer: bytes) -> None:
        """An answer came (``waiter.wake``): free its reservation. One byte long: a
        CHECK's if one is due (a link upstream says ``answered_wait`` for a WAIT's),
        else a WAIT's or BARRIER's (the core answers CHECK at once)."""
        if len(answer) == 1:  # (no other answer is one byte long)
            if self._checks:
                self._checks -= 1
                self.reserved -= 1 + REQUEST_RESERVE
            else:
                self.answered_wait()
        elif self._answers:
            self.reserved -= self._answers.popleft()

    def answered_wait(self) -> None:
        """A WAIT's or BARRIER's answer came."""
        if self.waits:  # (0: after a CANCEL_WAIT forgot them)
            self.waits -= 1
            self.reserved -= 1 + REQUEST_RESERVE

    def cancelled(self) -> None:
        """CANCEL_WAIT: the client's WAITs and BARRIERs will not be answered."""
        self.reserved -= self.waits * (1 + REQUEST_RESERVE)
        self.waits = 0
