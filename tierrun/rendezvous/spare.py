"""A node that arrives while the running round has its maximum of nodes (``--nnodes
MIN:MAX``) waits as a spare, as torch's c10d backend puts such a node on its redundancy
list: the running members could not admit it, so it does not make them restart; it
joins the next round once a member leaves or dies, and if the job ends first it exits
without error. A spare holds no place in the next round while it waits (one that dies
meanwhile leaves nothing behind), and checks every ``POLL`` seconds whether the job has
ended: one request per spare per poll, whatever the job's size."""

from __future__ import annotations

import logging
from typing import Callable

from torch.distributed.elastic.rendezvous import RendezvousClosedError

log = logging.getLogger("tierrun.rendezvous")

POLL = 1.0


class SpareNotNeededError(RendezvousClosedError):
    """The job ended while this node waited as a spare: nothing failed."""


def wait(node: str, run_id: str, r: int, max_nodes: int, changed_within: Callable[[float], bool],
         ended: Callable[[], bool]) -> None:
    """Wait as a spare until round ``r`` (running with ``max_nodes``) changes:
    ``changed_within(seconds)`` blocks up to that long and says whether it did; ``ended()``
    whether the job has ended, which raises ``SpareNotNeededError``. Blocks."""
    log.warning("node %s: round %d of rendezvous '%s' runs with its maximum of %d nodes (--nnodes); this node "
                "waits as a spare and joins when one of them leaves or dies", node, r, run_id, max_nodes)
    while True:
        changed = changed_within(POLL)
        if ended():
            raise SpareNotNeededError(
                f"node {node} waited as a spare and was not needed: rendezvous '{run_id}' ended with its "
                f"maximum of {max_nodes} nodes running (raise the maximum of --nnodes MIN:MAX to use more nodes)")
        if changed:
            return
