"""The batch being built: requests a front-end's clients sent since the last batch left.

A client's CANCEL_WAIT must drop its WAITs and BARRIERs still here, and only those sent
before it (a WAIT it sends after its CANCEL_WAIT stays). Scanning the batch at every
CANCEL_WAIT would cost O(batch) each: a client pipelining WAIT, CANCEL_WAIT pairs would
make a batch quadratic. So a cancel is O(1) (a mark: this client's waits queued so far
go) and the marks are applied once, when the batch is taken: O(batch).
"""

from __future__ import annotations

from typing import Any

from ..protocol import Request
from ..protocol.opcodes import WAITING_OPS

Pending = tuple[Any, bytes, Request]  # (waiter, namespace, request or a watching read)


def opcode_of(req: Request) -> int:
    """A request's opcode; a watching read's (marked, ``(mark, request, watcher)``) is
    its request's."""
    return req[1][0] if req[0] < 0 else req[0]


class PendingBatch:
    __slots__ = ("items", "_waits", "_cancelled")

    def __init__(self) -> None:
        self.items: list[Pending] = []
        self._waits: dict[Any, int] = {}  # waiter -> its WAITs and BARRIERs in items
        self._cancelled: dict[Any, int] = {}  # waiter -> its waits in items[:n] are dropped

    def add(self, waiter: Any, ns: bytes, req: Request) -> None:
        """O(1)."""
        self.items.append((waiter, ns, req))
        if (req[1][0] if req[0] < 0 else req[0]) in WAITING_OPS:  # (opcode_of, inlined: every request)
            self._waits[waiter] = self._waits.get(waiter, 0) + 1

    def cancel_waits(self, waiter: Any) -> bool:
        """Drop ``waiter``'s WAITs and BARRIERs queued so far; whether there were any. O(1)."""
        if not self._waits.pop(waiter, 0):
            return False
        self._cancelled[waiter] = len(self.items)
        return True

    def take(self) -> list[Pending]:
        """The batch, without the cancelled waits; empties this one. O(batch)."""
        items, cancelled = self.items, self._cancelled
        self.items, self._waits, self._cancelled = [], {}, {}
        if cancelled:
            items = [p for i, p in enumerate(items)
                     if i >= cancelled.get(p[0], 0) or opcode_of(p[2]) not in WAITING_OPS]
        return items
