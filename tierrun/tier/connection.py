"""The connections of a front-end's link session: one TCP connection at a time, the
handshake, frames in and out, reconnecting with backoff and resuming (see
:class:`.upstream.LinkUpstream`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from time import monotonic

from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import (
    ACK, DEFAULT_MAX_FRAME, ERROR, HANDSHAKE_MAX_FRAME, HELLO, INVALIDATE, LINK_MAGIC, PONG, REPLIES, RESUMED,
    WELCOME, FrameDecoder, LinkError, decode_count, decode_pong, encode_count, encode_session,
)
from .plan import PlanLimits
from .upstream import LinkUpstream

log = logging.getLogger("tierrun.frontend")


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
        self.last_rx = monotonic()
        link = self._link
        try:
            for ftype, payload in self._decoder.feed(data):
                if ftype == REPLIES and self.established.done():
                    link.on_replies(payload)
                    self._counted()
                elif ftype == INVALIDATE and self.established.done():
                    link.replies_received += 1  # (numbered with the REPLIES frames)
                    link.on_invalidate(payload)
                    self._counted()
                elif ftype == PONG and self.established.done():
                    received, lease = decode_pong(payload)
                    link._outbox.ack(received)
                    if self._pings:  # the core heard from us when this ACK arrived
                        link.lease_granted(self, self._pings.popleft() + lease)
                elif ftype == ACK and self.established.done():
                    link._outbox.ack(decode_count(payload))
                elif ftype == HELLO and not self._client_nonce:
                    # AUTH, SESSION and the first ACK (its PONG starts the watch lease)
                    # in one write: the store host reads them in one wake-up. The
                    # session id goes out before the host proved it knows the token,
                    # which gives a fake host nothing: it cannot resume without the token.
                    self._server_nonce = payload[2:]
                    frame, self._client_nonce = auth.answer_hello(link._token, payload)
                    self.ack(frame + encode_session(link.session_id, not link._opened, link.replies_received))
                elif ftype == WELCOME and self._client_nonce and not self._welcomed:
                    auth.check_welcome(link._token, self._server_nonce, self._client_nonce, payload)
                    self._welcomed = True
                    self._decoder.max_frame = DEFAULT_MAX_FRAME
                elif ftype == RESUMED and self._welcomed and not self.established.done():
                    link.established(self, decode_count(payload))
                    self.established.set_result(None)
                elif ftype == ERROR:
                    what = "ended the link session" if self.established.done() else "refused the link"
                    raise LinkError(f"the store host {what}: {payload.decode(errors='replace')}")
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
        except LinkError as e:
            if not self.established.done():
                self.established.set_exception(e)
                self.abort(str(e))
            else:  # the session is unusable: our state and the core's disagree
                link.die(str(e))
        except Exception as e:  # a bug, or no memory: fail-stop, never resume past it
            log.exception("unexpected error handling the store host's frames")
            if not self.established.done():
                self.established.set_exception(LinkError(f"internal error: {e!r}"))
            link.die(f"internal error in the node's link to the store host: {e!r}")

    def _counted(self) -> None:
        self._unacked_in += 1
        if self._unacked_in >= self._link.config.ack_every:
            self.ack()

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
        self._link.connection_lost(self, reason)


def _retrieve(f: asyncio.Future[None]) -> None:
    if not f.cancelled():
        f.exception()


async def _open(link: LinkUpstream, timeout: float) -> None:
    """One attempt: connect, authenticate, open or resume the session. Raises OSError,
    TimeoutError, or LinkError when the store host refuses."""
    assert link.address is not None
    loop = asyncio.get_running_loop()
    transport, conn = await asyncio.wait_for(loop.create_connection(link.connection, *link.address), timeout)
    try:
        await asyncio.wait_for(asyncio.shield(conn.established), timeout)
    except BaseException:
        transport.abort()
        raise


async def reconnect(link: LinkUpstream, reason: str) -> None:
    """Reconnect with backoff (0.1 s to 1 s) until the grace period ends."""
    loop = asyncio.get_running_loop()
    grace = link.config.grace
    since = loop.time()
    host, port = link.address  # type: ignore[misc]
    reason = reason.replace("the store host", f"the store host {host}:{port}", 1)
    reason = reason.replace(" lost (", f" lost at {time.strftime('%H:%M:%S')} (", 1)
    log.warning("%s; reconnecting (for up to %g s)", reason, grace)
    delay = 0.1
    try:
        while link.dead is None:  # (it may give up meanwhile, e.g. its buffer overflowed)
            try:
                await _open(link, link.config.heartbeat_timeout)
                log.warning("link to the store host resumed after %.1f s", loop.time() - since)
                return
            except LinkError as e:  # refused: the session is gone, or not our store
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
    finally:
        link._reconnecting = None


async def connect_link(host: str, port: int, token: bytes, on_lost: Callable[[str], None],
                       timeout: float = 60.0, config: LinkConfig | None = None,
                       limits: PlanLimits | None = None) -> LinkUpstream:
    """Connect and open a session, retrying while the store host is not up yet (backoff
    0.1 s to 2 s). Raises LinkError (refused, wrong token, version) or TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    link = LinkUpstream(token, on_lost, config, (host, port), limits)
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
