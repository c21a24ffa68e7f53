"""What a watch saw of its key, as the core hands it out and links carry it.

    state := ABSENT                      the key holds no value (and is no queue)
           | VALUE | u64 length | value  the key's value
           | UNWATCHABLE                 a queue's key: nothing was registered
"""

from __future__ import annotations

import struct

ABSENT, VALUE, UNWATCHABLE = b"\x00", b"\x01", b"\x02"

#: How a read watches its key (a link carries each as its own entry kind):
#: WATCH_READ: watched now (a WAIT on a missing key as absent, while it waits: later
#: WAITs may join it); FETCH: a WAIT watched only once its key is there, of a client
#: with nothing outstanding (a front-end above may answer it from its own watch);
#: FETCH_AFTER_WRITES: the same, of a client with writes on their way up, which must
#: execute first (only the core answers it); PEEK: no client's read, a front-end reading
#: ahead: the key's state at once, the key watched only if it holds a value.
WATCH_READ, FETCH, FETCH_AFTER_WRITES, PEEK = range(4)
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
