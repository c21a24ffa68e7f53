"""The store's state and semantics: what torch's libuv TCPStore server does, without I/O.

Every topology (flat, tiered, stacked front-ends) executes its operations here, so
this is the one place where store semantics live. Single-threaded and deterministic.

Answers are the wire-format reply bytes; deferred answers (WAIT, BARRIER) are handed
to the requester's :class:`Waiter` when they become ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Protocol

from ..protocol import Limits, Op, Request
from ..protocol.opcodes import CHECK_NOT_READY, CHECK_READY, STOP_WAITING, WAIT_CANCELED
from ..protocol.replies import encode_bytes, encode_i64, encode_key_list, encode_many, encode_queue_pop, encode_u32
from .budget import BudgetFull, ScanPacer, StoreBudget, held, multi_set_growth
from .values import StoreError, parse_counter, wrap_i64
from .wait_shares import WaitShares, make_room
from .watch_state import PEEK, UNWATCHABLE, WATCH_READ, encode_watch_state

__all__ = ["MAX_WATCHES_PER_OWNER", "StoreCore", "StoreError", "Waiter"]


class Waiter(Protocol):
    """Whoever issued a request: receives deferred answers. Must be hashable."""

    def wake(self, reply: bytes) -> None:
        """Deliver a deferred reply (STOP_WAITING). Must not call back into the core."""

    def drop(self, reason: str) -> None:
        """Its wait was dropped to make room (:mod:`.wait_shares`): close its client."""


#: Called with the watchers of a key that just changed, before anyone waiting on the
#: key is woken: they must stop answering from what they saw (see ``execute_watching``).
WatchesBroken = Callable[[list[object]], None]

#: A watcher that is a pair ``(owner, id)`` (a link session and its watch id) counts
#: against its owner: past this many standing watches, the owner's older half is
#: broken like watches of changed keys (its front-end forgets them and watches anew
#: on its next polls). So the keys of finished rounds, which never change again, do
#: not pile up per node at the store host: at most this many registrations per owner.
MAX_WATCHES_PER_OWNER = 8192


class StoreCore:
    """Keys, counters, queues and waiters.

    ``execute(request, waiter)`` runs one request and returns its reply bytes, or
    ``None`` when there is no reply (SET, APPEND, …) or the reply is deferred (a WAIT
    on missing keys, a BARRIER not yet full); a deferred reply arrives through
    ``waiter.wake``. Raises :class:`StoreError` for a request that must fail, before
    it changes anything: a write past the store's budget (``limits.max_store_bytes``,
    ``max_store_keys``, an APPEND's value past ``max_value_bytes``) or a read whose answer
    would pass ``max_reply_bytes`` (see :mod:`.budget`; each check O(1) but MULTI_GET's,
    O(its keys)). Never blocks. Cost: O(size of the request) plus O(waiters woken); a
    full scan (LIST_KEYS; a namespace's, see ``frontend.namespace``) O(keys in the store),
    paced (``budget.ScanPacer``).
    """

    def __init__(self, limits: Limits | None = None, pacer: ScanPacer | None = None) -> None:
        self.budget = StoreBudget(limits or Limits())
        self.shares = WaitShares()  # each source's share of the keys waited for
        self.pacer = pacer or ScanPacer()
        self._key_bytes = 0  # bytes of the keys of _data (a LIST_KEYS answer's size)
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        # key -> waiters blocked on it, in arrival order (a dict as an ordered set)
        self._waiting: dict[bytes, dict[Waiter, None]] = {}
        # waiter -> [number of keys still missing, the keys it registered on]
        self._pending: dict[Waiter, list] = {}
        # key -> watchers who answer reads of it from what they saw (execute_watching)
        self._watched: dict[bytes, dict[object, None]] = {}
        # owner -> its watchers (each on one key) and their keys, oldest first (see
        # MAX_WATCHES_PER_OWNER)
        self._owned: dict[object, dict[object, bytes]] = {}
        self.max_watches_per_owner = MAX_WATCHES_PER_OWNER
        self.watches_evicted = 0  # broken for room, not because their key changed
        # a blocked watching WAIT's waiter -> (its key, its watcher): watched once woken
        self._watch_on_wake: dict[Waiter, tuple[bytes, object]] = {}
        #: Told of every change of a watched key (set by whoever hands out watches).
        self.on_watches_broken: WatchesBroken = lambda watchers: None
        self.operations = 0
        self._handlers: dict[int, Callable[[Request, Waiter], bytes | None]] = {
            Op.SET: self._set,
            Op.COMPARE_SET: self._compare_set,
            Op.GET: self._get,
            Op.ADD: self._add,
            Op.CHECK: self._check,
            Op.WAIT: self._wait,
            Op.GETNUMKEYS: self._num_keys,
            Op.DELETE_KEY: self._delete_key,
            Op.APPEND: self._append,
            Op.MULTI_GET: self._multi_get,
            Op.MULTI_SET: self._multi_set,
            Op.CANCEL_WAIT: self._cancel_wait,
            Op.PING: self._ping,
            Op.QUEUE_PUSH: self._queue_push,
            Op.QUEUE_POP: self._queue_pop,
            Op.QUEUE_LEN: self._queue_len,
            Op.LIST_KEYS: self._list_keys,
            Op.BARRIER: self._barrier,
        }

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        self.operations += 1
        try:
            return self._handlers[req[0]](req, waiter)
        except BudgetFull as full:  # (others' waits may make room: see wait_shares)
            return make_room(self, waiter, full, lambda: self._handlers[req[0]](req, waiter))

    def execute_watching(self, req: Request, waiter: Waiter, watcher: object,
                         how: int = WATCH_READ) -> bytes | None:
        """Run a one-key CHECK, GET or WAIT and watch its key for ``watcher``: answer
        its watch state (``watch_state.encode_watch_state``) followed by the reply, now,
        or (a WAIT on a missing key) through ``waiter.wake`` once the key is there.
        Until the key next changes, or the watcher's owner has too many watches
        (``MAX_WATCHES_PER_OWNER``; either way ``on_watches_broken`` gets the watcher),
        the watcher may answer reads of it from that state; a WAIT that blocks watches
        its key as absent meanwhile (a change breaks that watch first, then wakes it,
        which watches the key anew), unless ``how`` is a FETCH: then only once woken (no
        other WAIT joins it meanwhile: its key's first write starts no round for it). A
        queue's key is not watched. ``how`` PEEK (a front-end reading ahead, for no
        client): only the state of a key that holds a value; nothing waits. O(1) more."""
        self.operations += 1
        try:
            return self._execute_watching(req, waiter, watcher, how)
        except BudgetFull as full:
            return make_room(self, waiter, full, lambda: self._execute_watching(req, waiter, watcher, how))

    def _execute_watching(self, req: Request, waiter: Waiter, watcher: object, how: int) -> bytes | None:
        op = req[0]
        key = req[1] if op == Op.GET else req[1][0]
        if how == PEEK:
            return self.watch_state(key, watcher) if key in self._data else UNWATCHABLE
        if op == Op.WAIT and key not in self._data and not self._queues.get(key):
            # (what _wait does for one missing key, inline: every node's agent WAITs
            # so for its rank assignment, ~10 us less each at the store host)
            self.forget(waiter)
            self._block(waiter, [key])
            self._watch_on_wake[waiter] = (key, watcher)
            if how == WATCH_READ and key not in self._queues:  # watched as absent while it waits
                self._watch(key, watcher)
            return None
        reply = self._handlers[op](req, waiter)
        return self.watch_state(key, watcher) + reply  # type: ignore[operator]

    def watch_state(self, key: bytes, watcher: object) -> bytes:
        """Register ``watcher`` on ``key`` (unless it is a queue's): its state now."""
        if key in self._queues:
            return encode_watch_state(False, None)
        self._watch(key, watcher)
        return encode_watch_state(True, self._data.get(key))

    def _watch(self, key: bytes, watcher: object) -> None:
        """Register ``watcher`` on ``key``. O(1); past an owner's limit, O(limit) once
        per limit / 2 registrations."""
        self._watched.setdefault(key, {})[watcher] = None
        if type(watcher) is tuple:
            owned = self._owned.get(watcher[0])
            if owned is None:
                owned = self._owned[watcher[0]] = {}
            owned[watcher] = key
            if len(owned) > self.max_watches_per_owner:
                self._evict(owned)

    def _evict(self, owned: dict[object, bytes]) -> None:
        """Break the older half of one owner's watches."""
        watched = self._watched
        evicted = []
        for watcher, key in list(islice(owned.items(), len(owned) // 2)):
            del owned[watcher]
            watchers = watched.get(key)
            if watchers is not None and watcher in watchers:
                del watchers[watcher]
                if not watchers:
                    del watched[key]
                evicted.append(watcher)
        if evicted:
            self.watches_evicted += len(evicted)
            self.on_watches_broken(evicted)

    def _disown(self, watchers: dict[object, None]) -> None:
        """Their key changed: off their owners' lists. O(watchers)."""
        owned_by = self._owned
        for watcher in watchers:
            if type(watcher) is tuple:
                owned = owned_by.get(watcher[0])  # type: ignore[index]
                if owned is not None:
                    owned.pop(watcher, None)

    def _break_watches(self, key: bytes) -> None:
        watchers = self._watched.pop(key)
        self._disown(watchers)
        self.on_watches_broken(list(watchers))

    def drop_watches_of(self, owner: object) -> None:
        """``owner`` (a link session) is gone: drop its watches, without a round (it
        answers nothing any more). O(its watches)."""
        owned = self._owned.pop(owner, None)
        if not owned:
            return
        watched = self._watched
        for watcher, key in owned.items():
            watchers = watched.get(key)
            if watchers is not None:
                watchers.pop(watcher, None)
                if not watchers:
                    del watched[key]

    @property
    def num_watches(self) -> int:
        return sum(len(w) for w in self._watched.values())

    def forget(self, waiter: Waiter) -> None:
        """Drop the waiter's pending waits (its connection closed). Its keys stay."""
        if self._watch_on_wake:
            self._watch_on_wake.pop(waiter, None)
        entry = self._pending.pop(waiter, None)
        if entry is None:
            return
        self.budget.unwait(entry[1])
        self.shares.removed(waiter)
        for key in entry[1]:
            waiters = self._waiting.get(key)
            if waiters is not None:
                waiters.pop(waiter, None)
                if not waiters:
                    del self._waiting[key]

    @property
    def num_keys(self) -> int:
        return len(self._data)

    @property
    def num_waiters(self) -> int:
        return len(self._pending)

    def keys(self) -> list[bytes]:
        return list(self._data)

    def snapshot(self) -> dict[bytes, bytes]:
        """A copy of the key/value map (for tests and diagnostics)."""
        return dict(self._data)

    def _present(self, key: bytes) -> bool:
        if key in self._data:
            return True
        queue = self._queues.get(key)
        return bool(queue)

    def _block(self, waiter: Waiter, keys: list[bytes]) -> None:
        size = self.budget.wait(keys)  # (the keys count while they are waited for; refused: nothing done)
        for key in keys:
            self._waiting.setdefault(key, {})[waiter] = None
        self._pending[waiter] = [len(keys), keys]
        self.shares.added(waiter, len(keys), size)

    def _wake_all(self, key: bytes) -> None:
        waiters = self._waiting.pop(key, None)
        if waiters is None:
            return
        pending = self._pending
        for waiter in waiters:
            entry = pending[waiter]
            entry[0] -= 1
            if entry[0] == 0:
                del pending[waiter]
                self._release(waiter, entry[1])

    def _release(self, waiter: Waiter, keys: list[bytes]) -> None:
        """A WAIT has all its ``keys``: answer it (a watching one with its key's state)."""
        self.budget.unwait(keys)
        self.shares.removed(waiter)
        watching = self._watch_on_wake.pop(waiter, None) if self._watch_on_wake else None
        if watching is not None:
            key, watcher = watching
            waiter.wake(self.watch_state(key, watcher) + STOP_WAITING)
        else:
            waiter.wake(STOP_WAITING)

    def _wake_one(self, key: bytes) -> None:
        """A queue push: release waiters in order until one has nothing left to wait for."""
        waiters = self._waiting.get(key)
        while waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            entry = self._pending[waiter]
            entry[0] -= 1
            if entry[0] == 0:
                del self._pending[waiter]
                self._release(waiter, entry[1])
                break
        if waiters is not None and not waiters:
            del self._waiting[key]

    def _grow(self, key: bytes, current: bytes | None, new: bytes) -> None:
        """Count (or refuse: BudgetExceeded) ``key`` going from ``current`` to ``new``."""
        if current is None:
            self.budget.grow(key, len(key) + held(len(new)), 1)
            self._key_bytes += len(key)
        else:
            self.budget.grow(key, held(len(new)) - held(len(current)), 0)

    def _grow_many(self, keys: tuple[bytes, ...], values: tuple[bytes, ...]) -> None:
        """Count (or refuse, all of it) a MULTI_SET, exactly. O(keys)."""
        more, entries, key_bytes = multi_set_growth(self._data, keys, values)
        self.budget.grow(keys[0] if keys else b"", more, entries)
        self._key_bytes += key_bytes

    def _set(self, req: Request, waiter: Waiter) -> None:
        key, value = req[1], req[2]
        self._grow(key, self._data.get(key), value)
        self._data[key] = value
        if key in self._watched:
            self._break_watches(key)
        if key in self._waiting:
            self._wake_all(key)
        return None

    def _compare_set(self, req: Request, waiter: Waiter) -> bytes:
        _, key, expected, desired = req
        current = self._data.get(key)
        changed = False
        if current is None:
            if expected:
                result = expected
            else:
                self._grow(key, None, desired)
                self._data[key] = result = desired
                changed = True
        else:
            if current == expected:
                self.budget.grow(key, held(len(desired)) - held(len(current)), 0)
                self._data[key] = desired
                changed = current != desired
                current = desired
            result = current
        if changed and key in self._watched:
            self._break_watches(key)
        # torch wakes waiters even when nothing changed.
        self._wake_all(key)
        return encode_bytes(result)

    def _get(self, req: Request, waiter: Waiter) -> bytes:
        return encode_bytes(self._data.get(req[1], b""))

    def _add(self, req: Request, waiter: Waiter) -> bytes:
        _, key, delta = req
        current = self._data.get(key)
        value = delta if current is None else wrap_i64(parse_counter(current, key) + delta)
        new = str(value).encode()
        self._grow(key, current, new)  # (a number counts the same whatever it is: budget.held)
        self._data[key] = new
        if key in self._watched:
            self._break_watches(key)
        if key in self._waiting:
            self._wake_all(key)
        return encode_i64(value)

    def _check(self, req: Request, waiter: Waiter) -> bytes:
        present = self._present
        return CHECK_READY if all(present(k) for k in req[1]) else CHECK_NOT_READY

    def _wait(self, req: Request, waiter: Waiter) -> bytes | None:
        present = self._present
        missing = [k for k in dict.fromkeys(req[1]) if not present(k)]
        if not missing:
            return STOP_WAITING
        self.forget(waiter)  # a connection has at most one wait outstanding
        self._block(waiter, missing)
        return None

    def _num_keys(self, req: Request, waiter: Waiter) -> bytes:
        return encode_i64(len(self._data))

    def _delete_key(self, req: Request, waiter: Waiter) -> bytes:
        # Deleting wakes nobody, as in torch.
        old = self._data.pop(req[1], None)
        if old is None:
            return encode_i64(0)
        self.budget.bytes -= len(req[1]) + held(len(old))
        self.budget.entries -= 1
        self._key_bytes -= len(req[1])
        if req[1] in self._watched:
            self._break_watches(req[1])
        return encode_i64(1)

    def _append(self, req: Request, waiter: Waiter) -> None:
        key, piece = req[1], req[2]
        current = self._data.get(key)
        if current is not None:
            self.budget.value(key, len(current) + len(piece))
            self.budget.grow(key, held(len(current) + len(piece)) - held(len(current)), 0)
        else:
            self._grow(key, None, piece)
        self._data[key] = piece if current is None else current + piece
        if key in self._watched:
            self._break_watches(key)
        if key in self._waiting:
            self._wake_all(key)
        return None

    def _multi_get(self, req: Request, waiter: Waiter) -> bytes:
        get = self._data.get
        values = [get(k, b"") for k in req[1]]  # (references: nothing copied yet)
        self.budget.reply(8 * len(values) + sum(map(len, values)))
        return encode_many(values)

    def _multi_set(self, req: Request, waiter: Waiter) -> None:
        data = self._data
        self._grow_many(req[1], req[2])
        waiting = self._waiting
        watched = self._watched
        broken: list[object] = []  # (one invalidation round for the whole request)
        for key, value in zip(req[1], req[2]):
            data[key] = value
            if key in watched:
                watchers = watched.pop(key)
                self._disown(watchers)
                broken += watchers
        if broken:
            self.on_watches_broken(broken)
        for key in req[1]:
            if key in waiting:
                self._wake_all(key)
        return None

    def _cancel_wait(self, req: Request, waiter: Waiter) -> bytes:
        self.forget(waiter)
        return WAIT_CANCELED

    def _ping(self, req: Request, waiter: Waiter) -> bytes:
        return encode_u32(req[1])

    def _queue_push(self, req: Request, waiter: Waiter) -> None:
        key, value = req[1], req[2]
        queue = self._queues.get(key)
        if queue is None:  # (the queue's name counts, as a key's)
            self.budget.grow(key, len(key) + len(value), 2)
            queue = self._queues[key] = deque()
        else:
            self.budget.grow(key, len(value), 1)
        queue.append(value)
        if key in self._watched:
            self._break_watches(key)
        if key in self._waiting:
            self._wake_one(key)
        return None

    def _queue_pop(self, req: Request, waiter: Waiter) -> bytes:
        queue = self._queues.get(req[1])
        if not queue:
            return encode_queue_pop(0, None)
        length = len(queue)
        value = queue.popleft()
        self.budget.bytes -= len(value)
        self.budget.entries -= 1
        return encode_queue_pop(length, value)

    def _queue_len(self, req: Request, waiter: Waiter) -> bytes:
        queue = self._queues.get(req[1])
        return encode_i64(len(queue) if queue else 0)

    def _list_keys(self, req: Request, waiter: Waiter) -> bytes:
        data = self._data
        self.budget.reply(8 + 8 * len(data) + self._key_bytes)
        started = self.pacer.start(len(data), waiter)
        try:
            return encode_key_list(data)
        finally:
            self.pacer.done(started, waiter)

    def _barrier(self, req: Request, waiter: Waiter) -> bytes | None:
        _, key, world_size = req
        current = self._data.get(key)
        count = 1 if current is None else wrap_i64(parse_counter(current, key) + 1)  # (as torch's count wraps)
        new = str(count).encode()
        if count < world_size:  # (it waits: registered first, so that a refusal changes nothing)
            self.forget(waiter)
            self._block(waiter, [key])
        try:
            self._grow(key, current, new)
        except StoreError:
            self.forget(waiter)
            raise
        self._data[key] = new
        if key in self._watched:
            self._break_watches(key)
        if count >= world_size:
            self._wake_all(key)
            return STOP_WAITING
        return None
