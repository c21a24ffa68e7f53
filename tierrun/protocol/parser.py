"""Sans-I/O parser of the torch TCPStore request stream: bytes in, requests out.

A request is a tuple ``(op, *args)`` with ``op`` in the torch 2.2+ numbering
(:class:`~tierrun.protocol.opcodes.Op`); keys and values are ``bytes``::

    (Op.SET, key, value)            (Op.COMPARE_SET, key, expected, desired)
    (Op.GET, key)                   (Op.ADD, key, delta)
    (Op.CHECK, keys)                (Op.WAIT, keys)            keys: tuple[bytes, ...]
    (Op.GETNUMKEYS,)                (Op.DELETE_KEY, key)
    (Op.APPEND, key, value)         (Op.MULTI_GET, keys)
    (Op.MULTI_SET, keys, values)    (Op.CANCEL_WAIT,)
    (Op.PING, nonce)                (Op.QUEUE_PUSH, key, value)
    (Op.QUEUE_POP, key)             (Op.QUEUE_LEN, key)
    (Op.LIST_KEYS,)                 (Op.BARRIER, key, world_size)

VALIDATE is checked here and produces no request. The numbering (2.1 or 2.2+) is
decided from the first bytes of the connection: a 2.2+ client always opens with
``00 ce f7 85 3c``, and only there: a VALIDATE later on is invalid, as torch's server
has it (it closes the connection).

Cost: every byte is examined once (a request split across reads resumes where it
stopped), so parsing is O(bytes read). Nothing is allocated from a length the client
claims before that many bytes have arrived, and every length is checked against
:class:`Limits` as soon as it is read, to avoid memory exhaustion by a hostile peer.
"""

from __future__ import annotations

import struct

from .limits import Limits
from .opcodes import TORCH21_MAX_OPCODE, VALIDATION_MAGIC, Op

Request = tuple


class ProtocolError(Exception):
    """The peer sent something no torch client sends; the connection must be closed.
    ``requests``: those completed before it in the same ``RequestParser.feed`` (and a
    MULTI_SET's pairs before a bad one: see ``RequestParser``), to execute first."""

    requests: list = []
    partial: tuple | None = None  # (a MULTI_SET of the pairs before the bad one)


class LimitExceeded(ProtocolError):
    """A well-formed request past a size limit: torch's server closes that client. (A
    link entry past the store host's limits fails its client only; a malformed one
    ends the link's session.)"""


# Field kinds of a request's plan.
_KEY, _VALUE, _U32, _I64, _KEYS, _PAIRS = range(6)

_PLANS: dict[int, tuple[int, ...]] = {
    Op.SET: (_KEY, _VALUE),
    Op.COMPARE_SET: (_KEY, _VALUE, _VALUE),
    Op.GET: (_KEY,),
    Op.ADD: (_KEY, _I64),
    Op.CHECK: (_KEYS,),
    Op.WAIT: (_KEYS,),
    Op.GETNUMKEYS: (),
    Op.DELETE_KEY: (_KEY,),
    Op.APPEND: (_KEY, _VALUE),
    Op.MULTI_GET: (_KEYS,),
    Op.MULTI_SET: (_PAIRS,),
    Op.CANCEL_WAIT: (),
    Op.PING: (_U32,),
    Op.QUEUE_PUSH: (_KEY, _VALUE),
    Op.QUEUE_POP: (_KEY,),
    Op.QUEUE_LEN: (_KEY,),
    Op.LIST_KEYS: (),
    Op.BARRIER: (_KEY, _I64),
}

_OP_MEMBERS = tuple(Op)  # Op(n) is slow on the hot path; indexing is not
_u32 = struct.Struct("<I").unpack_from
_u64 = struct.Struct("<Q").unpack_from
_i64 = struct.Struct("<q").unpack_from
_MAGIC_BYTES = b"\x00" + struct.pack("<I", VALIDATION_MAGIC)

# Numbering of a connection, decided by its first bytes.
_UNDECIDED, _TORCH22, _TORCH21 = range(3)


_DEFAULT_LIMITS = Limits()


# Fast paths of decode_request for what start-up traffic is made of: a key, a key and a
# counter, a key and a value, one key to WAIT for or CHECK. Each takes a request only if
# it is exactly well formed and within limits, else returns None and the general path
# decodes it (or raises its error).
def _key(data: bytes, end: int, limits: Limits) -> Request | None:
    (n,) = _u64(data, 1)
    if 9 + n == end and n <= limits.max_key_bytes:
        return (_OP_MEMBERS[data[0]], data[9:])
    return None


def _key_i64(data: bytes, end: int, limits: Limits) -> Request | None:
    (n,) = _u64(data, 1)
    if 17 + n == end and n <= limits.max_key_bytes:
        return (_OP_MEMBERS[data[0]], data[9 : 9 + n], _i64(data, 9 + n)[0])
    return None


def _key_value(data: bytes, end: int, limits: Limits) -> Request | None:
    (n,) = _u64(data, 1)
    if 17 + n > end or n > limits.max_key_bytes:
        return None
    (m,) = _u64(data, 9 + n)
    if 17 + n + m == end and m <= limits.max_value_bytes:
        return (_OP_MEMBERS[data[0]], data[9 : 9 + n], data[17 + n :])
    return None


def _one_key(data: bytes, end: int, limits: Limits) -> Request | None:
    if end < 17 or _u64(data, 1)[0] != 1:
        return None
    (n,) = _u64(data, 9)
    if 17 + n == end and n <= limits.max_key_bytes:
        return (_OP_MEMBERS[data[0]], (data[17:],))
    return None


_FAST = {Op.GET: _key, Op.ADD: _key_i64, Op.SET: _key_value, Op.WAIT: _one_key, Op.CHECK: _one_key}


def _too_long(n: int, limit: int, is_value: object) -> ProtocolError:
    return LimitExceeded(f"{'value' if is_value else 'key'} of {n} bytes exceeds the limit of {limit}")


def decode_request(data: bytes, limits: Limits = _DEFAULT_LIMITS) -> Request:
    """Exactly one complete torch 2.2+ request, VALIDATE excluded: what a link entry
    carries. The store host's per-operation path for links: the whole request is in
    hand, so nothing is buffered or resumed, and the cost is O(len(data)). The same
    limits as the stream parser; raises :class:`ProtocolError` on anything else
    (a truncated request, trailing bytes)."""
    end = len(data)
    if end > limits.max_request_bytes:
        raise LimitExceeded(f"request exceeds {limits.max_request_bytes} bytes")
    if not end or data[0] > Op.BARRIER or data[0] == Op.VALIDATE:
        raise ProtocolError("a link entry must hold exactly one request")
    op = data[0]
    fast = _FAST.get(op)
    if fast is not None and end > 8:
        req = fast(data, end, limits)
        if req is not None:
            return req
    args: list = [_OP_MEMBERS[op]]
    pos = 1
    try:
        for kind in _PLANS[op]:
            if kind == _KEY or kind == _VALUE:
                (n,) = _u64(data, pos)
                limit = limits.max_key_bytes if kind == _KEY else limits.max_value_bytes
                if n > limit:
                    what = "key" if kind == _KEY else "value"
                    raise LimitExceeded(f"{what} of {n} bytes exceeds the limit of {limit}")
                pos += 8
                args.append(data[pos : pos + n])
                pos += n
            elif kind == _U32:
                args.append(_u32(data, pos)[0])
                pos += 4
            elif kind == _I64:
                args.append(_i64(data, pos)[0])
                pos += 8
            else:
                (count,) = _u64(data, pos)
                if count > limits.max_keys_per_request:
                    raise LimitExceeded(
                        f"{count} keys in one request exceed the limit of {limits.max_keys_per_request}"
                    )
                pos += 8
                pairs = kind == _PAIRS
                # (the limit of item j: keys, or a pair's key then its value)
                limit_of = (limits.max_key_bytes, limits.max_value_bytes if pairs else limits.max_key_bytes)
                items = []
                append = items.append
                for j in range(count * 2 if pairs else count):
                    (n,) = _u64(data, pos)
                    if n > limit_of[j & 1]:
                        raise _too_long(n, limit_of[j & 1], pairs and j & 1)
                    pos += 8
                    append(data[pos : pos + n])
                    pos += n
                if pairs:
                    args += (tuple(items[0::2]), tuple(items[1::2]))
                else:
                    args.append(tuple(items))
            if pos > end:
                break
    except struct.error:
        pos = end + 1
    if pos != end:
        raise ProtocolError("a link entry must hold exactly one request")
    return tuple(args)


class RequestParser:
    """Turns the byte stream of one client connection into requests.

    ``feed(data)`` returns every request completed by ``data`` and keeps the rest for
    later. It raises :class:`ProtocolError` on anything invalid, with the requests
    ``data`` completed before it as the error's ``requests`` (torch's server executes
    and answers those, then closes); the parser is then unusable and the caller should
    close the connection.
    """

    __slots__ = (
        "_limits", "_buf", "_numbering", "_op", "_plan", "_step", "_args",
        "_items", "_remaining", "_request_bytes", "_items_bytes",
    )

    def __init__(self, limits: Limits | None = None, numbering: str | None = None) -> None:
        """``numbering="2.2"`` skips detection (links carry 2.2+ requests, no VALIDATE)."""
        self._limits = limits or Limits()
        self._buf = bytearray()
        self._numbering = _TORCH22 if numbering == "2.2" else _UNDECIDED
        self._op = -1  # opcode of the request being parsed, -1 between requests
        self._plan: tuple[int, ...] = ()
        self._step = 0  # index into _plan
        self._args: list = []
        self._items: list = []  # keys (or keys and values, in turn) of a _KEYS/_PAIRS field so far
        self._remaining = -1  # items still to read in a _KEYS/_PAIRS field; -1: count unread
        self._request_bytes = 0  # bytes of the current request consumed so far
        self._items_bytes = 0  # bytes of the keys and values in _items

    @property
    def is_legacy(self) -> bool:
        """True once the connection is known to use torch 2.1's numbering."""
        return self._numbering == _TORCH21

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by a complete field."""
        return len(self._buf)

    @property
    def held(self) -> int:
        """Bytes held for the request being received: what is buffered, and the keys
        and values of a multi-key request parsed so far. O(1)."""
        return len(self._buf) + self._items_bytes

    def feed(self, data: bytes) -> list[Request]:
        out: list[Request] = []
        try:
            self._feed(data, out)
        except ProtocolError as e:
            e.requests = out if e.partial is None else out + [e.partial]
            raise
        return out

    def _feed(self, data: bytes, out: list[Request]) -> None:
        buf = self._buf
        buf += data
        if self._numbering == _UNDECIDED and not self._decide_numbering():
            return
        pos = 0
        end = len(buf)
        limits = self._limits
        while True:
            start = pos
            if self._op < 0:
                if pos >= end:
                    break
                op = buf[pos]
                if self._numbering == _TORCH21:
                    if op > TORCH21_MAX_OPCODE:
                        raise ProtocolError(f"unknown opcode {op} (torch 2.1 numbering)")
                    op += 1
                elif op > Op.BARRIER:
                    raise ProtocolError(f"unknown opcode {op}")
                elif op == Op.VALIDATE:  # (the first one went with the numbering; torch's
                    # server closes at this opcode, before its magic: so here, at once)
                    raise ProtocolError("VALIDATE after the connection's first request")
                pos += 1
                self._op = op
                self._plan = _PLANS[op]
                self._step = 0
                self._args = [_OP_MEMBERS[op]]
                self._request_bytes = 1
            plan = self._plan
            args = self._args
            complete = True
            while self._step < len(plan):
                kind = plan[self._step]
                if kind == _KEY or kind == _VALUE:
                    if end - pos < 8:
                        complete = False
                        break
                    (n,) = _u64(buf, pos)
                    limit = limits.max_key_bytes if kind == _KEY else limits.max_value_bytes
                    if n > limit:
                        what = "key" if kind == _KEY else "value"
                        raise ProtocolError(f"{what} of {n} bytes exceeds the limit of {limit}")
                    if end - pos - 8 < n:
                        complete = False
                        break
                    args.append(bytes(buf[pos + 8 : pos + 8 + n]))
                    pos += 8 + n
                elif kind == _U32:
                    if end - pos < 4:
                        complete = False
                        break
                    args.append(_u32(buf, pos)[0])
                    pos += 4
                elif kind == _I64:
                    if end - pos < 8:
                        complete = False
                        break
                    args.append(_i64(buf, pos)[0])
                    pos += 8
                else:
                    pos, complete = self._parse_items(kind, pos, end)
                    if not complete:
                        break
                self._step += 1
            self._request_bytes += pos - start
            if self._request_bytes > limits.max_request_bytes:
                raise ProtocolError(
                    f"request exceeds {limits.max_request_bytes} bytes"
                )
            if not complete:
                break
            self._op = -1
            out.append(tuple(args))
        if pos:
            del buf[:pos]

    def _parse_items(self, kind: int, pos: int, end: int) -> tuple[int, bool]:
        """Parse a counted list of keys (_KEYS) or key/value pairs (_PAIRS).

        Resumable: the items parsed so far (a pair's key, then its value) are kept in
        ``self._items``. O(bytes): what is still to parse is copied once a call, and only
        when its next item is all in (so each byte at most twice), and each item once
        more: an agent's MULTI_SET of every node's ranks costs a few steps per key.
        """
        buf = self._buf
        limits = self._limits
        pairs = kind == _PAIRS
        if self._remaining < 0:
            if end - pos < 8:
                return pos, False
            (count,) = _u64(buf, pos)
            if count > limits.max_keys_per_request:
                raise ProtocolError(
                    f"{count} keys in one request exceed the limit of "
                    f"{limits.max_keys_per_request}"
                )
            pos += 8
            self._remaining = count * 2 if pairs else count
            self._items = []
        items = self._items
        # (the limit of item j: keys, or a pair's key then its value)
        limit_of = (limits.max_key_bytes, limits.max_value_bytes if pairs else limits.max_key_bytes)
        j = len(items)
        if not self._remaining:  # (a request of no keys)
            data = b""
        elif end - pos < 8:
            return pos, False
        elif end - pos - 8 < _u64(buf, pos)[0]:
            # the next item is not all in: copy nothing (a 64 MiB value arriving in
            # small reads must not be copied once per read), but refuse it now if its
            # length is past its limit
            (n,) = _u64(buf, pos)
            if n > limit_of[j & 1]:
                raise self._item_too_long(n, limit_of[j & 1], pairs, j)
            return pos, False
        else:
            data = bytes(buf[pos:end])  # (slices of bytes are bytes: one copy per item)
        p, size = 0, len(data)
        append = items.append
        remaining = self._remaining
        while remaining:
            if size - p < 8:
                break
            (n,) = _u64(data, p)
            if n > limit_of[j & 1]:
                raise self._item_too_long(n, limit_of[j & 1], pairs, j)
            q = p + 8 + n
            if q > size:
                break
            append(data[p + 8 : q])
            self._items_bytes += q - p
            p = q
            j += 1
            remaining -= 1
        self._remaining = remaining
        pos += p
        if remaining:
            return pos, False
        if pairs:
            self._args.append(tuple(items[0::2]))
            self._args.append(tuple(items[1::2]))
        else:
            self._args.append(tuple(items))
        self._items = []
        self._items_bytes = 0
        self._remaining = -1
        return pos, True

    def _item_too_long(self, n: int, limit: int, pairs: bool, j: int) -> ProtocolError:
        """Item ``j`` of a _KEYS/_PAIRS field claims ``n`` bytes, past ``limit``. In a
        MULTI_SET the pairs before it still take effect, as on torch's server, which
        sets each pair as it reads it and closes the connection at the bad one: they
        go as a MULTI_SET of their own (``ProtocolError.partial``), unless that would
        pass the request-bytes limit (a request tierrun refuses whole anyway). (A
        MULTI_SET still arriving takes effect only once whole or cut short by a bad
        pair, where torch's pairs take effect one by one as they arrive: a deviation
        by decision, ``tests/oracle/regressions.py``.)"""
        e = _too_long(n, limit, pairs and j & 1)
        if pairs and j >= 2:
            items = self._items[: j - (j & 1)]
            if 9 + sum(8 + len(item) for item in items) <= self._limits.max_request_bytes:
                e.partial = (Op.MULTI_SET, tuple(items[0::2]), tuple(items[1::2]))
        return e

    def _decide_numbering(self) -> bool:
        """Tell torch >= 2.2 (opens with VALIDATE) from torch 2.1 (no VALIDATE)."""
        buf = self._buf
        if not buf:
            return False
        if buf[0] != 0:
            self._numbering = _TORCH21
            return True
        if len(buf) < len(_MAGIC_BYTES):
            return False
        if buf[: len(_MAGIC_BYTES)] == _MAGIC_BYTES:
            self._numbering = _TORCH22
            del buf[: len(_MAGIC_BYTES)]  # (checked: the only VALIDATE a connection may send)
            return True
        # Opcode 0 without the magic: a 2.1 SET, unless the key length is absurd, in
        # which case it is most likely a VALIDATE with a wrong magic.
        if len(buf) >= 9 and _u64(buf, 1)[0] > self._limits.max_key_bytes:
            raise ProtocolError(
                f"wrong VALIDATE magic {_u32(buf, 1)[0]:#x} in the first request"
            )
        if len(buf) < 9:
            return False
        self._numbering = _TORCH21
        return True
