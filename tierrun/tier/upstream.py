"""A front-end's upstream over a link: the thin asyncio adapter that composes the batch
planner (:mod:`.plan`), the answer fan-out (:mod:`.fanout`), the watch cache
(:mod:`.watches`), the read-ahead (:mod:`.readahead`) and hold (:mod:`.hold`)
policies with a link session (:mod:`.connection`).

Requests that arrive during one event-loop iteration form one *batch*, sent in one
frame (several, past a frame's size) and executed atomically, in order, by the core;
a batch opening with a contended write is held (:mod:`.hold`). Every request of a
namespace travels under one link client id (opened once per session), whoever sent it;
the core matches answers by request id. Each WAIT or BARRIER waits at the core on its
own, so a client's CANCEL_WAIT (answered here, as torch's server answers it) cancels
only what that client waits for: a CANCEL entry once nobody waits under the upstream
request any more.

Fail-stop: an answer that cannot be the one of the request sent, or any unexpected
error while handling what the store host sent, ends the session (every client of the
node is dropped with the reason, and ``on_lost`` tells the node's agent), never a
resume past answers half handed out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from ..core import StoreError, Waiter
from ..core.watch_state import FETCH, FETCH_AFTER_WRITES, PEEK, WATCH_READ, encode_watch_state
from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    OK, PEEKS, SESSION_ID_BYTES, WAITS, WATCH_LEASE, LinkError, decode_invalidate, decode_replies, encode_batch,
    encode_count, INVALIDATED, entry_cancel, entry_open, entry_request, entry_waits, entry_watch,
)
from ..link.outbox import Outbox
from ..link.reply_gate import break_watches
from ..protocol import Op, Request
from ..protocol.opcodes import NO_REPLY_OPS, WAIT_CANCELED, WAITING_OPS, WATCHABLE_OPS
from ..protocol.requests import encode_request
from . import fanout
from .hold import HELD_WRITES, HoldPolicy, issuer
from .plan import (
    FETCH_AFTER_WRITES_MARK, FETCH_MARK, PEEK_MARK, WATCH_MARK, Plan, PlanLimits, UpOp, plan_batch, plan_peeks,
)
from .readahead import ReadAhead
from .watches import MISSING, WatchCache, answer_from

if TYPE_CHECKING:
    from .connection import LinkConnection

log = logging.getLogger("tierrun.frontend")

_MARK_OF = {WATCH_READ: WATCH_MARK, FETCH: FETCH_MARK, FETCH_AFTER_WRITES: FETCH_AFTER_WRITES_MARK}


class CoalescingStats:
    """What a front-end merged before its requests left the node."""

    def __init__(self) -> None:
        self.requests = 0  # from local clients
        self.upstream_ops = 0
        self.batches = 0
        self.merged_reads = 0
        self.merged_waits = 0
        self.merged_adds = 0
        self.merged_appends = 0
        self.folded_sets = 0  # SETs sent inside another's MULTI_SET
        self.folded_gets = 0  # GETs answered from another's MULTI_GET
        self.folded_waits = 0  # one-key WAITs sent in another's WAITS entry
        self.ids_opened = 0  # link client ids (namespaces) opened upstream: an OPEN entry each
        self.watches_sent = 0  # reads sent as WATCH entries
        self.watch_answers = 0  # reads answered from a watch (no request upstream)
        self.watch_joins = 0  # WAITs that joined a WAIT sent earlier, through its watch
        self.peeks_sent = 0  # keys read ahead (PEEKS entries), of our own or for front-ends below
        self.invalidations = 0  # watches the core invalidated
        self.held_batches = 0  # batches held open for a contended write (LinkConfig.contended_write_hold)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class LinkUpstream:
    """The link to the core (or to another front-end). Use :meth:`view` per namespace.

    Its session survives the connection (:mod:`.connection`): when the connection drops
    (or is silent for ``heartbeat_timeout``) it reconnects with backoff and resumes,
    resending the batches the core has not received; local clients see only latency.
    Past ``grace`` it gives up: every client waiting on it is dropped with the reason
    and ``on_lost`` is called.
    """

    def __init__(self, token: bytes, on_lost: Callable[[str], None], config: LinkConfig | None = None,
                 address: tuple[str, int] | None = None, limits: PlanLimits | None = None) -> None:
        self._token = token
        self._on_lost = on_lost
        self.config = config or LinkConfig()
        self.limits = limits or PlanLimits()
        self.address = address
        self.session_id = secrets.token_bytes(SESSION_ID_BYTES)
        self._outbox = Outbox(self.config.max_unacked_bytes)  # BATCH frames
        self.replies_received = 0
        self._conn: LinkConnection | None = None  # connected, session resumed
        self._opened = False  # the core has this session
        self.dead: str | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._heartbeat: asyncio.TimerHandle | None = None
        self._sent_since_beat = False  # a batch left since the last heartbeat interval began
        self._beat_with_next_batch = False  # the heartbeat rides with the next batch
        self._reconnecting: asyncio.Task[None] | None = None
        self._pending: list[tuple[Waiter, bytes, Request]] = []
        self._extra: list[bytes] = []  # CANCEL entries for the next batch
        self._inflight: dict[int, UpOp] = {}
        self._ns_cids: dict[bytes, int] = {}  # namespace -> its link client id
        self._wait_of: dict[Waiter, UpOp] = {}  # a client's WAIT or BARRIER upstream
        self._next_id = 1
        #: Per batch in flight, the request id of its last answer that the upstream
        #: gives at once (not a WAIT's or BARRIER's): while there are
        #: ``batches_in_flight`` of them, new requests wait for the next batch.
        self._batches_awaiting: set[int] = set()
        self.stats = CoalescingStats()
        self.watches = WatchCache()
        self._readahead = ReadAhead()
        self._hold_policy = HoldPolicy(self.config.contended_write_hold)
        self._unanswered: dict[Waiter, int] = {}  # client -> its requests awaiting answers
        self._unconfirmed: set[Waiter] = set()  # clients whose last request has no answer
        self._held = False  # the open batch opened with a contended write: it is held
        self._hold: asyncio.Handle | None = None  # ... until then (None: a batch is in flight)

    # -- the session (see .connection for its connections) -----------------------------

    def silence(self) -> float | None:
        """Seconds since the upstream was last heard from on the current connection;
        None while there is none (reconnecting, or given up)."""
        return None if self._conn is None else monotonic() - self._conn.last_rx

    def connection(self) -> LinkConnection:
        """A protocol for a new connection to the core; it resumes this session."""
        from .connection import LinkConnection
        return LinkConnection(self)

    def established(self, conn: LinkConnection, batches_received: int) -> None:
        """RESUMED arrived on ``conn``: resend what the core has not executed."""
        if self.dead is not None:
            conn.abort(self.dead)
            return
        missed = self._outbox.since(batches_received)
        self._conn = conn
        self._opened = True
        if missed:
            conn.write(b"".join(missed))
        if not self.ready.done():
            self.ready.set_result(None)
        if self._heartbeat is None:
            self._schedule_heartbeat()

    def _schedule_heartbeat(self) -> None:
        """The next beat falls on a whole multiple of the interval of the wall clock, as
        every node's does: the store host reads its idle links' heartbeats in one
        wake-up, not one each, and a proxy its children's. A tick less than a tenth of
        an interval away is skipped (the loop's timers fire up to a millisecond early,
        and a beat woken just before its tick must not beat again at the tick)."""
        interval = self.config.heartbeat_interval
        delay = (-time.time()) % interval
        if delay < interval / 10:
            delay += interval
        self._heartbeat = asyncio.get_running_loop().call_later(delay, self._beat)

    def _beat(self) -> None:
        """Every heartbeat interval: acknowledge (the heartbeat), or drop a silent
        connection. A link that sent a batch during the last interval sends its
        heartbeat with its next batch instead (in one write), or at the next beat if none
        comes: heartbeats at most two intervals apart, well within the watch lease."""
        conn = self._conn
        if conn is not None:
            silent = monotonic() - conn.last_rx
            if silent > self.config.heartbeat_timeout:
                conn.abort(f"nothing heard from the store host for {silent:.1f} s")
            elif self._sent_since_beat and not self._beat_with_next_batch:
                self._beat_with_next_batch = True
            else:
                self._beat_with_next_batch = False
                conn.ack()
        self._sent_since_beat = False
        if self._batches_awaiting and (self._pending or self._extra):
            # (belt and braces: a held batch never waits on an answer for more than a beat)
            self._batches_awaiting.clear()
            self._schedule_flush()
        if self.dead is None:
            self._schedule_heartbeat()

    def connection_lost(self, conn: LinkConnection, reason: str) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._drop_watches()
        if self.dead is None and self._reconnecting is None and self.address is not None:
            from .connection import reconnect
            self._reconnecting = asyncio.ensure_future(reconnect(self, reason))
        elif self.address is None:
            self.die(reason)

    def die(self, reason: str) -> None:
        """Give up the session: drop every waiting client with ``reason``."""
        if self.dead is not None:
            return
        self.dead = reason
        if not self.ready.done():
            self.ready.set_exception(LinkError(reason))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        if self._conn is not None:
            self._conn.abort(reason)
            self._conn = None
        inflight, self._inflight = self._inflight, {}
        for u in inflight.values():
            for w in u.waiters:
                w.drop(reason)  # type: ignore[attr-defined]
        pending, self._pending = self._pending, []
        for w, _, _ in pending:
            w.drop(reason)  # type: ignore[attr-defined]
        self._drop_watches()
        self._on_lost(reason)

    def close(self) -> None:
        """End the session cleanly: the core drops it at once."""
        if self.dead is None:
            if self._conn is not None:
                self._conn.write(auth.error("the front-end is stopping"))
            self.dead = "closed"
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            if self._reconnecting is not None:
                self._reconnecting.cancel()
            if self._conn is not None:
                self._conn.close()

    def _send(self, data: bytes) -> None:
        try:
            self._outbox.add(data)
        except LinkError as e:
            self.die(f"the store host stopped acknowledging: {e}")
            return
        self._sent_since_beat = True
        if self._conn is not None:
            if self._beat_with_next_batch:
                self._beat_with_next_batch = False
                self._conn.ack(after=data)
            else:
                self._conn.write(data)

    def lease_left(self) -> float:
        """How much longer (seconds) this front-end may answer from its watches: what
        it may grant the front-ends linked to it."""
        return self.watches.lease_left(monotonic(), WATCH_LEASE) if self._conn is not None else 0.0

    def lease_granted(self, conn: LinkConnection, until: float) -> None:
        if conn is self._conn:
            self.watches.lease_until = max(self.watches.lease_until, until)

    # -- requests ----------------------------------------------------------------------

    def view(self, namespace: str = "") -> LinkView:
        return LinkView(self, namespace.encode())

    def submit(self, req: Request, waiter: Waiter, ns: bytes) -> bytes | None:
        if self.dead is not None:
            raise StoreError(self.dead)
        op = req[0]
        if op == Op.CANCEL_WAIT:
            self._cancel_waits(waiter)
            return WAIT_CANCELED
        self.stats.requests += 1
        if op in WATCHABLE_OPS and (op == Op.GET or len(req[1]) == 1):
            k = (ns, req[1] if op == Op.GET else req[1][0])
            clean = waiter not in self._unanswered and waiter not in self._unconfirmed
            watches = self.watches
            if clean:
                now = monotonic()
                value = watches.value(op, k, now)
                if value is not MISSING:
                    self.stats.watch_answers += 1
                    return answer_from(op, value)  # type: ignore[arg-type]
                if op == Op.WAIT and self._join_wait(k, waiter, None, now):
                    self._unanswered[waiter] = 1
                    return None
            if watches.watchable(k):
                if clean and (op == Op.CHECK or watches.is_poll(k, waiter, op)):
                    # (a CHECK is a poll from the first: NCCL's heartbeat monitor)
                    req = (WATCH_MARK, req, None)  # type: ignore[assignment]
                elif op == Op.WAIT:  # (torch's get() is a WAIT, then a GET: fetch the value)
                    req = (FETCH_MARK if clean else FETCH_AFTER_WRITES_MARK, req, None)  # type: ignore[assignment]
        self._enqueue(waiter, ns, req)
        if op in NO_REPLY_OPS:
            self._unconfirmed.add(waiter)
        else:
            self._unanswered[waiter] = self._unanswered.get(waiter, 0) + 1
            if self._unconfirmed:
                self._unconfirmed.discard(waiter)  # (this answer confirms what came before)
        return None

    def submit_watching(self, req: Request, waiter: Waiter, watcher: Any, ns: bytes,
                        how: int = WATCH_READ) -> bytes | None:
        """A watching read from a front-end linked to this one (``watcher``: its session
        and watch id; ``how``: its entry's kind, see ``core.watch_state``): answered from
        this one's watch when it can, else sent upstream alike. A FETCH_AFTER_WRITES
        always goes upstream, joining nothing: its client has writes on their way, which
        must execute first. The front-end below is told of every invalidation of the key
        from now on (even before the answer: so it may let WAITs join its own)."""
        if self.dead is not None:
            raise StoreError(self.dead)
        op = req[0]
        k = (ns, req[1] if op == Op.GET else req[1][0])
        self.stats.requests += 1
        watches = self.watches
        now = monotonic()
        if how == PEEK:
            return self._peek(k, req, waiter, watcher, now)
        if how != FETCH_AFTER_WRITES:  # (its client has nothing outstanding)
            value = watches.value(op, k, now)
            if value is not MISSING:
                self.stats.watch_answers += 1
                watches.watch_below(k, watcher)
                return encode_watch_state(True, value) + answer_from(op, value)  # type: ignore[arg-type]
            if op == Op.WAIT and self._join_wait(k, waiter, watcher, now):
                return None
            if how == FETCH and watches.seen(k) and watches.watchable(k):
                # a second front-end's WAIT on the key: a poll (one agent per node
                # waiting for the exit barrier's last member), so it waits upstream
                # watching the key as absent, and later ones join it here
                how = WATCH_READ
        self._enqueue(waiter, ns, (_MARK_OF[how], req, watcher))  # type: ignore[arg-type]
        return None

    def _peek(self, k: tuple[bytes, bytes], req: Request, waiter: Waiter, watcher: Any, now: float) -> bytes | None:
        """A front-end below reads ahead: answered from this one's watch, or with the
        answer of the peek of the key already on its way up, or sent up."""
        watches = self.watches
        if now < watches.lease_until and k in watches.values:
            self.stats.watch_answers += 1
            watches.watch_below(k, watcher)
            return encode_watch_state(True, watches.values[k])
        u = watches.peeking.get(k)
        if u is not None:  # (told of invalidations from now on, as a WATCH that joins)
            u.waiters.append(waiter)
            u.watchers.append(watcher)  # type: ignore[union-attr]
            watches.watch_below(k, watcher)
            return None
        self._enqueue(waiter, k[0], (PEEK_MARK, req, watcher))  # type: ignore[arg-type]
        return None

    def _join_wait(self, k: tuple[bytes, bytes], waiter: Waiter, watcher: Any, now: float) -> bool:
        """Let a WAIT on ``k`` join the WATCH-WAIT already sent for it, if any (and the
        lease runs)."""
        u = self.watches.joinable(k, now)
        if u is None:
            return False
        u.waiters.append(waiter)
        u.watchers.append(watcher)  # type: ignore[union-attr]
        self._wait_of[waiter] = u
        if watcher is not None:
            self.watches.watch_below(k, watcher)
        self.stats.watch_joins += 1
        return True

    def _enqueue(self, waiter: Waiter, ns: bytes, req: Request) -> None:
        """Put a request in the next batch, held open if it starts with a contended
        write, closed at once by anything else but another contended write or a WAIT of
        a client whose write the batch holds (see :mod:`.hold`)."""
        policy = self._hold_policy
        contended = waits_on_held = False
        if policy.hold:
            now = monotonic()
            if req[0] in HELD_WRITES:
                contended = policy.contended(waiter, ns, req, now)
            else:
                read = req[1] if req[0] < 0 else req
                policy.note_read(ns, read, now)
                waits_on_held = read[0] == Op.WAIT and issuer(waiter) in policy.writers
        if not self._pending and not self._extra:
            if contended:
                self.stats.held_batches += 1
                self._held = True
                policy.open(monotonic())
                limit = self.config.batches_in_flight
                if not limit or len(self._batches_awaiting) < limit:
                    self._hold = asyncio.get_running_loop().call_later(policy.hold, self._hold_over)
                # (else the hold runs meanwhile: _on_replies goes on with it)
            else:
                self._schedule_flush()
        elif self._held:
            if waits_on_held:
                pass  # (its client's write is held: its WAIT stays with it, held too)
            elif not contended:
                self._held = False
                if self._hold is not None:
                    self._hold.cancel()
                    self._hold = None
                    asyncio.get_running_loop().call_soon(self._flush)
            else:
                policy.joined(monotonic())
        if self._held:
            policy.writers.add(issuer(waiter))
        self._pending.append((waiter, ns, req))

    def _hold_over(self) -> None:
        """The held batch leaves, unless a write joined it in its last hold; it leaves on
        the next tick of the wall clock's ``hold_grid``, as every other front-end's held
        batches of the same storm do, so the frames reach the upstream together."""
        left = self._hold_policy.left(monotonic())
        if left > 0.001:
            self._hold = asyncio.get_running_loop().call_later(left, self._hold_over)
            return
        grid = self.config.hold_grid
        to_tick = (-time.time()) % grid if grid else 0.0
        if to_tick > 0.001:
            self._hold = asyncio.get_running_loop().call_later(to_tick, self._flush)
        else:
            self._flush()

    def _answered(self, waiter: Waiter) -> None:
        n = self._unanswered.get(waiter)
        if n is not None:
            if n > 1:
                self._unanswered[waiter] = n - 1
            else:
                del self._unanswered[waiter]

    def forget(self, waiter: Waiter, ns: bytes) -> None:
        """The client is gone: drop what it waits for."""
        self._cancel_waits(waiter)
        self._unanswered.pop(waiter, None)
        self._unconfirmed.discard(waiter)

    def _cancel_waits(self, waiter: Waiter) -> None:
        """Drop the client's WAIT or BARRIER, sent (upstream too, once nobody else waits
        under it) or still to be sent. O(1), or O(pending) when it is still to be sent."""
        group = self._wait_of.pop(waiter, None)
        if group is not None:
            if waiter in group.waiters:
                at = group.waiters.index(waiter)
                del group.waiters[at]
                if group.watchers is not None:
                    del group.watchers[at]
                self._answered(waiter)
            if not group.waiters and group.cid:  # nobody waits: drop it upstream
                self._queue_extra(entry_cancel(group.cid, group.rid))
                group.cid = 0
        elif any(w is waiter for w, _, _ in self._pending):
            kept = [p for p in self._pending if p[0] is not waiter or _op_of(p[2]) not in WAITING_OPS]
            if len(kept) < len(self._pending):
                self._answered(waiter)
            self._pending = kept

    def _queue_extra(self, entry: bytes) -> None:
        if not self._pending and not self._extra:
            self._schedule_flush()
        self._extra.append(entry)

    def _schedule_flush(self) -> None:
        """A batch closes at the end of this loop iteration, or ``batch_window`` seconds
        after its first request. While ``batches_in_flight`` batches await their
        answers, it closes when one of them is answered instead."""
        limit = self.config.batches_in_flight
        if limit and len(self._batches_awaiting) >= limit:
            return  # (_on_replies flushes)
        loop = asyncio.get_running_loop()
        if self.config.batch_window:
            loop.call_later(self.config.batch_window, self._flush)
        else:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send the batch: plan it (:func:`.plan.plan_batch`), note what the watch cache
        must know, read ahead, and encode its entries. O(keys of the batch)."""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self._held = False
        self._hold_policy.writers.clear()
        pending, self._pending = self._pending, []
        extra, self._extra = self._extra, []
        plan = plan_batch(pending, self.limits) if pending else Plan()
        self._note_plan(plan)
        self._send_plan(plan, extra)

    def _note_plan(self, plan: Plan) -> None:
        stats, counts, watches = self.stats, plan.counts, self.watches
        for name, n in vars(counts).items():
            if n:
                setattr(stats, name, getattr(stats, name) + n)
        watches.note_reads(plan.reads)
        wait_of = self._wait_of
        for u in plan.all_ops():
            if u.group:
                for w in u.waiters:
                    wait_of[w] = u
            if u.wkey is not None:
                watches.note_sent(u)
        if plan.fetched:
            for ns, keys in self._readahead.after_fetches(plan.fetched, watches):
                for u in plan_peeks(plan, ns, keys, watches.peeking, self.limits):
                    watches.note_sent(u)

    def _new_id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def _cid_of(self, ns: bytes, entries: list[bytes]) -> int:
        cid = self._ns_cids.get(ns)
        if cid is None:
            cid = self._ns_cids[ns] = self._new_id()
            entries.append(entry_open(cid, ns))
            self.stats.ids_opened += 1
        return cid

    def _send_plan(self, plan: Plan, entries: list[bytes]) -> None:
        """Give the plan's ops their request ids and entries, and send them: one BATCH
        frame, or several in order when the entries would pass a frame's size."""
        stats, inflight = self.stats, self._inflight
        answered_at_once = 0
        sent = 0
        frames: list[list[bytes]] = []
        size = sum(map(len, entries))
        max_bytes = self.limits.max_frame_bytes - 64  # (a frame's head and entry count)
        for u in plan.ops:
            new: list[bytes] = []
            u.cid = self._cid_of(u.ns, new)
            members = u.members or ()
            if members or u.fetch:  # one WAITS (WATCHES, ...) entry: request ids rid, rid + 1, ...
                u.rid = self._new_id()
                inflight[u.rid] = u
                for m in members:
                    m.cid = u.cid
                    m.rid = self._new_id()
                    inflight[m.rid] = m
                new.append(entry_waits(u.cid, u.rid, [u.req[1][0]] + [m.req[1][0] for m in members],
                                       u.fetch or WAITS))
                sent += 1 + len(members)
                if u.fetch == PEEKS:
                    stats.peeks_sent += 1 + len(members)
                elif u.fetch:
                    stats.watches_sent += 1 + len(members)
            elif u.watchers is not None:
                u.rid = self._new_id()
                inflight[u.rid] = u
                if u.req[0] != Op.WAIT:
                    answered_at_once = u.rid
                new.append(entry_watch(u.cid, u.rid, encode_request(u.req)))
                stats.watches_sent += 1
                sent += 1
            else:
                req = u.request()
                rid = self._new_id() if u.waiters else 0
                if rid:
                    u.rid = rid
                    inflight[rid] = u
                    if req[0] not in WAITING_OPS:
                        answered_at_once = rid
                new.append(entry_request(u.cid, rid, encode_request(req)))
                sent += 1
            added = sum(map(len, new))
            if entries and size + added > max_bytes:  # (in order: frames are executed in turn)
                frames.append(entries)
                entries, size = [], 0
            entries += new
            size += added
        if entries:
            frames.append(entries)
        if answered_at_once:
            self._batches_awaiting.add(answered_at_once)
        if frames and self.dead is None:
            stats.batches += 1
            stats.upstream_ops += sent
            for f in frames:
                self._send(encode_batch(f))

    # -- what the store host sends (called by .connection) ------------------------------

    def on_replies(self, payload: bytes) -> None:
        """A REPLIES frame: hand each answer out (:mod:`.fanout`). Raises LinkError on an
        answer that cannot be the one of the request sent."""
        self.replies_received += 1
        awaiting = self._batches_awaiting
        answered = self._answered
        for rid, status, data in decode_replies(payload):
            u = self._inflight.pop(rid, None)
            if u is None:
                continue
            if rid in awaiting:
                awaiting.discard(rid)
                if self._held and self._hold is None:  # (held meanwhile: it leaves when its hold is over)
                    self._hold = asyncio.get_running_loop().call_soon(self._hold_over)
                elif self._pending or self._extra:
                    self._schedule_flush()
            if status != OK:
                self.watches.failed(u)
                reason = fanout.failure(u, data)
                for w in u.waiters:
                    if u.group:
                        self._wait_of.pop(w, None)
                    answered(w)
                    w.drop(reason)  # type: ignore[attr-defined]
                continue
            if u.watchers is not None:
                self._watch_answered(u, data)
                continue
            group = u.group
            for w, answer in fanout.answers(u, data):
                if group:
                    self._wait_of.pop(w, None)
                answered(w)
                w.wake(answer)

    def _watch_answered(self, u: UpOp, data: bytes) -> None:
        """A watching read's answer: keep the state (the watch is on until
        invalidated), answer local clients with the request's answer and front-ends
        below with both."""
        watched, value, out = fanout.watch_answers(u, data)
        self.watches.answered(u, watched, value)
        if u.fetch == PEEKS and not watched:
            self._readahead.past_end(*u.wkey)  # type: ignore[misc]
        for w, watcher, answer in out:
            if u.group:
                self._wait_of.pop(w, None)
            if watcher is None:
                self._answered(w)
            w.wake(answer)

    def on_invalidate(self, payload: bytes) -> None:
        """The core says these watches broke: forget them, pass it on to the front-ends
        below that watch the same keys, and confirm once they have."""
        round_id, ids = decode_invalidate(payload)
        n, below = self.watches.invalidate(ids, self._inflight)
        self.stats.invalidations += n

        def confirm() -> None:
            if self._conn is not None:
                self._conn.write(encode_count(INVALIDATED, round_id))

        if below:
            break_watches(below, confirm)
        else:
            confirm()

    def _drop_watches(self) -> None:
        below = self.watches.drop_all()
        if below:
            break_watches(below)


def _op_of(req: Request) -> int:
    """The opcode of a pending request (of the request a watching read carries)."""
    return req[1][0] if req[0] < 0 else req[0]


class LinkView:
    """The link as seen by one front-end listener: every client in ``namespace``."""

    def __init__(self, link: LinkUpstream, namespace: bytes) -> None:
        self._link = link
        self._ns = namespace

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        return self._link.submit(req, waiter, self._ns)

    def execute_watching(self, req: Request, waiter: Waiter, watcher: Any, how: int = WATCH_READ) -> bytes | None:
        return self._link.submit_watching(req, waiter, watcher, self._ns, how)

    def forget(self, waiter: Waiter) -> None:
        self._link.forget(waiter, self._ns)
