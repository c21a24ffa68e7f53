"""An elastic job's tree of node proxies (``--store-fanout F`` with ``tierrun``): each
round's tree is built from that round's members, in rank order (``tree.RoundTree``).

Every node's proxy links to the store host while the node joins a round: no node needs
anyone but the store host to rendezvous, whoever died. Once the round has closed, each
member knows its place: a member whose parent is another member's proxy waits until that
proxy publishes where it takes links (``r/tree/<rank>``, set by the parent once its own
move is done), starts a new proxy linked to it, on a fresh link session, moves its
round watch (heartbeat and the WAIT on ``r/changed``) onto it, and retires the old one;
a member with children publishes its proxy's link address. At the next re-formation
(torch's agent has stopped the node's workers before it calls ``next_rendezvous``) a
node whose proxy links to a parent goes back to a proxy linked to the store host the
same way. Every proxy a node starts takes links (``--link-listen``): any member may be a
relay in some round.

Why nothing is lost or applied twice: a node moves only while nothing of its own is in
flight through the proxy it leaves (its workers are stopped or not started yet, its
agent's requests are synchronous and done, and its round watch moves first); a new
proxy opens a new link session, so nothing is resent on another path; a replaced proxy
keeps its link, and relays for the nodes still linked to it, until they have moved
(``JobStore.retire``), so their requests on the way are answered on the path they took.
A request in flight through a relay that dies is in doubt: no proxy resends it
elsewhere, and its client's connection closes (as torch's client sees a store that
died), when its node leaves that proxy.
"""

from __future__ import annotations

import logging
import time

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ..server import StoreProcess
from .handler_base import StoreRendezvousHandler
from .job_store import JobStore
from .sockets import bracket
from .tree import RoundTree, store_fanout_from

log = logging.getLogger("tierrun.rendezvous")

#: Seconds a child's link to its parent may stay in doubt (reconnecting, or silent for
#: the link timeout) before the node re-forms the job through the store host.
PARENT_PATIENCE = 0.5
#: Seconds between two looks at that link (one stats request to the node's proxy).
PARENT_CHECK_INTERVAL = 0.25


class _RoundOver(Exception):
    """The round changed (a member died or left, a node joined) while a member waited."""


class TreeRounds(StoreRendezvousHandler):
    """The tree part of the ``tierrun`` handler: ``_go_flat`` before joining a round,
    ``_take_place`` once it closed, ``_parent_lost`` while it runs. A subclass gives
    ``_rewatch`` (restart the round watch on the node's current proxy), ``_round_changed``
    and ``_k`` (a round key)."""

    def __init__(self, job: JobStore, run_id: str, local_addr: str | None, config: dict) -> None:
        super().__init__(job, run_id, local_addr, config)
        #: This node's --store-fanout (0: none, or not tiered).
        self._fanout = store_fanout_from(config) if job.tiered else 0
        self._doubt_since: float | None = None
        self._doubt_checked = 0.0

    # -- what the handler gives -------------------------------------------------------

    def _rewatch(self) -> None:
        raise NotImplementedError

    def _round_changed(self, r: int) -> bool:
        raise NotImplementedError

    def _k(self, r: int, name: str) -> str:
        raise NotImplementedError

    # -- the tree ---------------------------------------------------------------------

    def _go_flat(self) -> None:
        """Before joining a round, or once its parent is lost: link this node's proxy to
        the store host if it links to a parent (which may be dead, or move in the new
        round), and move the round watch onto it. Blocks while the new proxy starts;
        raises ``RendezvousConnectionError`` if the store host is unreachable."""
        self._doubt_since = None
        if self.job.parent is None:
            return
        left = self.job.upstream_name
        old = self.job.relink(None)
        log.info("node %s re-forms through the store host: its store proxy no longer links to %s",
                 self.node_addr, left)
        self._rewatch()
        self.job.retire(old, self._stopped_beats_ended())

    def _take_place(self, r: int, rank: int, members: int, layout: str) -> None:
        """Once round ``r`` has closed: move this node's proxy under its parent in the
        round's tree, and publish where it takes links if it has children. ``layout``:
        the round's ``tree`` key, "F,HOST_RANK" (F = 0: no tree this round). A parent
        that does not publish (it died: the round re-forms; or it could not move)
        leaves this node linked to the store host for the round, which is correct, only
        wider. Blocks up to the store timeout."""
        fanout, host_rank = (int(v) for v in layout.split(","))
        if fanout == 0 or rank == host_rank or not isinstance(self.job.proxy, StoreProcess):
            return  # (the store host's node front-end is in its store process)
        tree = RoundTree(members, fanout, host_rank)
        parent = tree.parent(rank)
        if parent is not None:
            address = self._parent_address(r, parent)
            if address is not None:
                self._move(r, parent, address)
        proxy = self.job.proxy
        assert isinstance(proxy, StoreProcess) and self.job.link_addr is not None
        children = tree.children(rank)
        if children:
            where = f"{bracket(self.job.link_addr)}:{proxy.link_port}"
            self.job.client().set(self._k(r, f"tree/{rank}"), where)
        log.info("store tree of round %d: node %s (node rank %d) links to %s; %s", r, self.node_addr, rank,
                 self.job.upstream_name,
                 _linked(children))

    def _parent_address(self, r: int, parent: int) -> str | None:
        """Where the proxy of node rank ``parent`` takes links in round ``r``, once it
        published it; None if the round changed first, or after the store timeout."""
        key = self._k(r, f"tree/{parent}")

        def check() -> None:
            self.check_store_host()
            if self._round_changed(r):
                raise _RoundOver

        try:
            self._wait_quietly([key], self.job.timeout.total_seconds(), check)
        except _RoundOver:
            log.info("round %d changed before node rank %d published its proxy's link address; node %s "
                     "stays linked to the store host for the round", r, parent, self.node_addr)
            return None
        except TimeoutError:
            log.warning("node %s: its parent in the store tree of round %d, node rank %d, did not say where "
                        "its proxy takes links within %.0f s; this node stays linked to the store host for "
                        "the round. Check node rank %d's log.", self.node_addr, r, parent,
                        self.job.timeout.total_seconds(), parent)
            return None
        return self.job.client().get(key).decode()

    def _move(self, r: int, parent: int, address: str) -> None:
        name = f"its parent in the store tree (node rank {parent}'s proxy, {address})"
        try:
            old = self.job.relink((address, name))
        except RendezvousConnectionError as e:
            log.warning("node %s: its store proxy could not link to %s in round %d (%s); it stays linked "
                        "to the store host for the round", self.node_addr, name, r, e)
            return
        self._rewatch()  # (before the old proxy goes: the watchers see no gap in the beats)
        self.job.retire(old, self._stopped_beats_ended())

    def _parent_lost(self) -> bool:
        """This node's proxy links to a parent whose link has been in doubt for
        ``PARENT_PATIENCE`` (reconnecting: the parent's node died; or silent), or it gave
        up on it. The caller then re-forms the job (its workers restart, ``_go_flat``).
        At most one stats request to the proxy per ``PARENT_CHECK_INTERVAL``; False when
        the proxy links to the store host (``check_store_host`` judges that link)."""
        proxy = self.job.proxy
        if self.job.parent is None or not isinstance(proxy, StoreProcess):
            return False
        now = time.monotonic()
        if proxy.exited() is None and now - self._doubt_checked >= PARENT_CHECK_INTERVAL:
            self._doubt_checked = now
            # (silent for the link's own timeout, or reconnecting: a slow parent is no lost one)
            if self.job.link_in_doubt(self.job.link_config.heartbeat_timeout / 2):
                self._doubt_since = self._doubt_since or now
            else:
                self._doubt_since = None
        if proxy.exited() is None and (self._doubt_since is None or now - self._doubt_since < PARENT_PATIENCE):
            return False
        log.warning("node %s lost %s (%s); restarting this node's workers and re-forming the job through "
                    "the store host", self.node_addr, self.job.upstream_name,
                    "its proxy gave up on it" if proxy.exited() is not None else "the link is in doubt")
        return True


def _linked(children: list[int]) -> str:
    if not children:
        return "no node links to it"
    if len(children) == 1:
        return f"node rank {children[0]} links to its proxy"
    return f"node ranks {', '.join(map(str, children))} link to its proxy"
