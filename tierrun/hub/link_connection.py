"""One link connection at the store host (or at a relaying proxy), for
:class:`.link_server.LinkServer`: the handshake, then its session's frames: sealed,
numbered, acknowledged, executed (:mod:`.session`). The request path of every node's
request: a lone request (most frames of a start-up) takes :meth:`_lone_request`, one
call and one write."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic
from typing import Protocol

from ..link import auth
from ..link.frames import (
    ACK, BATCH, ERROR, FAILED, INVALIDATED, LINK_MAGIC, LOOKUP, OK, REQUEST, TAG, UNORDERED,
    FrameDecoder, LinkError, Unauthenticated, decode_count, encode_pong, encode_reply, lone_request,
)
from ..link.seal import Sealer
from ..link.session import Heartbeat, ServerHandshake
from ..core import StoreError
from ..protocol import ProtocolError
from ..protocol.parser import decode_request
from ..protocol.opcodes import NO_REPLY_OPS, WAITING_OPS
from .lookup import LookupAnswer
from .session import SMALL_ANSWER, Host, Session
from .waiters import waiter_for


log = logging.getLogger("tierrun.store")

_LONE_SIZE = lone_request.size  # (a lone request's bytes start here)


class LinkServer(Host, Protocol):
    """What a connection needs of the server that accepted it
    (:class:`.link_server.LinkServer`; a protocol, so that neither module imports the
    other)."""

    connections: set[LinkServerConnection]

    def lease(self) -> float: ...

    def admit(self, conn: LinkServerConnection, address: str) -> str | None: ...

    def handshake_over(self, address: str, conn: LinkServerConnection) -> None: ...

    def attach(self, conn: LinkServerConnection, sid: bytes, fresh: bool, replies_received: int) -> Session: ...

    def detach(self, session: Session) -> None: ...


#: How much longer than the heartbeat timeout the store's own front-end process (a
#: connection that is not ``resumable``) may take to send its first frame: it is a new
#: Python process, whose imports take seconds on a loaded machine (one that dies is seen
#: at once: the store supervises it as its child). A node's link has the handshake deadline.
PROCESS_START_ALLOWANCE = 20.0


class LinkServerConnection(asyncio.Protocol):
    """One connection from a front-end: handshake, then its session's frames."""

    def __init__(self, server: LinkServer, peer: str, initial: bytes, token: bytes | None,
                 resumable: bool, sniffed: bool, not_a_link: str = "not a link") -> None:
        self._server = server
        self.peer = peer
        self._initial = initial
        self.resumable = resumable
        self._first_byte = not sniffed
        self._not_a_link = not_a_link  # (why one whose first byte is not a link's is closed)
        self.on_lost: Callable[[], None] | None = None  # (called once the connection is gone)
        self.on_open: Callable[[], None] | None = None  # (called once its session is open)
        self._handshake = ServerHandshake(token)
        self._decoder = FrameDecoder(self._handshake.max_frame)
        self._session: Session | None = None
        self._transport: asyncio.Transport | None = None
        self._corked: list[bytes] | None = None  # (while a read is handled, what it writes: one write at its end)
        # (the store's own front-end process speaks first once its Python has started)
        self.heartbeat = Heartbeat(server.config.heartbeat_timeout,
                                   monotonic() + (0.0 if resumable else PROCESS_START_ALLOWANCE))
        #: The source host, counted in ``LinkServer.handshaking`` until the session opens.
        self._address: str | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._sealer: Sealer | None = None  # once WELCOME is out, what seals our frames
        #: Not read while its session's relayed writes wait for room upstream.
        self.paused = False
        self._keeping: asyncio.TimerHandle | None = None  # (the keep-alive of a paused connection)
        self._lookup: LookupAnswer | None = None  # (a connection that asked one LOOKUP: no session)

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
        if self._initial:  # (HELLO leaves with the answer to what came with the first byte)
            initial, self._initial = self._initial, b""
            self._corked = [self._handshake.start()]
            self.data_received(initial)
        else:
            transport.write(self._handshake.start())

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
                self.abort(self._not_a_link)
                return
            data = data[1:]
        if self._corked is None:  # (else HELLO is corked: see connection_made)
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
                    if session._refusals_sent:
                        session.acknowledged()
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
                elif self._lookup is not None:
                    raise LinkError("nothing may follow a LOOKUP")
                elif session is None and ftype == LOOKUP:
                    self._answer_lookup(payload)
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
                        if self.on_open is not None:
                            self.on_open()
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
            if self._lookup is not None and decoder.partial:
                raise LinkError("nothing may follow a LOOKUP")
            session = self._session
            if session is not None and session._wakes:  # every answer of this read: one frame
                session.flush_answers()
        except Unauthenticated as e:  # not the front-end's: drop this connection, not the session
            self._uncork()
            self.abort(str(e))
        except (LinkError, ProtocolError) as e:
            self._say_closing(e)
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

    def _answer_lookup(self, payload: bytes) -> None:
        """A LOOKUP (``hub.lookup``): verified, it waits as long as its key takes,
        outside the handshake's bounds; answered, the connection closes. Raises
        LinkError (refused: the caller says why and closes)."""
        handshake = self._handshake
        nonce, key = handshake.lookup(payload)
        if len(key) > self._server.limits.max_key_bytes:  # (as a request's key would be)
            raise LinkError(f"a LOOKUP key of {len(key)} bytes, over the store's {self._server.limits.max_key_bytes}")
        if self._deadline is not None:  # (it may wait long for its key, but it still counts among
            self._deadline.cancel()     # its address's connections in their handshake: a recorded
            self._deadline = None       # LOOKUP replayed cannot hold more than that many open)

        def send(answer: bytes) -> None:
            self._server.stats.lookups += 1
            self._write_wire(handshake.found(nonce, answer))
            self._uncork()  # (with HELLO, in one write, when the key was set already)
            if self._transport is not None:
                self._transport.close()

        self._lookup = LookupAnswer(self._server.upstream_for(b""), key, send, self.refuse)
        self._lookup.start()

    def _opened(self) -> None:
        """The session is open: the handshake's bounds no longer apply."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._address is not None:
            self._server.handshake_over(self._address, self)
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
            if req[0] in NO_REPLY_OPS:
                session.refused(rid)  # (an AFTER it: not run)
            answer = (rid, FAILED, session.failed(req, err))
        else:
            if reply is None:
                if req[0] not in NO_REPLY_OPS:
                    client.pending.append(rid)  # (a stacked front-end's: answered later)
                elif client.relays_writes:  # (its write may wait for room: a relaying proxy)
                    session.relayed_writes(client)
                answer = None
            else:  # (vet inlined for a small answer)
                answer = (rid, OK, reply) if len(reply) <= SMALL_ANSWER else (rid, *session.vet(reply))
        if answer is not None:
            if session._wakes:  # (it woke a WAIT of this link: that answer first, as torch's server sends them)
                session._wakes.append(answer)
            else:  # (through the gate: if the request changed a watched key, the round goes first)
                if session.relayed and rid > next(iter(session.relayed)):  # (see Session.ordering)
                    answer = (rid, answer[1] | UNORDERED, answer[2])
                session.emit(encode_reply(*answer), session.take_refusals() if answer[1] != OK else None)
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
            if self.resumable and not quiet:
                self._say_closing(reason)
            else:
                log.info("closing link from %s: %s", self.peer, reason)
            self._transport.abort()

    def _say_closing(self, reason: object) -> None:
        """A warning: always for a session's link; for a connection not yet a session's
        (a flood's, maybe), within the link server's budget (``logs.FloodLog``)."""
        (log.warning if self._session is not None else self._server.closed_log.warning)(
            "closing link from %s: %s", self.peer, reason)

    def pause_reading(self) -> None:
        """Read nothing until :meth:`resume_reading` (``Session.relayed_writes``); not
        timed out, and kept alive: an ACK every heartbeat interval, or the front-end
        below, hearing nothing, would drop the link while this one waits for room."""
        t = self._transport
        if t is not None and not t.is_closing() and not self.paused:
            try:
                t.pause_reading()
                self.paused = True
            except NotImplementedError:  # (an in-memory transport in tests: it reads on)
                return
            self._keep_alive()

    def _keep_alive(self) -> None:
        self._keeping = None
        t = self._transport
        if self.paused and self._session is not None and t is not None and not t.is_closing():
            self.write(self._session.ledger.ack())
            self._keeping = asyncio.get_running_loop().call_later(self._server.config.heartbeat_interval,
                                                                  self._keep_alive)

    def resume_reading(self) -> None:
        """Read again; counted as heard from now (nothing was read meanwhile)."""
        if self.paused:
            self.paused = False
            if self._keeping is not None:
                self._keeping.cancel()
                self._keeping = None
            self.heartbeat.heard(monotonic())
            if self._transport is not None and not self._transport.is_closing():
                self._transport.resume_reading()

    def release_session(self) -> None:
        self._session = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._opened()  # (whatever it was waiting for, it is not in a handshake any more)
        if self._lookup is not None:
            self._lookup.cancel()
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
