"""Reading one key of the store over a link, blocking: for an agent that needs a value
before its node's proxy can start (a node of a store tree learns where its parent
takes links), where the store host's public port takes links only.

One LOOKUP frame (``link.frames``, ``link.auth``), authenticated by the job token as a
link is, but with no session: first as a UDP datagram to the store's port
(``hub.lookup_datagrams``: the cheapest for the store host, which takes one per node of
a tree), resent while unanswered; if no authenticated answer comes within
``udp_wait`` seconds (``LinkConfig.lookup_udp_wait``: UDP filtered, an older store
host), over TCP, sent with the link's first byte: the store host reads it at once,
answers once the key is set, and closes.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

from ..link import auth
from ..link.config import LinkConfig
from ..link.frames import ERROR, FOUND, HELLO, LINK_MAGIC, PENDING, FrameDecoder, LinkError

_u64 = struct.Struct("<Q")
#: The largest answer read (an address, here): a peer cannot make this end buffer more
#: before it proved it knows the token.
MAX_ANSWER = 1 << 16
#: Seconds between resends once the store host said PENDING (it forgets a LOOKUP not
#: resent within ``hub.lookup_datagrams.FORGET_AFTER``; a FOUND may be lost).
UDP_RESEND = 1.0


def read_over_link(address: tuple[str, int], token: bytes, key: bytes, timeout: float,
                   source: str | None = None, udp_wait: float = LinkConfig.lookup_udp_wait) -> bytes:
    """The value of ``key`` (as stored: torch's clients add a leading ``/``), once it is
    set, connecting from the local address ``source`` if given. Blocks up to ``timeout``
    seconds in all. Raises ``OSError`` (unreachable; a ``TimeoutError`` past
    ``timeout``) or ``LinkError``: refused (a wrong token, another version, the
    store's budgets: its message), or an answer that does not prove the token."""
    deadline = time.monotonic() + timeout
    value = read_over_udp(address, token, key, deadline, source, udp_wait) if udp_wait > 0 else None
    if value is not None:
        return value
    timeout = max(deadline - time.monotonic(), 0.001)
    with socket.create_connection(address, timeout=timeout,
                                  source_address=None if source is None else (source, 0)) as sock:
        if sock.getsockname() == sock.getpeername():  # (see rendezvous.sockets.connect)
            raise ConnectionRefusedError(f"nothing listens on {address[0]}:{address[1]} yet")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request, nonce = auth.lookup(token, key)
        sock.sendall(bytes([LINK_MAGIC]) + request)
        decoder = FrameDecoder(MAX_ANSWER + 64)
        for ftype, payload in _frames(sock, decoder, deadline):
            if ftype == HELLO:  # (the store host greets every link; a LOOKUP needs no answer to it)
                if len(payload) < 2:
                    raise LinkError("malformed HELLO")
                auth.check_version(payload, "the store host speaks", "this node")
                continue
            if ftype == FOUND:
                answer = auth.check_found(token, nonce, payload)
                (length,) = _u64.unpack_from(answer)
                return answer[8 : 8 + length]
            if ftype == ERROR:  # (a refusal: a wrong token, or the store's)
                raise LinkError(payload.decode(errors="replace"))
            raise LinkError(f"unexpected frame type {ftype} in answer to a LOOKUP")
    raise LinkError("no answer")  # (not reached: _frames ends by raising)


def read_over_udp(address: tuple[str, int], token: bytes, key: bytes, deadline: float,
                  source: str | None, give_up: float) -> bytes | None:
    """``key``'s value by LOOKUP datagrams (sent at 0, 0.2, 0.6, 1.6 s..., then every
    ``UDP_RESEND`` once the store host answered PENDING), or None: no authenticated
    answer within ``give_up`` seconds, an ICMP error (nothing listening on the port
    yet, unreachable, a firewall's reject: at once on Linux), or the store host said to
    use TCP. Datagrams
    whose HMAC fails are ignored. Raises ``TimeoutError`` past ``deadline``."""
    made = _udp_socket(address, source)
    if made is None:  # (TCP says why, or finds a way)
        return None
    sock, where = made
    request, nonce = auth.lookup(token, key)
    datagram = bytes([LINK_MAGIC]) + request
    with sock:
        start = time.monotonic()
        heard = False  # the store host answered PENDING: it will answer FOUND
        retry = 0.2
        resend_at = start
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"the store host did not set {key.decode(errors='replace')} in time")
            if not heard and now - start >= give_up:
                return None
            if now >= resend_at:
                try:
                    sock.sendto(datagram, where)
                except OSError:  # (no route for UDP: TCP may have one)
                    return None
                resend_at = now + (UDP_RESEND if heard else retry)
                retry = min(2 * retry, UDP_RESEND)
            limit = min(resend_at, deadline) if heard else min(resend_at, deadline, start + give_up)
            sock.settimeout(max(limit - now, 0.001))
            try:
                data = sock.recv(MAX_ANSWER + 64)
            except TimeoutError:
                continue
            except OSError:  # (an ICMP error, reported by IP_RECVERR: refused, nothing on the
                # port yet, and TCP is refused at once too; or unreachable, or a firewall's
                # REJECT of UDP: TCP says why, or finds a way)
                return None
            # (from any address: a store host listening on every address may answer from
            # another than the one asked; FOUND and PENDING prove the token by their HMAC)
            if len(data) < 5 or int.from_bytes(data[:4], "little") != len(data) - 4:
                continue
            ftype, payload = data[4], data[5:]
            try:
                if ftype == FOUND:
                    answer = auth.check_found(token, nonce, payload)
                    (length,) = _u64.unpack_from(answer)
                    return answer[8 : 8 + length]
                if ftype == PENDING:
                    auth.check_pending(token, nonce, payload)
                    if not heard:
                        heard = True
                        resend_at = time.monotonic() + UDP_RESEND
                elif ftype == ERROR:  # (too large a value; unauthenticated: at worst, TCP for nothing)
                    return None
            except (LinkError, struct.error):
                continue  # (not the store host's: ignored)


def _udp_socket(address: tuple[str, int], source: str | None) -> tuple[socket.socket, tuple] | None:
    """A UDP socket for the first of ``address``'s resolved addresses it can be made
    for, bound to ``source`` if given (as ``socket.create_connection`` picks the first it
    can connect to), and that address; None if none. Forward lookups only."""
    host, port = address
    for family, _, _, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            sock = socket.socket(family, socket.SOCK_DGRAM)
        except OSError:  # (no IPv6 here)
            continue
        try:
            if source is not None:
                sock.bind((source, 0))
        except OSError:  # (another family than the source's)
            sock.close()
            continue
        _report_refusals(sock, family)
        return sock, where
    return None


def _frames(sock: socket.socket, decoder: FrameDecoder, deadline: float):
    """The frames ``sock`` receives, one at a time, until ``deadline``."""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the store host closed the link")
        yield from decoder.frames(data)


#: Linux's IP_RECVERR and IPV6_RECVERR (not in Python's socket module).
_RECVERR = {socket.AF_INET: (socket.IPPROTO_IP, 11), socket.AF_INET6: (socket.IPPROTO_IPV6, 25)}


def _report_refusals(sock: socket.socket, family: int) -> None:
    """Have an unconnected UDP socket's ``recv`` raise the ICMP errors its datagrams
    meet (``ConnectionRefusedError`` for a closed port, host unreachable, a firewall's
    reject), as a connected one would: while the store host is not up yet, or where
    UDP is rejected, a LOOKUP learns it at once instead of waiting out ``udp_wait``.
    Linux only; elsewhere the wait stays."""
    option = _RECVERR.get(family)
    if option is not None and sys.platform.startswith("linux"):
        try:
            sock.setsockopt(*option, 1)
        except OSError:
            pass
