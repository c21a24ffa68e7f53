"""Whose WAITs hold the keys waited for: each source's share (a client's host, a node's
link), so that one greedy source cannot lock everyone else out of the store.

A key waited for counts against ``--max-store-keys`` while it is waited for (the store
holds ~300 B for it: :meth:`.budget.StoreBudget.wait`). Counted alone, 8 connections of
one host, each waiting on 131,072 missing keys (torch's limit per request), held the
whole default budget: every other client's next new key, and its next WAIT (torch's
``get`` is a WAIT first), was refused. So when waits hold half the key budget or more
(a store full of keys, not of waits, refuses as before), a request past the budget (a
write, or a WAIT) takes room from the source that waits on the most keys, if that one
waits on more than the requester's source would with the request: that source's
largest waits are dropped, one at a time, until the request goes (each client closed
with one log line, as a refused request's is). So a source that waits on few keys is
never refused for what others wait for; the greediest is refused, or closed.

Cost: O(1) per wait and answer; each wait dropped to make room, O(sources + the
greediest's waiters), and only while the budget is full.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def source_of(waiter: Any) -> object:
    """Whose share a waiter's keys count in: its ``scan_source`` (a client connection's
    host; a node link's session, for the ticket of a WAIT through a node proxy), else
    the waiter itself."""
    source = getattr(waiter, "scan_source", None)
    return waiter if source is None else source


class WaitShares:
    """Keys waited for per source, and per waiter of each source. O(1) per call but
    :meth:`greediest`."""

    __slots__ = ("keys_of", "waiters_of", "total")

    def __init__(self) -> None:
        self.total = 0  # keys waited for, all sources together
        self.keys_of: dict[object, int] = {}
        self.waiters_of: dict[object, dict[Any, int]] = {}

    def added(self, waiter: Any, keys: int) -> None:
        source = source_of(waiter)
        self.total += keys
        self.keys_of[source] = self.keys_of.get(source, 0) + keys
        self.waiters_of.setdefault(source, {})[waiter] = keys

    def removed(self, waiter: Any, keys: int) -> None:
        source = source_of(waiter)
        self.total -= keys
        left = self.keys_of[source] - keys
        if left:
            self.keys_of[source] = left
            del self.waiters_of[source][waiter]
        else:
            del self.keys_of[source]
            del self.waiters_of[source]

    def greediest(self, waiter: Any, keys: int) -> tuple[int, Any]:
        """The source that waits on the most keys, if it waits on more than
        ``waiter``'s would with ``keys`` more: its keys, and its waiter that waits on
        the most; else (0, None). O(sources + that source's waiters)."""
        if not self.keys_of:
            return 0, None
        source = max(self.keys_of, key=self.keys_of.__getitem__)
        held = self.keys_of[source]
        mine = source_of(waiter)
        if source == mine or held <= self.keys_of.get(mine, 0) + keys:
            return 0, None
        waiters = self.waiters_of[source]
        return held, max(waiters, key=waiters.__getitem__)


def make_room(core: Any, waiter: Any, full: Any, retry: Callable[[], T]) -> T:
    """``waiter``'s request was refused (``full``: a ``budget.BudgetFull``): drop the
    largest waits of the greediest source (see the module), one at a time, retrying the
    request after each, until it goes; re-raises when no wait may be dropped for it. A
    node proxy's link is one source: its largest waits go first, so a greedy client's
    WAIT on many keys goes before its node's other clients' waits. The request changed
    nothing when refused (the core refuses before it changes anything)."""
    budget, shares = core.budget, core.shares
    refused = budget.refused  # (counted once, whatever the retries)
    while True:
        held, victim = shares.greediest(waiter, full.waits)
        if victim is None or shares.total * 2 < budget.max_entries:  # (full of keys, not of waits)
            budget.refused = refused
            raise full
        n = shares.waiters_of[source_of(victim)][victim]
        core.forget(victim)
        victim.drop(f"its wait on {n:,} keys was dropped to make room for another host's request: the store's "
                    f"budget (--max-store-keys {budget.max_entries:,}, --max-store-bytes {budget.max_bytes:,}) "
                    f"is full and its host (or node) waited on {held:,} keys, the most of any: wait for fewer "
                    "keys at a time")
        try:
            result = retry()
        except type(full) as again:
            full = again
            continue
        budget.refused = refused - 1
        return result
