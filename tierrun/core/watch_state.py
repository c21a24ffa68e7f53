"""What a watch saw of its key, as the core hands it out and links carry it.

    state := ABSENT                      the key holds no value (and is no queue)
           | VALUE | u64 length | value  the key's value
           | UNWATCHABLE                 a queue's key: nothing was registered
"""

from __future__ import annotations

import struct

ABSENT, VALUE, UNWATCHABLE = b"\x00", b"\x01", b"\x02"
_u64 = struct.Struct("<Q")


def encode_watch_state(watched: bool, value: bytes | None) -> bytes:
    if not watched:
        return UNWATCHABLE
    return ABSENT if value is None else VALUE + _u64.pack(len(value)) + value


def decode_watch_answer(data: bytes) -> tuple[bool, bytes | None, bytes]:
    """A state followed by a request's answer: (watched, the value or None, the answer).
    Raises ValueError on anything else."""
    head = data[:1]
    if head == VALUE and len(data) >= 9:
        (n,) = _u64.unpack_from(data, 1)
        if len(data) >= 9 + n:
            return True, data[9 : 9 + n], data[9 + n :]
    elif head == ABSENT or head == UNWATCHABLE:
        return head == ABSENT, None, data[1:]
    raise ValueError("malformed watch state")
