"""The watch cache of a front-end: keys it may answer on the node. No I/O, no clock:
calls that depend on time take ``now``.

Across batches, only through watches (docs/architecture.md; link/frames.py): a
one-key CHECK (a poll from the first: NCCL's heartbeat monitor, torch's only caller of
CHECK), or GET or WAIT of a key polled (read before by another client, or by the same
client asking the same: the ranks' WAITs and GETs of the unique id, a barrier's WAITs)
goes upstream as a WATCH, whose answer carries the key's state; the front-end then
answers reads of the key from that state, and WAITs on it join the WAIT that waits for
it upstream, until the core invalidates the watch (which it does before anyone can
learn of a change) or the lease runs out. A key's first one-key WAIT *fetches* it: it
goes up in a WATCHES entry, whose answers carry the key's state too, so the GET of
torch's get() (a WAIT, then a GET) is answered on the node; such a WAIT watches its key
only once it is there (nothing joins it), so the write that releases it costs no
invalidation round. A proxy that takes other front-ends' links treats a second
front-end's fetch of a key as a poll (the exit barrier: one agent per node WAITs for its
last member): it goes up as a WATCH-WAIT, which later ones join.

Answers from watches (and joins) only for a client with nothing outstanding (every
earlier request of it answered, none since without an answer); such a client's reads
are sent plain, its WAITs fetch in a FETCHES entry, which no front-end on the way
answers from its watches. A key invalidated ``MAX_CHURN`` times is not watched again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..link.frames import PEEKS
from ..protocol import Op
from ..protocol.opcodes import CHECK_NOT_READY, CHECK_READY, STOP_WAITING
from ..protocol.replies import encode_bytes
from .plan import UpOp

#: Keys a front-end watches at most, and bytes of their values it holds at most (past
#: either, it forgets them all and starts again).
MAX_WATCHES = 16384
MAX_WATCHED_BYTES = 32 << 20
#: A key whose watch was invalidated this often is read without one from then on.
MAX_CHURN = 4
MISSING = object()
Key = tuple[bytes, bytes]  # (namespace, key)


def answer_from(op: int, value: bytes | None) -> bytes:
    """A CHECK's, GET's or WAIT's answer from a watched key's state."""
    if op == Op.GET:
        return encode_bytes(value if value is not None else b"")
    if op == Op.CHECK:
        return CHECK_READY if value is not None else CHECK_NOT_READY
    return STOP_WAITING


class WatchCache:
    """Watched keys' states, the WAITs sent watching a key, the front-ends below that
    watch a key through this one, and what tells a poll from a first read."""

    def __init__(self) -> None:
        self.values: dict[Key, bytes | None] = {}  # watched key -> value, None: absent
        self.value_bytes = 0  # ... their values' bytes
        self.watch_of: dict[int, Key] = {}  # watch id (its WATCH's rid) -> key
        self.waiting_on: dict[Key, UpOp] = {}  # the WATCH-WAIT sent for a key
        self.downstream: dict[Key, list[Any]] = {}  # front-ends below watching a key
        self.peeking: dict[Key, UpOp] = {}  # peeks awaiting their answer
        self._seen: dict[Key, tuple[Any, int]] = {}  # key -> (its first reader, what it asked)
        self._churn: dict[Key, int] = {}  # invalidations per key
        self.lease_until = 0.0  # answer from watches only before this (monotonic)

    # -- decisions ---------------------------------------------------------------------

    def value(self, op: int, k: Key, now: float) -> bytes | None | object:
        """``k``'s watched value (None: absent) when a CHECK, GET or WAIT of it can be
        answered from its watch now (within the lease; a WAIT only once the key is
        there), else MISSING."""
        if now >= self.lease_until:
            return MISSING
        value = self.values.get(k, MISSING)
        return MISSING if value is None and op == Op.WAIT else value

    def joinable(self, k: Key, now: float) -> UpOp | None:
        """The WATCH-WAIT sent for ``k`` that a WAIT may join (the core watches the key
        meanwhile, so until it says the key changed, that WAIT's answer is this one's)."""
        u = self.waiting_on.get(k)
        return u if u is not None and u.cid and now < self.lease_until else None

    def is_poll(self, k: Key, waiter: Any, op: int) -> bool:
        """Was ``k`` read before by another client, or did this one ask the same?"""
        first = self._seen.get(k)
        return first is not None and (first[0] is not waiter or first[1] == op)

    def seen(self, k: Key) -> bool:
        return k in self._seen

    def watchable(self, k: Key) -> bool:
        return self._churn.get(k, 0) < MAX_CHURN

    def __contains__(self, k: Key) -> bool:
        """Not worth reading ahead: watched already, or changing too often."""
        return k in self.values or self._churn.get(k, 0) >= MAX_CHURN

    def lease_left(self, now: float, lease: float) -> float:
        return max(0.0, min(lease, self.lease_until - now))

    # -- bookkeeping -------------------------------------------------------------------

    def note_reads(self, reads: list[tuple[Key, Any, int]]) -> None:
        """A batch's one-key reads, in order: each key's first reader is remembered."""
        seen = self._seen
        for k, waiter, op in reads:
            if k not in seen:
                if len(seen) >= MAX_WATCHES:
                    seen.clear()
                seen[k] = (waiter, op)

    def note_sent(self, u: UpOp) -> None:
        """A watching read goes upstream: a WATCH-WAIT may be joined by later WAITs; a
        peek is answered to the front-ends below that read ahead alike; they are told of
        invalidations of the key from now on (of a read merged with another's, only once
        it is watched)."""
        k = u.wkey
        assert k is not None
        if u.fetch == PEEKS:
            self.peeking[k] = u
            below = [w for w in u.watchers or () if w is not None]
        else:
            if u.fetch == 0 and u.req[0] == Op.WAIT:
                self.waiting_on[k] = u
            below = [u.watchers[0]] if u.watchers and u.watchers[0] is not None else []
        if below:
            self.downstream.setdefault(k, []).extend(below)

    def watch_below(self, k: Key, watcher: Any) -> None:
        self.downstream.setdefault(k, []).append(watcher)

    def answered(self, u: UpOp, watched: bool, value: bytes | None) -> list[Any]:
        """A watching read's answer came: keep the state; returns the list of front-ends
        below watching the key (registered here), or [] when not watched."""
        k = u.wkey
        assert k is not None
        if self.waiting_on.get(k) is u:
            del self.waiting_on[k]
        if self.peeking.get(k) is u:
            del self.peeking[k]
        if not watched:
            below = self.downstream.get(k)
            if below is not None and u.fetch == PEEKS:  # (nothing was registered)
                for watcher in u.watchers or ():
                    if watcher in below:
                        below.remove(watcher)
            return []
        size = len(value) if value else 0
        if len(self.values) >= MAX_WATCHES or self.value_bytes + size > MAX_WATCHED_BYTES:
            self.values.clear()  # (forgetting is always safe; the core's invalidations
            self.watch_of.clear()  # of forgotten watches are confirmed all the same)
            self.value_bytes = 0
        old = self.values.get(k)
        self.value_bytes += size - (len(old) if old else 0)
        self.values[k] = value
        self.watch_of[u.rid] = k
        below = self.downstream.get(k)
        if below is None:
            below = self.downstream[k] = []
        for watcher in u.watchers or ():
            if watcher is not None and watcher not in below:
                below.append(watcher)
        return below

    def failed(self, u: UpOp) -> None:
        k = u.wkey
        if k is not None:
            if self.waiting_on.get(k) is u:
                del self.waiting_on[k]
            if self.peeking.get(k) is u:
                del self.peeking[k]

    def invalidate(self, ids: list[int], inflight: dict[int, UpOp]) -> tuple[int, list[Any]]:
        """The core says these watches broke: forget them. Returns how many, and the
        front-ends below to tell."""
        below: list[Any] = []
        n = 0
        for wid in ids:
            k = self.watch_of.pop(wid, None)
            if k is None:  # a WATCH-WAIT still waiting: its key is watched as absent
                u = inflight.get(wid)
                if u is None or u.wkey is None:
                    continue
                k = u.wkey
            n += 1
            old = self.values.pop(k, None)
            if old:
                self.value_bytes -= len(old)
            self.waiting_on.pop(k, None)
            below += self.downstream.pop(k, ())
            if len(self._churn) > MAX_WATCHES:
                self._churn.clear()
            self._churn[k] = self._churn.get(k, 0) + 1
        return n, below

    def drop_all(self) -> list[Any]:
        """The connection is gone: answer nothing more from watches (resent answers and
        invalidations bring them back in order). Returns the front-ends below to tell."""
        self.lease_until = 0.0
        self.values.clear()
        self.value_bytes = 0
        self.watch_of.clear()
        self.waiting_on.clear()
        below = [w for ws in self.downstream.values() for w in ws]
        self.downstream.clear()
        return below


def nobody_below(watchers: list, on_done: Callable[[], None] | None) -> None:
    """(A front-end's ``on_watches_broken`` until something links front-ends to it.)"""
    raise RuntimeError("front-ends below watch keys, but nothing runs their invalidation rounds")
