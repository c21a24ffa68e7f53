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
  address (a new one evicts the oldest: a process squatting a node's address cannot
  lock its link out); every link counts against ``max_connections`` (the front-end that
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
from ..frontend.contracts import TORCH_CLIENT_REFUSED
from ..link.config import LinkConfig
from ..link.frames import DEFAULT_MAX_FRAME, WATCH_LEASE, LinkError, StoreSizes, encode_resumed
from ..link.session import RECHECK_AFTER, DeadlineCheck
from ..logs import FloodLog
from ..protocol.limits import Limits
from .reply_gate import ReplyGate
from .link_connection import LinkServerConnection
from .session import LinkStats, Session
from .wills import Wills

log = logging.getLogger("tierrun.store")



class LinkServer:
    """Every link and session of one upstream: the core (the store host), or a
    front-end's own link upstream (a front-end that takes other front-ends' links)."""

    def __init__(self, upstream_for: Callable[[bytes], Upstream], token: bytes | None,
                 config: LinkConfig | None = None, lease: Callable[[], float] = lambda: WATCH_LEASE,
                 gate: ReplyGate | None = None,
                 drop_watches: Callable[[Session], None] = lambda session: None,
                 limits: Limits | None = None, max_connections: int = 65536,
                 largest_value: int | None = None) -> None:
        """``upstream_for(namespace)``: where a link client's requests go; ``lease()``:
        how long (seconds, at most WATCH_LEASE) a front-end may answer from its
        watches past the ACK being answered (a stacked front-end grants no longer
        than its own lease upstream still runs); ``gate``: the invalidation rounds of
        the store (shared by every LinkServer of one core); ``drop_watches(session)``:
        called when a session ends, to free what its watches hold upstream;
        ``limits``: what one request may hold (the store's, as its clients get; told to
        every front-end when its session opens, so that it refuses what the store
        would); ``max_connections``: link connections beyond this are closed as soon
        as they are accepted; ``largest_value``: the longest value the store may hold
        (a relay's: the store host's, as it was told; the store host's: its limit)."""
        self.upstream_for = upstream_for
        self.token = token
        self.config = config or LinkConfig()
        self.lease = lease
        self.gate = gate or ReplyGate()
        self.drop_watches = drop_watches
        self.limits = limits or Limits()
        self.largest_value = largest_value or self.limits.max_value_bytes
        self.max_connections = max_connections
        self.stats = LinkStats()
        self.wills = Wills(upstream_for, self.limits.max_key_bytes, self.config.heartbeat_interval)
        self.sessions: dict[bytes, Session] = {}
        self.connections: set[LinkServerConnection] = set()
        #: Source address -> its connections whose session is not open yet.
        self.handshaking: dict[str, dict[LinkServerConnection, None]] = {}
        #: Largest frame sent (the front-ends' decoders accept no larger).
        self.max_frame = DEFAULT_MAX_FRAME
        self._watchdog: asyncio.TimerHandle | None = None
        self._late = DeadlineCheck()
        #: Where a connection closed before it was a session's link says so (a flood: in part).
        self.closed_log = FloodLog(log, "connections to the link port closed")

    def accept(self, peer: str = "", initial: bytes = b"", token: bytes | None = None,
               resumable: bool = True, sniffed: bool = True, not_a_link: str = "not a link") -> LinkServerConnection:
        """The protocol for a new link connection. ``peer``: its name in logs (default:
        its address); ``initial``: bytes already read from it (after the first byte);
        ``token``: the one it must prove instead of the job token (the store host's own
        front-end processes have their own); ``resumable=False``: its session ends with
        it; ``sniffed=False``: its first byte is still to come (a links-only listener), and
        ``not_a_link`` says why one whose first byte is not a link's is closed."""
        if self._watchdog is None:
            self._schedule_watchdog(self.config.heartbeat_timeout)
        return LinkServerConnection(self, peer, initial, token or self.token, resumable, sniffed, not_a_link)

    def take(self, transport: asyncio.Transport, peer: str, initial: bytes | None,
             on_closed: Callable[[], None] | None = None) -> None:
        """Adopt a connection a front-end accepted and recognised as a link (``initial``:
        what it read after the first byte), or took on a links-only port before reading
        anything (None: a torch client is refused, saying why); ``on_closed()`` once it
        is gone (the front-end counts it until then)."""
        conn = self.accept(peer, initial or b"", sniffed=initial is not None, not_a_link=TORCH_CLIENT_REFUSED)
        conn.on_lost = on_closed
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def admit(self, conn: LinkServerConnection, address: str) -> str | None:
        """Count a new connection from ``address`` (a host); why it is refused, or None.
        At ``max_handshakes_per_address`` connections from there still in their
        handshake, the oldest is closed to make room: slow or stalled connections from
        a node's address (another process there) cannot keep the node's own link out;
        to do so they would have to outrun its handshake (one round trip) again and
        again. O(1)."""
        if len(self.connections) >= self.max_connections:
            return f"{len(self.connections)} link connections open (the limit)"
        waiting = self.handshaking.setdefault(address, {})
        if len(waiting) >= self.config.max_handshakes_per_address:
            oldest = next(iter(waiting))
            del waiting[oldest]
            oldest.abort(f"{len(waiting) + 1} link connections from {address} in their handshake (the limit: "
                         "TIERRUN_LINK_HANDSHAKES_PER_ADDRESS); this one, the oldest, makes room for a new one")
        waiting[conn] = None
        self.connections.add(conn)
        return None

    def handshake_over(self, address: str, conn: LinkServerConnection) -> None:
        """``conn``, from ``address``, opened its session, or closed before."""
        waiting = self.handshaking.get(address)
        if waiting is not None:
            waiting.pop(conn, None)
            if not waiting:
                del self.handshaking[address]

    def _schedule_watchdog(self, delay: float, again: bool = False) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(self._late.armed(monotonic(), delay, again),
                                                               self._check_heartbeats)

    def _check_heartbeats(self) -> None:
        """Close connections silent for longer than the heartbeat timeout; come back when
        the least recently heard of the others would be (not every interval: an idle
        store host wakes for its links' heartbeats only). A check that ran late (this
        process was not running) looks again once what they sent is read. O(links)."""
        now = monotonic()
        timeout = self.config.heartbeat_timeout
        deadline = now - timeout
        oldest = now
        silent = []
        for conn in self.connections:
            last_rx = now if conn.paused else conn.heartbeat.last_rx  # (paused: not read on purpose)
            if last_rx < deadline:
                silent.append(conn)
            elif last_rx < oldest:
                oldest = last_rx
        if silent and self._late.look_again(now):
            self._schedule_watchdog(RECHECK_AFTER, again=True)
            return
        for conn in silent:
            conn.abort(f"nothing heard for {timeout:g} s")
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
        session.resumed = True
        session.conn = conn
        session.peer = conn.peer
        self.stats.links += conn.resumable  # (node links, not the host's own front-ends)
        lim = self.limits
        sizes = StoreSizes(lim.max_key_bytes, lim.max_value_bytes, lim.max_keys_per_request, lim.max_request_bytes,
                           lim.max_reply_bytes, self.largest_value)
        conn.write(encode_resumed(session.ledger.received, sizes) + b"".join(missed))
        return session

    def detach(self, session: Session) -> None:
        """Its connection is gone: keep the session for the grace period."""
        session.conn = None
        session.lost_at = monotonic()
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
        self.wills.ended(session, reason, quiet)
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
        self.wills.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in list(self.connections):
            if final is not None:
                conn.refuse(final)
            else:
                conn.abort("the store is stopping")
