"""The core's end of links: authenticates front-ends, keeps their sessions, executes
their batches.

A batch is executed atomically and in order (the core is single-threaded and the whole
batch runs in one callback). The answers of the batches of one read leave in one REPLIES
frame at the end of that read, with any deferred answers (WAIT, BARRIER) of the link
woken meanwhile, in the same write as whatever else the read has this connection send
(the PONG of a heartbeat that rode with a batch); deferred answers woken by other links'
batches leave together at the end of the loop iteration: one frame per link, however
many waiters a write released.

Watches (a WATCH entry: ``StoreCore.execute_watching``) are handed out per session;
when a watched key changes, the :class:`ReplyGate` runs an invalidation round before
anyone hears of the change. Each ACK of a front-end is answered with a PONG, through
the gate, granting it a watch lease.

A *session* outlives its connection: its clients, their pending waits and the REPLIES
frames the front-end has not acknowledged stay here for ``LinkConfig.grace`` seconds, so
a front-end that reconnects resumes with nothing lost, and since BATCH frames are
counted, nothing it resends is executed twice. A connection silent for
``heartbeat_timeout`` is closed, which starts the same grace period.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Callable
from time import monotonic

from ..core import StoreCore, StoreError
from ..core.watch_state import FETCH, FETCH_AFTER_WRITES, PEEK, WATCH_READ
from ..frontend import Upstream
from ..frontend.namespace import NamespacedUpstream
from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    ACK, AUTH, BATCH, CANCEL, DEFAULT_MAX_FRAME, ERROR, FAILED, HANDSHAKE_MAX_FRAME, INVALIDATED, LINK_MAGIC, OK,
    FETCHES, OPEN, PEEKS, REQUEST, RESUMED, SESSION, WAITS, WATCH, WATCH_LEASE, WATCHES, FrameDecoder, LinkError,
    decode_batch, decode_count, decode_keys, decode_session, encode_count, encode_pong, encode_reply,
    lone_request, replies_frames,
)
from ..link.outbox import Outbox
from ..link.reply_gate import ReplyGate
from ..protocol import Op, ProtocolError, Request
from ..protocol.limits import Limits
from ..protocol.parser import decode_request
from ..protocol.opcodes import NO_REPLY_OPS, WAITING_OPS, WATCHABLE_OPS

log = logging.getLogger("tierrun.store")

MAX_SHARED_NAMESPACES = 1024


_LONE_SIZE = lone_request.size  # (a lone request's bytes start here)


class RemoteClient:
    """A link client (one namespace of a front-end), as its upstream sees it: the waiter
    of its deferred answers. A WAIT or BARRIER waits under a :class:`Ticket` of its
    own, so any number may wait at once; a front-end's link upstream (a stacked
    front-end) also defers every other answer, delivered in request order. It
    ``relay``\ s: its requests are a whole subtree's (see ``LinkUpstream._contended``)."""

    __slots__ = ("session", "upstream", "pending", "tickets")
    relay = True

    def __init__(self, session: Session, upstream: Upstream) -> None:
        self.session = session
        self.upstream = upstream
        self.pending: deque[int] = deque()  # request ids of deferred answers, in order
        self.tickets: dict[int, Ticket] = {}  # request id -> its waiting WAIT/BARRIER

    def wake(self, reply: bytes) -> None:
        self.session.queue_reply(self.pending.popleft(), OK, reply)

    def drop(self, reason: str) -> None:
        """The request failed upstream (or the upstream link is gone)."""
        if self.pending:
            self.session.queue_reply(self.pending.popleft(), FAILED, reason.encode())

    def forget(self) -> None:
        """The session is gone: drop what waits upstream for it."""
        tickets, self.tickets = self.tickets, {}
        for ticket in tickets.values():
            self.upstream.forget(ticket)
        self.upstream.forget(self)


class Ticket:
    """One waiting WAIT or BARRIER of a remote client: answered by its request id."""

    __slots__ = ("client", "rid")

    def __init__(self, client: RemoteClient, rid: int) -> None:
        self.client = client
        self.rid = rid

    def wake(self, reply: bytes) -> None:
        if self.client.tickets.pop(self.rid, None) is not None:
            self.client.session.queue_reply(self.rid, OK, reply)

    def drop(self, reason: str) -> None:
        if self.client.tickets.pop(self.rid, None) is not None:
            self.client.session.queue_reply(self.rid, FAILED, reason.encode())


class LinkStats:
    def __init__(self) -> None:
        self.links = 0  # connections with a live session now
        self.links_accepted = 0  # sessions opened
        self.link_resumes = 0
        self.sessions_expired = 0
        self.batches = 0
        self.operations = 0


class Session:
    """One front-end's state at the core, independent of its current connection."""

    def __init__(self, server: LinkServer, sid: bytes, peer: str) -> None:
        self.server = server
        self.sid = sid
        self.peer = peer
        self.clients: dict[int, RemoteClient] = {}
        self.received = 0  # BATCH frames executed
        self.outbox = Outbox(server.config.max_unacked_bytes)
        self.conn: LinkServerConnection | None = None
        self.expiry: asyncio.TimerHandle | None = None
        self._wakes: list[tuple[int, int, bytes]] = []  # answers for the next REPLIES frame
        self._flush_due = False  # a _flush_wakes is scheduled
        self._loop = asyncio.get_running_loop()
        self.last_ping_rx = monotonic()  # when its last ACK arrived: its lease began before

    def execute(self, payload: bytes) -> None:
        """Run one BATCH. Raises LinkError/ProtocolError on a malformed one."""
        stats = self.server.stats
        stats.batches += 1
        self.received += 1
        # (answers go straight to the next REPLIES frame: an invalidation round started
        # by a request of this batch sends what came before it first)
        replies = self._wakes
        clients = self.clients
        limits = self.server.limits
        for kind, cid, rid, data in decode_batch(payload):
            if kind == REQUEST:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                try:
                    req = decode_request(data, limits)
                except ProtocolError as err:  # (refused, as torch's server would: that client only)
                    self._refuse(rid, err, replies)
                    continue
                stats.operations += 1
                waiter = client if req[0] not in WAITING_OPS else Ticket(client, rid)  # (one each)
                try:
                    reply = client.upstream.execute(req, waiter)
                except StoreError as err:
                    replies.append((rid, FAILED, str(err).encode()))
                    continue
                if reply is not None:
                    replies.append((rid, OK, reply))
                elif waiter is not client:
                    client.tickets[rid] = waiter  # type: ignore[assignment]
                elif req[0] not in NO_REPLY_OPS:
                    client.pending.append(rid)
            elif kind == WATCH:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                try:
                    req = decode_request(data, limits)
                except ProtocolError as err:
                    self._refuse(rid, err, replies)
                    continue
                if req[0] not in WATCHABLE_OPS or (req[0] != Op.GET and len(req[1]) != 1):
                    raise LinkError(f"{Op(req[0]).name} cannot watch (only one-key CHECK, GET, WAIT)")
                stats.operations += 1
                self._execute_watching(client, rid, req, WATCH_READ, replies)
            elif kind == OPEN:
                if cid in clients:
                    raise LinkError(f"client {cid} opened twice")
                clients[cid] = RemoteClient(self, self.server.upstream_for(data))
            elif kind == WAITS:
                client = clients.get(cid)
                if client is None:
                    raise LinkError(f"request for unknown client {cid}")
                keys = decode_keys(data, limits.max_keys_per_request, limits.max_key_bytes)
                stats.operations += len(keys)
                for r, key in enumerate(keys, rid):
                    ticket = Ticket(client, r)
                    reply = client.upstream.execute((Op.WAIT, (key,)), ticket)
                    if reply is not None:
                        replies.append((r, OK, reply))
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

    def _refuse(self, rid: int, err: ProtocolError, replies: list[tuple[int, int, bytes]]) -> None:
        """A request the store refuses (past a limit): its client is answered FAILED
        (its front-end closes it, as torch's server closes such a client); a request
        with no answer (rid 0) is dropped with a log line. The link stays up."""
        if rid:
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
            replies.append((rid, FAILED, str(err).encode()))
            return
        if reply is not None:
            replies.append((rid, OK, reply))
        else:
            client.tickets[rid] = ticket

    def send(self, data: bytes) -> None:
        """Number, keep and (if connected) write one REPLIES frame."""
        try:
            self.outbox.add(data)
        except LinkError as e:
            self.server.expire(self, str(e))
            return
        if self.conn is not None:
            self.conn.write(data)

    def queue_reply(self, rid: int, status: int, reply: bytes) -> None:
        """A deferred answer: those queued in one loop iteration leave in one frame."""
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush_wakes)
        self._wakes.append((rid, status, reply))

    def _flush_wakes(self) -> None:
        self._flush_due = False
        wakes = self._wakes
        if wakes:
            try:
                frames = replies_frames(wakes, self.server.max_frame)
            except Exception as e:  # (no memory for the frame: fail-stop, never a lost answer)
                wakes.clear()
                self.server.fail(self, e)
                return
            wakes.clear()  # (in place: a batch being executed appends to it)
            if self.server.sessions.get(self.sid) is self:
                for frame in frames:
                    self.server.gate.emit(self.send, frame)

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


class LinkServer:
    """Every link and session of one upstream: the core (the store host), or a
    front-end's own link upstream (a front-end that takes other front-ends' links)."""

    def __init__(self, upstream_for: Callable[[bytes], Upstream], token: bytes | None,
                 config: LinkConfig | None = None, lease: Callable[[], float] = lambda: WATCH_LEASE,
                 gate: ReplyGate | None = None,
                 drop_watches: Callable[[Session], None] = lambda session: None,
                 limits: Limits | None = None) -> None:
        """``upstream_for(namespace)``: where a link client's requests go; ``lease()``:
        how long (seconds, at most WATCH_LEASE) a front-end may answer from its
        watches past the ACK being answered (a stacked front-end grants no longer
        than its own lease upstream still runs); ``gate``: the invalidation rounds of
        the store (shared by every LinkServer of one core); ``drop_watches(session)``:
        called when a session ends, to free what its watches hold upstream;
        ``limits``: what one request may hold (the store's, as its clients get)."""
        self.upstream_for = upstream_for
        self.token = token
        self.config = config or LinkConfig()
        self.lease = lease
        self.gate = gate or ReplyGate()
        self.drop_watches = drop_watches
        self.limits = limits or Limits()
        self.stats = LinkStats()
        self.sessions: dict[bytes, Session] = {}
        self.connections: set[LinkServerConnection] = set()
        #: Largest frame sent (the front-ends' decoders accept no larger).
        self.max_frame = DEFAULT_MAX_FRAME
        self._watchdog: asyncio.TimerHandle | None = None

    def accept(self, peer: str = "", initial: bytes = b"", token: bytes | None = None,
               resumable: bool = True, sniffed: bool = True) -> LinkServerConnection:
        """The protocol for a new link connection. ``peer``: its name in logs (default:
        its address); ``initial``: bytes already read from it (after the first byte);
        ``token``: the one this connection must prove, instead of the job token (the
        store host's own front-end processes have their own); ``resumable=False``: its
        session ends with the connection (no grace period); ``sniffed=False``: the link's
        first byte is still to come (a listener that takes only links)."""
        if self._watchdog is None:
            self._schedule_watchdog(self.config.heartbeat_timeout)
        return LinkServerConnection(self, peer, initial, token or self.token, resumable, sniffed)

    def take(self, transport: asyncio.Transport, peer: str, initial: bytes) -> None:
        """Adopt a connection a front-end accepted and recognised as a link."""
        conn = self.accept(peer, initial)
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def _schedule_watchdog(self, delay: float) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(delay, self._check_heartbeats)

    def _check_heartbeats(self) -> None:
        """Close connections silent for longer than the heartbeat timeout; come back when
        the least recently heard of the others would be (not every interval: an idle
        store host wakes for its links' heartbeats only). O(links)."""
        now = monotonic()
        timeout = self.config.heartbeat_timeout
        deadline = now - timeout
        oldest = now
        for conn in list(self.connections):
            if conn.last_rx < deadline:
                conn.abort(f"nothing heard for {timeout:g} s")
            elif conn.last_rx < oldest:
                oldest = conn.last_rx
        self._schedule_watchdog(oldest + timeout - now + 0.01)  # (>= 0.01: aborted ones are not counted)

    def attach(self, conn: LinkServerConnection, sid: bytes, fresh: bool, replies_received: int) -> Session:
        """Open or resume a session on ``conn``; write RESUMED and what the front-end
        missed. Raises LinkError if the session cannot be resumed."""
        session = self.sessions.get(sid)
        if session is None:
            if not fresh:
                raise LinkError(
                    "this store host does not know the node's link session: the store host "
                    "restarted, or the node was cut off longer than the "
                    f"{self.config.grace:g} s grace period"
                )
            session = self.sessions[sid] = Session(self, sid, conn.peer)
            self.stats.links_accepted += conn.resumable
            log.info("link from %s: new session", conn.peer)
        else:
            old = session.conn
            if old is not None:  # the front-end gave up on it before we noticed
                old.release_session()
                self.stats.links -= 1
                old.abort("replaced by a newer connection of the same session")
            if session.expiry is not None:
                session.expiry.cancel()
                session.expiry = None
            self.stats.link_resumes += 1
            log.warning("link from %s: session resumed (was %s)", conn.peer, session.peer)
        missed = session.outbox.since(replies_received)
        session.conn = conn
        session.peer = conn.peer
        self.stats.links += conn.resumable  # (node links, not the host's own front-ends)
        conn.write(encode_count(RESUMED, session.received) + b"".join(missed))
        return session

    def detach(self, session: Session) -> None:
        """Its connection is gone: keep the session for the grace period."""
        session.conn = None
        self.stats.links -= 1
        if self.sessions.get(session.sid) is session:
            grace = self.config.grace
            log.warning("link from %s lost; its session is kept for %g s", session.peer, grace)
            session.expiry = asyncio.get_running_loop().call_later(
                grace, self.expire, session, f"not resumed within {grace:g} s"
            )

    def expire(self, session: Session, reason: str, quiet: bool = False) -> None:
        """End a session: drop its clients' waits, close its connection."""
        if self.sessions.pop(session.sid, None) is None:
            return
        (log.info if quiet else log.warning)("session of %s ended: %s", session.peer, reason)
        if not quiet:
            self.stats.sessions_expired += 1
        if session.expiry is not None:
            session.expiry.cancel()
        session.drop_clients()
        self.drop_watches(session)
        session.outbox.ack(session.outbox.sent)
        if session.conn is not None:
            session.conn.abort(reason, quiet)

    def fail(self, session: Session, error: BaseException) -> None:
        """An unexpected error (a bug, no memory) while handling the session's frames:
        end it (fail-stop). Its batch may be half applied, so it must not be resumed;
        the front-end is told why and its node's agent reports it."""
        log.error("link from %s: internal error, ending its session", session.peer,
                  exc_info=(type(error), error, error.__traceback__))
        conn = session.conn
        if conn is not None:  # (closed after the ERROR frame is out: expire's abort does nothing then)
            conn.refuse(f"the store host failed handling this link's requests: {error!r}")
        self.expire(session, f"internal error: {error!r}")

    def close(self) -> None:
        """The store is stopping: drop every link."""
        self.gate.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in list(self.connections):
            conn.abort("the store is stopping")


class LinkServerConnection(asyncio.Protocol):
    """One connection from a front-end: handshake, then its session's frames."""

    def __init__(self, server: LinkServer, peer: str, initial: bytes, token: bytes | None,
                 resumable: bool, sniffed: bool) -> None:
        self._server = server
        self.peer = peer
        self._initial = initial
        self._token = token
        self.resumable = resumable
        self._first_byte = not sniffed
        #: Called once the connection is gone.
        self.on_lost: Callable[[], None] | None = None
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self._nonce = secrets.token_bytes(auth.NONCE)
        self._authenticated = False
        self._session: Session | None = None
        self._unacked_in = 0
        self._transport: asyncio.Transport | None = None
        #: While a read is handled, what it writes, sent in one write at its end.
        self._corked: list[bytes] | None = None
        self.last_rx = monotonic()  # (not the loop's clock: no getpid() per read)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        if not self.peer:
            address = transport.get_extra_info("peername")
            self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else "?"
        self._server.connections.add(self)
        transport.write(auth.hello(self._nonce))
        if self._initial:
            initial, self._initial = self._initial, b""
            self.data_received(initial)

    def write(self, data: bytes) -> None:
        if self._corked is not None:
            self._corked.append(data)
            return
        assert self._transport is not None
        if not self._transport.is_closing():
            self._transport.write(data)

    def _uncork(self) -> None:
        """Send what the read just handled wrote (a PONG and a REPLIES frame, often):
        one write, not one per frame."""
        out, self._corked = self._corked, None
        if out:
            self.write(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.last_rx = monotonic()  # (not the loop's clock: no getpid() per read)
        session = self._session
        if session is not None and not self._decoder.partial and len(data) > _LONE_SIZE and not session._wakes:
            try:
                if self._lone_request(session, data):
                    return
            except Exception as e:  # (see LinkServer.fail)
                self._server.fail(session, e)
                return
        if self._first_byte:
            self._first_byte = False
            if data[0] != LINK_MAGIC:
                self.abort("not a link")
                return
            data = data[1:]
        self._corked = []
        try:
            for ftype, payload in self._decoder.feed(data):
                session = self._session
                if session is not None and ftype == BATCH:
                    session.execute(payload)
                    self._unacked_in += 1
                    if self._unacked_in >= self._server.config.ack_every:
                        self._ack(session)
                elif session is not None and ftype == ACK:
                    session.outbox.ack(decode_count(payload))
                    session.last_ping_rx = self.last_rx
                    # the answer to the front-end's heartbeat, and its watch lease
                    gate = self._server.gate
                    if gate.closed:  # (the PONG waits: a plain ACK says we are alive)
                        self._ack(session)
                    self._unacked_in = 0
                    gate.emit(self.write, encode_pong(session.received, self._server.lease()))
                elif session is not None and ftype == INVALIDATED:
                    self._server.gate.confirmed(session, decode_count(payload))
                elif session is not None and ftype == ERROR:
                    self._server.expire(session, "the front-end closed its session", quiet=True)
                    return
                elif not self._authenticated:
                    self._authenticate(ftype, payload)
                elif session is None and ftype == SESSION:
                    self._session = self._server.attach(self, *decode_session(payload))
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
            session = self._session
            if session is not None and session._wakes:  # every answer of this read: one frame
                session.flush_answers()
        except (LinkError, ProtocolError) as e:
            log.warning("closing link from %s: %s", self.peer, e)
            assert self._transport is not None
            self._uncork()
            self.write(auth.error(str(e)))
            self._transport.close()  # after the ERROR frame is out
            if self._session is not None:  # a resent batch would fail the same way
                self._server.expire(self._session, f"protocol error: {e}")
        except Exception as e:  # a bug, or no memory: fail-stop (see LinkServer.fail)
            self._uncork()
            if self._session is not None:
                self._server.fail(self._session, e)
            else:
                log.exception("closing link from %s: internal error", self.peer)
                self.abort(f"internal error: {e!r}")
        finally:
            self._uncork()

    def _lone_request(self, session: Session, data: bytes) -> bool:
        """Handle ``data`` if it is exactly one BATCH of one request that is answered at
        once (a node's counter ADD, its SET of a record: most of a start-up's frames at
        the store host) while none of the link's answers is queued: what the general
        path does, in one call and one write, with no decoder, batch loop or answer
        queue: each call costs the store host on caches gone cold since its last frame
        (a cold replay of a 512x8 start-up's captured frames: ~10% less CPU per frame;
        live, below the wire-up benchmark's noise). False (nothing done) for anything
        else, which the general path handles, errors included."""
        length, ftype, n, kind, cid, rid, size = lone_request.unpack_from(data)
        if ftype != BATCH or n != 1 or kind != REQUEST or length + 4 != len(data) or size + _LONE_SIZE != len(data):
            return False
        client = session.clients.get(cid)
        if client is None:
            return False
        try:
            req = decode_request(data[_LONE_SIZE:], self._server.limits)
        except ProtocolError:
            return False
        if req[0] in WAITING_OPS:
            return False
        stats = self._server.stats
        stats.batches += 1
        stats.operations += 1
        session.received += 1
        try:
            reply = client.upstream.execute(req, client)
        except StoreError as err:
            frame = encode_reply(rid, FAILED, str(err).encode())
        else:
            if reply is None:
                if req[0] not in NO_REPLY_OPS:
                    client.pending.append(rid)  # (a stacked front-end's: answered later)
                frame = b""
            else:
                frame = encode_reply(rid, OK, reply)
        if frame:  # (through the gate: if the request changed a watched key, the round goes first)
            self._server.gate.emit(session.send, frame)
        self._unacked_in += 1
        if self._unacked_in >= self._server.config.ack_every:
            self._ack(session)
        return True

    def _ack(self, session: Session) -> None:
        self._unacked_in = 0
        self.write(encode_count(ACK, session.received))

    def _authenticate(self, ftype: int, payload: bytes) -> None:
        if ftype != AUTH:
            raise LinkError("expected AUTH")
        if self._token is None:
            raise LinkError("this store accepts no links (it was started without a job token)")
        self.write(auth.check_auth(self._token, self._nonce, payload))
        self._authenticated = True
        self._decoder.max_frame = DEFAULT_MAX_FRAME

    def refuse(self, reason: str) -> None:
        """Send an ERROR frame after what this read wrote, then close."""
        self._uncork()
        self.write(auth.error(reason))
        if self._transport is not None:
            self._transport.close()

    def abort(self, reason: str, quiet: bool = False) -> None:
        """Drop the connection now, unsent data included (the peer may not be reading).
        Logged as a warning unless ``quiet`` (its front-end ended the session) or the
        link is the store host's own front-end process's."""
        if self._transport is not None and not self._transport.is_closing():
            (log.warning if self.resumable and not quiet else log.info)("closing link from %s: %s", self.peer, reason)
            self._transport.abort()

    def release_session(self) -> None:
        self._session = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        session, self._session = self._session, None
        if session is not None and session.conn is self:
            if self.resumable:
                self._server.detach(session)
            else:
                session.conn = None
                self._server.expire(session, "its connection closed", quiet=True)
        if self.on_lost is not None:
            self.on_lost()
