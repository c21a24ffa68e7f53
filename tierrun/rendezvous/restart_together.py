"""The members of a round stop their workers together when a node joins.

torch's agent, every monitor interval, looks at its workers first and only if they are
healthy asks the handler ``num_nodes_waiting``; a positive answer stops and restarts
them, a membership change that does not count against ``--max_restarts``. Agents poll
out of phase, so the first to stop its workers fails the others' collectives, and an
agent that finds its worker failed before it asked counts a failure: with no restart
left, a job that was only scaling up ends (torchrun's c10d backend has this race).

So a member, the first time it sees its round changed by a joining node, counts itself
in and waits until every member of the round has (at most ``TIMEOUT``: a member whose
workers finished, or that hangs, never will). While it waits its agent is inside
``num_nodes_waiting``, past the health check: its workers may fail now, it restarts them
anyway. A member that comes back to the next round (its workers failed, it restarts)
counts itself in for the round it left. Two store requests per member per change.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("tierrun.rendezvous")

TIMEOUT = 5.0  # seconds a member waits for the others to see the change


def wait_for_members(store, key: Callable[[str], str], members: int,
                     wait: Callable[[list[str], float], None], where: str) -> None:
    """Count this member in and block until every member of the round has seen that a
    node joined, at most ``TIMEOUT`` s. Not after a death or a leave (``changed`` says
    which): the members' workers fail then anyway, and a restart must not wait for the
    dead. ``wait(keys, timeout)`` WAITs, raising ``TimeoutError``; store errors raise."""
    if store.multi_get([key("changed")])[0] != b"joined":
        return
    if count_in(store, key, members):
        return
    try:
        wait([key("all_seen")], TIMEOUT)
    except TimeoutError:
        log.info("%s: not every member saw the new node within %.0f s; restarting this node's "
                 "workers now", where, TIMEOUT)


def count_in(store, key: Callable[[str], str], members: int) -> bool:
    """ADD the round's ``seen`` count; the member that completes it SETs ``all_seen``,
    which the others WAIT for. Returns whether every member has now seen the change.
    ``store`` is a torch ``Store``; ``key(name)`` names a key of the round."""
    if int(store.add(key("seen"), 1)) < members:
        return False
    store.set(key("all_seen"), "1")
    return True
