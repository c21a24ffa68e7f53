"""Reading one key of the store over a link, blocking: for an agent that needs a value
before its node's proxy can start (a node of a store tree learns where its parent
takes links), where the store host's public port takes links only.

A link session of its own, the length of one WAIT and one GET, built from the sans-I/O
pieces (``link.session``, ``link.frames``): authenticated and sealed as a proxy's, so
the store host need not serve torch's protocol to other nodes.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time

from ..link import auth
from ..link.frames import (
    ERROR, FAILED, REPLIES, SESSION_ID_BYTES, FrameDecoder, LinkError, decode_replies, encode_batch, entry_open,
    entry_request,
)
from ..link.session import ClientHandshake, Ledger
from ..protocol import Op
from ..protocol.requests import encode_request

_u64 = struct.Struct("<Q")


def read_over_link(address: tuple[str, int], token: bytes, key: bytes, timeout: float,
                   source: str | None = None) -> bytes:
    """The value of ``key`` (as stored: torch's clients add a leading ``/``), once it is
    set, connecting from the local address ``source`` if given. Blocks up to ``timeout``
    seconds in all. Raises ``OSError`` (unreachable; a
    ``TimeoutError`` past ``timeout``), ``LinkError`` (refused: wrong token, another
    version), or ``LookupError`` if the store host fails the request."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(address, timeout=timeout,
                                  source_address=None if source is None else (source, 0)) as sock:
        if sock.getsockname() == sock.getpeername():  # (see rendezvous.sockets.connect)
            raise ConnectionRefusedError(f"nothing listens on {address[0]}:{address[1]} yet")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake = ClientHandshake(token, secrets.token_bytes(SESSION_ID_BYTES), True, Ledger(1 << 20, 1 << 30))
        decoder = FrameDecoder(handshake.max_frame)
        sock.sendall(handshake.start())
        frames = _frames(sock, decoder, deadline)
        while handshake.resumed is None:
            out = handshake.feed(*next(frames))
            if out:
                sock.sendall(out)
            decoder.max_frame, decoder.opener = handshake.max_frame, handshake.opener
        sealer = handshake.sealer
        assert sealer is not None
        # (two batches: on a link a WAIT does not hold back the requests after it)
        sock.sendall(sealer.seal(encode_batch([entry_open(1, b""),
                                               entry_request(1, 1, encode_request((Op.WAIT, (key,))))])))
        _answer(frames, 1)
        sock.sendall(sealer.seal(encode_batch([entry_request(1, 2, encode_request((Op.GET, key)))])))
        value = _answer(frames, 2)
        sock.sendall(sealer.seal(auth.error("done")))  # (the store host ends the session at once)
    (length,) = _u64.unpack_from(value)
    return value[8 : 8 + length]


def _frames(sock: socket.socket, decoder: FrameDecoder, deadline: float):
    """The frames ``sock`` receives, one at a time, until ``deadline``."""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the store host closed the link")
        yield from decoder.frames(data)


def _answer(frames, rid: int) -> bytes:
    """The answer to request ``rid`` (other frames, a PONG say, are skipped)."""
    for ftype, payload in frames:
        if ftype == ERROR:
            raise LinkError("the store host ended the link: " + payload.decode(errors="replace"))
        if ftype != REPLIES:
            continue
        for got, status, data in decode_replies(payload):
            if got == rid:
                if status == FAILED:
                    raise LookupError(data.decode(errors="replace"))
                return data
    raise LinkError("no answer")  # (not reached: frames ends by raising)
