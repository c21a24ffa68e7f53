"""What a request can fail on, and how the store reads the counters it holds (as
torch's server does: ``std::stoll``, int64 wrap-around)."""

from __future__ import annotations

import re


class StoreError(Exception):
    """A request the store cannot execute (ADD on a non-number, a write past the
    store's budget, an answer past its size limit).

    As in torch's server, the requester's connection is closed (torch's client then
    raises ``DistNetworkError``); the store is unchanged and serves everyone else.
    """


# std::stoll: optional leading whitespace, a sign, then at least one digit; the rest
# is ignored.
_LEADING_INT = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def parse_counter(value: bytes, key: bytes) -> int:
    """Read a counter the way torch's server does (``std::stoll``). Raises StoreError."""
    if value.isdigit() and len(value) < 19:  # what ADD itself stores: the fast path
        return int(value)
    m = _LEADING_INT.match(value)
    if m is None:
        raise StoreError(f"key {key!r} holds {value[:32]!r}, which is not a number")
    n = int(m.group(1))
    if not _I64_MIN <= n <= _I64_MAX:
        raise StoreError(f"key {key!r} holds a number outside int64")
    return n


def wrap_i64(n: int) -> int:
    """Two's-complement wrap, as an int64 addition does on every platform we run on."""
    return (n + (1 << 63)) % (1 << 64) - (1 << 63)
