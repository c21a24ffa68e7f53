"""A front-end's upstream over a link: batching and coalescing (design.md's rule).

Requests that arrive during one event-loop iteration form one *batch*, sent in one
frame and executed atomically, in order, by the core. A batch that opens with a
*contended* write (an ADD, SET, MULTI_SET or APPEND to a key family, the key less its
trailing number, that another client wrote within the last second: every node's count
of a barrier or of torch's ``init/``, every node's role record) stays open
``LinkConfig.contended_write_hold`` seconds (10 ms), so that the others' writes, which
reach a node (and a stacked front-end) at different moments, leave with it: fewer
frames at the store host, each of which costs it far more than the entries it carries.
Each write that joins keeps it open one hold more, up to HOLD_STRETCH holds in all:
writers that keep coming leave together, and the last one (a barrier's, which every
other waits for) waits one hold at most, plus the wait for the next tick of a 10 ms
wall-clock grid (``LinkConfig.hold_grid``), on which every front-end's held batches
leave, so that the store host takes them in one wake-up. A record (a SET, MULTI_SET
or APPEND) of a family that was read through this front-end within the second is not
held: its readers wait for it one by one (Gloo's ranks, every rank's address in turn).
Any other request closes the held batch at once, so reads (and chains of them, such as
Gloo's address exchange) never wait, with one exception: a WAIT of a client whose write
the batch holds stays in it (every agent SETs its role record, then WAITs for its
assignment; let that WAIT send the batch and a node's records leave one by one). It
waits no longer than its client's write, which it could not overtake anyway, and what it
waits for rarely exists yet. A client repeating its own write of a family
within the second (a counter in a loop) is not held either, except by a front-end
relaying a subtree's writes, which cannot tell one client's repeats from another's.
Within a batch:
- identical read-only requests (WAIT, CHECK, GET, MULTI_GET, GETNUMKEYS, QUEUE_LEN)
  with no write to their keys between them are sent once and the answer fanned out;
- consecutive ADDs to one key with no other operation on that key between them become
  one ADD of the sum; the i-th caller gets ``final - sum + prefix_i``, exactly what
  sequential execution returns; consecutive APPENDs to one key, one APPEND of the
  concatenation (APPEND has no answer);
- SETs (and MULTI_SETs: a lower front-end's folds) of distinct keys fold into one
  MULTI_SET, GETs of distinct keys into one MULTI_GET whose values are handed out, and
  one-key WAITs on distinct keys into one WAITS link entry (each still waits, and is
  answered, on its own), run where the fold's first request stands.
  A request joins a fold only if it commutes with everything it moves ahead of: no
  request on its key (a GET or WAIT: no write to it; a SET: no request at all, nor a
  GETNUMKEYS or LIST_KEYS, whose answer a new key changes) since the fold's place.
  So every answer is the one in-order execution gives. (This is what torch's rank
  assignment needs: one SET, WAIT and GET of a key of its own per node; one MULTI_SET,
  one WAITS and one MULTI_GET carry a whole batch of them.)
A client's request joins an earlier merged or folded request only if the client has
sent nothing since that one's place (or, an ADD, only that run's ADDs): its requests
take effect, and its answers leave, in the order it sent them (design.md's
per-connection order). A SET counts too: it has no answer, but the client's next
answer tells it the SET was done, and a read moved ahead of it could be answered (from
a watch, or before the SET's invalidation round) while the SET is still on its way.

Across batches, only through watches (design.md's standing watch; link frames.py): a
one-key CHECK (a poll from the first: NCCL's heartbeat monitor, torch's only caller of
CHECK), or GET or WAIT of a key polled (read before by another client, or by the same
client asking the same: the ranks' WAITs and GETs of the unique id, a barrier's WAITs)
goes upstream as a WATCH, whose answer carries the key's
state; the front-end then answers reads of the key from that state, and WAITs on it
join the WAIT that waits for it upstream, until the core invalidates the watch (which
it does before anyone can learn of a change) or the lease runs out. A key's first
one-key WAIT *fetches* it: it goes up in a WATCHES entry (folded like WAITS), whose
answers carry the key's state too, so the GET of torch's get() (a WAIT, then a GET: an
agent reading its rank assignment, a Gloo rank a peer's address) is answered on the
node; such a WAIT watches its key only once it is there (nothing joins it), so the
write that releases it costs no invalidation round. A proxy that takes other front-ends'
links treats a second front-end's fetch of a key as a poll (the exit barrier: one agent
per node WAITs for its last member): it goes up as a WATCH-WAIT, which later ones join.
A fetch of a key whose trailing number follows that of a key fetched (or read ahead) in
an earlier batch also *reads ahead*: a PEEKS entry asks for the state of the next
LOOKAHEAD keys (twice as many each time the reads go on in order, up to MAX_LOOKAHEAD),
which the core answers at once, watching those that hold a value (Gloo's ranks read
every rank's address in turn: a few fetches instead of one per key). Answers from
watches (and joins) only for a client with nothing outstanding: every earlier request of
it answered, none since without an answer (a SET), so its own writes are executed (and
their invalidations in) first; such a client's reads are sent plain, its WAITs fetch in
a FETCHES entry, which no front-end on the way answers from its watches. A key
invalidated ``MAX_CHURN`` times is not watched again (it changes too often).

Every request of a namespace travels under one link client id (opened once per session:
an OPEN entry costs the core as much as a request), whoever sent it; the core matches
answers by request id. Each WAIT or BARRIER waits at the core on its own, so a client's
CANCEL_WAIT (answered here, as torch's server answers it) cancels only what that client
waits for: a CANCEL entry once nobody waits under the upstream request any more.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import socket
import struct
import time
from collections import defaultdict, deque
from collections.abc import Callable
from time import monotonic

from ..core import StoreError, Waiter
from ..core.watch_state import FETCH, FETCH_AFTER_WRITES, PEEK, WATCH_READ, decode_watch_answer, encode_watch_state
from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    ACK, DEFAULT_MAX_FRAME, ERROR, FETCHES, HANDSHAKE_MAX_FRAME, HELLO, INVALIDATE, INVALIDATED, LINK_MAGIC, OK, PEEKS,
    PONG, REPLIES, RESUMED, SESSION_ID_BYTES, WAITS, WATCH_LEASE, WATCHES, WELCOME, FrameDecoder, LinkError,
    decode_count, decode_invalidate, decode_pong, decode_replies, encode_batch, encode_count, encode_session,
    entry_cancel, entry_open, entry_request, entry_waits, entry_watch,
)
from ..link.outbox import Outbox
from ..link.reply_gate import break_watches
from ..protocol import Op, Request
from ..protocol.opcodes import (
    CHECK_NOT_READY, CHECK_READY, NO_REPLY_OPS, STOP_WAITING, WAIT_CANCELED, WAITING_OPS, WATCHABLE_OPS,
)
from ..protocol.replies import encode_bytes
from ..protocol.requests import encode_request

log = logging.getLogger("tierrun.frontend")

_i64 = struct.Struct("<q")
_u64 = struct.Struct("<Q")
_DEDUP_OPS = frozenset({Op.WAIT, Op.CHECK, Op.GET, Op.MULTI_GET, Op.GETNUMKEYS, Op.QUEUE_LEN})
_ALL_KEYS = b"\x00*"  # pseudo-key touched by every write: GETNUMKEYS depends on all
#: At most this many requests (keys, in a SET fold) in one fold (the core's limit is 128 Ki
#: keys per request).
MAX_FOLD = 1024
#: Keys a front-end watches at most (past it, it forgets them all and starts again).
MAX_WATCHES = 16384
#: A key whose watch was invalidated this often is read without one from then on.
MAX_CHURN = 4
_WATCH = -1  # a pending request ``(_WATCH, request, watcher or None)``: send it as a WATCH
_FETCH = -2  # ``(_FETCH, WAIT request, watcher or None)``: send it in a WATCHES entry
_FETCH_AFTER_WRITES = -3  # the same, in a FETCHES entry (its client has writes on their way)
_PEEK = -4  # ``(_PEEK, WAIT request, watcher)``: a front-end below reading ahead, in a PEEKS entry
_ENTRY_KIND = {_WATCH: 0, _FETCH: WATCHES, _FETCH_AFTER_WRITES: FETCHES, _PEEK: PEEKS}  # (0: a WATCH entry)
#: A key's fetch also peeks at this many keys after it (the same name, numbered on),
#: twice as many each time the reads go on in order, up to MAX_LOOKAHEAD.
LOOKAHEAD = 16
MAX_LOOKAHEAD = 256
_TRAILING_NUMBER = re.compile(rb"[0-9]{1,18}\Z")
#: A write is contended when another client wrote its key family this recently (seconds).
CONTENDED_WITHIN = 1.0
#: A held batch that other clients' writes keep joining stays open up to this many holds.
HOLD_STRETCH = 4
_HELD_WRITES = frozenset({Op.ADD, Op.SET, Op.MULTI_SET, Op.APPEND})
_NOTED_READS = frozenset({Op.GET, Op.WAIT, Op.CHECK})
_MISSING = object()


def _issuer(waiter: Waiter) -> Waiter:
    """The client a request came from: a relayed WAIT waits under a ticket of its own
    (``link_server.Ticket``), whose ``client`` is the link client that sent it."""
    return getattr(waiter, "client", waiter)


def _family(ns: bytes, key: bytes) -> tuple[bytes, bytes]:
    """A key's family, as the contended-write hold tells writers and readers apart: the
    key less its trailing number, in its namespace."""
    return ns, key.rstrip(b"0123456789")


def _keys(req: Request) -> tuple[bytes, ...]:
    op = req[0]
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET):
        return req[1]
    if op in (Op.GETNUMKEYS, Op.LIST_KEYS, Op.CANCEL_WAIT):
        return ()
    return (req[1],)


def _same_run(earlier: tuple[Waiter, bytes, Request], ns: bytes, op: int, key: bytes) -> bool:
    """Is ``earlier`` (a client's last request, at or after the place of the open run of
    ``op`` on ``key``) in that run? Then the client's next one may join it: the
    run's answers leave in order. (Runs are cut by any other request on their key, so an
    ADD of the key in that stretch is in the run.)"""
    req = earlier[2]
    return req[0] == op and earlier[1] == ns and req[1] == key


def _set_fold_size(f: _Upstream) -> int:
    """Keys in a SET fold so far (it began with a SET or a MULTI_SET)."""
    if f.fold is not None:
        return len(f.fold.keys)
    return 1 if f.req[0] == Op.SET else len(f.req[1])


class _Upstream:
    """One operation sent upstream, and who gets its answer."""

    __slots__ = ("req", "cid", "rid", "waiters", "deltas", "group", "pos", "fold", "members", "wkey", "watchers",
                 "fetch")

    def __init__(self, req: Request, cid: int, waiter: Waiter | None, pos: int) -> None:
        self.req = req
        self.cid = cid  # 0 once a WAIT group is cancelled upstream
        self.rid = 0  # its request id, once sent with an answer expected
        self.waiters: list[Waiter] = [waiter] if waiter is not None else []
        self.deltas: list[int] | None = None  # set for a merged ADD
        self.group = False  # a WAIT or BARRIER (its waiters may cancel one by one)
        self.pos = pos  # where its first request stands in the batch
        self.fold: _Fold | None = None  # set once a second SET/GET/APPEND joins
        self.members: list[_Upstream] | None = None  # one-key WAITs sent with this one
        self.wkey: tuple[bytes, bytes] | None = None  # a WATCH: (namespace, key)
        #: A WATCH: per waiter, the downstream watcher it answers for (None: a local
        #: client, answered with the request's own answer, not the watch state).
        self.watchers: list[tuple[object, int] | None] | None = None
        self.fetch = 0  # a WAIT that fetches: the entry kind it goes in (WATCHES, FETCHES); joined by
        # nothing; or a peek (PEEKS)


class _Fold:
    """Requests folded into one: the keys of a MULTI_SET or MULTI_GET (with the SETs'
    values, or which value each GET waiter gets), or an APPEND's pieces."""

    __slots__ = ("keys", "values", "slot", "picks")

    def __init__(self, u: _Upstream) -> None:
        req = u.req
        if req[0] == Op.MULTI_SET:
            self.keys, self.values = list(req[1]), list(req[2])  # type: ignore[misc]
            self.slot: dict[bytes, int] = {}
            self.picks: list[int] = []
            return
        self.keys = [req[1]]
        self.values = [req[2]] if req[0] != Op.GET else []
        self.slot = {req[1]: 0}  # GET: key -> index of its value
        self.picks = [0] * len(u.waiters)  # GET: per waiter, the index of its value

    def request(self, op: int) -> Request:
        if op == Op.SET or op == Op.MULTI_SET:
            return (Op.MULTI_SET, tuple(self.keys), tuple(self.values))
        if op == Op.GET:
            return (Op.MULTI_GET, tuple(self.keys))
        return (Op.APPEND, self.keys[0], b"".join(self.values))


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

    Its session survives the connection: when the connection drops (or is silent for
    ``heartbeat_timeout``) it reconnects with backoff and resumes, resending the batches
    the core has not received; local clients see only latency. Past ``grace`` it gives
    up: every client waiting on it is dropped with the reason and ``on_lost`` is called.
    """

    def __init__(self, token: bytes, on_lost: Callable[[str], None],
                 config: LinkConfig | None = None, address: tuple[str, int] | None = None) -> None:
        self._token = token
        self._on_lost = on_lost
        self.config = config or LinkConfig()
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
        self._inflight: dict[int, _Upstream] = {}
        self._ns_cids: dict[bytes, int] = {}  # namespace -> its link client id
        self._wait_of: dict[Waiter, _Upstream] = {}  # a client's WAIT or BARRIER upstream
        self._next_id = 1
        #: Per batch in flight, the request id of its last answer that the upstream
        #: gives at once (not a WAIT's or BARRIER's): while there are
        #: ``batches_in_flight`` of them, new requests wait for the next batch.
        self._batches_awaiting: set[int] = set()
        self.stats = CoalescingStats()
        # -- watches (see the module docstring) --
        self._cache: dict[tuple[bytes, bytes], bytes | None] = {}  # (ns, key) -> value, None: absent
        self._watch_of: dict[int, tuple[bytes, bytes]] = {}  # watch id (its WATCH's rid) -> (ns, key)
        self._waiting_on: dict[tuple[bytes, bytes], _Upstream] = {}  # the WATCH-WAIT sent for a key
        self._downstream: dict[tuple[bytes, bytes], list[tuple[object, int]]] = {}  # front-ends below
        #: key -> (its first reader, what it asked): a read by another client, or the same
        #: request again, is a poll
        self._seen: dict[tuple[bytes, bytes], tuple[Waiter, int]] = {}
        self._churn: dict[tuple[bytes, bytes], int] = {}  # invalidations per key
        self._peeking: dict[tuple[bytes, bytes], _Upstream] = {}  # peeks awaiting their answer
        self._peeked: dict[tuple[bytes, bytes], None] = {}  # keys read ahead before (not again)
        #: (ns, a key name less its trailing number) -> how many keys it last read ahead
        self._lookahead_of: dict[tuple[bytes, bytes], int] = {}
        self._lease_until = 0.0  # answer from watches only before this (monotonic)
        self._unanswered: dict[Waiter, int] = {}  # client -> its requests awaiting answers
        self._unconfirmed: set[Waiter] = set()  # clients whose last request has no answer
        #: (ns, key family) -> (its last writer, when): is a write contended
        self._family_writer: dict[tuple[bytes, bytes], tuple[Waiter, float]] = {}
        self._client_wrote: dict[tuple[tuple[bytes, bytes], Waiter], float] = {}  # ... by this client, when
        self._family_read: dict[tuple[bytes, bytes], float] = {}  # (ns, key family) -> when last read
        self._held = False  # the open batch opened with a contended write: it is held
        self._held_writers: set[Waiter] = set()  # clients with a request in the held batch
        self._hold: asyncio.Handle | None = None  # ... until then (None: a batch is in flight)
        self._hold_until = 0.0  # (monotonic) ... one hold after the last write that joined it,
        self._hold_last = 0.0  # ... but no later than HOLD_STRETCH holds after its first

    # -- the session and its connections ----------------------------------------------

    def silence(self) -> float | None:
        """Seconds since the upstream was last heard from on the current connection;
        None while there is none (reconnecting, or given up)."""
        return None if self._conn is None else monotonic() - self._conn.last_rx

    def connection(self) -> LinkConnection:
        """A protocol for a new connection to the core; it resumes this session."""
        return LinkConnection(self)

    def _established(self, conn: LinkConnection, batches_received: int) -> None:
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
        every node's does (their clocks agree to a few ms): the store host reads its
        idle links' heartbeats in one wake-up, not one each (8 idle links: 1.6 -> 0.5 ms
        of CPU a second, ``bench/heartbeat.py --idle``), and a proxy its children's.
        A tick less than a tenth of an interval away is skipped: the loop's timers fire
        up to a millisecond early (uvloop's resolution), and a beat woken just before its
        tick must not beat again at the tick (which, repeated, sent bursts of ACKs)."""
        interval = self.config.heartbeat_interval
        delay = (-time.time()) % interval
        if delay < interval / 10:
            delay += interval
        self._heartbeat = asyncio.get_running_loop().call_later(delay, self._beat)

    def _beat(self) -> None:
        """Every heartbeat interval: acknowledge (the heartbeat), or drop a silent connection.
        A link that sent a batch during the last interval sends its heartbeat with its
        next batch instead (in one write, so the store host reads both in one wake-up),
        or at the next beat if none comes: heartbeats at most two intervals apart, well
        within the watch lease."""
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

    def _connection_lost(self, conn: LinkConnection, reason: str) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._drop_watches()
        if self.dead is None and self._reconnecting is None and self.address is not None:
            self._reconnecting = asyncio.ensure_future(self._reconnect(reason))
        elif self.address is None:
            self._die(reason)

    async def _reconnect(self, reason: str) -> None:
        """Reconnect with backoff (0.1 s to 1 s) until the grace period ends."""
        loop = asyncio.get_running_loop()
        grace = self.config.grace
        since = loop.time()
        host, port = self.address  # type: ignore[misc]
        reason = reason.replace("the store host", f"the store host {host}:{port}", 1)
        reason = reason.replace(" lost (", f" lost at {time.strftime('%H:%M:%S')} (", 1)
        log.warning("%s; reconnecting (for up to %g s)", reason, grace)
        delay = 0.1
        try:
            while self.dead is None:  # (it may give up meanwhile, e.g. its buffer overflowed)
                try:
                    await _open(self, self.config.heartbeat_timeout)
                    log.warning("link to the store host resumed after %.1f s", loop.time() - since)
                    return
                except LinkError as e:  # refused: the session is gone, or not our store
                    self._die(str(e))
                    return
                except (OSError, asyncio.TimeoutError) as e:
                    last = e
                if loop.time() - since + delay > grace:
                    self._die(f"{reason}; not back within the {grace:g} s grace period "
                              f"(last attempt: {type(last).__name__}{f' {last}' if str(last) else ''})")
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            self._reconnecting = None

    def _die(self, reason: str) -> None:
        """Give up the session: drop every waiting client with ``reason``."""
        if self.dead is not None:
            return
        self.dead = reason
        if not self.ready.done():
            self.ready.set_exception(LinkError(reason))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
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
            self._die(f"the store host stopped acknowledging: {e}")
            return
        self._sent_since_beat = True
        if self._conn is not None:
            if self._beat_with_next_batch:
                self._beat_with_next_batch = False
                self._conn.ack(after=data)
            else:
                self._conn.write(data)

    # -- requests ---------------------------------------------------------------------

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
            if clean:
                value = self._watched_value(op, k)
                if value is not _MISSING:
                    self.stats.watch_answers += 1
                    return _answer_from(op, value)  # type: ignore[arg-type]
                if op == Op.WAIT and self._join_wait(k, waiter, None):
                    self._unanswered[waiter] = 1
                    return None
            first = self._seen.get(k)
            if self._churn.get(k, 0) < MAX_CHURN:
                if clean and (op == Op.CHECK or first is not None and (first[0] is not waiter or first[1] == op)):
                    # (a CHECK is a poll from the first: torch's only caller, NCCL's
                    # heartbeat monitor, CHECKs its key every second)
                    req = (_WATCH, req, None)  # type: ignore[assignment]
                elif op == Op.WAIT:  # (torch's get() is a WAIT, then a GET: fetch the value)
                    req = (_FETCH if clean else _FETCH_AFTER_WRITES, req, None)  # type: ignore[assignment]
        self._enqueue(waiter, ns, req)
        if op in NO_REPLY_OPS:
            self._unconfirmed.add(waiter)
        else:
            self._unanswered[waiter] = self._unanswered.get(waiter, 0) + 1
            if self._unconfirmed:
                self._unconfirmed.discard(waiter)  # (this answer confirms what came before)
        return None

    def submit_watching(self, req: Request, waiter: Waiter, watcher: tuple[object, int], ns: bytes,
                        how: int = WATCH_READ) -> bytes | None:
        """A watching read from a front-end linked to this one (``watcher``: its session
        and watch id; ``how``: its entry's kind, see ``core.watch_state``): answered from
        this one's watch when it can, else sent upstream alike. A FETCH_AFTER_WRITES
        always goes upstream, joining nothing: its client has writes on their way (an
        agent's SET of its role record, just before), which must execute first. The
        front-end below is told of every invalidation of the key from now on (even
        before the answer: so it may let WAITs join its own)."""
        if self.dead is not None:
            raise StoreError(self.dead)
        op = req[0]
        k = (ns, req[1] if op == Op.GET else req[1][0])
        self.stats.requests += 1
        if how == PEEK:
            return self._peek(k, req, waiter, watcher)
        if how != FETCH_AFTER_WRITES:  # (its client has nothing outstanding)
            value = self._watched_value(op, k)
            if value is not _MISSING:
                self.stats.watch_answers += 1
                self._downstream.setdefault(k, []).append(watcher)
                return encode_watch_state(True, value) + _answer_from(op, value)  # type: ignore[arg-type]
            if op == Op.WAIT and self._join_wait(k, waiter, watcher):
                return None
            if how == FETCH and k in self._seen and self._churn.get(k, 0) < MAX_CHURN:
                # a second front-end's WAIT on the key: a poll (one agent per node
                # waiting for the exit barrier's last member), so it waits upstream
                # watching the key as absent, and later ones join it here
                how = WATCH_READ
        marker = _WATCH if how == WATCH_READ else _FETCH if how == FETCH else _FETCH_AFTER_WRITES
        self._enqueue(waiter, ns, (marker, req, watcher))  # type: ignore[arg-type]
        return None

    def _peek(self, k: tuple[bytes, bytes], req: Request, waiter: Waiter, watcher: tuple[object, int]) -> bytes | None:
        """A front-end below reads ahead: answered from this one's watch, or with the
        answer of the peek of the key already on its way up, or sent up."""
        if monotonic() < self._lease_until and k in self._cache:
            self.stats.watch_answers += 1
            self._downstream.setdefault(k, []).append(watcher)
            return encode_watch_state(True, self._cache[k])
        u = self._peeking.get(k)
        if u is not None:  # (told of invalidations from now on, as a WATCH that joins)
            u.waiters.append(waiter)
            u.watchers.append(watcher)  # type: ignore[union-attr]
            self._downstream.setdefault(k, []).append(watcher)
            return None
        self._enqueue(waiter, k[0], (_PEEK, req, watcher))  # type: ignore[arg-type]
        return None

    def _lookahead(self, ns: bytes, key: bytes) -> list[bytes]:
        """The keys to read ahead after fetching ``key``: if the key before it (trailing
        number - 1) was fetched or read ahead in an earlier batch (Gloo's ranks read every
        rank's key in turn; agents that each read their own key at once read nothing
        ahead), the next LOOKAHEAD keys not watched, nor read ahead before, twice as
        many as last time for the same name (up to MAX_LOOKAHEAD), as a file system reads
        ahead (the caller then marks ``key`` as fetched). O(keys read ahead)."""
        m = _TRAILING_NUMBER.search(key)
        if m is None:
            return []
        base, n = key[: m.start()], int(m.group())
        peeked, cache, churn = self._peeked, self._cache, self._churn
        if (ns, base + str(n - 1).encode()) not in peeked:
            return []
        sizes = self._lookahead_of
        if len(sizes) >= MAX_WATCHES:
            sizes.clear()
        size = sizes[(ns, base)] = min(2 * sizes.get((ns, base), LOOKAHEAD // 2), MAX_LOOKAHEAD)
        ahead = []
        for i in range(n + 1, n + 1 + size):
            k = (ns, base + str(i).encode())
            if k not in peeked and k not in cache and churn.get(k, 0) < MAX_CHURN:
                peeked[k] = None
                ahead.append(k[1])
        return ahead

    def _enqueue(self, waiter: Waiter, ns: bytes, req: Request) -> None:
        """Put a request in the next batch, held open if it starts with a contended
        write (``LinkConfig.contended_write_hold``), closed at once by anything else but
        another contended write or a WAIT of a client whose write the batch holds."""
        hold = self.config.contended_write_hold
        contended = waits_on_held = False
        if hold:
            if req[0] in _HELD_WRITES:
                contended = self._contended(waiter, ns, req)
            else:
                read = req[1] if req[0] < 0 else req
                self._note_read(ns, read)
                waits_on_held = read[0] == Op.WAIT and _issuer(waiter) in self._held_writers
        if not self._pending and not self._extra:
            if contended:
                self.stats.held_batches += 1
                self._held = True
                now = monotonic()
                self._hold_until = now + hold
                self._hold_last = now + HOLD_STRETCH * hold
                limit = self.config.batches_in_flight
                if not limit or len(self._batches_awaiting) < limit:
                    self._hold = asyncio.get_running_loop().call_later(hold, self._hold_over)
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
            else:  # another writer joined: hold on while they keep coming
                self._hold_until = min(monotonic() + hold, self._hold_last)
        if self._held:
            self._held_writers.add(_issuer(waiter))
        self._pending.append((waiter, ns, req))

    def _hold_over(self) -> None:
        """The held batch leaves, unless a write joined it in its last hold: then it
        waits one hold from that write (up to HOLD_STRETCH holds from its first). It
        leaves on the next tick of the wall clock's ``hold_grid``: so do every other
        front-end's held batches of the same storm (clocks in sync, as a cluster's
        are), and the frames reach the upstream together, handled in one wake-up
        there rather than one each."""
        left = self._hold_until - monotonic()
        if left > 0.001:
            self._hold = asyncio.get_running_loop().call_later(left, self._hold_over)
            return
        grid = self.config.hold_grid
        to_tick = (-time.time()) % grid if grid else 0.0
        if to_tick > 0.001:
            self._hold = asyncio.get_running_loop().call_later(to_tick, self._flush)
        else:
            self._flush()

    def _contended(self, waiter: Waiter, ns: bytes, req: Request) -> bool:
        """Whether this write's key family (its first key, less the trailing number) was
        written by another client within ``CONTENDED_WITHIN`` seconds (every node's
        count of a barrier, its role record); notes this write. A client writing one
        family again within that time (a counter in a loop) is not held, unless it
        relays for a front-end below (``relay``: a subtree's writes, where repeats are
        other clients'). O(key)."""
        k = _family(ns, req[1][0] if req[0] == Op.MULTI_SET else req[1])
        now = monotonic()
        writers = self._family_writer
        if len(writers) >= MAX_WATCHES:
            writers.clear()
        last = writers.get(k)
        writers[k] = (waiter, now)
        if req[0] != Op.ADD:  # (a record, not a count: is it being read, one by one?)
            read = self._family_read.get(k)
            if read is not None and now - read < CONTENDED_WITHIN:
                return False
        if not getattr(waiter, "relay", False):
            mine = self._client_wrote
            if len(mine) >= MAX_WATCHES:
                mine.clear()
            before = mine.get((k, waiter))
            mine[(k, waiter)] = now
            if before is not None and now - before < CONTENDED_WITHIN:
                return False
        return last is not None and last[0] is not waiter and now - last[1] < CONTENDED_WITHIN

    def _note_read(self, ns: bytes, req: Request) -> None:
        """Note that a key family is being read one key at a time through here: its
        writes are records that clients wait for one by one (Gloo's addresses), not
        counts or records read all at once when complete (torch's rank assignment WAITs
        for every node's role record in one request, then MULTI_GETs them), so they are
        not held. O(key)."""
        if req[0] in _NOTED_READS and (req[0] == Op.GET or len(req[1]) == 1):
            reads = self._family_read
            if len(reads) >= MAX_WATCHES:
                reads.clear()
            reads[_family(ns, req[1] if req[0] == Op.GET else req[1][0])] = monotonic()

    def _watched_value(self, op: int, k: tuple[bytes, bytes]) -> bytes | None | object:
        """``k``'s watched value (None: absent) when a CHECK, GET or WAIT of it can be
        answered from its watch now (within the lease; a WAIT only once the key is
        there), else _MISSING."""
        if monotonic() >= self._lease_until:
            return _MISSING
        value = self._cache.get(k, _MISSING)
        return _MISSING if value is None and op == Op.WAIT else value

    def _join_wait(self, k: tuple[bytes, bytes], waiter: Waiter, watcher: tuple[object, int] | None) -> bool:
        """Let a WAIT on ``k`` join the WATCH-WAIT already sent for it, if any (and the
        lease runs): the core watches the key for this front-end meanwhile, so until it
        says the key changed, that WAIT's answer is this one's too."""
        u = self._waiting_on.get(k)
        if u is None or not u.cid or monotonic() >= self._lease_until:
            return False
        u.waiters.append(waiter)
        u.watchers.append(watcher)  # type: ignore[union-attr]
        self._wait_of[waiter] = u
        if watcher is not None:
            self._downstream.setdefault(k, []).append(watcher)
        self.stats.watch_joins += 1
        return True

    def lease_left(self) -> float:
        """How much longer (seconds) this front-end may answer from its watches: what
        it may grant the front-ends linked to it."""
        return max(0.0, min(WATCH_LEASE, self._lease_until - monotonic())) if self._conn is not None else 0.0

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
        after its first request: a longer batch merges more, for that much latency.
        While ``batches_in_flight`` batches await their answers, it closes when one
        of them is answered instead."""
        limit = self.config.batches_in_flight
        if limit and len(self._batches_awaiting) >= limit:
            return  # (_on_replies flushes)
        loop = asyncio.get_running_loop()
        if self.config.batch_window:
            loop.call_later(self.config.batch_window, self._flush)
        else:
            loop.call_soon(self._flush)

    def _new_id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def _flush(self) -> None:
        """Send the batch: merge and fold by the rule of this module's docstring. O(keys
        of the batch's requests): a few dict operations per key."""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self._held = False
        self._held_writers.clear()
        pending, self._pending = self._pending, []
        entries, self._extra = self._extra, []
        ops: list[_Upstream] = []
        open_reads: dict[tuple, _Upstream] = {}  # (ns, [kind,] opcode, keys): its upstream op
        reads_on: dict[tuple[bytes, bytes], list[tuple]] = defaultdict(list)  # (ns, key): open_reads keys
        runs: dict[tuple[int, bytes, bytes], _Upstream] = {}  # (ADD|APPEND, ns, key): open run
        folds: dict[tuple[int, bytes], _Upstream] = {}  # (SET|GET|WAIT, ns): the latest foldable op
        last_touch: dict[tuple[bytes, bytes], int] = {}  # (ns, key): place of the last request on it
        last_write: dict[tuple[bytes, bytes], int] = {}
        last_of: dict[Waiter, int] = {}  # client: place of its last request
        ahead: list[tuple[bytes, bytes]] = []  # keys fetched: read the keys after them too
        stats = self.stats
        seen = self._seen

        def touched(ns: bytes, keys, write: bool) -> None:
            # (O(keys) only while an ADD run or a read is open: an agent's request
            # of every node's key walks them only if it must)
            if runs:
                for k in keys:
                    runs.pop((Op.ADD, ns, k), None)
                    runs.pop((Op.APPEND, ns, k), None)
            if write and reads_on:
                for k in keys:
                    for dk in reads_on.pop((ns, k), ()):
                        open_reads.pop(dk, None)
                for dk in reads_on.pop((ns, _ALL_KEYS), ()):
                    open_reads.pop(dk, None)

        ns_cids = self._ns_cids

        def cid_of(ns: bytes) -> int:
            cid = ns_cids.get(ns)
            if cid is None:
                cid = ns_cids[ns] = self._new_id()
                entries.append(entry_open(cid, ns))
                stats.ids_opened += 1
            return cid

        last = len(pending) - 1
        for i, (waiter, ns, req) in enumerate(pending):
            op = req[0]
            since = last_of.get(waiter, -1)  # this client's previous request
            last_of[waiter] = i
            if op < 0:  # a read that also watches its key: merged only with its like
                inner, watcher = req[1], req[2]  # type: ignore[misc]
                keys = _keys(inner)
                touched(ns, keys, write=False)
                k = (ns, keys[0])
                last_touch[k] = i
                if (op == _FETCH or op == _FETCH_AFTER_WRITES) and k not in seen:  # (a second WAIT
                    if len(seen) >= MAX_WATCHES:  # on the key is a poll)
                        seen.clear()
                    seen[k] = (waiter, Op.WAIT)
                # (a fetch after writes answers nobody else, nor is it answered with another;
                # a read is its opcode and keys: equal exactly when its bytes are)
                dk = (ns, b"a" if op == _FETCH_AFTER_WRITES else b"p" if op == _PEEK else b"w",
                      inner[0], tuple(keys))
                same = open_reads.get(dk)
                if same is not None and since < same.pos:
                    same.waiters.append(waiter)
                    same.watchers.append(watcher)  # type: ignore[union-attr]
                    if op == _PEEK:
                        self._downstream.setdefault(k, []).append(watcher)
                    elif inner[0] == Op.WAIT:
                        self._wait_of[waiter] = same
                        stats.merged_waits += 1
                    else:
                        stats.merged_reads += 1
                    continue
                f = folds.get((op, ns)) if op != _WATCH else None
                folded = (f is not None and since < f.pos and last_write.get(k, -1) < f.pos
                          and len(f.members or ()) < MAX_FOLD)
                u = _Upstream(inner, cid_of(ns), waiter, f.pos if folded else i)  # type: ignore[union-attr]
                u.wkey = k
                u.watchers = [watcher]
                u.fetch = _ENTRY_KIND[op]
                if op == _PEEK:
                    self._peeking[k] = u
                elif op == _FETCH:
                    ahead.append(k)
                if inner[0] == Op.WAIT and op != _PEEK:
                    u.group = True
                    self._wait_of[waiter] = u
                    if not u.fetch:  # (later WAITs on the key may join it)
                        self._waiting_on[k] = u
                if watcher is not None:  # told of invalidations from now on
                    self._downstream.setdefault(k, []).append(watcher)
                open_reads[dk] = u
                reads_on[k].append(dk)
                if folded:  # (it waits from the fold's place: one WATCHES entry)
                    f.members = f.members or []  # type: ignore[union-attr]
                    f.members.append(u)  # type: ignore[union-attr]
                    stats.folded_waits += op != _PEEK
                    continue
                if u.fetch:
                    folds[(op, ns)] = u
                ops.append(u)
                continue
            keys = _keys(req)
            if op in _DEDUP_OPS:
                if op in WATCHABLE_OPS and len(keys) == 1 and (ns, keys[0]) not in seen:
                    if len(seen) >= MAX_WATCHES:
                        seen.clear()
                    seen[(ns, keys[0])] = (waiter, op)  # its first reader
                dk = (ns, op, tuple(keys))  # (keys may come as a list from in-process callers)
                same = open_reads.get(dk)
                touched(ns, keys, write=False)
                bookkeeping = i != last or ahead  # (for the batch's later requests, its PEEKS)
                if bookkeeping:
                    for k in keys or (_ALL_KEYS,):
                        last_touch[(ns, k)] = i
                if same is not None and since < same.pos:
                    same.waiters.append(waiter)
                    if same.fold is not None:
                        same.fold.picks.append(same.fold.slot[req[1]])
                    if op == Op.WAIT:
                        self._wait_of[waiter] = same
                        stats.merged_waits += 1
                    else:
                        stats.merged_reads += 1
                    continue
                if op == Op.GET:
                    f = folds.get((Op.GET, ns))
                    if (f is not None and since < f.pos and last_write.get((ns, req[1]), -1) < f.pos
                            and (f.fold is None or len(f.fold.keys) < MAX_FOLD)):
                        fold = f.fold or _Fold(f)
                        f.fold = fold
                        fold.slot[req[1]] = len(fold.keys)
                        fold.picks.append(len(fold.keys))
                        fold.keys.append(req[1])
                        f.waiters.append(waiter)
                        open_reads[dk] = f
                        reads_on[(ns, req[1])].append(dk)
                        stats.folded_gets += 1
                        continue
                if op == Op.WAIT and len(keys) == 1:
                    f = folds.get((Op.WAIT, ns))
                    if (f is not None and since < f.pos and last_write.get((ns, keys[0]), -1) < f.pos
                            and len(f.members or ()) < MAX_FOLD):
                        u = _Upstream(req, f.cid, waiter, f.pos)  # (it waits from the fold's place)
                        u.group = True
                        self._wait_of[waiter] = u
                        f.members = f.members or []
                        f.members.append(u)
                        open_reads[dk] = u
                        reads_on[(ns, keys[0])].append(dk)
                        stats.folded_waits += 1
                        continue
                u = _Upstream(req, cid_of(ns), waiter, i)
                if op == Op.WAIT:
                    u.group = True
                    self._wait_of[waiter] = u
                    if len(keys) == 1:
                        folds[(Op.WAIT, ns)] = u
                elif op == Op.GET:
                    folds[(Op.GET, ns)] = u
                open_reads[dk] = u
                if bookkeeping:
                    for k in keys or (_ALL_KEYS,):
                        reads_on[(ns, k)].append(dk)
                ops.append(u)
                continue
            if op == Op.ADD or op == Op.APPEND:
                key = (op, ns, req[1])
                run = runs.get(key)
                touched(ns, keys, write=True)
                last_touch[(ns, req[1])] = last_write[(ns, req[1])] = i
                if run is not None and (since < run.pos or _same_run(pending[since], ns, op, req[1])):
                    if op == Op.ADD:
                        run.waiters.append(waiter)
                        run.deltas.append(req[2])  # type: ignore[union-attr]
                        stats.merged_adds += 1
                    else:
                        run.fold = run.fold or _Fold(run)
                        run.fold.values.append(req[2])
                        stats.merged_appends += 1
                    runs[key] = run
                    continue
                u = _Upstream(req, cid_of(ns), waiter if op == Op.ADD else None, i)
                if op == Op.ADD:
                    u.deltas = [req[2]]
                runs[key] = u
                ops.append(u)
                continue
            if op == Op.SET or op == Op.MULTI_SET and keys:  # (a lower front-end's fold joins ours)
                f = folds.get((Op.SET, ns))
                joins = (f is not None and since < f.pos and last_touch.get((ns, _ALL_KEYS), -1) < f.pos
                         and all(last_touch.get((ns, k), -1) < f.pos for k in keys)
                         and _set_fold_size(f) + len(keys) <= MAX_FOLD)
                touched(ns, keys, write=True)
                if i != last:  # (an agent's MULTI_SET of every node's key, alone: no need)
                    for k in keys:
                        last_touch[(ns, k)] = last_write[(ns, k)] = i
                if joins:
                    fold = f.fold or _Fold(f)  # type: ignore[union-attr]
                    f.fold = fold  # type: ignore[union-attr]
                    if op == Op.SET:
                        fold.keys.append(req[1])
                        fold.values.append(req[2])
                    else:
                        fold.keys += req[1]
                        fold.values += req[2]  # type: ignore[misc]
                    stats.folded_sets += len(keys)
                    continue
                u = _Upstream(req, cid_of(ns), None, i)
                folds[(Op.SET, ns)] = u
                ops.append(u)
                continue
            touched(ns, keys, write=True)
            for k in keys or (_ALL_KEYS,):
                last_touch[(ns, k)] = last_write[(ns, k)] = i
            u = _Upstream(req, cid_of(ns), None if op in NO_REPLY_OPS else waiter, i)
            if op == Op.BARRIER:
                u.group = True
                self._wait_of[waiter] = u
            ops.append(u)
        if len(self._peeked) >= MAX_WATCHES:
            self._peeked.clear()
        reads = [(ns, key, self._lookahead(ns, key)) for ns, key in ahead]
        for ns, key, peeks in reads:  # read the keys after fetched ones: PEEKS, at the batch's end
            self._peeked[(ns, key)] = None  # (the fetch of the key after it reads ahead)
            for peek in peeks:
                k = (ns, peek)
                if k in self._peeking or k in reads_on:
                    continue
                u = _Upstream((Op.WAIT, (peek,)), cid_of(ns), None, len(pending))
                u.wkey = k
                u.watchers = []
                u.fetch = PEEKS
                self._peeking[k] = u
                f = folds.get((_PEEK, ns))
                if f is not None and len(f.members or ()) < MAX_FOLD:
                    f.members = f.members or []
                    f.members.append(u)
                else:
                    folds[(_PEEK, ns)] = u
                    ops.append(u)
        answered_at_once = 0
        sent = len(ops)
        for u in ops:
            if u.members or u.fetch:  # one WAITS (WATCHES) entry: request ids rid, rid + 1, ... in key order
                members = u.members or ()
                u.rid = self._new_id()
                self._inflight[u.rid] = u
                for m in members:
                    m.rid = self._new_id()
                    self._inflight[m.rid] = m
                kind = u.fetch or WAITS
                entries.append(entry_waits(u.cid, u.rid, [u.req[1][0]] + [m.req[1][0] for m in members], kind))
                sent += len(members)
                if u.fetch == PEEKS:
                    stats.peeks_sent += 1 + len(members)
                elif u.fetch:
                    stats.watches_sent += 1 + len(members)
                continue
            req = u.req
            if u.watchers is not None:
                u.rid = self._new_id()
                self._inflight[u.rid] = u
                if req[0] != Op.WAIT:
                    answered_at_once = u.rid
                entries.append(entry_watch(u.cid, u.rid, encode_request(req)))
                stats.watches_sent += 1
                continue
            if u.fold is not None:
                req = u.fold.request(req[0])
            elif u.deltas is not None and len(u.deltas) > 1:
                req = (Op.ADD, req[1], sum(u.deltas))
            rid = 0 if not u.waiters else self._new_id()
            if rid:
                u.rid = rid
                self._inflight[rid] = u
                if req[0] not in WAITING_OPS:
                    answered_at_once = rid
            entries.append(entry_request(u.cid, rid, encode_request(req)))
        if answered_at_once:
            self._batches_awaiting.add(answered_at_once)
        if entries and self.dead is None:
            stats.batches += 1
            stats.upstream_ops += sent
            self._send(encode_batch(entries))

    def _on_replies(self, payload: bytes) -> None:
        self.replies_received += 1
        awaiting = self._batches_awaiting
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
            answered = self._answered
            if status != OK:
                reason = data.decode(errors="replace")
                if u.wkey is not None and self._waiting_on.get(u.wkey) is u:
                    del self._waiting_on[u.wkey]
                if u.wkey is not None and self._peeking.get(u.wkey) is u:
                    del self._peeking[u.wkey]
                for w in u.waiters:
                    if u.group:
                        self._wait_of.pop(w, None)
                    answered(w)
                    w.drop(f"{Op(u.req[0]).name} failed: {reason}")  # type: ignore[attr-defined]
                continue
            if u.watchers is not None:
                self._watch_answered(u, data)
            elif u.group:
                for w in u.waiters:
                    self._wait_of.pop(w, None)
                    answered(w)
                    w.wake(data)
            elif u.fold is not None:  # a MULTI_GET: each waiter's value as a GET answer
                values = _split_values(data)
                for w, pick in zip(u.waiters, u.fold.picks):
                    answered(w)
                    w.wake(values[pick])
            elif u.deltas is not None and len(u.deltas) > 1:
                final = _i64.unpack(data)[0]
                prefix = final - sum(u.deltas)
                for w, d in zip(u.waiters, u.deltas):
                    prefix += d
                    answered(w)
                    w.wake(_i64.pack(prefix))
            else:
                for w in u.waiters:
                    answered(w)
                    w.wake(data)

    def _watch_answered(self, u: _Upstream, data: bytes) -> None:
        """A WATCH's answer: keep the state (the watch is on until invalidated), answer
        local clients with the request's answer and front-ends below with both."""
        try:
            watched, value, answer = decode_watch_answer(data)
        except ValueError as e:
            raise LinkError(str(e)) from None
        k = u.wkey
        assert k is not None
        if self._waiting_on.get(k) is u:
            del self._waiting_on[k]
        if u.fetch == PEEKS:
            if self._peeking.get(k) is u:
                del self._peeking[k]
            if not watched:  # (nothing was registered: the front-ends below will not hear of it)
                below = self._downstream.get(k)
                for watcher in u.watchers or ():
                    if below is not None and watcher in below:
                        below.remove(watcher)
                m = _TRAILING_NUMBER.search(k[1])  # past the last key (or ahead of the writers):
                if m is not None:  # read ahead less from here on
                    self._lookahead_of.pop((k[0], k[1][: m.start()]), None)
        if watched:
            if len(self._cache) >= MAX_WATCHES:
                self._cache.clear()  # (forgetting is always safe; the core's invalidations
                self._watch_of.clear()  # of forgotten watches are confirmed all the same)
            self._cache[k] = value
            self._watch_of[u.rid] = k
        below = self._downstream.get(k) if watched else None
        for w, watcher in zip(u.waiters, u.watchers):  # type: ignore[arg-type]
            if u.group:
                self._wait_of.pop(w, None)
            if watcher is None:
                self._answered(w)
                w.wake(answer)
            else:
                if watched:
                    if below is None:
                        below = self._downstream[k] = []
                    if watcher not in below:
                        below.append(watcher)
                w.wake(data)

    def _on_invalidate(self, payload: bytes) -> None:
        """The core says these watches broke: forget them, pass it on to the front-ends
        below that watch the same keys, and confirm once they have."""
        round_id, ids = decode_invalidate(payload)
        below: list[tuple[object, int]] = []
        for wid in ids:
            k = self._watch_of.pop(wid, None)
            if k is None:  # a WATCH-WAIT still waiting: its key is watched as absent
                u = self._inflight.get(wid)
                if u is None or u.wkey is None:
                    continue
                k = u.wkey
            self.stats.invalidations += 1
            self._cache.pop(k, None)
            self._waiting_on.pop(k, None)
            below += self._downstream.pop(k, ())
            if len(self._churn) > MAX_WATCHES:
                self._churn.clear()
            self._churn[k] = self._churn.get(k, 0) + 1

        def confirm() -> None:
            if self._conn is not None:
                self._conn.write(encode_count(INVALIDATED, round_id))

        if below:
            break_watches(below, confirm)
        else:
            confirm()

    def _drop_watches(self) -> None:
        """The connection is gone: answer nothing more from watches (resent answers and
        invalidations bring them back in order), and have the front-ends below drop theirs."""
        self._lease_until = 0.0
        self._cache.clear()
        self._watch_of.clear()
        self._waiting_on.clear()
        below = [w for ws in self._downstream.values() for w in ws]
        self._downstream.clear()
        if below:
            break_watches(below)


def _answer_from(op: int, value: bytes | None) -> bytes:
    """A CHECK's, GET's or WAIT's answer from a watched key's state."""
    if op == Op.GET:
        return encode_bytes(value if value is not None else b"")
    if op == Op.CHECK:
        return CHECK_READY if value is not None else CHECK_NOT_READY
    return STOP_WAITING


def _op_of(req: Request) -> int:
    """The opcode of a pending request (of the request a WATCH carries)."""
    return req[1][0] if req[0] < 0 else req[0]


def _split_values(data: bytes) -> list[bytes]:
    """A MULTI_GET answer, cut into one GET answer (u64 length + value) per key."""
    out = []
    at = 0
    while at < len(data):
        end = at + 8 + _u64.unpack_from(data, at)[0]
        out.append(data[at:end])
        at = end
    return out


class LinkView:
    """The link as seen by one front-end listener: every client in ``namespace``."""

    def __init__(self, link: LinkUpstream, namespace: bytes) -> None:
        self._link = link
        self._ns = namespace

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        return self._link.submit(req, waiter, self._ns)

    def execute_watching(self, req: Request, waiter: Waiter, watcher: tuple[object, int],
                         how: int = WATCH_READ) -> bytes | None:
        return self._link.submit_watching(req, waiter, watcher, self._ns, how)

    def forget(self, waiter: Waiter) -> None:
        self._link.forget(waiter, self._ns)


class LinkConnection(asyncio.Protocol):
    """One TCP connection of a :class:`LinkUpstream`: the handshake, then its frames."""

    def __init__(self, link: LinkUpstream) -> None:
        self._link = link
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self._transport: asyncio.Transport | None = None
        self._client_nonce = b""
        self._server_nonce = b""
        self._welcomed = False  # the store host proved it knows the token
        self._unacked_in = 0
        self._pings: deque[float] = deque()  # when each ACK not yet answered by a PONG left
        self.established: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.established.add_done_callback(_retrieve)  # an abandoned attempt may fail later
        self.last_rx = monotonic()  # (not the loop's clock: no getpid() per read)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(bytes([LINK_MAGIC]))

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def ack(self, after: bytes = b"") -> None:
        """Send an ACK (the heartbeat; its PONG renews the watch lease), after ``after``
        in the same write."""
        self._unacked_in = 0
        self._pings.append(monotonic())
        self.write(after + encode_count(ACK, self._link.replies_received))

    def data_received(self, data: bytes) -> None:
        self.last_rx = monotonic()  # (not the loop's clock: no getpid() per read)
        link = self._link
        try:
            for ftype, payload in self._decoder.feed(data):
                if ftype == REPLIES and self.established.done():
                    link._on_replies(payload)
                    self._unacked_in += 1
                    if self._unacked_in >= link.config.ack_every:
                        self.ack()
                elif ftype == INVALIDATE and self.established.done():
                    link.replies_received += 1  # (numbered with the REPLIES frames)
                    link._on_invalidate(payload)
                    self._unacked_in += 1
                    if self._unacked_in >= link.config.ack_every:
                        self.ack()
                elif ftype == PONG and self.established.done():
                    received, lease = decode_pong(payload)
                    link._outbox.ack(received)
                    if self._pings:  # the core heard from us when this ACK arrived
                        sent = self._pings.popleft()
                        if link._conn is self:
                            link._lease_until = max(link._lease_until, sent + lease)
                elif ftype == ACK and self.established.done():
                    link._outbox.ack(decode_count(payload))
                elif ftype == HELLO and not self._client_nonce:
                    # AUTH, SESSION and the first ACK (its PONG starts the watch lease)
                    # in one write, not one round trip each: the store host reads
                    # them in one wake-up. The session id goes out before the host
                    # proved it knows the token, which gives a fake host nothing: it
                    # cannot resume the session without the token.
                    self._server_nonce = payload[2:]
                    frame, self._client_nonce = auth.answer_hello(link._token, payload)
                    self.ack(frame + encode_session(link.session_id, not link._opened, link.replies_received))
                elif ftype == WELCOME and self._client_nonce and not self._welcomed:
                    auth.check_welcome(link._token, self._server_nonce, self._client_nonce, payload)
                    self._welcomed = True
                    self._decoder.max_frame = DEFAULT_MAX_FRAME
                elif ftype == RESUMED and self._welcomed and not self.established.done():
                    link._established(self, decode_count(payload))
                    self.established.set_result(None)
                elif ftype == ERROR:
                    raise LinkError("the store host refused the link: " + payload.decode(errors="replace"))
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
        except LinkError as e:
            if not self.established.done():
                self.established.set_exception(e)
                self.abort(str(e))
            else:  # the session is unusable: our state and the core's disagree
                link._die(str(e))

    def abort(self, reason: str) -> None:
        if self._transport is not None and not self._transport.is_closing():
            log.warning("dropping the link connection: %s", reason)
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"link to the store host lost ({exc or 'closed by the peer'})"
        if not self.established.done():
            self.established.set_exception(ConnectionError(reason))
        self._link._connection_lost(self, reason)


def _retrieve(f: asyncio.Future[None]) -> None:
    if not f.cancelled():
        f.exception()


async def _open(link: LinkUpstream, timeout: float) -> None:
    """One attempt: connect, authenticate, open or resume the session. Raises OSError,
    TimeoutError, or LinkError when the store host refuses."""
    assert link.address is not None
    loop = asyncio.get_running_loop()
    transport, conn = await asyncio.wait_for(
        loop.create_connection(link.connection, *link.address), timeout)
    try:
        await asyncio.wait_for(asyncio.shield(conn.established), timeout)
    except BaseException:
        transport.abort()
        raise


async def connect_link(host: str, port: int, token: bytes, on_lost: Callable[[str], None],
                       timeout: float = 60.0, config: LinkConfig | None = None) -> LinkUpstream:
    """Connect and open a session, retrying while the store host is not up yet (backoff
    0.1 s to 2 s). Raises LinkError (refused, wrong token, version) or TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    link = LinkUpstream(token, on_lost, config, (host, port))
    delay = 0.1
    while True:
        try:
            await _open(link, max(deadline - loop.time(), 1.0))
            return link
        except (OSError, asyncio.TimeoutError) as e:
            if loop.time() + delay > deadline:
                raise TimeoutError(f"cannot connect to the store host {host}:{port}: {e}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
