"""Who holds a node rank of a static job's round: the node record at
``<round>/node/<rank>``, claimed with COMPARE_SET, so that every decision is one atomic
step of the store's.

- The first node to claim a rank creates the record: it is counted (its workers, its
  arrival).
- A node that finds a record of its own address is the same node's agent, restarted:
  it takes the record back and is not counted again.
- A node that finds another address's record takes the rank over while the round has
  not formed: the holder is gone (a lost node replaced with a spare: the job goes on)
  or was started with the same ``--node_rank`` (a copied command line). Either way the
  newcomer is not counted again, and it must run as many workers as the holder (the
  round's count of nodes with each number of workers was made with the holder's).
- Once every node has arrived, each confirms its record (COMPARE_SET to a ``formed``
  copy) before it starts workers: a holder whose record was taken over stops there
  (``DuplicateNodeRankError``), so two nodes never run one rank; a record confirmed is
  never taken over, not even by an agent of the same node (it is refused).

Costs: one COMPARE_SET to claim (two to take over), one to confirm, per node and round.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass, replace

from torch.distributed.elastic.rendezvous import RendezvousError

#: How the messages name the flag (torch's own torchrun passes it as --rdzv-conf rank=K).
RANK_FLAG = "--node_rank (--rdzv-conf rank=K under torch's torchrun)"


class DuplicateNodeRankError(RendezvousError):
    """Two nodes of a static job claimed the same node rank, and this one must stop."""


class Claim(enum.Enum):
    NEW = "new"  # this node created the record: count it
    RESTARTED = "restarted"  # the same node's record (an agent restarted): not counted again
    TAKEN_OVER = "taken over"  # another node's, not yet formed: this node takes its place


@dataclass(frozen=True)
class NodeRecord:
    addr: str
    workers: int | None  # workers on the node (None: not known, under torch's torchrun)
    nonce: str = ""
    formed: bool = False  # confirmed once the round formed: never taken over

    @staticmethod
    def fresh(addr: str, workers: int | None) -> NodeRecord:
        return NodeRecord(addr, workers, secrets.token_hex(8))

    def encode(self) -> bytes:
        fields: dict = {"addr": self.addr, "nonce": self.nonce, "workers": self.workers}
        if self.formed:
            fields["formed"] = True
        return json.dumps(fields).encode()

    @staticmethod
    def decode(raw: bytes) -> NodeRecord:
        """A record as a node wrote it; one that is not ours names no address ("?")."""
        try:
            fields = json.loads(raw)
            return NodeRecord(str(fields["addr"]), fields.get("workers"), str(fields.get("nonce", "")),
                              bool(fields.get("formed", False)))
        except (ValueError, TypeError, KeyError):
            return NodeRecord("?", None)


@dataclass(frozen=True)
class Rank:
    """A node rank of a round, as messages name it."""

    rank: int
    nodes: int
    run_id: str

    def advice(self) -> str:
        return f"every node needs its own {RANK_FLAG}, 0 to {self.nodes - 1}"


def claim(store, key: str, mine: NodeRecord, rank: Rank) -> Claim:
    """Claim ``key`` (the record of ``rank``) with ``mine``. Raises
    ``DuplicateNodeRankError`` when the rank's round has formed (its holder runs, even
    one of this node's address: another agent of this node), or when the holder (another
    node, or this node's previous agent) ran another number of workers. O(1) requests (a
    retry per concurrent change)."""
    wanted = mine.encode()
    expected = b""
    while True:
        current = store.compare_set(key, expected, wanted)
        if current == wanted:
            if not expected:
                return Claim.NEW
            return Claim.RESTARTED if NodeRecord.decode(expected).addr == mine.addr else Claim.TAKEN_OVER
        holder = NodeRecord.decode(current)
        same = holder.addr == mine.addr
        if holder.formed:
            who = "another agent of this node holds it" if same else f"node {holder.addr} holds it"
            raise DuplicateNodeRankError(
                f"node {mine.addr} was started with node rank {rank.rank} of rendezvous '{rank.run_id}', but "
                f"{who} and that round has formed: its workers run. Stop this agent ({rank.advice()}); to "
                f"replace {'that agent' if same else holder.addr}, restart the job."
            )
        if holder.workers is not None and mine.workers is not None and holder.workers != mine.workers:
            who = "this node's previous agent ran" if same else f"node {holder.addr}, which holds it, runs"
            raise DuplicateNodeRankError(
                f"node {mine.addr} was started with node rank {rank.rank} of rendezvous '{rank.run_id}' and "
                f"{mine.workers} worker(s), but {who} {holder.workers}: the round counted those. Start it with "
                f"--nproc_per_node {holder.workers}, or restart the job ({rank.advice()})."
            )
        expected = current  # (the same node restarted, or one gone, or a twin: take its place)


def confirmed_record(mine: NodeRecord) -> bytes:
    """What a node's record becomes once its round formed: the COMPARE_SET from
    ``mine.encode()`` to this confirms it (see :func:`check_confirmed`)."""
    return replace(mine, formed=True).encode()


def check_confirmed(current: bytes, mine: NodeRecord, rank: Rank) -> None:
    """``current``: the answer to the COMPARE_SET that marks this node's record formed
    (see :func:`confirmed_record`). Raises ``DuplicateNodeRankError`` if another node
    (or agent) took the record over meanwhile: this one must not start workers."""
    if current != confirmed_record(mine):
        newcomer = NodeRecord.decode(current).addr
        who = "another agent of this node" if newcomer == mine.addr else f"node {newcomer}"
        raise DuplicateNodeRankError(
            f"node {mine.addr} held node rank {rank.rank} of rendezvous '{rank.run_id}' until {who} was started "
            f"with the same rank and took its place (as a spare replacing a lost node does): {rank.advice()}. "
            f"If {who} is not to be node rank {rank.rank}, stop it, and start this node again with the rank "
            "that is missing (node rank 0 names it while it waits)."
        )
