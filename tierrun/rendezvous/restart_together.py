"""The members of a round stop their workers together when a node joins.

torch's agent, every monitor interval, looks at its workers first and only if they are
healthy asks the handler ``num_nodes_waiting``; a positive answer stops and restarts
them, a membership change that does not count against ``--max_restarts``. Agents poll
out of phase, so the first to stop its workers fails the others' collectives, and an
agent that finds its worker failed before it asked counts a failure: with no restart
left, a job that was only scaling up ends (torchrun's c10d backend has this race).

So a member, the first time it sees its round changed by a joining node, counts itself
in and waits until every member of the round has, at most ``wait_limit`` (a member whose
workers finished, or that hangs, never will; nor one whose agent looks less often than
that). While it waits its agent is inside ``num_nodes_waiting``, past the health check:
its workers may fail now, it restarts them anyway. A member that comes back to the next
round on its own (its workers failed, it restarts) counts itself in for the round it
left; one that leaves releases the others. Per member and change: a GET of why the round
changed, an ADD, and unless it completes the count a WAIT on a connection of its own.
Members come back to the next round up to ``wait_limit`` apart, so that round's last
call waits for them that long, plus ``REJOIN``, at least (``last_call_limit``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("tierrun.rendezvous")

#: Seconds a member waits for the others to see the change, past their agents' monitor interval.
TIMEOUT = 5.0
#: Seconds a member may take to stop its workers and join the next round, once all have seen.
REJOIN = 5.0


def wait_limit(monitor_interval: float) -> float:
    """How long a member waits for the others, whose agents look every ``monitor_interval``
    seconds (torch's agent's; the launcher passes it, the same on every node as a rule)."""
    return TIMEOUT + monitor_interval


def last_call_limit(last_call: float, monitor_interval: float) -> float:
    """The last call of a round whose previous round changed by a join: long enough for
    that round's members, which restart together, to be back."""
    return max(last_call, wait_limit(monitor_interval) + REJOIN)


class Barrier:
    """One node's side, across rounds: it counts itself in at most once per round.
    Thread-safe. ``store`` is a torch ``Store`` holding round r's keys, ``key(name)``
    names one of them; store errors raise."""

    def __init__(self) -> None:
        self._counted: set[int] = set()
        self._lock = threading.Lock()

    def wait(self, r: int, store, key: Callable[[str], str], members: int, limit: float,
             wait: Callable[[list[str], float], None], where: str) -> None:
        """Round r changed because a node joined (the caller knows: not after a death or
        a leave, when the members' workers fail anyway and nobody may wait for the
        dead): count in, the first time, and block until every member has, at most
        ``limit`` s. ``wait(keys, timeout)`` WAITs, raising ``TimeoutError``."""
        if not self._first(r) or count_in(store, key, members):
            return
        try:
            wait([key("all_seen")], limit)
        except TimeoutError:
            log.warning("%s: not every member saw the new node within %.0f s (their agents look every "
                        "--monitor_interval seconds; or one has finished, or hangs); restarting this node's "
                        "workers now: another node's may fail in a collective first", where, limit)

    def back(self, r: int, store, key: Callable[[str], str], members: int) -> None:
        """This member left round r on its own (its workers failed; it is back in the
        next round) without having counted in: it counts in, so nobody waits for it."""
        if self._first(r):
            count_in(store, key, members)

    def _first(self, r: int) -> bool:
        with self._lock:
            first = r not in self._counted
            self._counted.add(r)
            return first


def count_in(store, key: Callable[[str], str], members: int) -> bool:
    """ADD the round's ``seen`` count; the member that completes it SETs ``all_seen``,
    which the others WAIT for. Returns whether every member has now seen the change."""
    if int(store.add(key("seen"), 1)) < members:
        return False
    store.set(key("all_seen"), "1")
    return True
