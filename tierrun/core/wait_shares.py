"""Whose WAITs hold the keys waited for: each source's share (a client's host, a node's
link), so that one greedy source cannot lock everyone else out of the store.

A key waited for counts against ``--max-store-keys`` while it is waited for (the store
holds ~300 B for it: :meth:`.budget.StoreBudget.wait`). Counted alone, 8 connections of
one host, each waiting on 131,072 missing keys (torch's limit per request), held the
whole default budget: every other client's next new key, and its next WAIT (torch's
``get`` is a WAIT first), was refused. So when waits hold half the key budget or more
(a store full of keys, not of waits, refuses as before), a request past the budget (a
write, or a WAIT) takes room from the sources that wait on more keys than the
requester's source would with the request, greediest first, each only down to that
level, their largest waits first: if what they may give covers what the request needs
(keys and bytes), those waits are dropped (each client closed with one log line, as a
refused request's is) and the request goes; else it is refused and nothing is dropped.

What it does not do: a source is an address (or a node's link, whose clients' waits and
writes are all one source), so a hog spread over many addresses, or over many small
WAITs behind one node, can still be the smaller one, and a well-behaved client waiting
on many keys the one dropped; a source that filled the store with keys (not waits) is
not counted for them.

Cost: O(1) per wait and answer besides the budget's O(keys); a request refused while waits hold half the budget,
O(sources) plus O(w log w) for the w waits of each source it looks at, and one retry.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def source_of(waiter: Any) -> object:
    """Whose share a waiter's keys count in: its ``scan_source`` (a client connection's
    host; a node link's session, for the requests that come through a node proxy), else
    the waiter itself."""
    source = getattr(waiter, "scan_source", None)
    return waiter if source is None else source


class WaitShares:
    """Keys waited for per source, and (keys, key bytes) per waiter of each source."""

    __slots__ = ("keys_of", "waiters_of", "total")

    def __init__(self) -> None:
        self.total = 0  # keys waited for, all sources together
        self.keys_of: dict[object, int] = {}
        self.waiters_of: dict[object, dict[Any, tuple[int, int]]] = {}

    def added(self, waiter: Any, n: int, key_bytes: int) -> None:
        """``waiter`` waits on ``n`` keys of ``key_bytes`` bytes (it waited on nothing). O(1)."""
        source = source_of(waiter)
        self.total += n
        self.keys_of[source] = self.keys_of.get(source, 0) + n
        self.waiters_of.setdefault(source, {})[waiter] = (n, key_bytes)

    def removed(self, waiter: Any) -> None:
        """``waiter`` waits no more (answered, forgotten). O(1)."""
        source = source_of(waiter)
        waiters = self.waiters_of[source]
        n = waiters.pop(waiter)[0]
        self.total -= n
        if waiters:
            self.keys_of[source] -= n
        else:
            del self.keys_of[source]
            del self.waiters_of[source]

    def room(self, waiter: Any, waits: int, entries: int, size: int) -> list[tuple[Any, int, int]] | None:
        """The waits to drop so that ``waiter``'s request (which would wait on
        ``waits`` keys) fits: ``entries`` keys and ``size`` bytes past the budget.
        Takes from each source that waits on more keys than the requester's would,
        greediest first, down to that level, its largest waits first. Each is
        ``(waiter, its keys, its source's keys before)``; None if they cannot free
        enough (then nothing is to be dropped)."""
        level = self.keys_of.get(source_of(waiter), 0) + waits
        heap = [(-held, i, source) for i, (source, held) in enumerate(self.keys_of.items()) if held > level]
        heapq.heapify(heap)  # (the index: sources never compare)
        plan: list[tuple[Any, int, int]] = []
        while heap and (entries > 0 or size > 0):
            _, _, source = heapq.heappop(heap)
            held = before = self.keys_of[source]
            largest_first = sorted(self.waiters_of[source].items(), key=lambda item: item[1][0], reverse=True)
            for victim, (n, key_bytes) in largest_first:
                if held <= level or (entries <= 0 and size <= 0):
                    break
                plan.append((victim, n, before))
                held -= n
                entries -= n
                size -= key_bytes
        return plan if entries <= 0 and size <= 0 else None


def make_room(core: Any, waiter: Any, full: Any, retry: Callable[[], T]) -> T:
    """``waiter``'s request was refused (``full``: a ``budget.BudgetFull``): if waits
    hold half the key budget or more and others' waits may make the room (see the
    module), drop them and run the request again (``retry``: it changed nothing when
    refused, as the core refuses before it changes anything); else re-raise."""
    budget, shares = core.budget, core.shares
    if shares.total * 2 < budget.max_entries:  # (full of keys, not of waits)
        raise full
    plan = shares.room(waiter, full.waits, full.over_entries, full.over_bytes)
    if not plan:
        raise full
    for victim, n, held in plan:
        core.forget(victim)
        victim.drop(f"its wait on {n:,} keys was dropped to make room for another host's request: the store's "
                    f"budget (--max-store-keys {budget.max_entries:,}, --max-store-bytes {budget.max_bytes:,}) "
                    f"is full of waits and its host (or node) waited on {held:,} keys, more than any other: "
                    "wait for fewer keys at a time")
    refused = budget.refused  # (counted once, by the first try)
    try:
        result = retry()
    except BaseException:
        budget.refused = refused
        raise
    budget.refused = refused - 1
    return result
