"""The store's budgets: what it holds (bytes, keys) and answers (one answer's size), and
how much of its time full scans may take. Torch's server has none of them: there a
22 KB MULTI_GET can make the server build a 2 GB answer, and SETs grow it without end.

Every check is O(1): the store keeps running totals, so no request scans anything to be
checked. A request past a budget raises :class:`BudgetExceeded` (a ``StoreError``) before
it changes anything: as with any failed request, its client is closed, as torch's server
closes it; the store and every other client go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..protocol.limits import Limits
from .values import StoreError

#: Scans of fewer keys than this are not paced: they take a few milliseconds.
PACED_SCAN_KEYS = 16 * 1024
#: Full scans may take at most this share of the store's time...
SCAN_SHARE = 0.5
#: ... in bursts of at most this many seconds (then as much as the share allows).
SCAN_BURST = 1.0


class BudgetExceeded(StoreError):
    """A write past the store's budget, or an answer past its size limit."""


class BudgetFull(BudgetExceeded):
    """A write, or a WAIT that would wait on ``waits`` keys, past the store's totals by
    ``over_entries`` keys and ``over_bytes`` bytes (``--max-store-keys``,
    ``--max-store-bytes``): keys others wait for may make room (``wait_shares``)."""

    def __init__(self, message: str, waits: int, over_entries: int, over_bytes: int) -> None:
        super().__init__(message)
        self.waits = waits
        self.over_entries = over_entries
        self.over_bytes = over_bytes


#: The least a key's value counts for: the longest int64 in decimal
#: (-9223372036854775808). So what a key counts for does not change when an ADD changes
#: its number, whatever the delta, and ADDs to one key merged into one ADD of their sum
#: (a node proxy merges a batch's) are refused past the budget exactly when the first of
#: them alone would be.
MIN_VALUE_BYTES = 20


def held(size: int) -> int:
    """What a key's value of ``size`` bytes counts for."""
    return size if size > MIN_VALUE_BYTES else MIN_VALUE_BYTES


def _key(key: bytes) -> str:
    return repr(key[:64]) + ("..." if len(key) > 64 else "")


class StoreBudget:
    """Running totals of what the store holds, against its limits.

    ``bytes``: keys and values (a key's value counts for at least
    ``MIN_VALUE_BYTES``: :func:`held`), queued values and queue names; ``entries``: keys,
    queues and queued values. The store calls :meth:`grow` before every write that
    adds (a negative size when a write shrinks a value) and lowers the totals itself when
    something goes. O(1) per call.
    """

    __slots__ = ("bytes", "entries", "max_bytes", "max_entries", "max_reply", "max_value", "refused")

    def __init__(self, limits: Limits) -> None:
        self.bytes = 0
        self.entries = 0
        self.max_bytes = limits.max_store_bytes
        self.max_entries = limits.max_store_keys
        self.max_reply = limits.max_reply_bytes
        self.max_value = limits.max_value_bytes
        self.refused = 0  # requests refused, ever

    def grow(self, key: bytes, more_bytes: int, more_entries: int) -> None:
        """Count a write that adds ``more_bytes`` and ``more_entries``. Raises
        BudgetExceeded (nothing counted) if it would pass a budget; a write that adds
        nothing to a total is never refused for that total (a full store still takes
        writes that shrink it or keep its size)."""
        b = self.bytes + more_bytes
        e = self.entries + more_entries
        if (b > self.max_bytes and more_bytes > 0) or (e > self.max_entries and more_entries > 0):
            self.refused += 1
            over = (e - self.max_entries if more_entries > 0 else 0, b - self.max_bytes if more_bytes > 0 else 0)
            if e > self.max_entries and more_entries > 0:
                raise BudgetFull(
                    f"the store holds {self.entries:,} keys and queued values, its budget (--max-store-keys), "
                    f"and this write (key {_key(key)}) adds {more_entries:,}; delete keys, or start the store "
                    "with a larger budget", 0, *over)
            raise BudgetFull(
                f"the store holds {self.bytes:,} bytes of keys and values and this write (key {_key(key)}) "
                f"adds {more_bytes:,}, past its budget (--max-store-bytes) of {self.max_bytes:,}; delete keys, "
                "or start the store with a larger budget", 0, *over)
        self.bytes = b
        self.entries = e

    def wait(self, keys: list[bytes]) -> int:
        """A WAIT (or BARRIER) about to block on ``keys``: the store holds a registration
        per key while it waits (~300 B in CPython, besides the key), so each counts as a
        key, and its bytes as a key's, until it is woken or forgotten (:meth:`unwait`).
        Returns their bytes. Raises BudgetExceeded (nothing counted) past a budget. O(keys)."""
        more = sum(map(len, keys))
        if self.entries + len(keys) > self.max_entries or self.bytes + more > self.max_bytes:
            self.refused += 1
            raise BudgetFull(
                f"it would wait on {len(keys):,} missing keys ({more:,} bytes), and the store holds "
                f"{self.entries:,} keys and waited-for keys ({self.bytes:,} bytes): past its budget "
                f"(--max-store-keys {self.max_entries:,}, --max-store-bytes {self.max_bytes:,}); keys waited "
                "for count as keys while they are waited for: wait for fewer keys at a time",
                len(keys), self.entries + len(keys) - self.max_entries, self.bytes + more - self.max_bytes)
        self.entries += len(keys)
        self.bytes += more
        return more

    def unwait(self, keys: list[bytes]) -> None:
        """The wait on ``keys`` counted by :meth:`wait` is over. O(keys)."""
        self.entries -= len(keys)
        self.bytes -= sum(map(len, keys))

    def value(self, key: bytes, size: int) -> None:
        """A value a write would leave (an APPEND's result): raises BudgetExceeded past
        the value limit."""
        if size > self.max_value:
            self.refused += 1
            raise BudgetExceeded(
                f"the value of key {_key(key)} would be {size:,} bytes, past the limit (--max-value-bytes) "
                f"of {self.max_value:,}")

    def reply(self, size: int) -> None:
        """An answer's size, known before it is built: raises BudgetExceeded past the
        limit of one answer."""
        if size > self.max_reply:
            self.refused += 1
            raise BudgetExceeded(
                f"its answer would be {size:,} bytes, past the limit (--max-reply-bytes) of {self.max_reply:,} "
                "for one answer; ask for fewer keys at a time")


def multi_set_growth(data: dict[bytes, bytes], keys: tuple[bytes, ...],
                     values: tuple[bytes, ...]) -> tuple[int, int, int]:
    """What a MULTI_SET of ``keys`` and ``values`` adds to ``data``: (bytes, keys, bytes of
    new keys), exactly (a key set twice counts once, with its last value). O(keys)."""
    more = entries = key_bytes = 0
    get = data.get
    for key, value in dict(zip(keys, values)).items():
        old = get(key)
        if old is None:
            more += len(key) + held(len(value))
            entries += 1
            key_bytes += len(key)
        else:
            more += held(len(value)) - held(len(old))
    return more, entries, key_bytes


def scanner_of(waiter: object) -> int | str:
    """Whose scan time a waiter's scans count as: a client connection's source host (its
    ``scan_source``: a client that opens a new connection for every scan is still one
    scanner; a node's link client: its session's id), else the waiter itself, by id. O(1)."""
    source = getattr(waiter, "scan_source", None)
    return source if source is not None else id(waiter)


class ScanPacer:
    """Keeps full scans of a large store (LIST_KEYS, a namespace's GETNUMKEYS: ~1 us a
    key, during which the store serves no one) to ``share`` of the store's time, in
    bursts of at most ``burst`` seconds: a token bucket of scan time. Fair: each
    scanner (a client's host, or a node's link: see :func:`scanner_of`) also runs a
    debt of its own scan time, paid back at ``share``; while the bucket is empty, a scanner with no debt (it
    has not scanned lately) still scans, on an overdraft of at most ``burst`` more,
    while the one that emptied the bucket is refused (BudgetExceeded: its client is
    closed). So one greedy scanner cannot lock the others out of LIST_KEYS, and however
    many clients scan, the store is never busy scanning for much longer than twice
    ``burst`` plus one scan (~1 s at the default --max-store-keys), well within a
    link's heartbeat timeout. Takes the time from ``clock`` (seconds). O(1) per scan
    (the debts are swept, O(scanners), once their table passes ``_SWEEP_AT``)."""

    __slots__ = ("share", "burst", "credit", "_clock", "_last", "_debts", "scans", "refused")

    #: Scanners with a debt kept before the paid-up ones are swept out.
    _SWEEP_AT = 4096

    def __init__(self, share: float = SCAN_SHARE, burst: float = SCAN_BURST,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.share = share
        self.burst = burst
        self.credit = burst
        self._clock = clock
        self._last = clock()
        #: scanner_of(scanner): (debt in seconds, as of); ids, not the objects: a closed link
        #: client is not kept alive (an id reused by a later one inherits a debt at most ``burst`` old)
        self._debts: dict[int | str, tuple[float, float]] = {}
        self.scans = 0  # paced scans done
        self.refused = 0

    def start(self, keys: int, scanner: object = None) -> float:
        """``scanner`` is about to scan ``keys`` keys: when it started (for
        :meth:`done`), or -1.0 for a scan too small to pace. Raises BudgetExceeded
        while scans have had their share and this scanner has had its own lately."""
        if keys < PACED_SCAN_KEYS:
            return -1.0
        now = self._clock()
        self._refill(now)
        if self.credit <= 0 and (self.credit <= -self.burst or self._debt(scanner_of(scanner), now) > 0):
            self.refused += 1
            raise BudgetExceeded(
                f"scans of the store's {keys:,} keys have taken their share of its time ({self.share:.0%}) "
                "lately, this client's among them, and the store keeps them to it so that its other "
                "clients are served; scan less often")
        self.scans += 1
        return now

    def done(self, started: float, scanner: object = None) -> None:
        """``scanner``'s scan begun at ``started`` is over: charge its time."""
        if started >= 0:
            now = self._clock()
            took = now - started
            self.credit -= took
            self._refill(now)
            debts = self._debts
            who = scanner_of(scanner)
            debts[who] = (self._debt(who, now) + took, now)
            if len(debts) > self._SWEEP_AT:
                for who in [w for w in debts if self._debt(w, now) <= 0]:
                    del debts[who]

    def _debt(self, scanner: int | str, now: float) -> float:
        debt, since = self._debts.get(scanner, (0.0, now))
        return max(0.0, debt - (now - since) * self.share)

    def _refill(self, now: float) -> None:
        self.credit = min(self.burst, self.credit + (now - self._last) * self.share)
        self._last = now
