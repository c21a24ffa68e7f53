"""Encoder of client requests (the inverse of :mod:`tierrun.protocol.parser`).

Used by tierrun's own clients (Unix sockets, tools, benchmarks) and by tests.
"""

from __future__ import annotations

import struct

from .opcodes import VALIDATION_MAGIC, Op
from .parser import Request

_pack_u64 = struct.Struct("<Q").pack
_pack_i64 = struct.Struct("<q").pack
_pack_u32 = struct.Struct("<I").pack


def _vec(b: bytes) -> bytes:
    return _pack_u64(len(b)) + b


def encode_request(req: Request, legacy: bool = False) -> bytes:
    """Bytes of one request; ``legacy`` uses torch 2.1's numbering."""
    op = req[0]
    if legacy:
        if op == Op.VALIDATE or op > Op.CANCEL_WAIT:
            raise ValueError(f"{Op(op).name} does not exist in torch 2.1's protocol")
        head = bytes((op - 1,))
    else:
        head = bytes((op,))
    if op in (Op.VALIDATE, Op.PING):
        return head + _pack_u32(req[1])
    if op in (Op.SET, Op.APPEND, Op.QUEUE_PUSH):
        return head + _vec(req[1]) + _vec(req[2])
    if op == Op.COMPARE_SET:
        return head + _vec(req[1]) + _vec(req[2]) + _vec(req[3])
    if op in (Op.GET, Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN):
        return head + _vec(req[1])
    if op in (Op.ADD, Op.BARRIER):
        return head + _vec(req[1]) + _pack_i64(req[2])
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):  # (a list, not a generator: joined faster)
        return head + _pack_u64(len(req[1])) + b"".join([_pack_u64(len(k)) + k for k in req[1]])
    if op == Op.MULTI_SET:
        pairs = b"".join([_pack_u64(len(k)) + k + _pack_u64(len(v)) + v
                          for k, v in zip(req[1], req[2], strict=True)])
        return head + _pack_u64(len(req[1])) + pairs
    if op in (Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS):
        return head
    raise ValueError(f"cannot encode {req!r}")


def encode_handshake(nonce: int) -> bytes:
    """What a torch >= 2.5 client sends first: VALIDATE then PING."""
    return encode_request((Op.VALIDATE, VALIDATION_MAGIC)) + encode_request((Op.PING, nonce))
