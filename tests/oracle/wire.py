"""Requests as tuples (tierrun's parser form, ``(Op.X, *args)``) -> raw bytes, and a
reader that cuts one connection's reply stream into the replies of the requests sent.

Besides tierrun's request tuples, a history may hold:
  ``(RAW, data)``             bytes sent as they are (unknown opcodes, absurd lengths)
  ``(Op.VALIDATE, magic)``    a VALIDATE in the middle of a connection
and a value or key may be a :class:`Big` (a long run of one byte, printed short).
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

from tierrun.protocol import Op
from tierrun.protocol.opcodes import VALIDATION_MAGIC
from tierrun.protocol.requests import encode_request

#: Pseudo-opcode: send ``req[1]`` as it is; no reply is expected.
RAW = 100

_u64 = struct.Struct("<Q").unpack_from
_i64 = struct.Struct("<q").unpack_from
_pack_u64 = struct.Struct("<Q").pack

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
KEY_LIMIT = 8 * 1024  # torch's libuv server: MAX_STRING_LEN
VALUE_LIMIT = 8 * 1024 * 1024  # MAX_PAYLOAD_LEN
KEYS_LIMIT = 128 * 1024  # MAX_KEY_COUNT


@dataclass(frozen=True)
class Big:
    """``n`` bytes of ``fill``: a value at a limit, without a literal of megabytes."""

    n: int
    fill: bytes = b"v"

    def __repr__(self) -> str:
        return f"Big({self.n}, {self.fill!r})"


def materialize(x):
    if isinstance(x, Big):
        return x.fill * x.n
    if isinstance(x, tuple):
        return tuple(materialize(i) for i in x)
    return x


def encode(req: tuple) -> bytes:
    if req[0] == RAW:
        return materialize(req[1])
    return encode_request(materialize(req))


def op_name(req: tuple) -> str:
    return "RAW" if req[0] == RAW else Op(req[0]).name


#: Requests whose answer may never come (the server holds it until the store changes).
BLOCKING = frozenset({Op.WAIT, Op.BARRIER})
#: Requests with no answer at all.
SILENT = frozenset({Op.VALIDATE, Op.SET, Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH, RAW})


def expects_reply(req: tuple) -> bool:
    return req[0] not in SILENT


def request_size(req: tuple) -> int:
    """Bytes on the wire, without building them."""
    def n(x):
        return x.n if isinstance(x, Big) else len(x)

    op = req[0]
    if op == RAW:
        return n(req[1])
    if op in (Op.VALIDATE, Op.PING):
        return 5
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):
        return 9 + sum(8 + n(k) for k in req[1])
    if op == Op.MULTI_SET:
        return 9 + sum(16 + n(k) + n(v) for k, v in zip(req[1], req[2]))
    total = 1
    for a in req[1:]:
        total += 8 + (n(a) if isinstance(a, (bytes, Big)) else 0)
    return total


def _vec(buf, pos: int):
    if len(buf) - pos < 8:
        return None
    (n,) = _u64(buf, pos)
    end = pos + 8 + n
    return end if end <= len(buf) else None


def _reply_end(req: tuple, buf, pos: int):
    """Where the reply to ``req`` starting at ``pos`` ends, or None if not all in."""
    op = req[0]
    have = len(buf) - pos
    if op in (Op.CHECK, Op.WAIT, Op.CANCEL_WAIT, Op.BARRIER):
        return pos + 1 if have >= 1 else None
    if op == Op.PING:
        return pos + 4 if have >= 4 else None
    if op in (Op.ADD, Op.GETNUMKEYS, Op.DELETE_KEY, Op.QUEUE_LEN):
        return pos + 8 if have >= 8 else None
    if op in (Op.GET, Op.COMPARE_SET):
        return _vec(buf, pos)
    if op == Op.MULTI_GET:
        for _ in req[1]:
            pos = _vec(buf, pos)
            if pos is None:
                return None
        return pos
    if op == Op.QUEUE_POP:
        if have < 8:
            return None
        return pos + 8 if _i64(buf, pos)[0] <= 0 else _vec(buf, pos + 8)
    if op == Op.LIST_KEYS:
        if have < 8:
            return None
        count = _i64(buf, pos)[0]
        pos += 8
        for _ in range(max(count, 0)):
            pos = _vec(buf, pos)
            if pos is None:
                return None
        return pos
    raise AssertionError(f"no reply expected to {op_name(req)}")


def normalize(req: tuple, reply: bytes) -> bytes:
    """LIST_KEYS lists keys in the order of torch's hash table: compared as a set."""
    if req[0] != Op.LIST_KEYS:
        return reply
    keys, pos = [], 8
    while pos < len(reply):
        end = _vec(reply, pos)
        keys.append(reply[pos:end])
        pos = end
    return reply[:8] + b"".join(sorted(keys))


def short(data: bytes, limit: int = 40) -> str:
    if len(data) <= limit:
        return repr(data)
    return f"{data[:limit]!r}...({len(data)} bytes)"


class ReplyReader:
    """The replies of one connection, in order. A WAIT (or BARRIER) still pending when
    the client sends CANCEL_WAIT is answered either 0 then 1 or (cancelled) 1 alone.

    ``tokens``: the completed replies so far, each ``(index of the request, bytes)``
    (LIST_KEYS normalized); ``cancelled``: indices of waits the cancel took away.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pending: deque[tuple[int, tuple]] = deque()  # (request index, request)
        self.sent = 0
        self.tokens: list[tuple[int, bytes]] = []
        self.closed = False

    def sending(self, req: tuple) -> None:
        if expects_reply(req):
            self.pending.append((self.sent, req))
            if len(self.pending) == 1:
                self.feed(b"")  # (an empty answer is complete at once)
        self.sent += 1

    def feed(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        buf = self.buf
        while self.pending:  # (a MULTI_GET of no keys is answered with no bytes)
            index, req = self.pending[0]
            if req[0] in BLOCKING and len(self.pending) > 1 and self.pending[1][1][0] == Op.CANCEL_WAIT \
                    and pos < len(buf) and buf[pos] == 1:
                self.pending.popleft()  # cancelled: the 1 is the CANCEL_WAIT's
                self.tokens.append((index, b"<cancelled>"))
                continue
            end = _reply_end(req, buf, pos)
            if end is None:
                break
            self.tokens.append((index, normalize(req, bytes(buf[pos:end]))))
            self.pending.popleft()
            pos = end
        del buf[:pos]

    @property
    def answered(self) -> bool:
        """Every request that must be answered at once has been (only waits pending)."""
        return all(req[0] in BLOCKING for _, req in self.pending)

    @property
    def waiting(self) -> bool:
        """A WAIT or BARRIER is still unanswered."""
        return any(req[0] in BLOCKING for _, req in self.pending)


def handshake(nonce: int) -> bytes:
    return encode_request((Op.VALIDATE, VALIDATION_MAGIC)) + encode_request((Op.PING, nonce))


def raw_claim(op: int, length: int) -> tuple:
    """A request whose first key/value claims ``length`` bytes and sends none of them."""
    return (RAW, bytes((op,)) + _pack_u64(length))
