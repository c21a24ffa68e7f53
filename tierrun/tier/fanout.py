"""Answer fan-out: an upstream operation's answer -> each of its clients' answers.
Pure (no I/O, no state): what sequential execution would have answered each of them.
Raises LinkError on an answer that cannot be the one of the request sent (our state and
the store host's disagree: the session must end)."""

from __future__ import annotations

import struct
from typing import Any

from ..core.watch_state import decode_watch_answer
from ..link.frames import LinkError
from ..protocol import Op
from ..core.values import wrap_i64
from .plan import UpOp

_i64 = struct.Struct("<q")
_u64 = struct.Struct("<Q")


def answers(u: UpOp, data: bytes) -> list[tuple[Any, bytes]]:
    """(client, its answer) for each waiter of a plain (not watching) op answered OK.
    O(waiters + len(data))."""
    if u.fold is not None:  # a MULTI_GET: each waiter's value, as a GET answer
        values = split_values(data, len(u.fold.keys))
        return [(w, values[pick]) for w, pick in zip(u.waiters, u.fold.picks)]
    deltas = u.deltas
    if deltas is not None and len(deltas) > 1:  # a merged ADD: final - sum + prefix_i, wrapped
        if len(data) != 8:
            raise LinkError(f"an ADD answered with {len(data)} bytes")
        prefix = _i64.unpack(data)[0] - wrap_i64(sum(deltas))
        out = []
        for w, d in zip(u.waiters, deltas):
            prefix += d
            out.append((w, _i64.pack(wrap_i64(prefix))))
        return out
    return [(w, data) for w in u.waiters]


def watch_answers(u: UpOp, data: bytes) -> tuple[bool, bytes | None, list[tuple[Any, Any, bytes]]]:
    """A watching read's answer: (watched, the key's value or None, and per waiter
    (client, its watcher or None, its answer)): a local client gets the request's
    answer, a front-end below the state with it."""
    try:
        watched, value, answer = decode_watch_answer(data)
    except ValueError as e:
        raise LinkError(str(e)) from None
    return watched, value, [(w, watcher, answer if watcher is None else data)
                            for w, watcher in zip(u.waiters, u.watchers or ())]


def failure(u: UpOp, reason: bytes) -> str:
    """What a client whose request the store host refused is told (its connection is
    then closed, as torch's server closes it)."""
    return failed(u.req[0], reason)


def failed(op: int, reason: bytes) -> str:
    """``SET failed: <reason>``; a reason from a relay (a proxy between this one and
    the store host) says so already, and is not said twice. O(len(reason))."""
    why = reason.decode(errors="replace")
    prefix = f"{Op(op).name} failed: "
    return why if why.startswith(prefix) else prefix + why


def split_values(data: bytes, n: int) -> list[bytes]:
    """A MULTI_GET answer of ``n`` keys, cut into one GET answer (u64 length + value)
    each. O(n)."""
    out = []
    at = 0
    try:
        for _ in range(n):
            end = at + 8 + _u64.unpack_from(data, at)[0]
            if end > len(data):
                break
            out.append(data[at:end])
            at = end
    except struct.error:
        pass
    if len(out) != n or at != len(data):
        raise LinkError(f"a MULTI_GET of {n} keys answered with {len(data)} bytes that do not hold them")
    return out
