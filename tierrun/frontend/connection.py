"""One torch client connection on a front-end: bytes in, requests to the upstream.

This is the store's request path, the hottest code in tierrun: one ``feed`` of the
parser per read, one upstream call per request, one ``write`` per read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from time import monotonic

from ..core import StoreError
from ..link.frames import LINK_MAGIC
from ..protocol import Limits, Op, ProtocolError, RequestParser
from ..protocol.opcodes import NO_REPLY_OPS
from ..protocol.replies import encode_u32
from .contracts import ConnectionOwner
from .owed import Owed, write_answer

log = logging.getLogger("tierrun.store")

_PING = Op.PING
_CANCEL_WAIT = Op.CANCEL_WAIT
#: Deferred answers that do not hold the client's next requests back (see the class):
#: torch's server goes on with a client's requests while its WAIT or BARRIER waits.
_ANSWERED_LATER = frozenset({Op.WAIT, Op.BARRIER})
#: Sent upstream ahead of a CANCEL_WAIT that follows writes not yet confirmed (its
#: answer, swallowed, confirms them).
_SYNC = (Op.PING, 0)
#: The opcode of the stand-in for an invalid request: its client is closed when its
#: requests before it are answered.
_INVALID = -1
#: A connection executes its client's next request only while it owes the client at
#: most this many bytes of answers (see :mod:`.owed`); past it, it stops reading until
#: the client reads (flow control).
REPLY_BUFFER = 1 << 20
TURN_REQUESTS = 1024  # requests of one connection served per turn of the event loop (see _serve)
#: Seconds a dropped client's connection is still read (and discarded) before it is closed.
LINGER = 10.0
#: Seconds a connection's writing must have been paused (its client not reading) before
#: it may be closed for the front-end's total of unread answers: clients that read, at
#: 1 Gb/s, take the largest answer in ~1 s, and many answering at once must not be
#: closed for a burst (the total may pass its budget by what is written meanwhile).
UNREAD_GRACE = 2.0


class ClientConnection(asyncio.Protocol):
    """Speaks the torch protocol with one client; answers PING itself.

    Closing rules: invalid input or a failed request closes this connection with one
    log line naming the peer and the reason; nothing else is affected. When the
    client stops reading its replies, we stop reading its requests and executing those
    already read (flow control: one read may carry thousands of GETs of a large value):
    a connection executes a request only while it owes its client at most
    ``REPLY_BUFFER`` bytes of answers, counting those not yet read, those held by an
    invalidation round and, at their largest, those still to come from upstream
    (:mod:`.owed`). So a client that does not read makes this process, and the store
    host behind it, hold about ``REPLY_BUFFER`` plus one answer for it, plus its
    requests; one owed more than ``limits.max_unread_bytes`` (which flow control
    leaves out of reach of a torch client) is closed.

    Order, as torch's server keeps it: a request whose answer comes later (from a link
    upstream; WAIT and BARRIER excepted) holds the client's next requests back until
    it is answered (``_fence``). So its answer comes before theirs, PING's and
    CANCEL_WAIT's too, and if it fails (its client is closed) nothing the client sent
    after it is executed. A torch client waits for every answer but WAIT's anyway: this
    costs it nothing. (A WAIT's or BARRIER's answer comes through ``wake_wait``: so the
    fence's is told apart.) PING and CANCEL_WAIT are answered here, but not ahead of
    what the client sent upstream before them (``_behind``: writes with no answer yet
    confirmed by a later one, a WAIT or BARRIER that the store host may have answered
    already): then a PING goes upstream instead, and a CANCEL_WAIT follows a PING sent
    up first, whose answer comes after all of theirs. Requests read before an invalid
    one are executed and answered, then the client is closed.

    Through a link, a WAIT or BARRIER sent before the answer of the client's previous one
    closes it (torch's client never does: it blocks on its wait). torch's server answers
    such a pair from one count of awaited keys per connection, which merged WAITs lack.
    """

    __slots__ = ("_frontend", "_upstream", "_parser", "_transport", "peer", "closed", "_sniff", "_gate",
                 "_backlog", "_writing_paused", "_owed", "_out", "_limits", "_write_room", "_fence", "_unconfirmed", "_swallow",
                 "_unfinished", "scan_source", "_unread", "_paused_at")

    def __init__(self, frontend: ConnectionOwner) -> None:
        self._frontend = frontend
        self._upstream = frontend.upstream
        self._parser = RequestParser(frontend.limits)
        self._transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        # On a port that also takes links, the first byte tells a link from a torch client.
        self._sniff = frontend.link_acceptor is not None
        self._gate = frontend.gate
        self._backlog: list = []  # requests read, not yet executed: the client is not reading
        self._writing_paused = False
        self._owed = Owed()
        self._out: list[bytes] | None = None  # while _serve runs: its answers, in order
        self._limits = frontend.limits
        #: A link upstream's: may a write go now (else ``room_again`` is called later)?
        self._write_room = getattr(frontend.upstream, "write_room", None)
        #: An answer (not a WAIT's or BARRIER's) is due: the client's next requests wait.
        self._fence = False
        self._unconfirmed = False  # writes went upstream, no later answer came yet
        self._swallow = False  # the fence's answer is _SYNC's: not the client's
        self._unfinished = 0  # bytes its parser holds for a request not complete yet
        #: Whose scans its scans count as (``core.budget.ScanPacer``): its source host, or
        #: its Unix user; a client opening a connection per scan is still the same scanner.
        self.scan_source: str | None = None
        self._unread = 0  # what it counts in its front-end's ``unread`` (see _park)
        self._paused_at = 0.0  # when its writing was paused (monotonic)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        # (TCP: a (host, port, ...) tuple, and TCP_NODELAY is already set: uvloop sets it
        # on every TCP transport, asyncio on those whose socket's protocol is TCP, as
        # ``listen.tcp_listen_socket`` makes them. The socket object is fetched only for
        # a Unix socket's credentials: making one costs each connection ~5% of its CPU.)
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
            self.scan_source = peer[0]
        elif (sock := transport.get_extra_info("socket")) is not None and sock.family == socket.AF_UNIX:
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            self.peer = f"unix pid {pid}"
            self.scan_source = f"unix uid {uid}"
            allowed = self._frontend.unix_uids
            if uid not in allowed:
                log.warning("refusing connection from unix pid %d: it runs as uid %d; only uid(s) %s may use "
                            "this store's Unix socket", pid, uid, ", ".join(map(str, sorted(allowed))))
                self.closed = True
                transport.abort()
                return
        if not self._frontend.admit(self):
            self.closed = True
            transport.abort()
        elif self._frontend.links_only:  # (a link's handshake from the start: its deadline, its cap)
            self._become_link(None)

    def data_received(self, data: bytes) -> None:
        if self.closed:  # (dropped: what it still sends is read and discarded, see drop)
            return
        if self._sniff:
            self._sniff = False
            if data[0] == LINK_MAGIC:
                self._become_link(data[1:])
                return
        try:
            requests = self._parser.feed(data)
        except ProtocolError as e:  # (those before it first; reading stops with the stand-in)
            requests = e.requests + [(_INVALID, f"invalid request: {e}")]
        held = self._parser.held
        if (held or self._unfinished) and not self._account_unfinished(held, bool(requests)):
            return
        if not requests:
            return
        if self._backlog or self._fence:
            self._backlog += requests
            assert self._transport is not None
            self._transport.pause_reading()
            return
        self._serve(requests)

    def _account_unfinished(self, held: int, completed: bool) -> bool:
        """Count the bytes held for this connection's unfinished request in its
        front-end's total (``completed``: this read completed a request, so the one
        unfinished began in it). Past ``limits.max_unfinished_bytes``, close the
        connections whose unfinished requests began longest ago until the total is
        within it: those parked mid-request, not the client sending a large request
        now (closing the one that took the total past the budget let a crowd of
        parked small ones get every large request refused). False if this one was
        closed. O(1) per read that begins or ends inside a request, plus O(1) per
        connection closed."""
        frontend = self._frontend
        frontend.unfinished += held - self._unfinished
        since = frontend.unfinished_since
        if not held:
            since.pop(self, None)
        elif completed or not self._unfinished:  # (a request begun in this read: the newest)
            since.pop(self, None)
            since[self] = None
        self._unfinished = held
        limit = self._limits.max_unfinished_bytes
        while frontend.unfinished > limit and since:
            oldest = next(iter(since))
            del since[oldest]
            oldest.drop(f"its unfinished request holds {oldest._unfinished:,} bytes and began before every "
                        f"other one this store holds ({frontend.unfinished:,} bytes in all, past the limit "
                        f"(--max-unfinished-bytes) of {limit:,}): it stopped sending mid-request")
        return not self.closed

    def _behind(self) -> bool:
        """Has the client sent a link upstream requests whose effect or answer a PING's
        or CANCEL_WAIT's answer must not overtake? (See the class.)"""
        return self._write_room is not None and (self._unconfirmed or self._owed.waits > 0)

    def owed(self) -> int:
        """Bytes of answers this connection owes its client (see :mod:`.owed`). O(1)."""
        assert self._transport is not None
        owed = self._owed
        return self._transport.get_write_buffer_size() + owed.held + owed.reserved

    def _serve(self, requests: list) -> None:
        """Execute ``requests`` in order and write their answers, in one write; past
        ``TURN_REQUESTS`` (links and other clients first) or ``REPLY_BUFFER`` owed, keep the
        rest (``_backlog``) and stop reading until its turn (``_resume``). O(requests)."""
        execute = self._upstream.execute
        self._out = out = []
        owed, transport = self._owed, self._transport
        assert transport is not None
        room = REPLY_BUFFER - (transport.get_write_buffer_size() + owed.held + owed.reserved)  # (owed(), inlined)
        i = 0
        try:
            for i, req in enumerate(requests):
                if self.closed:  # (closed meanwhile: past the budget of unread answers, see _park)
                    return
                if i == TURN_REQUESTS:  # (the rest on the next turn, after everyone else's)
                    self._backlog = requests[i:]
                    transport.pause_reading()
                    asyncio.get_running_loop().call_soon(self._resume)
                    break
                if room < 0:
                    self._write(out)
                    out.clear()
                    room = REPLY_BUFFER - self.owed()
                    if room < 0:  # (not reading: keep the rest until it does)
                        self._backlog = requests[i:]
                        transport.pause_reading()
                        return
                op = req[0]
                if op == _PING and not self._behind():
                    out.append(encode_u32(req[1]))
                    continue
                if op == _CANCEL_WAIT and self._behind():
                    self._owed.sent(_SYNC, self._limits)
                    execute(_SYNC, self)
                    self._fence = self._swallow = True
                    self._write(out)
                    out.clear()
                    self._backlog = requests[i:]
                    transport.pause_reading()
                    return
                if op == _INVALID:
                    self._write(out)
                    self.drop(req[1])
                    return
                if op in NO_REPLY_OPS and self._write_room is not None and not self._write_room(self):
                    self._write(out)  # (the link is congested: its writes wait, unread)
                    out.clear()
                    self._backlog = requests[i:]
                    transport.pause_reading()
                    return
                if op in _ANSWERED_LATER and self._owed.waits and self._write_room is not None:
                    self._write(out)  # (see the class: what torch's server would answer, a link cannot)
                    self.drop(f"{Op(op).name} sent before its previous WAIT or BARRIER was answered: through a "
                              "link (a node proxy, or a store host's --workers) a connection waits for one at a "
                              "time, as torch's client does")
                    return
                reply = execute(req, self)
                if reply is not None:
                    out.append(reply)
                    room -= len(reply)
                    if op == _CANCEL_WAIT:
                        self._owed.cancelled()
                elif op not in NO_REPLY_OPS:
                    room -= owed.sent(req, self._limits)
                    if op not in _ANSWERED_LATER:
                        self._fence = True
                        if out:
                            self._write(out)
                            out.clear()
                        if i + 1 < len(requests):
                            self._backlog = requests[i + 1:]
                            transport.pause_reading()
                        return
                elif self._write_room is not None:  # (a write through a link)
                    self._unconfirmed = True
        except StoreError as e:
            self._write(out)
            self.drop(f"{Op(requests[i][0]).name} failed: {e}")
            return
        finally:
            self._out = None
        if out:
            self._write(out)

    def _become_link(self, rest: bytes | None) -> None:
        acceptor = self._frontend.link_acceptor
        assert acceptor is not None and self._transport is not None
        release = self._frontend.became_link(self)
        self.closed = True
        acceptor(self._transport, self.peer, rest, release)

    def _write(self, out: list[bytes]) -> None:
        if out and not self.closed:
            data = out[0] if len(out) == 1 else b"".join(out)
            gate = self._gate
            if gate is not None and gate.closed:
                self._owed.held += len(data)
                gate.emit(self._send, data)
                return
            transport = self._transport
            assert transport is not None
            write_answer(transport, data)  # (past the buffer's high-water mark: pause_writing, now)
            if self._writing_paused:  # (before, or since a slice of it: what is held counts)
                self._park(max(0, transport.get_write_buffer_size() - self._unread))

    def _park(self, more: int) -> None:
        """``more`` bytes of answers wait in the socket's buffer of this connection while
        its writing is paused (its client is not reading them, or not yet): counted in
        its front-end's total of unread answers. Past ``limits.max_unread_total_bytes``,
        the connections paused longest ago, for at least ``UNREAD_GRACE``, are closed at
        once, freeing what they hold: clients that read get their answers; the one that
        stopped reading first goes. O(1), plus O(1) per connection closed."""
        frontend = self._frontend
        self._unread += more
        frontend.unread += more
        since = frontend.unread_since
        if self not in since:
            since[self] = None
        limit = self._limits.max_unread_total_bytes
        while frontend.unread > limit and since:
            oldest = next(iter(since))
            if monotonic() - oldest._paused_at < UNREAD_GRACE:
                break  # (a burst of answers being read: the oldest goes once its grace is over)
            held = oldest._unpark()
            log.warning("closing connection from %s: %s bytes of answers not read, the client that stopped "
                        "reading longest ago of this store's, whose unread answers (%s bytes with them) pass the "
                        "limit (--max-unread-total-bytes) of %s: it is not reading its answers", oldest.peer,
                        f"{held:,}", f"{frontend.unread + held:,}", f"{limit:,}")
            oldest.closed = True
            assert oldest._transport is not None
            oldest._transport.abort()  # (not a lingering close: its answers would stay)

    def _unpark(self) -> int:
        """Not counted as unread any more (reading again, or closed): what it counted."""
        held, self._unread = self._unread, 0
        self._frontend.unread -= held
        self._frontend.unread_since.pop(self, None)
        return held

    def wake(self, reply: bytes) -> None:
        """A deferred answer (a WAIT woken, any answer through a link): written after the
        answers of the requests being executed, if any (a pipelined SET may wake this
        client's own WAIT). Closes a client owed more than its budget; lifts the fence of
        the answer that held the client's next requests back (see the class)."""
        self._owed.answered(reply)
        if self._fence:  # (answers other than WAIT's come in order: this is the fence's)
            self._fence = False
            self._unconfirmed = False
            if self._swallow:  # (_SYNC's: now the CANCEL_WAIT it went ahead of)
                self._swallow = False
                if not self.closed:
                    cancel = self._backlog.pop(0)
                    try:
                        answer = self._upstream.execute(cancel, self)
                    except StoreError as e:
                        self.drop(f"CANCEL_WAIT failed: {e}")
                        return
                    self._owed.cancelled()
                    self._write([answer])  # type: ignore[list-item]
                    self._resume()
                return
        self._deliver(reply)

    def wake_wait(self, reply: bytes) -> None:
        """A WAIT's or BARRIER's answer, from a link upstream."""
        self._owed.answered_wait()
        self._deliver(reply)

    def _deliver(self, reply: bytes) -> None:
        if self._out is not None:
            self._out.append(reply)
            return
        self._write([reply])
        if not self.closed:
            owed, transport = self._owed, self._transport
            assert transport is not None
            if transport.get_write_buffer_size() + owed.held + owed.reserved > self._limits.max_unread_bytes:
                self.drop(f"{self.owed():,} bytes of answers not read, past the limit (--max-unread-bytes) "
                          f"of {self._limits.max_unread_bytes:,}: it is not reading its answers")
            elif self._backlog or not transport.is_reading():
                self._resume()  # (also when nothing is kept: reading may have stopped while
                # writing was paused, and resume_writing found the fence up)

    def _send(self, data: bytes) -> None:
        """An answer the reply gate held: written now (also once the connection is
        dropped: it answers a request from before; the FIN waits for it, see drop)."""
        owed = self._owed
        owed.held -= len(data)
        transport = self._transport
        assert transport is not None
        if not transport.is_closing():
            write_answer(transport, data)
            if self._writing_paused:  # (as in _write)
                self._park(max(0, transport.get_write_buffer_size() - self._unread))
            if not self.closed:
                if self._backlog:
                    self._resume()
            elif owed.held == 0:
                self._linger(transport)

    def drop(self, reason: str) -> None:
        """Close this connection because of something the client did; log one line."""
        if self.closed:
            return
        self._frontend.closed_log.warning("closing connection from %s: %s", self.peer, reason)
        self.closed = True
        self._frontend.unfinished -= self._unfinished  # (what its parser held goes now)
        self._frontend.unfinished_since.pop(self, None)
        self._unfinished = 0
        self._parser = RequestParser(self._limits)
        transport = self._transport
        assert transport is not None
        transport.resume_reading()  # (what it still sends is read and discarded)
        if self._owed.held == 0:  # (else once the reply gate lets its answers go: _send)
            self._linger(transport)

    @staticmethod
    def _linger(transport: asyncio.Transport) -> None:
        """A lingering close: the answers written go, then a FIN; what the client still
        sends is discarded for up to LINGER seconds. (Closing with bytes unread resets
        the connection, and the reset may destroy answers on their way: a client that
        pipelined a request past a limit after others lost their answers.)"""
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER, transport.close)

    def pause_writing(self) -> None:
        assert self._transport is not None
        self._writing_paused = True
        self._transport.pause_reading()
        self._paused_at = monotonic()
        self._park(self._transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._unpark()
        self._resume()

    def room_again(self) -> None:
        """The link has room for writes again (see ``tier.connection.SessionEnd.write_room``)."""
        self._resume()

    def _resume(self) -> None:
        """Execute the requests kept while the client was owed too much, if it is owed
        little enough now; read again once none is left."""
        assert self._transport is not None
        if self.closed or self._out is not None or self._fence:  # (_serve is running: it goes on itself)
            return
        if self._backlog:
            if self.owed() > REPLY_BUFFER:
                return
            backlog, self._backlog = self._backlog, []
            self._serve(backlog)
        if not self.closed and not self._backlog and not self._writing_paused:
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._frontend.unfinished -= self._unfinished
        self._frontend.unfinished_since.pop(self, None)
        self._unfinished = 0
        self._unpark()
        self._upstream.forget(self)
        self._frontend.release(self)

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()
