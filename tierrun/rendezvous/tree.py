"""The shape of a tree of node proxies (``--store-fanout F``): pure functions, O(1).

The store host serves its own node's agent and workers from its store (its node
front-end, with no link: one of its F) and takes no children: its workers are one hop
from the store, and it relays no other node's requests (relaying 64 nodes' at 512x8,
fanout 8, cost node 0 as much CPU again as its store: ``bench/wireup.py``). The other
nodes take places 0..K-1 of a heap: places 0..F-2 link to the store host, place
q >= F-1 to the proxy in place (q - F + 1) // F. So every proxy, the store host's core
included, has at most F links.

A static job (``parallel``) places node rank k in place k - 1 (node rank 0 hosts the
store): :class:`TreePlace`. An elastic round (``tierrun``) places its members in rank
order, the store host left out wherever its rank falls: :class:`RoundTree`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .conf import conf_flag


def parent_place(place: int, fanout: int) -> int | None:
    """The place whose proxy ``place`` links to; None: the store host."""
    top = fanout - 1  # places linked to the store host (its node front-end is its F-th)
    return None if place < top else (place - top) // fanout


def has_children(place: int, fanout: int, places: int) -> bool:
    """Whether some place of ``places`` links to ``place`` (its first child is F - 1 + F * place)."""
    return fanout - 1 + fanout * place < places


def store_fanout_from(config: dict) -> int:
    """``--rdzv_conf store_fanout=F`` (set by ``--store-fanout F``); 0: no tree.
    Raises ValueError saying what to write: not a whole number, 1 or negative, or a
    tree without ``tiered=1`` (its proxies are tiered wire-up's)."""
    raw = str(config.get("store_fanout", 0)).strip()
    try:
        f = int(raw)
    except ValueError:
        raise ValueError(f"store_fanout={raw} is not a whole number: write 0 (no tree) or 2 or more") from None
    if f < 0 or f == 1:
        raise ValueError(f"store_fanout={f}: write 0 (no tree) or 2 or more")
    if f and not conf_flag(config, "tiered"):
        raise ValueError(f"store_fanout={f} stacks the node proxies of tiered wire-up in a tree: add tiered=1 "
                         "(--tiered), or drop store_fanout")
    return f


@dataclass(frozen=True)
class TreePlace:
    """A static job's node ``rank`` in a tree of ``nodes`` (node rank 0 hosts the store):
    its parent's node rank (None: the store host) and whether it takes links, on
    ``addr``, publishing where under ``key(rank)``."""

    rank: int
    nodes: int
    fanout: int
    #: This node's address, where its proxy takes its children's links.
    addr: str
    run_id: str

    @property
    def parent(self) -> int | None:
        if self.rank == 0:
            return None
        up = parent_place(self.rank - 1, self.fanout)
        return None if up is None else up + 1

    @property
    def has_children(self) -> bool:
        return self.rank > 0 and has_children(self.rank - 1, self.fanout, self.nodes - 1)

    def key(self, rank: int) -> str:
        return f"tierrun/{self.run_id}/tree/{rank}"


@dataclass(frozen=True)
class RoundTree:
    """An elastic round's tree: ``members`` nodes of ranks 0..members-1, the store host
    the one of rank ``host_rank`` (-1: the store host is no member of the round). The
    others take places in rank order."""

    members: int
    fanout: int
    host_rank: int

    @property
    def places(self) -> int:
        return self.members - (0 <= self.host_rank < self.members)

    def _place(self, rank: int) -> int:
        return rank - (0 <= self.host_rank < rank)

    def _rank(self, place: int) -> int:
        return place + (0 <= self.host_rank <= place)

    def parent(self, rank: int) -> int | None:
        """The node rank whose proxy ``rank``'s links to; None: the store host (and for
        the store host itself)."""
        if rank == self.host_rank:
            return None
        up = parent_place(self._place(rank), self.fanout)
        return None if up is None else self._rank(up)

    def has_children(self, rank: int) -> bool:
        return rank != self.host_rank and has_children(self._place(rank), self.fanout, self.places)

    def children(self, rank: int) -> list[int]:
        """The node ranks linked to ``rank``'s proxy. O(F)."""
        if not self.has_children(rank):
            return []
        first = self.fanout - 1 + self.fanout * self._place(rank)
        return [self._rank(q) for q in range(first, min(first + self.fanout, self.places))]
