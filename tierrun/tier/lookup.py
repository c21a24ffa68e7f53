"""Reading one key of the store over a link, blocking: for an agent that needs a value
before its node's proxy can start (a node of a store tree learns where its parent
takes links), where the store host's public port takes links only.

One LOOKUP frame, sent with the link's first byte (``link.frames``, ``link.auth``):
authenticated by the job token as a link is, but no session and no round trip before
it, so the store host reads it at once, answers once the key is set, and closes: one
read of one connection per node of the tree, where a session's handshake, batches and
goodbye took five.
"""

from __future__ import annotations

import socket
import struct
import time

from ..link import auth
from ..link.frames import ERROR, FOUND, HELLO, LINK_MAGIC, FrameDecoder, LinkError

_u64 = struct.Struct("<Q")
#: The largest answer read (an address, here): a peer cannot make this end buffer more
#: before it proved it knows the token.
MAX_ANSWER = 1 << 16


def read_over_link(address: tuple[str, int], token: bytes, key: bytes, timeout: float,
                   source: str | None = None) -> bytes:
    """The value of ``key`` (as stored: torch's clients add a leading ``/``), once it is
    set, connecting from the local address ``source`` if given. Blocks up to ``timeout``
    seconds in all. Raises ``OSError`` (unreachable; a ``TimeoutError`` past
    ``timeout``) or ``LinkError``: refused (a wrong token, another version, the
    store's budgets: its message), or an answer that does not prove the token."""
    deadline = time.monotonic() + timeout
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


def _frames(sock: socket.socket, decoder: FrameDecoder, deadline: float):
    """The frames ``sock`` receives, one at a time, until ``deadline``."""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the store host closed the link")
        yield from decoder.frames(data)
