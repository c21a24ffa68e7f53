"""A front-end's upstream over a link: the thin asyncio adapter that composes the batch
planner (:mod:`.plan`), the answer fan-out (:mod:`.fanout`), the watch cache
(:mod:`.watches`), the read-ahead (:mod:`.readahead`), hold (:mod:`.hold`) and a
relay's pace (:mod:`.pace`) policies with a link session (:mod:`.connection`).

A loop iteration's requests form one *batch* (held, if it opens with a contended
write: :mod:`.hold`), sent in one frame (several past a frame's size), executed in
order. Every request of a namespace travels under one link client id (opened once per
session), whoever sent it; the core matches answers by request id. Each WAIT or
BARRIER waits at the core on its own, so a client's CANCEL_WAIT (answered here at once,
with torch's answer) cancels only what that client waits for: a CANCEL entry once
nobody waits under the upstream request any more.

Fail-stop: an answer that cannot be the one asked for, or any unexpected error handling
what the store host sent or sending a batch, ends the session (its clients dropped,
``on_lost`` told).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from time import monotonic
from typing import Any

from ..core import StoreError, Waiter
from ..core.watch_state import FETCH, FETCH_AFTER_WRITES, PEEK, WATCH_READ, encode_watch_state
from ..link.config import LinkConfig
from ..link.frames import FAILED, INVALIDATED, OK, PEEKS, UNORDERED, WATCH_LEASE, decode_invalidate, decode_replies
from ..link.frames import encode_count, entry_cancel
from ..protocol import Op, Request
from ..protocol.limits import Limits
from ..protocol.opcodes import NO_REPLY_OPS, WAIT_CANCELED, WATCHABLE_OPS
from . import fanout
from .entries import Ids, encode_plan
from .hold import HELD_WRITES, HoldPolicy
from .pace import BatchPace
from .pending import PendingBatch
from .waits_of import WaitsOf
from .plan import FETCH_AFTER_WRITES_MARK, FETCH_MARK, PEEK_MARK, WATCH_MARK, Plan, PlanLimits, UpOp, plan_batch
from .connection import SessionEnd
from .readahead import ReadAhead, plan_peeks
from .stats import CoalescingStats
from .watches import MISSING, WatchCache, answer_from, nobody_below
from .view import LinkView
from .writes import refused_write, write_size

log = logging.getLogger("tierrun.frontend")

_MARK_OF = {WATCH_READ: WATCH_MARK, FETCH: FETCH_MARK, FETCH_AFTER_WRITES: FETCH_AFTER_WRITES_MARK}


class LinkUpstream(SessionEnd):
    """The link to the store host (or to another front-end); :meth:`view` per namespace.
    Its session (:class:`.connection.SessionEnd`) survives its connections."""

    def __init__(self, token: bytes, on_lost: Callable[[str], None], config: LinkConfig | None = None,
                 address: tuple[str, int] | None = None, limits: PlanLimits | None = None) -> None:
        super().__init__(token, on_lost, config, address)
        self.limits = limits or PlanLimits()
        self._pending = PendingBatch()
        self._extra: list[bytes] = []  # CANCEL entries for the next batch
        self._inflight: dict[int, UpOp] = {}
        self._wait_of = WaitsOf()  # a client's WAITs and BARRIERs upstream
        self._ids = Ids()  # request ids, and a link client id per namespace
        #: Per batch in flight, the request id of its last answer the upstream gives at once (not a
        #: WAIT's or BARRIER's): while ``batches_in_flight`` of them wait, new requests wait for the next.
        self._batches_awaiting: set[int] = set()
        self.stats = CoalescingStats()
        self.watches = WatchCache()
        self._readahead = ReadAhead(self.limits.max_key_bytes)
        self._hold_policy = HoldPolicy(self.config.contended_write_hold)
        self._unanswered: dict[Waiter, int] = {}  # client (or ticket) -> its requests awaiting answers
        self._unconfirmed: set[Waiter] = set()  # clients whose writes no later answer has confirmed
        self._held = False  # the open batch opened with a contended write: it is held
        self._hold: asyncio.Handle | None = None  # ... until then (None: a batch is in flight)
        #: (watchers, on_done): the invalidation round of front-ends below (``hub.reply_gate``'s)
        self.on_watches_broken: Callable[[list, Callable[[], None] | None], None] = nobody_below
        self.pace: BatchPace | None = None  # a relay's (see .pace): set by who makes it one
        self._paced: asyncio.TimerHandle | None = None  # the batch leaves then, as its pace allows

    # -- the session's events (see .connection) ----------------------------------------

    def on_beat(self) -> None:
        if self._batches_awaiting and (self._pending.items or self._extra):
            # (belt and braces: a held batch never waits on an answer for more than a beat)
            self._batches_awaiting.clear()
            self._schedule_flush()

    def on_disconnected(self) -> None:
        self._drop_watches()

    def _stop_timers(self) -> None:
        for timer in (self._hold, self._paced):
            if timer is not None:
                timer.cancel()
        self._hold = self._paced = None

    def on_dead(self, reason: str) -> None:
        self._stop_timers()
        inflight, self._inflight = self._inflight, {}
        for u in inflight.values():
            for w in u.waiters:
                w.drop(reason)  # type: ignore[attr-defined]
        for w, _, _ in self._pending.take():
            w.drop(reason)  # type: ignore[attr-defined]
        self._drop_watches()

    def lease_granted(self, until: float) -> None:
        self.watches.lease_until = max(self.watches.lease_until, until)

    def on_upstream_limits(self, limits: Limits, largest_value: int) -> None:
        """Merges never exceed what the store host takes in one request, nor answers."""
        self.limits = self.limits.within(limits, largest_value)

    def lease_left(self) -> float:
        """How much longer (seconds) this front-end may answer from its watches: what
        it may grant the front-ends linked to it."""
        return self.watches.lease_left(monotonic(), WATCH_LEASE) if self._conn is not None else 0.0

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
        who = getattr(waiter, "client", waiter)  # (issuer(), inlined: a relayed request's ticket -> its client)
        if op in WATCHABLE_OPS and (op == Op.GET or len(req[1]) == 1):
            k = (ns, req[1] if op == Op.GET else req[1][0])
            unanswered = self._unanswered  # (a ticket's own answer, and its client's writes and other answers)
            clean = waiter not in unanswered and who not in unanswered and who not in self._unconfirmed
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
            self._unconfirmed.add(who)
        else:
            self._unanswered[waiter] = self._unanswered.get(waiter, 0) + 1
            if self._unconfirmed and waiter is who:  # (this answer confirms what came before; a
                self._unconfirmed.discard(who)  # ticket's, a WAIT's, may come long after: not it)
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
        self._wait_of.add(waiter, u)
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
        if self.pace is not None:
            self.pace.request(getattr(waiter, "client", waiter), monotonic())  # (issuer(), inlined)
        if policy.hold:
            now = monotonic()
            if req[0] in HELD_WRITES:
                contended = policy.contended(waiter, ns, req, now)
            else:
                read = req[1] if req[0] < 0 else req
                policy.note_read(ns, read, now)
                waits_on_held = read[0] == Op.WAIT and getattr(waiter, "client", waiter) in policy.writers  # (issuer())
        if not self._pending.items and not self._extra:
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
                    self._schedule_flush()  # (a relay's pace holds it too)
            else:
                policy.joined(monotonic())
        if self._held:
            policy.writers.add(getattr(waiter, "client", waiter))  # (issuer(), inlined)
        if req[0] in NO_REPLY_OPS:  # (see SessionEnd.write_room)
            self.queued_writes += write_size(req)
            self.queued_count += 1
        self._pending.add(waiter, ns, req)

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
        wait = 0.0 if self.pace is None else self.pace.wait(monotonic())
        if wait > to_tick:  # (a relay's held batch waits for its pace too, then the grid's tick)
            to_tick += -(-(wait - to_tick) // grid) * grid if grid else wait - to_tick
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
        self._stalled.discard(waiter)

    def _cancel_waits(self, waiter: Waiter) -> None:
        """Drop the client's WAIT or BARRIER, sent (upstream too, once nobody else waits
        under it) or still to be sent. O(1), or O(waiters of its group) once sent."""
        for group in self._wait_of.pop(waiter):
            if waiter in group.waiters:
                at = group.waiters.index(waiter)
                del group.waiters[at]
                if group.watchers is not None:
                    del group.watchers[at]
                self._answered(waiter)
            if not group.waiters and group.cid:  # nobody waits: drop it upstream
                self._queue_extra(entry_cancel(group.cid, group.rid))
                group.cid = 0
        if self._pending.cancel_waits(waiter):
            self._answered(waiter)

    def _queue_extra(self, entry: bytes) -> None:
        if not self._pending.items and not self._extra:
            self._schedule_flush()
        self._extra.append(entry)

    def _schedule_flush(self) -> None:
        """A batch closes at the end of this loop iteration, or ``batch_window`` seconds
        after its first request. While ``batches_in_flight`` batches await their
        answers, it closes when one of them is answered instead."""
        limit = self.config.batches_in_flight
        if limit and len(self._batches_awaiting) >= limit or self.dead is not None:
            return  # (_on_replies flushes; a dead session sends nothing)
        loop = asyncio.get_running_loop()
        if self.pace is not None:
            if self._paced is not None:
                return
            wait = self.pace.wait(monotonic())
            if wait > 0.0005:
                self._paced = loop.call_later(wait, self._flush)
                return
        if self.config.batch_window:
            loop.call_later(self.config.batch_window, self._flush)
        else:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send the batch: plan it (:func:`.plan.plan_batch`), note what the watch cache
        must know, read ahead, and encode its entries. O(keys of the batch). Fail-stop:
        an unexpected error ends the session (a batch lost here would leave its clients
        waiting for ever, the node's agent none the wiser)."""
        self._stop_timers()
        if self.pace is not None:
            self.pace.sent(monotonic())
        self._held = False
        self._hold_policy.writers.clear()
        pending = self._pending.take()
        extra, self._extra = self._extra, []
        unsent = pending
        try:
            plan = plan_batch(pending, self.limits, self._writes.unsettled) if pending else Plan()
            if not plan.lone:  # (a lone ADD or SET: nothing for the watch cache to note)
                self._note_plan(plan)
            unsent = []  # (from here what was sent is in flight: the session's end drops it)
            self._send_plan(plan, extra)
        except Exception as e:
            log.exception("unexpected error sending a batch to the store host")
            reason = f"internal error in the node's link to the store host: {e!r}"
            for w, _, _ in unsent:
                w.drop(reason)  # type: ignore[attr-defined]
            self.die(reason)
            return
        self.queued_writes = self.queued_count = 0
        if self.down_since is not None or self._stalled:  # (acked()'s conditions, checked here first)
            self.acked()

    def _note_plan(self, plan: Plan) -> None:
        watches = self.watches
        self.stats.merged(plan.counts)
        watches.note_reads(plan.reads)
        wait_of = self._wait_of
        for op in plan.ops:  # (every op, members after the op that carries them)
            for u in (op, *op.members) if op.members else (op,):
                for w in u.waiters if u.group else ():
                    wait_of.add(w, u)
                if u.wkey is not None:
                    watches.note_sent(u)
        if plan.fetched:
            for ns, keys in self._readahead.after_fetches(plan.fetched, watches):
                for u in plan_peeks(plan, ns, keys, watches.peeking, self.limits):
                    watches.note_sent(u)

    def _send_plan(self, plan: Plan, extra: list[bytes]) -> None:
        """Encode the plan's entries (:func:`.entries.encode_plan`) and send them."""
        out = encode_plan(plan, extra, self._ids, self._inflight, self.limits.max_frame_bytes, self._writes.gate)
        if out.answered_at_once:
            self._batches_awaiting.add(out.answered_at_once)
        if out.writes and self._writes.sent(out.writes):  # (many writes, no answer: a PING settles them)
            self._enqueue(self._writes.sync, b"", (Op.PING, 0))
        if out.frames and self.dead is None:
            self.stats.sent(out.ops, out.opened, out.watches, out.peeks)
            for frame in out.frames:
                self.send(frame)

    # -- what the store host sends (called by .connection) ------------------------------

    def on_replies(self, payload: bytes) -> None:
        """A REPLIES frame: hand each answer out (:mod:`.fanout`). Raises LinkError on an
        answer that cannot be the one of the request sent."""
        awaiting = self._batches_awaiting
        answered = self._answered
        writes = self._writes
        for rid, status, data in decode_replies(payload):
            u = self._inflight.pop(rid, None)
            refused = writes.answered(rid, status < UNORDERED)
            status &= FAILED  # (UNORDERED: a relay's answer, maybe ahead of earlier writes: see .writes)
            if u is None:
                if refused is not None and status != OK:
                    refused_write(*refused, data)
                continue
            if rid in awaiting:
                awaiting.discard(rid)
                if self._held and self._hold is None:  # (held meanwhile: it leaves when its hold is over)
                    self._hold = asyncio.get_running_loop().call_soon(self._hold_over)
                elif self._pending.items or self._extra:
                    self._schedule_flush()
            if status != OK:
                self.watches.failed(u)
                reason = fanout.failure(u, data)
                for w in u.waiters:
                    if u.group:
                        self._wait_of.answered(w, u)
                    answered(w)
                    w.drop(reason)  # type: ignore[attr-defined]
                continue
            if u.watchers is not None:
                self._watch_answered(u, data)
                continue
            group = u.group
            try:
                out = fanout.answers(u, data)
            except Exception:  # (not the answer asked for: the session ends; its clients too)
                for w in u.waiters:
                    w.drop("the store host's answer did not match the request")  # type: ignore[attr-defined]
                raise
            for w, answer in out:
                if group:  # (a WAIT's or BARRIER's: a client connection tells it apart)
                    self._wait_of.answered(w, u)
                    answered(w)
                    getattr(w, "wake_wait", w.wake)(answer)
                    continue
                answered(w)
                w.wake(answer)
        if writes.sync_needed():  # (writes sent behind the last PING: another)
            self._enqueue(writes.sync, b"", (Op.PING, 0))
        if self._stalled:  # (writes settled: room for more, maybe)
            self.acked()

    def _watch_answered(self, u: UpOp, data: bytes) -> None:
        """A watching read's answer: keep the state (the watch is on until
        invalidated), answer local clients with the request's answer and front-ends
        below with both."""
        try:
            watched, value, out = fanout.watch_answers(u, data)
        except Exception:  # (see on_replies)
            for w in u.waiters:
                w.drop("the store host's answer did not match the request")  # type: ignore[attr-defined]
            raise
        self.watches.answered(u, watched, value)
        if u.fetch == PEEKS and not watched:
            self._readahead.past_end(*u.wkey)  # type: ignore[misc]
        for w, watcher, answer in out:
            if u.group:
                self._wait_of.answered(w, u)
            if watcher is None:
                self._answered(w)
            (getattr(w, "wake_wait", w.wake) if u.group else w.wake)(answer)

    def on_invalidate(self, payload: bytes) -> None:
        """The core says these watches broke: forget them, pass it on to the front-ends
        below that watch the same keys, and confirm once they have."""
        round_id, ids = decode_invalidate(payload)
        n, below = self.watches.invalidate(ids, self._inflight)
        self.stats.invalidations += n

        def confirm() -> None:
            self.confirm(encode_count(INVALIDATED, round_id))

        if below:
            self.on_watches_broken(below, confirm)
        else:
            confirm()

    def _drop_watches(self) -> None:
        below = self.watches.drop_all()
        if below:
            self.on_watches_broken(below, None)

