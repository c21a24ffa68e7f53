"""The read-ahead policy. No I/O.

A fetch of a key whose trailing number follows that of a key fetched (or read ahead) in
an earlier batch also *reads ahead*: a PEEKS entry asks for the state of the next
LOOKAHEAD keys (twice as many each time the reads go on in order, up to MAX_LOOKAHEAD),
which the core answers at once, watching those that hold a value (Gloo's ranks read every
rank's address in turn: a few fetches instead of one per key), as a file system reads
ahead. Agents that each read their own key at once read nothing ahead.
"""

from __future__ import annotations

import re
from collections.abc import Container

from ..link.frames import PEEKS
from ..protocol import Op
from .plan import Plan, PlanLimits, UpOp

LOOKAHEAD = 16
MAX_LOOKAHEAD = 256
#: Keys (and names) remembered at most (past it, forgotten all at once).
MAX_REMEMBERED = 16384
_TRAILING_NUMBER = re.compile(rb"[0-9]{1,18}\Z")


class ReadAhead:
    """``max_key_bytes``: keys longer are never read ahead (the store host would refuse them)."""

    __slots__ = ("_peeked", "_lookahead_of", "max_key_bytes")

    def __init__(self, max_key_bytes: int) -> None:
        self.max_key_bytes = max_key_bytes
        self._peeked: dict[tuple[bytes, bytes], None] = {}  # keys fetched or read ahead before (not again)
        #: (ns, a key name less its trailing number) -> how many keys it last read ahead
        self._lookahead_of: dict[tuple[bytes, bytes], int] = {}

    def after_fetches(self, fetched: list[tuple[bytes, bytes]], skip: Container[tuple[bytes, bytes]]
                      ) -> list[tuple[bytes, list[bytes]]]:
        """For the keys a batch fetched, in order: (namespace, the keys to read ahead).
        Keys in ``skip`` (watched already, or changing too often) are not. O(keys read
        ahead)."""
        if len(self._peeked) >= MAX_REMEMBERED:
            self._peeked.clear()
        out = [(ns, self._ahead(ns, key, skip)) for ns, key in fetched]
        for ns, key in fetched:
            self._peeked[(ns, key)] = None  # (the fetch of the key after it reads ahead)
        return [(ns, keys) for ns, keys in out if keys]

    def _ahead(self, ns: bytes, key: bytes, skip: Container[tuple[bytes, bytes]]) -> list[bytes]:
        m = _TRAILING_NUMBER.search(key)
        if m is None:
            return []
        base, n = key[: m.start()], int(m.group())
        peeked = self._peeked
        if (ns, base + str(n - 1).encode()) not in peeked:
            return []
        sizes = self._lookahead_of
        if len(sizes) >= MAX_REMEMBERED:
            sizes.clear()
        size = sizes[(ns, base)] = min(2 * sizes.get((ns, base), LOOKAHEAD // 2), MAX_LOOKAHEAD)
        ahead = []
        longest = self.max_key_bytes
        for i in range(n + 1, n + 1 + size):
            k = (ns, base + str(i).encode())
            if len(k[1]) > longest:
                break
            if k not in peeked and k not in skip:
                peeked[k] = None
                ahead.append(k[1])
        return ahead

    def past_end(self, ns: bytes, key: bytes) -> None:
        """A key read ahead holds nothing yet (past the last one, or ahead of its
        writers): read ahead less from here on."""
        m = _TRAILING_NUMBER.search(key)
        if m is not None:
            self._lookahead_of.pop((ns, key[: m.start()]), None)


def plan_peeks(plan: Plan, ns: bytes, keys: list[bytes], peeking, limits: PlanLimits = PlanLimits()) -> list[UpOp]:
    """Read-ahead: a PEEKS op (members folded, ``limits.max_fold`` at most per entry) for
    each of ``keys`` not read in the batch nor in ``peeking`` already; appended to
    ``plan.ops``. Returns the new ops (members included)."""
    new: list[UpOp] = []
    f = plan.peek_folds.get(ns)
    for key in keys:
        k = (ns, key)
        if k in peeking or k in plan.read_keys:
            continue
        u = UpOp((Op.WAIT, (key,)), ns, None, 1 << 62)
        u.wkey = k
        u.watchers = []
        u.fetch = PEEKS
        new.append(u)
        if f is not None and len(f.members or ()) + 1 < limits.max_entry_keys:
            f.members = f.members or []
            f.members.append(u)
        else:
            f = plan.peek_folds[ns] = u
            plan.ops.append(u)
    return new
