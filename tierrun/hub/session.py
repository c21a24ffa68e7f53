"""The store host's side of one link session, independent of its connections: its
link clients (a namespace each), their pending waits, and the execution of its BATCH
frames. A batch is executed atomically and in order (the core is single-threaded and
the whole batch runs in one callback). The answers of the batches of one read leave in
one REPLIES frame (several, past a frame's size) at the end of that read, with any
deferred answers (WAIT, BARRIER) of the link woken meanwhile; deferred answers woken by
other links' batches leave together at the end of the loop iteration: one frame per
link, however many waiters a write released.

A request entry past the store's limits fails its client(s) alone (their front-end closes
them, as torch's server closes such a client; a write with no answer is dropped with a
log line: front-ends plan with the store's limits, so only a front-end that does not
sends one); a malformed batch ends the session. So does an answer that would make the
store host hold too much for the node (:meth:`Session.vet`): answers sent and not
acknowledged, queued or held by an invalidation round count, against 7/8 of the link's
resend buffer, so the node's link never overflows it (a lost node) because a client
asked for too much.

On a relaying proxy (its upstream a link) a write with no answer may be refused later,
upstream: it waits under a :class:`WriteTicket` that answers its request id FAILED
then, so the front-end below closes its clients; and while the upstream link has no
room for writes, the session's connection is not read (:meth:`Session.relayed_writes`).

An AFTER entry makes the request after it depend on a write the front-end sent before
(``tier.writes``): here, if that write was refused, the request is answered FAILED and
not run; on a relaying proxy, whose upstream decides later, the request goes on behind
the relayed write (its waiter's ``after``), and the proxy's own link sends an AFTER
entry before it in turn. Each session keeps its refused writes until the front-end has
acknowledged the REPLIES frame that carried their FAILED (it names them REFUSED from
then on: ``tier.writes``), the latest ``KEPT`` at most, and its relayed writes until
they land upstream (``WriteTicket.landed``).

A relaying proxy answers some requests itself (from its watches; refused there) and
may answer one ahead of a write it relayed earlier for the same front-end: while that
write has not landed upstream (or its refusal follows in the same frame), such an
answer is marked UNORDERED (:meth:`Session.ordering`), so the front-end below does not
take it to mean that write landed (``tier.writes``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from itertools import islice
from time import monotonic
from typing import Protocol

from ..core import StoreCore, StoreError
from ..core.watch_state import FETCH, FETCH_AFTER_WRITES, PEEK, WATCH_READ
from ..frontend import Upstream
from ..frontend.namespace import NamespacedUpstream
from ..link.config import LinkConfig
from ..link.frames import (
    AFTER, CANCEL, FAILED, FETCHES, OK, OPEN, PEEKS, REFUSED, REQUEST, UNORDERED, WAITS, WATCH, WATCHES, WILL_NAMESPACE,
    LinkError, decode_batch, decode_keys, replies_frames,
)
from ..link.session import Heartbeat, Ledger
from ..protocol import LimitExceeded, Op, Request
from ..protocol.limits import Limits
from ..protocol.parser import decode_request
from ..protocol.opcodes import NO_REPLY_OPS, WATCHABLE_OPS
from .reply_gate import ReplyGate
from .waiters import KEPT, OWN_WAITER_OPS, Behind, RemoteClient, Ticket, WriteTicket, waiter_for
from .wills import Will, WillClient, Wills

log = logging.getLogger("tierrun.store")

MAX_SHARED_NAMESPACES = 1024
#: Answers up to this size always go: a node's counters and WAITs must never be refused.
SMALL_ANSWER = 64 * 1024


class Host(Protocol):
    """What a session needs of the link server that keeps it."""

    config: LinkConfig
    limits: Limits
    max_frame: int
    gate: ReplyGate
    stats: LinkStats
    sessions: dict[bytes, Session]
    upstream_for: Callable[[bytes], Upstream]
    wills: Wills

    def expire(self, session: Session, reason: str, quiet: bool = False) -> None: ...

    def fail(self, session: Session, error: BaseException) -> None: ...


class Connection(Protocol):
    """What a session needs of its current connection."""

    paused: bool  # (not read on purpose)
    heartbeat: Heartbeat  # (its last_rx: when a frame was last read)

    def write(self, data: bytes) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class LinkStats:
    def __init__(self) -> None:
        self.links = 0  # connections with a live session now
        self.links_accepted = 0  # sessions opened
        self.lookups = 0  # LOOKUPs answered (connections with no session)
        self.link_resumes = 0
        self.sessions_expired = 0
        self.batches = 0
        self.operations = 0


class Session:
    """One front-end's state at the core, independent of its current connection."""

    def __init__(self, server: Host, sid: bytes, peer: str) -> None:
        self.server = server
        self.sid = sid
        self.peer = peer
        self.clients: dict[int, RemoteClient] = {}
        self.ledger = Ledger(server.config.max_unacked_bytes, server.config.ack_every)  # REPLIES out, BATCH in
        self.conn: Connection | None = None
        self.expiry: asyncio.TimerHandle | None = None
        self._wakes: list[tuple[int, int, bytes]] = []  # answers for the next REPLIES frame
        self._flush_due = False  # a _flush_wakes is scheduled
        self._loop = asyncio.get_running_loop()
        self.last_ping_rx = monotonic()  # when its last ACK arrived: its lease began before
        self.held = 0  # bytes of its frames held by the reply gate
        self.refused_count = 0  # requests refused, and answers refused for room (vet)
        # (OrderedDicts: dropping the oldest is O(1), a dict's scans what it deleted before)
        self.refused_writes: OrderedDict[int, None] = OrderedDict()  # its refused requests not yet acknowledged
        self._refusals: list[int] = []  # those whose FAILED is not in a REPLIES frame yet
        self._refusals_sent: deque[tuple[int, list[int]]] = deque()  # (a frame's number, the refusals it carried)
        #: Resumed on a new connection: the front-end's first ACK there (its handshake's)
        #: comes before it resends the BATCH frames we lacked, which it encoded before
        #: reading our FAILEDs (naming refused ids as they are): it forgets nothing.
        self.resumed = False
        #: A relaying proxy's relayed writes not yet known to have landed upstream, oldest
        #: (lowest request id) first; and those refused since the last REPLIES frame.
        self.relayed: OrderedDict[int, WriteTicket] = OrderedDict()
        self.relayed_refused: list[int] = []
        #: Its node's will (``wills``), and when its last connection was lost (monotonic).
        self.will: Will | None = None
        self.lost_at = 0.0

    def last_heard(self, now: float) -> float:
        """When a frame of it was last read (monotonic; ``now`` while its connection is
        not read on purpose), or its connection lost."""
        conn = self.conn
        if conn is None:
            return self.lost_at
        return now if conn.paused else conn.heartbeat.last_rx

    def refused(self, rid: int) -> None:
        """Request ``rid`` (a write with no answer, or one not run) was refused: a request
        AFTER it is not run. O(1)."""
        if rid:
            writes = self.refused_writes
            writes[rid] = None
            self._refusals.append(rid)
            if len(writes) > KEPT:
                writes.popitem(last=False)
            if self.relayed:
                self.relayed.pop(rid, None)

    def acknowledged(self) -> None:
        """The front-end acknowledged REPLIES frames (it has read them): the refused
        requests whose FAILED they carried are forgotten (an AFTER entry names them
        REFUSED from then on). O(refusals forgotten)."""
        if self.resumed:
            self.resumed = False
            return
        upto, sent, writes = self.ledger.outbox.acked, self._refusals_sent, self.refused_writes
        while sent and sent[0][0] <= upto:
            for rid in sent.popleft()[1]:
                writes.pop(rid, None)

    def take_refusals(self) -> list[int] | None:
        """The refusals the next REPLIES frame carries the FAILED of (None: none)."""
        refusals = self._refusals
        if not refusals:
            return None
        self._refusals = []
        return refusals

    def relayed_write_refused(self, rid: int, reason: bytes) -> None:
        """A write relayed upstream (``WriteTicket``) was refused there: answer it
        FAILED; answers queued before it for later requests go UNORDERED. O(1)."""
        self.refused(rid)
        self.relayed_refused.append(rid)
        self.queue_reply(rid, FAILED, reason)

    def ordering(self, replies: list[tuple[int, int, bytes]]) -> None:
        """A relaying proxy's: mark UNORDERED, in place, each answer of ``replies`` (the
        next REPLIES frame's, in order) whose request came after a relayed write not
        yet known to have landed upstream, or refused further on in ``replies`` (its
        FAILED would come after it). O(answers); not called while neither exists."""
        floor = next(iter(self.relayed), 1 << 64)
        refused = set(self.relayed_refused)
        self.relayed_refused.clear()
        for i in range(len(replies) - 1, -1, -1):
            rid, status, data = replies[i]
            if rid > floor:
                replies[i] = (rid, status | UNORDERED, data)
            if rid in refused and rid < floor:
                floor = rid

    def _after(self, gate: int, client: RemoteClient, rid: int, req: Request, replies: list) -> object:
        """A request AFTER write ``gate``: None if it must not run (answered FAILED here),
        else its waiter (behind the relayed write, on a relaying proxy; a relayed write's
        ticket is registered, as by ``waiter_for``). O(1)."""
        ticket = self.relayed.get(gate) if client.relays_writes else None
        if ticket is None and (gate in self.refused_writes or gate == REFUSED):
            self.refused(rid)  # (a write behind it is refused in turn)
            if rid:
                replies.append((rid, FAILED, b"not run: an earlier write of its client was refused"))
            return None
        waiter = client if req[0] not in OWN_WAITER_OPS else waiter_for(client, req, rid)
        if ticket is not None:
            if type(waiter) is WriteTicket or type(waiter) is Ticket:
                waiter.after = ticket
            elif waiter is client:
                return Behind(client, ticket)
        return waiter

    def execute(self, payload: bytes) -> None:
        """Run one BATCH. Raises LinkError/ProtocolError on a malformed one."""
        stats = self.server.stats
        stats.batches += 1
        # (answers go straight to the next REPLIES frame: an invalidation round started
        # by a request of this batch sends what came before it first)
        replies = self._wakes
        clients = self.clients
        limits = self.server.limits
        relayed: RemoteClient | None = None  # (a client of this batch whose write was relayed upstream)
        gate = gate_cid = 0  # (an AFTER entry's: the write the next request must follow, its client)
        for kind, cid, rid, data in decode_batch(payload):
            if gate and (kind != REQUEST or cid != gate_cid):
                raise LinkError("an AFTER entry not followed by a request of its client")
            if kind == REQUEST:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                try:
                    req = decode_request(data, limits)
                except LimitExceeded as err:  # (refused, as torch's server would: that client only)
                    self._refuse(rid, err, replies)
                    gate = 0
                    continue
                stats.operations += 1
                if gate:
                    waiter = self._after(gate, client, rid, req, replies)
                    gate = 0
                    if waiter is None:
                        continue
                else:
                    waiter = client if req[0] not in OWN_WAITER_OPS else waiter_for(client, req, rid)
                try:
                    reply = client.upstream.execute(req, waiter)
                except StoreError as err:
                    if req[0] in NO_REPLY_OPS:
                        self.refused(rid)
                    replies.append((rid, FAILED, self.failed(req, err)))
                    continue
                if reply is not None:  # (vet inlined for small answers: most of them)
                    replies.append((rid, OK, reply) if len(reply) <= SMALL_ANSWER else (rid, *self.vet(reply)))
                elif type(waiter) is Ticket:
                    client.tickets[rid] = waiter
                elif req[0] not in NO_REPLY_OPS:
                    client.pending.append(rid)
                elif client.relays_writes:
                    relayed = client
            elif kind == WATCH:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                try:
                    req = decode_request(data, limits)
                except LimitExceeded as err:
                    self._refuse(rid, err, replies)
                    continue
                if req[0] not in WATCHABLE_OPS or (req[0] != Op.GET and len(req[1]) != 1):
                    raise LinkError(f"{Op(req[0]).name} cannot watch (only one-key CHECK, GET, WAIT)")
                stats.operations += 1
                self._execute_watching(client, rid, req, WATCH_READ, replies)
            elif kind == OPEN:
                if cid in clients:
                    raise LinkError(f"client {cid} opened twice")
                server = self.server
                clients[cid] = RemoteClient(self, WillClient(self, server.wills) if data == WILL_NAMESPACE
                                            else server.upstream_for(data))
            elif kind == WAITS:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                keys = decode_keys(data, limits.max_keys_per_request, limits.max_key_bytes)
                stats.operations += len(keys)
                for r, key in enumerate(keys, rid):
                    ticket = Ticket(client, r)
                    try:  # (refused: past the store's budget, which counts keys waited for)
                        reply = client.upstream.execute((Op.WAIT, (key,)), ticket)
                    except StoreError as err:
                        replies.append((r, FAILED, self.failed((Op.WAIT, (key,)), err)))
                        continue
                    if reply is not None:
                        replies.append((r, *self.vet(reply)))
                    else:
                        client.tickets[r] = ticket
            elif kind == WATCHES or kind == FETCHES or kind == PEEKS:
                # (WAITs that fetch: their keys are watched once there; peeks: see frames.py)
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                keys = decode_keys(data, limits.max_keys_per_request, limits.max_key_bytes)
                stats.operations += len(keys)
                how = FETCH if kind == WATCHES else FETCH_AFTER_WRITES if kind == FETCHES else PEEK
                for r, key in enumerate(keys, rid):
                    self._execute_watching(client, r, (Op.WAIT, (key,)), how, replies)
            elif kind == CANCEL:
                client = clients.get(cid)
                ticket = None if client is None else client.tickets.pop(rid, None)
                if ticket is not None:
                    client.upstream.forget(ticket)  # type: ignore[union-attr]
            elif kind == AFTER:
                gate, gate_cid = rid, cid
        if gate:
            raise LinkError("an AFTER entry not followed by a request of its client")
        if relayed is not None:
            self.relayed_writes(relayed)

    def relayed_writes(self, client: RemoteClient) -> None:
        """``client``'s writes were relayed upstream (this is a relaying proxy): if its
        link has no room for more (``tier.connection.SessionEnd.write_room``), read
        nothing more of this session's connection until it has (:meth:`room_again`),
        as a front-end pauses a local client. The front-end below keeps its writes
        meanwhile (unacknowledged, its own write room bounds them), so a node below
        never pushes this proxy's link past its bound of unacknowledged bytes: at most
        one frame of each linked front-end beyond the room. O(1)."""
        if not client.upstream.write_room(self) and self.conn is not None:  # type: ignore[attr-defined]
            self.conn.pause_reading()

    def room_again(self) -> None:
        """The upstream link has room for writes again (or is gone): read on."""
        if self.conn is not None:
            self.conn.resume_reading()

    def _refuse(self, rid: int, err: LimitExceeded, replies: list[tuple[int, int, bytes]]) -> None:
        """A request the store refuses (past a limit): its client is answered FAILED
        (its front-end closes it, as torch's server closes such a client); a request
        with no answer (rid 0) is dropped with a log line. The link stays up."""
        if rid:
            self.refused(rid)
            replies.append((rid, FAILED, f"invalid request: {err}".encode()))
        else:
            log.warning("link from %s: dropped a request with no answer: %s", self.peer, err)

    def _execute_watching(self, client: RemoteClient, rid: int, req: Request, how: int,
                          replies: list[tuple[int, int, bytes]]) -> None:
        """A read that watches its key (``how``: see ``core.watch_state``): its answer (or
        error) goes to ``replies``, or its ticket waits for the answer."""
        ticket = Ticket(client, rid)
        try:
            reply = client.upstream.execute_watching(req, ticket, (self, rid), how)
        except StoreError as err:
            replies.append((rid, FAILED, self.failed(req, err)))
            return
        if reply is not None:
            replies.append((rid, *self.vet(reply)))
        else:
            client.tickets[rid] = ticket

    def send(self, data: bytes, refusals: list[int] | None = None) -> None:
        """Number, keep and (if connected) write one REPLIES frame (that carries the
        FAILED of ``refusals``)."""
        try:
            self.ledger.outbox.add(data)  # (ledger.sent, inlined)
        except LinkError as e:
            self.server.expire(self, str(e))
            return
        if refusals:
            self._refusals_sent.append((self.ledger.outbox.sent, refusals))
        if self.conn is not None:
            self.conn.write(data)

    def failed(self, req: Request, err: StoreError) -> bytes:
        """A request the store refused (its front-end closes its client): logged (the
        1st, 2nd, 4th, 8th... of the session: a hog cannot flood the log); the reason."""
        self.refused_count += 1
        if self.refused_count & (self.refused_count - 1) == 0:
            log.warning("link from %s: %s failed (%d refused so far): %s", self.peer, Op(req[0]).name,
                        self.refused_count, err)
        return str(err).encode()

    def vet(self, answer: bytes) -> tuple[int, bytes]:
        """``(OK, answer)``, or ``(FAILED, why)`` for an answer larger than
        ``SMALL_ANSWER`` that would make this store host hold more than 7/8 of the
        link's resend buffer for the node: its client is closed (by its front-end), the
        link stays up. O(1) for a small answer; O(answers queued) for a large one."""
        if len(answer) <= SMALL_ANSWER:
            return OK, answer
        owed = self.ledger.outbox.bytes + self.held + sum(len(w[2]) for w in islice(self._wakes, 4096))
        limit = self.server.config.max_unacked_bytes * 7 // 8  # (the rest: room for small answers)
        if owed + len(answer) <= limit:
            return OK, answer
        self.refused_count += 1
        why = (f"the store host holds {owed:,} bytes of answers for the node at {self.peer} not yet acknowledged; "
               f"with this one ({len(answer):,} bytes) it would pass its limit of {limit:,}: the node reads its "
               "link too slowly for what its clients ask")
        if self.refused_count & (self.refused_count - 1) == 0:  # (the 1st, 2nd, 4th, 8th... : a hog cannot flood the log)
            log.warning("link from %s: answer refused (%d so far): %s", self.peer, self.refused_count, why)
        return FAILED, why.encode()

    def emit(self, frame: bytes, refusals: list[int] | None = None) -> None:
        """Send a REPLIES frame through the reply gate (held while a round runs)."""
        gate = self.server.gate
        if gate.closed:
            self.held += len(frame)
            gate.emit(self._release if refusals is None else partial(self._release, refusals=refusals), frame)
        else:
            self.send(frame, refusals)

    def _release(self, frame: bytes, refusals: list[int] | None = None) -> None:
        self.held -= len(frame)
        self.send(frame, refusals)

    def queue_reply(self, rid: int, status: int, reply: bytes) -> None:
        """A deferred answer: those queued in one loop iteration leave in one frame."""
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush_wakes)
        if status == OK:
            status, reply = self.vet(reply)
        self._wakes.append((rid, status, reply))

    def _flush_wakes(self) -> None:
        self._flush_due = False
        wakes = self._wakes
        if wakes:
            if self.relayed or self.relayed_refused:
                self.ordering(wakes)
            try:
                frames = replies_frames(wakes, self.server.max_frame)
            except Exception as e:  # (no memory for the frame: fail-stop, never a lost answer)
                wakes.clear()
                self.server.fail(self, e)
                return
            wakes.clear()  # (in place: a batch being executed appends to it)
            refusals = self.take_refusals()  # (their FAILEDs are in the last frame at the latest)
            if self.server.sessions.get(self.sid) is self:
                for frame in frames[:-1]:
                    self.emit(frame)
                self.emit(frames[-1], refusals)

    def flush_answers(self) -> None:
        """Send the answers queued so far now (an invalidation round must follow them)."""
        self._flush_wakes()

    def drop_clients(self) -> None:
        for client in self.clients.values():
            client.forget()
        self.clients.clear()


def core_upstreams(core: StoreCore) -> Callable[[bytes], Upstream]:
    """Namespace -> the core as a front-end's clients in it see it. One wrapper per
    namespace, shared by its clients (a job has one namespace per rendezvous round; past
    ``MAX_SHARED_NAMESPACES`` a peer's new namespaces get wrappers of their own, so
    OPENs cannot grow the table without bound)."""
    upstreams: dict[bytes, Upstream] = {b"": core}

    def upstream_for(ns: bytes) -> Upstream:
        upstream = upstreams.get(ns)
        if upstream is None:
            upstream = NamespacedUpstream(core, ns + b"/")
            if len(upstreams) < MAX_SHARED_NAMESPACES:
                upstreams[ns] = upstream
        return upstream

    return upstream_for


