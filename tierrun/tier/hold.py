"""The hold policy for contended writes. No I/O, no clock: every call takes ``now``.

A batch that opens with a *contended* write (an ADD, SET, MULTI_SET or APPEND to a key
family, the key less its trailing number, that another client wrote within
``CONTENDED_WITHIN`` seconds: every node's count of a barrier or of torch's ``init/``,
every node's role record) stays open ``hold`` seconds (``LinkConfig.contended_write_hold``)
so that the others' writes, which reach a node (and a stacked front-end) at different
moments, leave with it: fewer frames at the store host, each of which costs it far more
than the entries it carries. Each write that joins keeps it open one hold more, up to
``HOLD_STRETCH`` holds in all: writers that keep coming leave together, and the last one
(a barrier's, which every other waits for) waits one hold at most, plus the wait for
the next tick of a wall-clock grid (``LinkConfig.hold_grid``) on which every
front-end's held batches leave, so that the store host takes them in one wake-up.

A record (a SET, MULTI_SET or APPEND) of a family that was read through this front-end
within the second is not held: its readers wait for it one by one (Gloo's ranks, every
rank's address in turn). Any other request closes the held batch at once, so reads (and
chains of them) never wait, with one exception: a WAIT of a client whose write the
batch holds stays in it (every agent SETs its role record, then WAITs for its
assignment). A client repeating its own write of a family within the second (a counter
in a loop) is not held either, except by a front-end relaying a subtree's writes
(``relay``), which cannot tell one client's repeats from another's.
"""

from __future__ import annotations

from typing import Any

from ..protocol import Op, Request

#: A write is contended when another client wrote its key family this recently (seconds).
CONTENDED_WITHIN = 1.0
#: A held batch that other clients' writes keep joining stays open up to this many holds.
HOLD_STRETCH = 4
#: Families remembered at most (past it, forgotten all at once: forgetting only holds less).
MAX_FAMILIES = 16384
HELD_WRITES = frozenset({Op.ADD, Op.SET, Op.MULTI_SET, Op.APPEND})
_NOTED_READS = frozenset({Op.GET, Op.WAIT, Op.CHECK})


_DIGITS = b"0123456789"


def family(ns: bytes, key: bytes) -> tuple[bytes, bytes]:
    """A key's family: the key less its trailing number, in its namespace."""
    return ns, key.rstrip(_DIGITS)


def issuer(waiter: Any) -> Any:
    """The client a request came from: a relayed WAIT waits under a ticket of its own,
    whose ``client`` is the link client that sent it."""
    return getattr(waiter, "client", waiter)


class HoldPolicy:
    """Which writes open a held batch, and until when it stays open."""

    __slots__ = ("hold", "_family_writer", "_client_wrote", "_family_read", "until", "last", "writers")

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self._family_writer: dict[tuple[bytes, bytes], tuple[Any, float]] = {}  # family -> last writer, when
        self._client_wrote: dict[tuple[tuple[bytes, bytes], Any], float] = {}  # ... by this client, when
        self._family_read: dict[tuple[bytes, bytes], float] = {}  # family -> when last read one key at a time
        self.until = 0.0  # the held batch leaves at this time (monotonic) ...
        self.last = 0.0  # ... but no later than this
        self.writers: set[Any] = set()  # clients with a request in the held batch

    def contended(self, waiter: Any, ns: bytes, req: Request, now: float) -> bool:
        """Whether this write's family was written by another client within
        ``CONTENDED_WITHIN`` seconds; notes this write. O(key)."""
        if req[0] == Op.MULTI_SET and not req[1]:
            return False  # (no keys: nothing to hold for)
        # (family() and issuer(), inlined: this runs for every write while holds are on)
        k = (ns, (req[1][0] if req[0] == Op.MULTI_SET else req[1]).rstrip(_DIGITS))
        waiter = getattr(waiter, "client", waiter)  # (a relayed write's ticket: its link client, as its ADDs)
        writers = self._family_writer
        if len(writers) >= MAX_FAMILIES:
            writers.clear()
        last = writers.get(k)
        writers[k] = (waiter, now)
        if req[0] != Op.ADD:  # (a record, not a count: is it being read, one by one?)
            read = self._family_read.get(k)
            if read is not None and now - read < CONTENDED_WITHIN:
                return False
        if not getattr(waiter, "relay", False):
            mine = self._client_wrote
            if len(mine) >= MAX_FAMILIES:
                mine.clear()
            before = mine.get((k, waiter))
            mine[(k, waiter)] = now
            if before is not None and now - before < CONTENDED_WITHIN:
                return False
        return last is not None and last[0] is not waiter and now - last[1] < CONTENDED_WITHIN

    def note_read(self, ns: bytes, req: Request, now: float) -> None:
        """Note that a key family is being read one key at a time: its writes are records
        that clients wait for one by one (Gloo's addresses), not held. O(key)."""
        if req[0] in _NOTED_READS and (req[0] == Op.GET or len(req[1]) == 1):
            reads = self._family_read
            if len(reads) >= MAX_FAMILIES:
                reads.clear()
            reads[family(ns, req[1] if req[0] == Op.GET else req[1][0])] = now

    def open(self, now: float) -> None:
        """A held batch opens now."""
        self.until = now + self.hold
        self.last = now + HOLD_STRETCH * self.hold

    def joined(self, now: float) -> None:
        """Another contended write joined the held batch: hold on while they keep coming."""
        self.until = min(now + self.hold, self.last)

    def left(self, now: float) -> float:
        """Seconds the held batch still waits (<= 0.001: it leaves now)."""
        return self.until - now
