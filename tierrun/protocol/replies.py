"""Encoders of the server's replies, byte for byte as torch's server writes them."""

from __future__ import annotations

import struct
from collections.abc import Iterable

_pack_u64 = struct.Struct("<Q").pack
_pack_i64 = struct.Struct("<q").pack
_pack_u32 = struct.Struct("<I").pack


def encode_bytes(value: bytes) -> bytes:
    """A byte vector: ``u64 length`` + bytes (GET, COMPARE_SET)."""
    return _pack_u64(len(value)) + value


#: ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN: ``encode_i64(value)``. The struct's own
#: method, not a function around it: ADD's answer is on the store's hottest path.
encode_i64 = _pack_i64


def encode_u32(value: int) -> bytes:
    """PING echoes its nonce."""
    return _pack_u32(value)


def encode_many(values: Iterable[bytes]) -> bytes:
    """MULTI_GET: one byte vector per key, no count in front."""
    return b"".join([_pack_u64(len(v)) + v for v in values])


def encode_queue_pop(length_before: int, value: bytes | None) -> bytes:
    """QUEUE_POP: the queue's length before the pop, then the popped value if any."""
    if value is None:
        return _pack_i64(length_before)
    return _pack_i64(length_before) + _pack_u64(len(value)) + value


def encode_key_list(keys: Iterable[bytes]) -> bytes:
    """LIST_KEYS: ``i64`` count, then each key as a string."""
    keys = list(keys)
    return _pack_i64(len(keys)) + b"".join([_pack_u64(len(k)) + k for k in keys])
