"""A link session as a state machine, sans I/O, used by both ends: the handshake (one
flight each way), the numbering and acknowledgement of frames, resumption after a
reconnect, and the heartbeat deadline. Frames in, frames to send and events out;
adapters (``tier.connection`` at a front-end, ``hub.link_server`` at the store host or
a relaying proxy) own the sockets and timers.

Handshake (see frames.py for the frames)::

    front-end                                   store host
    MAGIC                       ------------>
                                <------------   HELLO(version, server nonce)
    AUTH + SESSION* + ACK*      ------------>   (one write, read in one wake-up)
                                <------------   WELCOME(HMAC) + RESUMED*(n, limits)
                                                + missed frames* + PONG*

Frames marked * and every later one are sealed (``seal``: a MAC each, under keys of
this connection derived from both nonces and the token). The front-end sends its
session id before the host proved it knows the token: a fake host gains nothing from
it, since resuming needs the token, and it cannot seal. RESUMED counts only after a
valid WELCOME. Anything else, or out of order, raises LinkError; what the peer has not
proved it sent (before WELCOME, or failing its MAC) raises ``Unauthenticated``, which
ends the connection but not the session.
"""

from __future__ import annotations

import secrets

from . import auth
from .frames import (
    ACK, AUTH, DEFAULT_MAX_FRAME, ERROR, HANDSHAKE_MAX_FRAME, HELLO, LINK_MAGIC, RESUMED, SESSION, WELCOME,
    LinkError, StoreSizes, Unauthenticated, decode_resumed, decode_session, encode_count, encode_session,
)
from .outbox import Outbox
from .seal import Opener, Sealer, session_keys

#: Why a store started without a job token (a flat job's) refuses a link.
NO_LINKS = "this store accepts no links (it was started without a job token)"


class Ledger:
    """One end's count of a session's numbered frames (BATCH one way; REPLIES and
    INVALIDATE the other): the frames it sent and keeps until acknowledged, the frames
    it received, and when it owes the peer an ACK: every ``ack_every`` frames, or every
    1/32 of the peer's resend buffer (so a peer sending large frames never fills it
    while we read them, nor long holds back its writers: see ``SessionEnd.write_room``).
    Outlives connections. O(1) per frame."""

    __slots__ = ("outbox", "received", "unacked_in", "ack_every", "unacked_bytes_in", "ack_bytes")

    def __init__(self, max_unacked_bytes: int, ack_every: int) -> None:
        self.outbox = Outbox(max_unacked_bytes)
        self.received = 0  # numbered frames received from the peer
        self.unacked_in = 0  # ... since our last ACK on this connection
        self.ack_every = ack_every
        self.unacked_bytes_in = 0  # ... and their bytes
        self.ack_bytes = max(1, max_unacked_bytes // 32)

    def sent(self, frame: bytes) -> None:
        """Number and keep ``frame``. Raises LinkError past the resend buffer's bound."""
        self.outbox.add(frame)

    def got(self, size: int = 0) -> bool:
        """A numbered frame (of ``size`` bytes) arrived: True when an ACK is due."""
        self.received += 1
        self.unacked_in += 1
        self.unacked_bytes_in += size
        return self.unacked_in >= self.ack_every or self.unacked_bytes_in >= self.ack_bytes

    def ack(self) -> bytes:
        """The ACK frame to send now (it is also the heartbeat)."""
        self.unacked_in = 0
        self.unacked_bytes_in = 0
        return encode_count(ACK, self.received)

    def acked(self, upto: int) -> None:
        """The peer has every frame up to ``upto``. Raises LinkError for frames never sent."""
        self.outbox.ack(upto)

    def resume(self, peer_received: int) -> list[bytes]:
        """A new connection of the session: the frames the peer lacks, to resend in
        order. Raises LinkError when the peer cannot be this session's peer."""
        self.unacked_in = 0
        self.unacked_bytes_in = 0
        return self.outbox.since(peer_received)


class ClientHandshake:
    """The front-end's side of the handshake on one connection. ``feed`` each frame
    until ``resumed`` is set; ``start()`` is what the connection sends first. Once it
    answered HELLO, ``sealer`` seals what the connection sends; ``opener`` (once the
    host proved the token) checks what it receives."""

    def __init__(self, token: bytes, session_id: bytes, fresh: bool, ledger: Ledger) -> None:
        self._token = token
        self._session_id = session_id
        self._fresh = fresh
        self._ledger = ledger
        self._client_nonce = b""
        self._server_nonce = b""
        self._opener: Opener | None = None
        self.sealer: Sealer | None = None
        self.welcomed = False  # the host proved it knows the token
        self.resumed: int | None = None  # the host's count of our frames, once resumed
        #: The store's sizes (limits on one request, largest value), from RESUMED.
        self.limits: StoreSizes | None = None

    @staticmethod
    def start() -> bytes:
        return bytes([LINK_MAGIC])

    @property
    def max_frame(self) -> int:
        """The largest frame to accept now: small until the host proved the token."""
        return DEFAULT_MAX_FRAME if self.welcomed else HANDSHAKE_MAX_FRAME

    @property
    def opener(self) -> Opener | None:
        """What checks the host's frames: set from the frame after WELCOME on."""
        return self._opener if self.welcomed else None

    def feed(self, ftype: int, payload: bytes) -> bytes:
        """One frame of the handshake; returns what to send as it goes on the wire (AUTH,
        then SESSION sealed: the adapter adds the first ACK, sealed, in the same write,
        whose PONG starts the watch lease), or b"" for nothing. Raises LinkError, or
        ``Unauthenticated`` for what comes before the host proved the token (a refusal
        included: an impostor may send one)."""
        if ftype == HELLO and not self._client_nonce:
            try:
                frame, self._client_nonce = auth.answer_hello(self._token, payload)
            except LinkError as e:
                raise Unauthenticated(str(e)) from None
            self._server_nonce = payload[2:]
            up, down = session_keys(self._token, self._server_nonce, self._client_nonce)
            self.sealer, self._opener = Sealer(up), Opener(down)
            return frame + self.sealer.seal(encode_session(self._session_id, self._fresh, self._ledger.received))
        if ftype == WELCOME and self._client_nonce and not self.welcomed:
            try:
                auth.check_welcome(self._token, self._server_nonce, self._client_nonce, payload)
            except LinkError as e:
                raise Unauthenticated(str(e)) from None
            self.welcomed = True
            return b""
        if ftype == RESUMED and self.welcomed and self.resumed is None:
            self.resumed, self.limits = decode_resumed(payload)
            return b""
        error = LinkError if self.welcomed else Unauthenticated  # (after WELCOME: sealed)
        if ftype == ERROR:
            raise error("the store host refused the link: " + payload.decode(errors="replace"))
        raise error(f"unexpected frame type {ftype} during the handshake")


class ServerHandshake:
    """The store host's side of the handshake on one connection: HELLO first, then
    AUTH, then SESSION. ``feed`` returns what to send; once SESSION arrives, ``session``
    holds (session id, fresh, the front-end's count of our frames) for the adapter to
    attach. ``token`` None: this end takes no links. Once AUTH is verified, ``sealer``
    seals what the connection sends after WELCOME and ``opener`` checks what it
    receives after AUTH."""

    def __init__(self, token: bytes | None) -> None:
        self._token = token
        self._nonce = secrets.token_bytes(auth.NONCE)
        self.authenticated = False
        self.session: tuple[bytes, bool, int] | None = None
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None

    def start(self) -> bytes:
        return auth.hello(self._nonce)

    @property
    def max_frame(self) -> int:
        return DEFAULT_MAX_FRAME if self.authenticated else HANDSHAKE_MAX_FRAME

    def feed(self, ftype: int, payload: bytes) -> bytes:
        """One frame of the handshake; returns what to send (WELCOME: never sealed).
        Raises LinkError."""
        if not self.authenticated:
            if ftype != AUTH:
                raise LinkError("expected AUTH")
            if self._token is None:
                raise LinkError(NO_LINKS)
            welcome = auth.check_auth(self._token, self._nonce, payload)
            up, down = session_keys(self._token, self._nonce, payload[2 : 2 + auth.NONCE])
            self.sealer, self.opener = Sealer(down), Opener(up)
            self.authenticated = True
            return welcome
        if ftype == SESSION and self.session is None:
            self.session = decode_session(payload)
            return b""
        raise LinkError(f"unexpected frame type {ftype}")

    def lookup(self, payload: bytes) -> tuple[bytes, bytes]:
        """A LOOKUP instead of AUTH: (its nonce, its key), verified; nothing may follow
        it on this connection. Raises LinkError."""
        if self.authenticated:
            raise LinkError("a LOOKUP after AUTH")
        if self._token is None:
            raise LinkError(NO_LINKS)
        self.authenticated = True  # (its answer is all this connection gets: no session)
        return auth.check_lookup(self._token, payload)

    def found(self, nonce: bytes, answer: bytes) -> bytes:
        """The FOUND frame of a verified LOOKUP's ``answer``."""
        assert self._token is not None
        return auth.found(self._token, nonce, answer)


class Heartbeat:
    """When the peer was last heard from, and whether it is presumed gone. Takes the
    time (monotonic seconds) from its caller."""

    __slots__ = ("last_rx", "timeout")

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.last_rx = now

    def heard(self, now: float) -> None:
        self.last_rx = now

    def silent(self, now: float) -> float:
        return now - self.last_rx

    def expired(self, now: float) -> bool:
        return now - self.last_rx > self.timeout


#: A deadline check that runs more than this (seconds) after it was due ran in a process
#: that was itself not running meanwhile: a loaded machine, or one long step of its event
#: loop. What its peers sent may then be waiting unread in its sockets (uvloop runs due
#: timers before it reads), so their silence is its own, not theirs.
LATE_CHECK = 0.1
#: When such a check looks again: after one turn of the event loop, which reads first.
RECHECK_AFTER = 0.01


class DeadlineCheck:
    """Decides whether a late heartbeat check may condemn a silent peer, or must look
    again after the event loop has read its sockets (once: a look again that was itself
    late condemns, so a process that is always behind still notices dead peers). Takes
    the time (monotonic seconds) from its caller. O(1)."""

    __slots__ = ("due", "deferred")

    def __init__(self) -> None:
        self.due = 0.0
        self.deferred = False

    def armed(self, now: float, delay: float, again: bool = False) -> float:
        """The check is scheduled ``delay`` seconds from ``now``, as a look again if
        ``again``; returns ``delay``."""
        self.due = now + delay
        self.deferred = again
        return delay

    def look_again(self, now: float) -> bool:
        """Called by a check at ``now`` that found a peer silent past its deadline: True if
        it should not condemn it yet but look again (arm ``RECHECK_AFTER``, ``again``)."""
        return not self.deferred and now - self.due > LATE_CHECK
