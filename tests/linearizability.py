"""Wing & Gong's linearizability check, shared by the in-process tests
(test_linearizability.py) and the differential oracle's concurrent histories
(oracle/concurrent.py). Each brings its own sequential model: ``apply(state, request)``
returns ``(new state, reply)``, or None when the request cannot take effect in that
state (a WAIT on a missing key); a state must be hashable.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import lru_cache

from tierrun.protocol.opcodes import NO_REPLY_OPS


@dataclass
class Call:
    client: int
    req: tuple
    invoked: int
    returned: int | None = None  # logical time; None: never (a WAIT still pending)
    reply: bytes | None = None


def linearizable(calls: list[Call], apply: Callable[[Hashable, tuple], tuple | None], initial: Hashable,
                 no_reply=NO_REPLY_OPS) -> bool:
    """Wing & Gong's search with memoisation on (calls left, state). A client's calls
    take effect in its program order (one connection is FIFO). A call whose opcode is
    in ``no_reply`` may take effect with any reply."""
    previous: dict[int, int] = {}
    before = []  # the same client's previous call, or -1
    for i, c in enumerate(calls):
        before.append(previous.get(c.client, -1))
        previous[c.client] = i

    @lru_cache(maxsize=None)
    def search(left: frozenset, state) -> bool:
        if not left:
            return True
        # a call can go next only if it was invoked before every other left call returned
        first_return = min((calls[i].returned for i in left if calls[i].returned is not None), default=None)
        for i in left:
            c = calls[i]
            if (first_return is not None and c.invoked > first_return) or before[i] in left:
                continue
            outcome = apply(state, c.req)
            if outcome is None:
                continue
            new_state, reply = outcome
            if c.returned is not None and c.req[0] not in no_reply and reply != c.reply:
                continue
            if search(left - {i}, new_state):
                return True
        # a pending WAIT may never take effect
        pending = [i for i in left if calls[i].returned is None]
        return any(search(left - {i}, state) for i in pending)

    return search(frozenset(range(len(calls))), initial)
