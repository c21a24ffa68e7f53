"""The store host's end of links (and a relaying proxy's): authenticates front-ends,
keeps their sessions (:mod:`.session`) across connections, answers their heartbeats.
The asyncio adapter of ``link.session`` (handshake, numbering, acks, deadlines).

Watches (a WATCH entry: ``StoreCore.execute_watching``) are handed out per session;
when a watched key changes, the :class:`.reply_gate.ReplyGate` runs an invalidation
round before anyone hears of the change. Each ACK of a front-end is answered with a
PONG, through the gate, granting it a watch lease.

A *session* outlives its connection: its clients, their pending waits and the REPLIES
frames the front-end has not acknowledged stay here for ``LinkConfig.grace`` seconds, so
a front-end that reconnects resumes with nothing lost, and since BATCH frames are
counted, nothing it resends is executed twice. An unexpected error while handling a
session's frames ends it (fail-stop): its batch may be half applied, so it must never
be resumed. A store (or relay) that stops with ``close(final)`` tells each front-end why.

Every frame after the handshake is sealed (``link.seal``); one that fails its MAC, or
bytes that cannot be a frame, close that connection only: its session waits for the
front-end to resume it, as after any dropped connection.

What a connection can hold, and for how long:

- before its session is open (a peer that may not know the token): at most
  ``LinkConfig.handshake_timeout`` seconds, ``HANDSHAKE_MAX_FRAME`` bytes of a frame,
  and no more than ``max_handshakes_per_address`` such connections per source
  address; every link counts against ``max_connections`` (the front-end that
  accepted it counts it against its own too);
- once open: it is closed when nothing is heard for ``heartbeat_timeout`` (its session
  waits ``grace`` seconds for a resume); its unacknowledged frames are bounded by
  ``max_unacked_bytes`` (past it the session ends).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic

from ..frontend import Upstream
from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    ACK, BATCH, DEFAULT_MAX_FRAME, ERROR, FAILED, INVALIDATED, LINK_MAGIC, OK, REQUEST, TAG, WATCH_LEASE,
    FrameDecoder, LinkError, Unauthenticated, decode_count, encode_pong, encode_reply, encode_resumed,
    lone_request,
)
from ..link.seal import Sealer
from ..link.session import Heartbeat, ServerHandshake
from ..core import StoreError
from ..protocol import ProtocolError
from ..protocol.limits import Limits
from ..protocol.parser import decode_request
from ..protocol.opcodes import NO_REPLY_OPS, WAITING_OPS
from .reply_gate import ReplyGate
from .session import SMALL_ANSWER, LinkStats, Session, waiter_for

log = logging.getLogger("tierrun.store")

_LONE_SIZE = lone_request.size  # (a lone request's bytes start here)


class LinkServer:
    """Every link and session of one upstream: the core (the store host), or a
    front-end's own link upstream (a front-end that takes other front-ends' links)."""

    def __init__(self, upstream_for: Callable[[bytes], Upstream], token: bytes | None,
                 config: LinkConfig | None = None, lease: Callable[[], float] = lambda: WATCH_LEASE,
                 gate: ReplyGate | None = None,
                 drop_watches: Callable[[Session], None] = lambda session: None,
                 limits: Limits | None = None, max_connections: int = 65536) -> None:
        """``upstream_for(namespace)``: where a link client's requests go; ``lease()``:
        how long (seconds, at most WATCH_LEASE) a front-end may answer from its
        watches past the ACK being answered (a stacked front-end grants no longer
        than its own lease upstream still runs); ``gate``: the invalidation rounds of
        the store (shared by every LinkServer of one core); ``drop_watches(session)``:
        called when a session ends, to free what its watches hold upstream;
        ``limits``: what one request may hold (the store's, as its clients get; told to
        every front-end when its session opens, so that it refuses what the store
        would); ``max_connections``: link connections beyond this are closed as soon
        as they are accepted."""
        self.upstream_for = upstream_for
        self.token = token
        self.config = config or LinkConfig()
        self.lease = lease
        self.gate = gate or ReplyGate()
        self.drop_watches = drop_watches
        self.limits = limits or Limits()
        self.max_connections = max_connections
        self.stats = LinkStats()
        self.sessions: dict[bytes, Session] = {}
        self.connections: set[LinkServerConnection] = set()
        #: Source address -> its connections whose session is not open yet.
        self.handshaking: dict[str, int] = {}
        #: Largest frame sent (the front-ends' decoders accept no larger).
        self.max_frame = DEFAULT_MAX_FRAME
        self._watchdog: asyncio.TimerHandle | None = None

    def accept(self, peer: str = "", initial: bytes = b"", token: bytes | None = None,
               resumable: bool = True, sniffed: bool = True) -> LinkServerConnection:
        """The protocol for a new link connection. ``peer``: its name in logs (default:
        its address); ``initial``: bytes already read from it (after the first byte);
        ``token``: the one it must prove instead of the job token (the store host's own
        front-end processes have their own); ``resumable=False``: its session ends with
        it; ``sniffed=False``: its first byte is still to come (a links-only listener)."""
        if self._watchdog is None:
            self._schedule_watchdog(self.config.heartbeat_timeout)
        return LinkServerConnection(self, peer, initial, token or self.token, resumable, sniffed)

    def take(self, transport: asyncio.Transport, peer: str, initial: bytes,
             on_closed: Callable[[], None] | None = None) -> None:
        """Adopt a connection a front-end accepted and recognised as a link;
        ``on_closed()`` once it is gone (the front-end counts it until then)."""
        conn = self.accept(peer, initial)
        conn.on_lost = on_closed
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def admit(self, conn: LinkServerConnection, address: str) -> str | None:
        """Count a new connection from ``address`` (a host); why it is refused, or None.
        O(1)."""
        if len(self.connections) >= self.max_connections:
            return f"{len(self.connections)} link connections open (the limit)"
        n = self.handshaking.get(address, 0)
        if n >= self.config.max_handshakes_per_address:
            return (f"{n} link connections from {address} are still in their handshake "
                    f"(the limit: TIERRUN_LINK_HANDSHAKES_PER_ADDRESS)")
        self.handshaking[address] = n + 1
        self.connections.add(conn)
        return None

    def handshake_over(self, address: str) -> None:
        """A connection from ``address`` opened its session, or closed before."""
        n = self.handshaking.get(address, 0) - 1
        if n > 0:
            self.handshaking[address] = n
        else:
            self.handshaking.pop(address, None)

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
            last_rx = now if conn.paused else conn.heartbeat.last_rx  # (paused: not read on purpose)
            if last_rx < deadline:
                conn.abort(f"nothing heard for {timeout:g} s")
            elif last_rx < oldest:
                oldest = last_rx
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
        missed = session.ledger.resume(replies_received)
        session.conn = conn
        session.peer = conn.peer
        self.stats.links += conn.resumable  # (node links, not the host's own front-ends)
        lim = self.limits
        sizes = (lim.max_key_bytes, lim.max_value_bytes, lim.max_keys_per_request, lim.max_request_bytes)
        conn.write(encode_resumed(session.ledger.received, sizes) + b"".join(missed))
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
        session.ledger.acked(session.ledger.outbox.sent)
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

    def close(self, final: str | None = None) -> None:
        """Drop every link; with ``final``, tell each why (its front-end gives up at once)."""
        self.gate.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in list(self.connections):
            if final is not None:
                conn.refuse(final)
            else:
                conn.abort("the store is stopping")


class LinkServerConnection(asyncio.Protocol):
    """One connection from a front-end: handshake, then its session's frames."""

    def __init__(self, server: LinkServer, peer: str, initial: bytes, token: bytes | None,
                 resumable: bool, sniffed: bool) -> None:
        self._server = server
        self.peer = peer
        self._initial = initial
        self.resumable = resumable
        self._first_byte = not sniffed
        self.on_lost: Callable[[], None] | None = None  # (called once the connection is gone)
        self._handshake = ServerHandshake(token)
        self._decoder = FrameDecoder(self._handshake.max_frame)
        self._session: Session | None = None
        self._transport: asyncio.Transport | None = None
        self._corked: list[bytes] | None = None  # (while a read is handled, what it writes: one write at its end)
        self.heartbeat = Heartbeat(server.config.heartbeat_timeout, monotonic())
        #: The source host, counted in ``LinkServer.handshaking`` until the session opens.
        self._address: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._sealer: Sealer | None = None  # once WELCOME is out, what seals our frames
        #: Not read while its session's relayed writes wait for room upstream.
        self.paused = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        address = transport.get_extra_info("peername")
        if not self.peer:
            self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else "?"
        if self.resumable:  # (not the store's own front-end processes: trusted, and counted by no one)
            host = address[0] if isinstance(address, tuple) else "?"
            refused = self._server.admit(self, host)
            if refused is not None:
                self.abort(f"refused: {refused}")
                return
            self._address = host
            timeout = self._server.config.handshake_timeout
            self._deadline = asyncio.get_running_loop().call_later(
                timeout, self.abort, f"no link session within {timeout:g} s of connecting "
                "(TIERRUN_LINK_HANDSHAKE_TIMEOUT)")
        else:
            self._server.connections.add(self)
        transport.write(self._handshake.start())
        if self._initial:
            initial, self._initial = self._initial, b""
            self.data_received(initial)

    def write(self, data: bytes) -> None:
        """Send whole frames: sealed once WELCOME is out (the sealer numbers them in the
        order they are written, which is the order they leave). (``_write_wire``
        inlined: this runs for every frame the store host sends.)"""
        sealer = self._sealer
        if sealer is not None:
            data = sealer.seal(data)
        corked = self._corked
        if corked is not None:
            corked.append(data)
            return
        transport = self._transport
        assert transport is not None
        if not transport.is_closing():
            transport.write(data)

    def _write_wire(self, data: bytes) -> None:
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
            self._write_wire(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.heartbeat.last_rx = monotonic()  # (heard(), inlined; not the loop's clock: no getpid())
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
        decoder = self._decoder
        try:
            for ftype, payload in decoder.frames(data):
                session = self._session
                if session is not None and ftype == BATCH:
                    ack_due = session.ledger.got(len(payload))
                    session.execute(payload)
                    if ack_due:
                        self.write(session.ledger.ack())
                elif session is not None and ftype == ACK:
                    ledger = session.ledger
                    ledger.acked(decode_count(payload))
                    session.last_ping_rx = self.heartbeat.last_rx
                    # the answer to the front-end's heartbeat, and its watch lease
                    gate = self._server.gate
                    if gate.closed:  # (the PONG waits: a plain ACK says we are alive)
                        self.write(ledger.ack())
                    ledger.unacked_in = ledger.unacked_bytes_in = 0  # (the PONG acknowledges)
                    gate.emit(self.write, encode_pong(ledger.received, self._server.lease()))
                elif session is not None and ftype == INVALIDATED:
                    self._server.gate.confirmed(session, decode_count(payload))
                elif session is not None and ftype == ERROR:
                    self._server.expire(session, "the front-end closed its session", quiet=True)
                    return
                elif session is None:
                    handshake = self._handshake
                    out = handshake.feed(ftype, payload)
                    if out:  # (WELCOME: the last frame not sealed)
                        self._write_wire(out)
                    self._sealer = handshake.sealer
                    decoder.max_frame = handshake.max_frame
                    decoder.opener = handshake.opener
                    if handshake.session is not None:
                        self._session = self._server.attach(self, *handshake.session)
                        self._opened()
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
            session = self._session
            if session is not None and session._wakes:  # every answer of this read: one frame
                session.flush_answers()
        except Unauthenticated as e:  # not the front-end's: drop this connection, not the session
            self._uncork()
            self.abort(str(e))
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

    def _opened(self) -> None:
        """The session is open: the handshake's bounds no longer apply."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._address is not None:
            self._server.handshake_over(self._address)
            self._address = None

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
        end = len(data) - TAG  # (the frame's MAC follows it)
        if ftype != BATCH or n != 1 or kind != REQUEST or length + 4 != end or size + _LONE_SIZE != end:
            return False
        client = session.clients.get(cid)
        if client is None:
            return False
        try:
            req = decode_request(data[_LONE_SIZE:end], self._server.limits)
        except ProtocolError:
            return False
        opener = self._decoder.opener
        if req[0] in WAITING_OPS or opener is None or not opener.valid(data, 0, end):
            return False  # (one that fails its MAC: the general path says so)
        stats = self._server.stats
        stats.batches += 1
        stats.operations += 1
        ack_due = session.ledger.got(len(data))
        try:  # (not a WAIT here; a relayed write: its ticket)
            reply = client.upstream.execute(req, waiter_for(client, req, rid) if client.relays_writes else client)
        except StoreError as err:
            frame = encode_reply(rid, FAILED, session.failed(req, err))
        else:
            if reply is None:
                if req[0] not in NO_REPLY_OPS:
                    client.pending.append(rid)  # (a stacked front-end's: answered later)
                elif client.relays_writes:  # (its write may wait for room: a relaying proxy)
                    session.relayed_writes(client)
                frame = b""
            else:  # (vet inlined for a small answer)
                frame = encode_reply(rid, *((OK, reply) if len(reply) <= SMALL_ANSWER else session.vet(reply)))
        if frame:  # (through the gate: if the request changed a watched key, the round goes first)
            session.emit(frame)
        if ack_due:
            self.write(session.ledger.ack())
        return True

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

    def pause_reading(self) -> None:
        """Read nothing until :meth:`resume_reading` (``Session.relayed_writes``); not timed out."""
        t = self._transport
        if t is not None and not t.is_closing() and not self.paused:
            try:
                t.pause_reading()
                self.paused = True
            except NotImplementedError:  # (an in-memory transport in tests: it reads on)
                pass

    def resume_reading(self) -> None:
        """Read again; counted as heard from now (nothing was read meanwhile)."""
        if self.paused:
            self.paused = False
            self.heartbeat.heard(monotonic())
            if self._transport is not None and not self._transport.is_closing():
                self._transport.resume_reading()

    def release_session(self) -> None:
        self._session = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._opened()  # (whatever it was waiting for, it is not in a handshake any more)
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
