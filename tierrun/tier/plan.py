"""The batch planner: a batch of client requests -> the operations that go upstream,
and who gets which answer (docs/architecture.md: batches and merges). Pure: no I/O, no clock, no
state beyond one batch; :mod:`.upstream` composes it with the watch cache and the link.

Within a batch:
- identical read-only requests (WAIT, CHECK, GET, MULTI_GET, GETNUMKEYS, QUEUE_LEN)
  with no write to their keys between them are sent once and the answer fanned out;
- consecutive ADDs to one key with no other operation on that key between them become
  one ADD of the sum (wrapped to int64, as torch's server adds); the i-th caller gets
  ``final - sum + prefix_i``, exactly what sequential execution returns (APPENDs are
  not merged: the store host refuses an APPEND whose result passes its value limit or
  its budget, so a merged one could fail a writer whose piece alone would land);
- GETs of distinct keys fold into one MULTI_GET whose values are handed out, and
  one-key WAITs on distinct keys into one WAITS link entry (each still waits, and is
  answered, on its own), run where the fold's first request stands. A request joins a
  fold only if no write to its key came since the fold's place (it moves ahead of none).
- SETs and MULTI_SETs are sent as they are, never folded: the store host refuses a
  write past its budget (``--max-store-bytes``, ``--max-store-keys``) whole, so a fold
  of one client's SETs would take its SETs before the refused one with it.

A client's request joins an earlier merged or folded request only if the client has
sent nothing since that one's place (or, an ADD, only that run's): its
requests take effect, and its answers leave, in the order it sent them. A SET counts
too: it has no answer, but the client's next answer tells it the SET was done.

**A merge never builds what a single request may not** (:class:`PlanLimits`): a
MULTI_GET fold that would pass the keys per request or the request bytes the store host
accepts, or could answer (values as long as the store may hold) with more than a link
frame or one answer holds, is closed and the GET starts a new one. Planned with the
store host's limits (announced on the link), a merged request is refused only if one of
its requests alone would be (a run of ADDs past the store's budget: only if its first
ADD alone would be, by the store's own rule, ``core.budget``).

A request with an effect (a write, an ADD, a COMPARE_SET, ...) of a client whose own
write with no answer may still be refused (sent earlier in the batch, or in flight:
``tier.writes``) is never merged, and carries ``after``: whose write it must follow
(``tier.entries`` sends an AFTER entry before it). A relayed request may come with one
already (its waiter's ``after``, from the AFTER entry of the front-end below).

Reads that watch their key (:mod:`.watches`) come marked, ``(WATCH_MARK, request,
watcher)`` and the like, and merge only with their like. O(keys of the batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..link.frames import DEFAULT_MAX_FRAME, FETCHES, PEEKS, WATCHES
from ..protocol import Op, Request
from ..protocol.limits import Limits
from ..protocol.opcodes import NO_REPLY_OPS, WATCHABLE_OPS
from ..core.values import wrap_i64
from .stats import MergeCounts

#: Marks of a pending read that also watches its key: ``(mark, request, watcher)``.
WATCH_MARK = -1  # sent as a WATCH entry
FETCH_MARK = -2  # a WAIT sent in a WATCHES entry
FETCH_AFTER_WRITES_MARK = -3  # the same, in a FETCHES entry (its client has writes on their way)
PEEK_MARK = -4  # a front-end below reading ahead, in a PEEKS entry
ENTRY_KIND = {WATCH_MARK: 0, FETCH_MARK: WATCHES, FETCH_AFTER_WRITES_MARK: FETCHES, PEEK_MARK: PEEKS}

_DEDUP_OPS = frozenset({Op.WAIT, Op.CHECK, Op.GET, Op.MULTI_GET, Op.GETNUMKEYS, Op.QUEUE_LEN})
#: Requests with an effect on the store: after a refused write of their client, not run.
EFFECT_OPS = frozenset({Op.SET, Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH, Op.ADD, Op.COMPARE_SET,
                        Op.DELETE_KEY, Op.QUEUE_POP, Op.BARRIER})
#: Pseudo-key touched by every write: GETNUMKEYS and LIST_KEYS depend on all keys.
ALL_KEYS = b"\x00*"
_REQUEST_HEAD, _ITEM_HEAD = 9, 8  # encoded bytes of a request besides its items, of an item


@dataclass(frozen=True)
class PlanLimits:
    """What one merged request may hold: a single request's limits at the store host
    (a proxy plans with the limits the store host announced when it linked, else its
    own), and the link's largest frame; and the longest value a GET may return."""

    max_fold: int = 1024  # most requests in one fold (GETs, WAITs of an entry, keys read ahead)
    max_keys: int = Limits.max_keys_per_request
    max_key_bytes: int = Limits.max_key_bytes
    max_value_bytes: int = Limits.max_value_bytes  # the longest value the store may hold
    max_request_bytes: int = Limits.max_request_bytes
    #: Most bytes of a link frame: a MULTI_GET fold's answer must fit one.
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    #: Largest answer the store host gives one request: a MULTI_GET fold's must not pass it.
    max_reply_bytes: int = Limits.max_reply_bytes
    max_get_fold: int = field(init=False, repr=False, compare=False)
    max_entry_keys: int = field(init=False, repr=False, compare=False)

    @classmethod
    def of(cls, limits: Limits, max_frame_bytes: int = DEFAULT_MAX_FRAME, max_fold: int = 1024) -> PlanLimits:
        return cls(max_fold=max_fold, max_keys=limits.max_keys_per_request, max_key_bytes=limits.max_key_bytes,
                   max_value_bytes=limits.max_value_bytes, max_request_bytes=limits.max_request_bytes,
                   max_frame_bytes=max_frame_bytes, max_reply_bytes=limits.max_reply_bytes)

    def within(self, limits: Limits, largest_value: int) -> PlanLimits:
        """These limits, none past ``limits`` (the store host's, learnt on the link), for
        a store whose values may be ``largest_value`` bytes long (whatever this
        front-end lets its clients write)."""
        return PlanLimits(max_fold=self.max_fold, max_keys=min(self.max_keys, limits.max_keys_per_request),
                          max_key_bytes=min(self.max_key_bytes, limits.max_key_bytes),
                          max_value_bytes=largest_value,
                          max_request_bytes=min(self.max_request_bytes, limits.max_request_bytes),
                          max_frame_bytes=self.max_frame_bytes,
                          max_reply_bytes=min(self.max_reply_bytes, limits.max_reply_bytes))

    def __post_init__(self) -> None:
        # (per request of a batch: computed once)
        #: GETs in one MULTI_GET: its answer, whatever the values, fits in a frame and
        #: within the store host's limit of one answer.
        room = min(self.max_frame_bytes // 2, self.max_reply_bytes)
        object.__setattr__(self, "max_get_fold", max(1, min(
            self.max_fold, self.max_keys, room // (self.max_value_bytes + _ITEM_HEAD + 32))))
        #: One-key WAITs (and watching reads) in one WAITS entry.
        object.__setattr__(self, "max_entry_keys", max(1, min(self.max_fold, self.max_keys)))


class Fold:
    """GETs folded into one MULTI_GET: its keys, which value each waiter gets, and
    ``size``, the encoded bytes of the MULTI_GET."""

    __slots__ = ("keys", "slot", "picks", "size")

    def __init__(self, u: UpOp) -> None:
        key = u.req[1]
        self.keys = [key]
        self.slot = {key: 0}  # key -> index of its value
        self.picks = [0] * len(u.waiters)  # per waiter, the index of its value
        self.size = _REQUEST_HEAD + _ITEM_HEAD + len(key)

    def request(self) -> Request:
        return (Op.MULTI_GET, tuple(self.keys))


class UpOp:
    """One operation sent upstream, and who gets its answer."""

    __slots__ = ("req", "ns", "cid", "rid", "waiters", "deltas", "group", "pos", "fold", "members", "wkey",
                 "watchers", "fetch", "writer", "after")

    def __init__(self, req: Request, ns: bytes, waiter: Any, pos: int) -> None:
        self.req = req
        self.ns = ns
        self.cid = 0  # its link client id, once sent (0 again once a WAIT group is cancelled)
        self.rid = 0  # its request id, once sent with an answer expected
        self.waiters: list[Any] = [waiter] if waiter is not None else []
        self.deltas: list[int] | None = None  # an ADD: each waiter's delta
        self.group = False  # a WAIT or BARRIER (its waiters may cancel one by one)
        self.pos = pos  # where its first request stands in the batch
        self.fold: Fold | None = None  # a GET: set once a second GET joins
        self.members: list[UpOp] | None = None  # one-key WAITs sent with this one
        self.wkey: tuple[bytes, bytes] | None = None  # a watching read: (namespace, key)
        #: A watching read: per waiter, the downstream watcher it answers for (None: a
        #: local client, answered with the request's own answer, not the watch state).
        self.watchers: list[Any] | None = None
        self.fetch = 0  # a WAIT that fetches: its entry kind (WATCHES, FETCHES, PEEKS)
        #: A write with no answer (SET, APPEND, ...): the client whose write it
        #: carries, to close if the store host refuses it (a write is never merged).
        self.writer: Any = None
        #: A request of a client whose write may still be refused: that client (whose
        #: latest write it must follow: an AFTER entry goes before it).
        self.after: Any = None

    def request(self) -> Request:
        """The request that goes upstream (a fold's, or an ADD of the run's sum)."""
        if self.fold is not None:
            return self.fold.request()
        if self.deltas is not None and len(self.deltas) > 1:
            return (Op.ADD, self.req[1], wrap_i64(sum(self.deltas)))
        return self.req

    def __repr__(self) -> str:
        return f"UpOp({self.request()!r}, waiters={len(self.waiters)}, members={len(self.members or ())})"


def keys_of(req: Request) -> tuple[bytes, ...]:
    op = req[0]
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET):
        return req[1]
    if op in (Op.GETNUMKEYS, Op.LIST_KEYS, Op.CANCEL_WAIT, Op.PING):
        return ()
    return (req[1],)


@dataclass
class Plan:
    """What one batch sends: ``ops`` in order (folded WAITs as ``members`` of the op
    whose entry carries them), and what the watch cache must note."""

    ops: list[UpOp] = field(default_factory=list)
    #: One-key reads, in order: (namespace, key), client, opcode (a key's first reader).
    reads: list[tuple[tuple[bytes, bytes], Any, int]] = field(default_factory=list)
    #: Keys fetched (FETCH_MARK), in order: the read-ahead policy reads on from them.
    fetched: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: Keys with a read still open at the end of the batch (a peek of them is not needed).
    read_keys: set[tuple[bytes, bytes]] = field(default_factory=set)
    #: Per namespace, the op whose PEEKS entry the batch's read-ahead joins.
    peek_folds: dict[bytes, UpOp] = field(default_factory=dict)
    counts: MergeCounts = field(default_factory=MergeCounts)
    #: One ADD or SET, planned without the planner: nothing for the watch cache to note.
    lone: bool = False


def nothing_unsettled(writer: Any) -> int:
    """For a front-end with no write in flight: 0 for every client."""
    return 0


def plan_batch(pending: list[tuple[Any, bytes, Request]], limits: PlanLimits = PlanLimits(),
               unsettled: Callable[[Any], int] = nothing_unsettled) -> Plan:
    """Merge and fold ``pending`` (client, namespace, request) by this module's rule.
    ``unsettled(client)``: the request id of the client's latest write that may yet be
    refused, 0 if none (``WritesInFlight.unsettled``). A batch of one ADD or SET (most batches of a
    start-up whose requests trickle in) is planned as the planner would plan it, without
    the planner's tables."""
    if len(pending) == 1 and not unsettled(pending[0][0]) and getattr(pending[0][0], "after", None) is None:
        waiter, ns, req = pending[0]
        if req[0] == Op.ADD:
            u = UpOp(req, ns, waiter, 0)
            u.deltas = [req[2]]
            return Plan([u], lone=True)
        if req[0] == Op.SET:
            u = UpOp(req, ns, None, 0)
            u.writer = waiter
            return Plan([u], lone=True)
    return _Planner(limits, unsettled).run(pending)


class _Planner:
    __slots__ = ("limits", "unsettled", "wrote", "plan", "open_reads", "reads_on", "runs", "folds", "last_touch",
                 "last_write", "last")

    def __init__(self, limits: PlanLimits, unsettled: Callable[[Any], int]) -> None:
        self.limits = limits
        self.unsettled = unsettled
        self.wrote: set[Any] = set()  # writers of the batch's writes with no answer so far
        self.plan = Plan()
        self.open_reads: dict[tuple, UpOp] = {}  # (ns, [kind,] opcode, keys): its op
        self.reads_on: dict[tuple[bytes, bytes], list[tuple]] = {}  # (ns, key): open_reads keys
        self.runs: dict[tuple[int, bytes, bytes], UpOp] = {}  # (ADD, ns, key): open run
        self.folds: dict[tuple[int, bytes], UpOp] = {}  # (GET|WAIT|mark, ns): the latest fold
        self.last_touch: dict[tuple[bytes, bytes], int] = {}  # (ns, key): place of the last request on it
        self.last_write: dict[tuple[bytes, bytes], int] = {}
        self.last = -1  # place of the batch's last request (nothing after it needs its keys noted)

    def touched(self, ns: bytes, keys, write: bool) -> None:
        # (O(keys) only while an ADD run or a read is open)
        runs = self.runs
        if runs:
            for k in keys:
                runs.pop((Op.ADD, ns, k), None)
        reads_on = self.reads_on
        if write and reads_on:
            open_reads = self.open_reads
            for k in keys:
                for dk in reads_on.pop((ns, k), ()):
                    open_reads.pop(dk, None)
            for dk in reads_on.pop((ns, ALL_KEYS), ()):
                open_reads.pop(dk, None)

    def read_on(self, k: tuple[bytes, bytes], dk: tuple) -> None:
        self.reads_on.setdefault(k, []).append(dk)

    def run(self, pending: list[tuple[Any, bytes, Request]]) -> Plan:
        last_of: dict[Any, int] = {}  # client: place of its last request
        plan = self.plan
        self.last = len(pending) - 1
        for i, (waiter, ns, req) in enumerate(pending):
            client = getattr(waiter, "client", waiter)  # (a relayed WAIT's ticket: its link client's)
            since = last_of.get(client, -1)  # this client's previous request
            last_of[client] = i
            op = req[0]
            if op < 0:
                self.watching(i, since, waiter, ns, req)
            elif op in _DEDUP_OPS:
                self.read(i, since, waiter, ns, req)
            elif op == Op.ADD or op == Op.APPEND:
                self.add_or_append(i, since, pending, waiter, ns, req)
            else:
                keys = keys_of(req)
                self.touched(ns, keys, write=True)
                if i != self.last:  # (an agent's MULTI_SET of every node's key, alone: no need)
                    for k in keys or (ALL_KEYS,):
                        self.last_touch[(ns, k)] = self.last_write[(ns, k)] = i
                u = UpOp(req, ns, None if op in NO_REPLY_OPS else waiter, i)
                if op in EFFECT_OPS:
                    u.after = self.after(waiter)
                if op in NO_REPLY_OPS:
                    u.writer = waiter
                    self.wrote.add(waiter)
                u.group = op == Op.BARRIER
                plan.ops.append(u)
        plan.read_keys = set(self.reads_on)
        return plan

    def after(self, waiter: Any) -> Any:
        """Whose write a request with an effect from ``waiter`` must follow: its own
        (or, relayed, the one the front-end below named), if it may still be refused;
        None: nobody's. O(1)."""
        writer = getattr(waiter, "after", None)
        if writer is None:
            writer = waiter
        return writer if writer in self.wrote or self.unsettled(writer) else None

    def _joins(self, f: UpOp | None, since: int, k: tuple[bytes, bytes], members: bool) -> bool:
        """May a request of a client whose previous one stands at ``since``, on key
        ``k``, join fold ``f`` (its WAITS entry, if ``members``)?"""
        return (f is not None and since < f.pos and self.last_write.get(k, -1) < f.pos
                and (not members or len(f.members or ()) + 1 < self.limits.max_entry_keys))

    def watching(self, i: int, since: int, waiter: Any, ns: bytes, req: Request) -> None:
        """A read that also watches its key: merged only with its like."""
        mark, inner, watcher = req  # type: ignore[misc]
        keys = keys_of(inner)
        self.touched(ns, keys, write=False)
        k = (ns, keys[0])
        self.last_touch[k] = i
        plan = self.plan
        if mark == FETCH_MARK or mark == FETCH_AFTER_WRITES_MARK:  # (a second WAIT on the key is a poll)
            plan.reads.append((k, waiter, Op.WAIT))
        # (a fetch after writes answers nobody else, nor is it answered with another's)
        tag = b"a" if mark == FETCH_AFTER_WRITES_MARK else b"p" if mark == PEEK_MARK else b"w"
        dk = (ns, tag, inner[0], tuple(keys))
        same = self.open_reads.get(dk)
        if same is not None and since < same.pos:
            same.waiters.append(waiter)
            same.watchers.append(watcher)  # type: ignore[union-attr]
            if mark != PEEK_MARK and inner[0] == Op.WAIT:
                plan.counts.merged_waits += 1
            elif mark != PEEK_MARK:
                plan.counts.merged_reads += 1
            return
        f = self.folds.get((mark, ns)) if mark != WATCH_MARK else None
        folded = self._joins(f, since, k, members=True)
        u = UpOp(inner, ns, waiter, f.pos if folded else i)  # type: ignore[union-attr]
        u.wkey = k
        u.watchers = [watcher]
        u.fetch = ENTRY_KIND[mark]
        u.group = inner[0] == Op.WAIT and mark != PEEK_MARK
        if mark == FETCH_MARK:
            plan.fetched.append(k)
        self.open_reads[dk] = u
        self.read_on(k, dk)
        if folded:  # (it waits from the fold's place: one WATCHES entry)
            f.members = f.members or []  # type: ignore[union-attr]
            f.members.append(u)  # type: ignore[union-attr]
            plan.counts.folded_waits += mark != PEEK_MARK
            return
        if u.fetch:
            self.folds[(mark, ns)] = u
            if mark == PEEK_MARK:
                plan.peek_folds[ns] = u
        plan.ops.append(u)

    def read(self, i: int, since: int, waiter: Any, ns: bytes, req: Request) -> None:
        op = req[0]
        keys = keys_of(req)
        plan = self.plan
        if op in WATCHABLE_OPS and len(keys) == 1:
            plan.reads.append(((ns, keys[0]), waiter, op))
        dk = (ns, op, tuple(keys))  # (keys may come as a list from in-process callers)
        same = self.open_reads.get(dk)
        self.touched(ns, keys, write=False)
        # (O(keys), but not for the batch's last request: one agent's MULTI_GET of every
        # node's key, alone, walks none)
        bookkeeping = i != self.last or plan.fetched
        if bookkeeping:
            for k in keys or (ALL_KEYS,):
                self.last_touch[(ns, k)] = i
        if same is not None and since < same.pos:
            same.waiters.append(waiter)
            if same.fold is not None:
                same.fold.picks.append(same.fold.slot[req[1]])
            if op == Op.WAIT:
                plan.counts.merged_waits += 1
            else:
                plan.counts.merged_reads += 1
            return
        if op == Op.GET:
            f = self.folds.get((Op.GET, ns))
            if self._joins(f, since, (ns, req[1]), members=False):
                fold = f.fold or Fold(f)  # type: ignore[union-attr]
                size = _ITEM_HEAD + len(req[1])
                if len(fold.keys) < self.limits.max_get_fold and fold.size + size <= self.limits.max_request_bytes:
                    f.fold = fold  # type: ignore[union-attr]
                    fold.size += size
                    fold.slot[req[1]] = len(fold.keys)
                    fold.picks.append(len(fold.keys))
                    fold.keys.append(req[1])
                    f.waiters.append(waiter)  # type: ignore[union-attr]
                    self.open_reads[dk] = f  # type: ignore[assignment]
                    self.read_on((ns, req[1]), dk)
                    plan.counts.folded_gets += 1
                    return
        if op == Op.WAIT and len(keys) == 1:
            f = self.folds.get((Op.WAIT, ns))
            if self._joins(f, since, (ns, keys[0]), members=True):
                u = UpOp(req, ns, waiter, f.pos)  # type: ignore[union-attr]  # (it waits from the fold's place)
                u.group = True
                f.members = f.members or []  # type: ignore[union-attr]
                f.members.append(u)  # type: ignore[union-attr]
                self.open_reads[dk] = u
                self.read_on((ns, keys[0]), dk)
                plan.counts.folded_waits += 1
                return
        u = UpOp(req, ns, waiter, i)
        if op == Op.WAIT:
            u.group = True
            if len(keys) == 1:
                self.folds[(Op.WAIT, ns)] = u
        elif op == Op.GET:
            self.folds[(Op.GET, ns)] = u
        self.open_reads[dk] = u
        if bookkeeping or len(keys) == 1:  # (a one-key read: its key is not read ahead too)
            for k in keys or (ALL_KEYS,):
                self.read_on((ns, k), dk)
        plan.ops.append(u)

    def add_or_append(self, i: int, since: int, pending: list, waiter: Any, ns: bytes, req: Request) -> None:
        op, key = req[0], req[1]
        rk = (op, ns, key)
        run = self.runs.get(rk)
        self.touched(ns, (key,), write=True)
        self.last_touch[(ns, key)] = self.last_write[(ns, key)] = i
        plan = self.plan
        after = self.after(waiter)
        if op == Op.APPEND:  # (never merged: see the module's docstring)
            u = UpOp(req, ns, None, i)
            u.writer = waiter
            u.after = after
            self.wrote.add(waiter)
            plan.ops.append(u)
            return
        if after is not None:  # (alone: it runs only if that write was not refused)
            u = UpOp(req, ns, waiter, i)
            u.deltas = [req[2]]
            u.after = after
            plan.ops.append(u)
            return
        if run is not None and (since < run.pos or _same_run(pending[since], ns, op, key)):
            run.waiters.append(waiter)
            run.deltas.append(req[2])  # type: ignore[union-attr]
            plan.counts.merged_adds += 1
            self.runs[rk] = run
            return
        u = UpOp(req, ns, waiter, i)
        u.deltas = [req[2]]
        self.runs[rk] = u
        plan.ops.append(u)


def _same_run(earlier: tuple[Any, bytes, Request], ns: bytes, op: int, key: bytes) -> bool:
    """Is ``earlier`` (a client's last request, at or after the place of the open run of
    ``op`` on ``key``) in that run? Then the client's next one may join it: the run's
    answers leave in order. (Runs are cut by any other request on their key.)"""
    req = earlier[2]
    return req[0] == op and earlier[1] == ns and req[1] == key
