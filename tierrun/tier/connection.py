"""A front-end's link session on the event loop: its connections (one at a time), the
heartbeat, reconnecting with backoff and resuming. The asyncio adapter of
``link.session`` (handshake, numbering, acks, deadlines); what travels in the session is
:class:`.upstream.LinkUpstream`'s business (it subclasses :class:`SessionEnd`).

Fail-stop: an unexpected error while handling what the store host sent ends the
session (every client is dropped with the reason and ``on_lost`` tells the node's
agent), never a resume past answers half handed out. What the store host has not
proved it sent (``Unauthenticated``: a frame failing its MAC, garbage, a refusal before
WELCOME) ends only the connection: nothing of it was acted upon, so the session
reconnects and resumes, until the grace period is over.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from time import monotonic

from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    ACK, ERROR, INVALIDATE, PONG, REPLIES, SESSION_ID_BYTES, FrameDecoder, LinkError, StoreSizes,
    Unauthenticated, decode_count, decode_pong,
)
from ..link.session import RECHECK_AFTER, ClientHandshake, DeadlineCheck, Heartbeat, Ledger
from ..protocol.limits import Limits
from .writes import STALL_AT, WritesInFlight

log = logging.getLogger("tierrun.frontend")

#: Seconds a connection the store host took may leave the handshake unanswered before
#: the first attempt says so (``open_connection``'s ``on_silent``).
SILENT_AFTER = 2.0


class SessionEnd:
    """The front-end's end of one link session. It survives its connections: when one
    drops (or is silent for ``heartbeat_timeout``) it reconnects with backoff and
    resumes, resending the frames the store host has not received; local clients see
    only latency. Past ``grace`` it gives up (:meth:`die`)."""

    def __init__(self, token: bytes, on_lost: Callable[[str], None], config: LinkConfig | None,
                 address: tuple[str, int] | None) -> None:
        self._token = token
        self._on_lost = on_lost
        self.config = config or LinkConfig()
        self.address = address  # None: a lost connection is not retried
        #: The local address its connections leave from (None: the system's choice); a
        #: simulated node on a loopback address of its own, as a real node has.
        self.source: str | None = None
        self.session_id = secrets.token_bytes(SESSION_ID_BYTES)
        self.ledger = Ledger(self.config.max_unacked_bytes, self.config.ack_every)  # BATCH out, REPLIES in
        self._conn: LinkConnection | None = None  # connected, session resumed
        self._opened = False  # the store host has this session
        self.dead: str | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._heartbeat: asyncio.TimerHandle | None = None
        self._late = DeadlineCheck()
        self._sent_since_beat = False  # a batch left since the last heartbeat interval began
        self._beat_with_next_batch = False  # the heartbeat rides with the next batch
        self._reconnecting: asyncio.Task[None] | None = None
        #: Since when (loop time) the session has had no healthy connection: set when one
        #: is lost, cleared once a new one has had every frame it resent acknowledged (a
        #: connection that is dropped again before, e.g. by injected garbage, does not
        #: renew the grace period).
        self.down_since: float | None = None
        self._resync_upto = 0  # the frames to be acknowledged before that
        #: The store's limits on one request, as the store host said when the session
        #: opened (None before), and the longest value it may hold.
        self.upstream_limits: Limits | None = None
        self.upstream_largest_value = 0
        #: Past this many bytes sent and not acknowledged, clients' writes wait (write_room).
        self.congested_at = self.config.max_unacked_bytes // 16  # (twice the store host's ack step)
        self._stalled: set = set()  # clients whose writes wait for room
        self.queued_writes = self.queued_count = 0  # bytes and number of writes for the next batch (the subclass's)
        self._writes = WritesInFlight()  # writes with no answer, answered if refused

    # -- for the subclass -----------------------------------------------------------------

    def on_replies(self, payload: bytes) -> None:
        raise NotImplementedError

    def on_invalidate(self, payload: bytes) -> None:
        raise NotImplementedError

    def on_disconnected(self) -> None:
        """The connection is gone (the session may resume): answer nothing from watches."""

    def on_dead(self, reason: str) -> None:
        """The session is over: drop every client with ``reason``."""

    def on_beat(self) -> None:
        """Every heartbeat interval."""

    def lease_granted(self, until: float) -> None:
        """The store host heard from us: watches may be answered until ``until``."""

    def on_upstream_limits(self, limits: Limits, largest_value: int) -> None:
        """The store host's limits on one request, and the longest value it may hold,
        when the session opens."""

    # -- the session --------------------------------------------------------------------

    def write_room(self, client: object) -> bool:
        """May ``client`` send a write (a request with no answer) now? Not while the
        frames sent and not acknowledged, and the writes waiting for the next batch (a
        batch waits while one is in flight), pass ``congested_at``: a client that floods
        the link with SETs would make it pass its bound (the session, and the node,
        lost); nor while ``writes.STALL_AT`` writes are in flight with no answer yet
        (:mod:`.writes`). Then ``client.room_again()`` is called once they are back
        under it (or the session is over). O(1)."""
        if self._room() or self.dead is not None:
            return True
        self._stalled.add(client)
        return False

    def _room(self) -> bool:
        return (self.ledger.outbox.bytes + self.queued_writes <= self.congested_at
                and len(self._writes) + self.queued_count < STALL_AT)

    def acked(self) -> None:
        """The store host acknowledged frames (or a batch left): once it has everything
        resent on this connection, the connection is healthy (the grace period starts
        afresh after the next loss); waiting writes go if there is room."""
        if self.down_since is not None and self.ledger.outbox.acked >= self._resync_upto:
            self.down_since = None
        if self._stalled and (self._room() or self.dead is not None):
            stalled, self._stalled = self._stalled, set()
            for client in stalled:
                client.room_again()  # type: ignore[attr-defined]

    def silence(self) -> float | None:
        """Seconds since the upstream was last heard from on the current connection;
        None while there is none (reconnecting, or given up)."""
        return None if self._conn is None else self._conn.heartbeat.silent(monotonic())

    def connection(self) -> LinkConnection:
        """A protocol for a new connection to the store host; it resumes this session."""
        return LinkConnection(self)

    def established(self, conn: LinkConnection, batches_received: int,
                    limits: StoreSizes | None = None) -> None:
        """RESUMED arrived on ``conn``: resend what the store host has not executed."""
        if self.dead is not None:
            conn.abort(self.dead)
            return
        missed = self.ledger.resume(batches_received)
        self._conn = conn
        self._opened = True
        self._resync_upto = self.ledger.outbox.sent
        if limits is not None and self.upstream_limits is None:
            self.upstream_limits = Limits(
                max_key_bytes=limits.key_bytes, max_value_bytes=limits.value_bytes,
                max_keys_per_request=limits.keys_per_request, max_request_bytes=limits.request_bytes,
                max_reply_bytes=limits.reply_bytes)
            self.upstream_largest_value = limits.largest_value
            self.on_upstream_limits(self.upstream_limits, limits.largest_value)
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
        self._heartbeat = asyncio.get_running_loop().call_later(self._late.armed(monotonic(), delay), self._beat)

    def _beat(self) -> None:
        """Every heartbeat interval: acknowledge (the heartbeat), or drop a silent
        connection. A link that sent a batch during the last interval sends its
        heartbeat with its next batch instead (in one write), or at the next beat if none
        comes: heartbeats at most two intervals apart, well within the watch lease. A
        beat that ran late (this process was not running) looks again once what the
        store host sent is read, before it calls the store host silent."""
        conn = self._conn
        if conn is not None and conn.heartbeat.expired(now := monotonic()) and self._late.look_again(now):
            self._heartbeat = asyncio.get_running_loop().call_later(self._late.armed(now, RECHECK_AFTER, again=True),
                                                                  self._beat)
            return
        try:
            if conn is None and self._reconnecting is None and self.dead is None and self.address is not None:
                # (no connection and nothing reconnecting: a state no path should leave,
                # but one that would hang the node for good, neither recovering nor giving up)
                log.error("the link had no connection and was not reconnecting; reconnecting")
                if self.down_since is None:
                    self.down_since = asyncio.get_running_loop().time()
                self._reconnecting = asyncio.ensure_future(_reconnect(self, "link to the store host lost (unnoticed)"))
            if conn is not None:
                now = monotonic()
                if conn.heartbeat.expired(now):
                    conn.abort(f"nothing heard from the store host for {conn.heartbeat.silent(now):.1f} s")
                elif self._sent_since_beat and not self._beat_with_next_batch:
                    self._beat_with_next_batch = True
                else:
                    self._beat_with_next_batch = False
                    conn.ack()
            self._sent_since_beat = False
            self.on_beat()
        except Exception as e:  # (fail-stop: a link whose heartbeats stopped would notice nothing)
            log.exception("unexpected error in the link's heartbeat")
            self.die(f"internal error in the node's link to the store host: {e!r}")
        finally:
            if self.dead is None:
                self._schedule_heartbeat()

    def connection_lost(self, conn: LinkConnection, reason: str) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        if self.down_since is None:
            self.down_since = asyncio.get_running_loop().time()
        try:
            self.on_disconnected()
        except Exception as e:  # (fail-stop: never a link left with nothing reconnecting it)
            log.exception("unexpected error dropping the watches of a lost link connection")
            self.die(f"internal error in the node's link to the store host: {e!r}")
            return
        if self.dead is None and self._reconnecting is None and self.address is not None:
            self._reconnecting = asyncio.ensure_future(_reconnect(self, reason))
        elif self.address is None:
            self.die(reason)

    def die(self, reason: str) -> None:
        """Give up the session: drop every waiting client with ``reason``."""
        if self.dead is not None:
            return
        self.dead = reason
        try:
            if not self.ready.done():
                self.ready.set_exception(LinkError(reason))
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            if self._conn is not None:
                self._conn.abort(reason)
                self._conn = None
            self.on_dead(reason)
            self.acked()  # (clients waiting to write learn, at their next request, that it is over)
        finally:  # (whatever failed above, the node's agent hears that the link is over)
            self._on_lost(reason)

    def close(self) -> None:
        """End the session cleanly: the store host drops it at once."""
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

    def send(self, frame: bytes) -> None:
        """Number, keep and (if connected) write one BATCH frame."""
        try:
            self.ledger.sent(frame)
        except LinkError as e:
            self.die(f"the store host stopped acknowledging: {e}")
            return
        self._sent_since_beat = True
        if self._conn is not None:
            if self._beat_with_next_batch:
                self._beat_with_next_batch = False
                self._conn.ack(after=frame)
            else:
                self._conn.write(frame)

    def confirm(self, frame: bytes) -> None:
        """Write an unnumbered frame (an INVALIDATED) if connected."""
        if self._conn is not None:
            self._conn.write(frame)



class LinkConnection(asyncio.Protocol):
    """One TCP connection of a :class:`SessionEnd`: the handshake, then its frames."""

    def __init__(self, link: SessionEnd) -> None:
        self._link = link
        self._handshake = ClientHandshake(link._token, link.session_id, not link._opened, link.ledger)
        self._decoder = FrameDecoder(self._handshake.max_frame)
        self._transport: asyncio.Transport | None = None
        self._pings: deque[float] = deque()  # when each ACK not yet answered by a PONG left
        self.established: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.established.add_done_callback(_retrieve)  # an abandoned attempt may fail later
        self.heartbeat = Heartbeat(link.config.heartbeat_timeout, monotonic())

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(self._handshake.start())

    def write(self, data: bytes) -> None:
        """Send whole frames (sealed here: only once the handshake is over is there
        anything else to send)."""
        if self._transport is not None and not self._transport.is_closing():
            sealer = self._handshake.sealer
            assert sealer is not None
            self._transport.write(sealer.seal(data))

    def ack(self, after: bytes = b"") -> None:
        """Send an ACK (the heartbeat; its PONG renews the watch lease), after the
        frames ``after`` in the same write."""
        self._pings.append(monotonic())
        self.write(after + self._link.ledger.ack())

    def _answer_handshake(self, flight: bytes) -> None:
        """Send ``flight`` (the handshake's, on the wire as it is) and the first ACK,
        sealed, in one write."""
        sealer = self._handshake.sealer
        assert sealer is not None and self._transport is not None
        self._pings.append(monotonic())
        self._transport.write(flight + sealer.seal(self._link.ledger.ack()))

    def data_received(self, data: bytes) -> None:
        self.heartbeat.last_rx = monotonic()  # (heard(), inlined; not the loop's clock: no getpid() per read)
        link = self._link
        ledger = link.ledger
        decoder = self._decoder
        try:
            for ftype, payload in decoder.frames(data):
                if not self.established.done():
                    handshake = self._handshake
                    out = handshake.feed(ftype, payload)
                    if out:
                        self._answer_handshake(out)
                    decoder.max_frame = handshake.max_frame
                    decoder.opener = handshake.opener
                    if handshake.resumed is not None:
                        link.established(self, handshake.resumed, handshake.limits)
                        self.established.set_result(None)
                elif ftype == REPLIES:
                    ack_due = ledger.got(len(payload))
                    link.on_replies(payload)
                    if ack_due:
                        self.ack()
                elif ftype == INVALIDATE:
                    ack_due = ledger.got()
                    link.on_invalidate(payload)
                    if ack_due:
                        self.ack()
                elif ftype == PONG:
                    received, lease = decode_pong(payload)
                    ledger.acked(received)
                    link.acked()
                    if self._pings:  # the store host heard from us when this ACK arrived
                        until = self._pings.popleft() + lease
                        if link._conn is self:
                            link.lease_granted(until)
                elif ftype == ACK:
                    ledger.acked(decode_count(payload))
                    link.acked()
                elif ftype == ERROR:
                    raise LinkError("the other end ended the link session: " + payload.decode(errors="replace"))
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
        except LinkError as e:
            if not self.established.done():
                self.established.set_exception(e)
                self.abort(str(e))
            elif isinstance(e, Unauthenticated):  # not the store host's: this connection only
                self.abort(f"{e}; reconnecting")
            else:  # the session is unusable: our state and the store host's disagree
                link.die(str(e))
        except Exception as e:  # a bug, or no memory: fail-stop, never resume past it
            log.exception("unexpected error handling the store host's frames")
            if not self.established.done():
                self.established.set_exception(LinkError(f"internal error: {e!r}"))
            link.die(f"internal error in the node's link to the store host: {e!r}")

    def abort(self, reason: str) -> None:
        """Drop the connection now, even one already closing (a graceful close waits
        for its unsent bytes, forever if the peer stopped reading)."""
        transport = self._transport
        if transport is not None:
            if not transport.is_closing():
                log.warning("dropping the link connection: %s", reason)
            transport.abort()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"link to the store host lost ({exc or 'closed by the peer'})"
        if not self.established.done():
            self.established.set_exception(ConnectionError(reason))
        self._link.connection_lost(self, reason)


def _retrieve(f: asyncio.Future[None]) -> None:
    if not f.cancelled():
        f.exception()


async def open_connection(link: SessionEnd, timeout: float, on_silent: Callable[[], None] | None = None) -> None:
    """One attempt: connect, authenticate, open or resume the session. Raises OSError,
    TimeoutError, or LinkError when the store host refuses. ``on_silent()`` is called if
    the connection is taken but the handshake has no answer within ``SILENT_AFTER``
    seconds (another program holding the port, a frozen store host), while the attempt
    waits on to its timeout."""
    assert link.address is not None
    loop = asyncio.get_running_loop()
    local = None if link.source is None else (link.source, 0)
    transport, conn = await asyncio.wait_for(
        loop.create_connection(link.connection, *link.address, local_addr=local), timeout)
    if transport.get_extra_info("sockname") == transport.get_extra_info("peername"):
        transport.abort()  # (a TCP simultaneous open with itself: see rendezvous.sockets.connect)
        raise ConnectionRefusedError(f"nothing listens on {link.address[0]}:{link.address[1]} yet")
    try:
        if on_silent is not None and timeout > SILENT_AFTER:
            try:
                await asyncio.wait_for(asyncio.shield(conn.established), SILENT_AFTER)
            except asyncio.TimeoutError:
                on_silent()
                await asyncio.wait_for(asyncio.shield(conn.established), timeout - SILENT_AFTER)
        else:
            await asyncio.wait_for(asyncio.shield(conn.established), timeout)
    except asyncio.TimeoutError:
        established = conn.established
        if established.done() and not established.cancelled() and established.exception() is None:
            return  # (resumed as the timeout fired: the session is on this connection now;
            # dropping it would start a reconnect while the caller retried: two resumes)
        transport.abort()
        raise
    except BaseException:
        transport.abort()
        raise


async def _reconnect(link: SessionEnd, reason: str) -> None:
    """Reconnect with backoff (0.1 s to 1 s) until the grace period ends (counted from
    when the session last had a healthy connection). An attempt that meets something
    the store host has not proved it sent (garbage, a frame failing its MAC, a refusal
    before WELCOME: an impostor, or a store host restarted without the session) is just
    a failed attempt; a refusal the store host proved (sealed) ends the session."""
    loop = asyncio.get_running_loop()
    grace = link.config.grace
    since = loop.time() if link.down_since is None else link.down_since
    host, port = link.address  # type: ignore[misc]
    reason = reason.replace("the store host", f"the store host {host}:{port}", 1)
    reason = reason.replace(" lost (", f" lost at {time.strftime('%H:%M:%S')} (", 1)
    left = grace - (loop.time() - since)
    delay = 0.1
    last: BaseException | None = None
    try:
        if left <= 0:  # (its connections keep failing before they are healthy: resends refused)
            link.die(f"{reason}; no healthy connection within the {grace:g} s grace period")
            return
        log.warning("%s; reconnecting (for up to %.3g s)", reason, left)
        while link.dead is None:  # (it may give up meanwhile, e.g. its buffer overflowed)
            try:
                await open_connection(link, link.config.heartbeat_timeout)
                if link._conn is not None:
                    log.warning("link to the store host resumed after %.1f s", loop.time() - since)
                    return
                # (resumed, and lost again before this task ran: its loss started no
                # reconnecting, this is still it, from that loss: a resume that was
                # healthy gets a fresh grace period)
                last = ConnectionError("lost again as it resumed")
                since = link.down_since if link.down_since is not None else loop.time()
                delay = 0.1
            except Unauthenticated as e:  # not proved to be the store host's: try again
                log.warning("link attempt to the store host %s:%d failed: %s", host, port, e)
                last = e
            except LinkError as e:  # refused by the store host: the session is gone
                link.die(str(e))
                return
            except (OSError, asyncio.TimeoutError) as e:
                last = e
            if loop.time() - since + delay > grace:
                link.die(f"{reason}; not back within the {grace:g} s grace period "
                         f"(last attempt: {type(last).__name__}{f' {last}' if str(last) else ''})")
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
    except Exception as e:  # a bug, or no memory: fail-stop, never a link that stops trying
        log.exception("unexpected error reconnecting the link")
        link.die(f"internal error reconnecting the node's link to the store host: {e!r}")
    finally:
        link._reconnecting = None
