"""Writes in flight with no answer (SET, APPEND, MULTI_SET, QUEUE_PUSH): whom to close if
the store host refuses one (past its budget, or its limits).

Torch's protocol has no answer for these writes, and torch's server closes the client
whose write fails. So a front-end sends each with a request id; the store host answers
it only if it refuses it (FAILED), and the front-end closes the client whose write it
carried (a write is never merged with another: each is refused on its own). A write is
forgotten once an answer to a later request arrives: the store host executes a link's
requests in the order of their ids and answers in that order, so a refusal of it would
have come first. A relay, which answers some requests itself (from its watches, or
refused there), marks an answer that may be ahead of writes it relayed before it
UNORDERED (``link.frames``): that one settles no other write. A relayed write's
waiter hears when it lands (``landed``; ``hub.waiters.WriteTicket``). At most
``MAX_WRITES`` are remembered (a client that only writes gets no answers to forget
them by): the oldest beyond it are forgotten, and a refusal of one of those is only
logged by the store host (and a client whose write that was is not closed). So that it
does not come to that (at a relay, every node's writes below it count), a PING follows
once ``SYNC_AT`` writes are in flight (its answer settles them:
:attr:`WritesInFlight.sync`; another follows it if the writes sent behind it are as
many), and from ``STALL_AT`` writes in flight or queued on, the front-end reads no more
writes from its clients, nor a relay from the front-ends below (``write_room``), until
answers have settled them. What still passes: a frame's worth of writes per front-end
below, beyond ``STALL_AT`` (a relay whose children all flood at once). O(1) per write
and per answer, amortised.

A client whose write is refused is closed, but the requests it sent after that write
went on before the refusal came back: so each client's latest write whose outcome is not
known to be a success (in flight, or refused) is kept (:meth:`WritesInFlight.unsettled`),
and a request with an effect that the client sends meanwhile leaves behind an AFTER
entry naming that write (``tier.entries``): the store host runs it only if the write
was not refused, as the store alone would have closed the client at that write. Once
its refusal has come, the AFTER entry says REFUSED instead (:meth:`WritesInFlight.gate`:
a request of a relayed client still on its way up, here), so the store host need only
remember a refused write until the front-end acknowledged its FAILED.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from ..link.frames import REFUSED
from ..protocol import Op
from .fanout import failed

MAX_WRITES = 64 * 1024
SYNC_AT, STALL_AT = MAX_WRITES // 4, MAX_WRITES // 2


class Sync:
    """The waiter of a front-end's own PING that settles its writes in flight."""

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due = False  # a PING is on its way

    def wake(self, reply: bytes) -> None:
        self.due = False

    drop = wake


class WritesInFlight:
    __slots__ = ("_order", "_writers", "_latest", "_refused", "max_writes", "sync")

    def __init__(self, max_writes: int = MAX_WRITES) -> None:
        self._order: deque[int] = deque()  # request ids, ascending
        self._writers: dict[int, tuple[int, Any]] = {}  # request id -> (opcode, client)
        #: client -> request id of its latest write not known to have landed (in flight,
        #: or refused: kept, oldest dropped past ``max_writes``)
        self._latest: OrderedDict[Any, int] = OrderedDict()  # (dropping the oldest: O(1))
        self._refused: set[int] = set()  # those of _latest whose refusal came
        self.max_writes = max_writes
        self.sync = Sync()

    def __len__(self) -> int:
        return len(self._writers)

    def sent(self, writes: list[tuple[int, int, Any]]) -> bool:
        """Writes that left in a batch: (request id, opcode, its client), ids ascending.
        True if a PING must follow them (``SYNC_AT``; one at a time: ``sync.due``)."""
        latest, refused = self._latest, self._refused
        for rid, op, writer in writes:
            self._order.append(rid)
            self._writers[rid] = (op, writer)
            if refused:
                refused.discard(latest.get(writer, 0))
            latest[writer] = rid
            latest.move_to_end(writer)  # (the oldest stay first)
        while len(self._order) > self.max_writes:
            self._landed(self._order.popleft())
        while len(latest) > self.max_writes:
            refused.discard(latest.popitem(last=False)[1])
        return self.sync_needed()

    def sync_needed(self) -> bool:
        """True if a PING must go now (``SYNC_AT`` writes in flight, none on its way):
        after a batch of writes, and after answers (those sent behind a PING may be as
        many). O(1)."""
        if len(self._writers) >= SYNC_AT and not self.sync.due:
            self.sync.due = True
            return True
        return False

    def unsettled(self, writer: Any) -> int:
        """The request id of ``writer``'s latest write not known to have landed (in flight,
        or refused); 0 if it has none. O(1)."""
        return self._latest.get(writer, 0)

    def gate(self, writer: Any) -> int:
        """What an AFTER entry for ``writer`` names: :meth:`unsettled`, or REFUSED once
        that write's refusal came (the store host may have forgotten it). O(1)."""
        rid = self._latest.get(writer, 0)
        return REFUSED if rid and rid in self._refused else rid

    def _landed(self, rid: int) -> None:
        """Write ``rid`` is forgotten: executed (a later answer came), or too old."""
        write = self._writers.pop(rid, None)
        if write is not None:
            writer = write[1]
            if self._latest.get(writer) == rid:
                del self._latest[writer]
            landed = getattr(writer, "landed", None)  # (a relayed write's ticket)
            if landed is not None:
                landed()

    def answered(self, rid: int, ordered: bool = True) -> tuple[int, Any] | None:
        """An answer for request ``rid`` came: (opcode, client) of that write if it is
        one (it was refused), else None; writes sent before it are forgotten, unless the
        answer is not ``ordered`` (a relay's UNORDERED one)."""
        write = self._writers.pop(rid, None)  # (refused: its client's latest stays unsettled)
        if write is not None and self._latest.get(write[1]) == rid:
            self._refused.add(rid)
        if not ordered:
            return write
        order = self._order
        while order and order[0] < rid:
            self._landed(order.popleft())
        return write


def write_size(req: tuple) -> int:
    """Bytes of a SET's, APPEND's, QUEUE_PUSH's or MULTI_SET's keys and values."""
    if req[0] == Op.MULTI_SET:
        return sum(map(len, req[1])) + sum(map(len, req[2]))
    return len(req[1]) + len(req[2])


def refused_write(op: int, writer: Any, reason: bytes) -> None:
    """The store host refused a write with no answer (past its budget): close the
    client whose write it was, as torch's server closes a client whose write fails. A
    relayed write (a front-end below sent it with a request id) waits under a ticket
    whose ``drop`` answers that id with FAILED, so the front-end below closes its own
    client in turn (``hub.waiters.WriteTicket``). A link client itself (``relay``: a
    write sent with no request id, which nobody below can be told of) is not closed:
    the store host logged it. O(1)."""
    if not getattr(writer, "relay", False):
        writer.drop(failed(op, reason))
