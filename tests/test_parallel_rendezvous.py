"""The parallel (static) rendezvous on torch's in-memory store: the arrival count (O(1)
operations per node), and who holds a node rank (``node_claim``): an agent restarted into
the same round is not counted twice, a node that replaces a lost one takes its place
before the round forms, and of two nodes started with one node rank only one runs."""

from datetime import timedelta

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousError

from tierrun.rendezvous.job_store import JobStore
from tierrun.rendezvous.node_claim import (
    Claim, DuplicateNodeRankError, NodeRecord, Rank, check_confirmed, claim, confirmed_record,
)
from tierrun.rendezvous.parallel import ARRIVAL_UNIT, ParallelRendezvousHandler

KEY = "r/node/1"
RANK = Rank(1, 3, "job")


def confirm(store, key: str, mine: NodeRecord, rank: Rank) -> None:
    """The agent's confirmation, as it sends it (pipelined with a GET there)."""
    check_confirmed(store.compare_set(key, mine.encode(), confirmed_record(mine)), mine, rank)


def arrive(h: ParallelRendezvousHandler, store) -> None:
    """The agent's arrival, as it counts it (pipelined there): the last one sets the key."""
    if h._arrived(store.add("r/arrived", h.arrival), store, "r"):
        store.set("r/all_arrived", "1")


def handler(rank: int, nodes: int) -> ParallelRendezvousHandler:
    job = JobStore("127.0.0.1", 29500, hosting=False, timeout=timedelta(seconds=5))
    return ParallelRendezvousHandler(job, rank, nodes, "job", timedelta(seconds=5), f"10.0.0.{rank + 1}", {})


def test_the_last_node_to_arrive_sets_the_one_key_all_wait_for():
    store = HashStore()
    for rank in (2, 0):
        arrive(handler(rank, 3), store)
        assert not store.check(["r/all_arrived"])
    arrive(handler(1, 3), store)
    assert store.check(["r/all_arrived"])
    assert store.add("r/arrived", 0) == 3 + 9 * ARRIVAL_UNIT  # (3 nodes, each of --nnodes 3)


@pytest.mark.parametrize("counts, formed", [((2, 3, 2), False), ((3, 2, 2), False), ((2, 2, 3), True)])
def test_a_node_that_counts_another_number_of_nodes_is_found_in_the_same_add(counts, formed):
    """Whoever arrives after a node with another --nnodes finds out in its ADD and names
    the nodes (from the arrivals list); the count completes only for nodes that agree
    (two of --nnodes 2 before one of 3: their job of 2 forms, the third stops): nobody
    starts a job whose nodes disagree on its size."""
    store = HashStore()
    stopped = []
    for rank, nodes in enumerate(counts):
        store.append("r/arrivals", f"{rank} 10.0.0.{rank + 1} {nodes}\n")
        try:
            arrive(handler(rank, nodes), store)
        except RendezvousError as e:
            stopped.append(rank)
            assert "the nodes were started with different --nnodes" in str(e)
            assert f"node rank {rank} (10.0.0.{rank + 1}) with {nodes}" in str(e), str(e)
    assert stopped and store.check(["r/all_arrived"]) == formed


def node(addr: str, workers: int | None = 8) -> NodeRecord:
    return NodeRecord.fresh(addr, workers)


def test_the_first_claim_is_new_and_the_same_nodes_restarted_agent_takes_it_back():
    store = HashStore()
    first = node("10.0.0.2")
    assert claim(store, KEY, first, RANK) is Claim.NEW
    again = node("10.0.0.2")  # the agent restarted: a new nonce, the same address
    assert claim(store, KEY, again, RANK) is Claim.RESTARTED
    confirm(store, KEY, again, RANK)
    assert NodeRecord.decode(store.get(KEY)).formed
    other_agent = node("10.0.0.2")  # once the round formed, its holder runs: not even this node takes it
    with pytest.raises(DuplicateNodeRankError, match="another agent of this node holds it and that round has formed"):
        claim(store, KEY, other_agent, RANK)
    assert NodeRecord.decode(store.get(KEY)) == NodeRecord("10.0.0.2", 8, again.nonce, formed=True)


def test_a_node_that_takes_a_rank_over_before_the_round_forms_runs_and_the_holder_stops():
    store = HashStore()
    holder, newcomer = node("10.0.0.2"), node("10.0.0.9")
    assert claim(store, KEY, holder, RANK) is Claim.NEW
    assert claim(store, KEY, newcomer, RANK) is Claim.TAKEN_OVER  # a spare for a lost node, or a twin
    with pytest.raises(DuplicateNodeRankError) as e:
        confirm(store, KEY, holder, RANK)  # (a lost holder never gets here)
    assert "node 10.0.0.2 held node rank 1 of rendezvous 'job' until node 10.0.0.9 was started" in str(e.value)
    assert "0 to 2" in str(e.value) and "--node_rank" in str(e.value)
    confirm(store, KEY, newcomer, RANK)
    assert NodeRecord.decode(store.get(KEY)).addr == "10.0.0.9"


@pytest.mark.parametrize("formed_first", [True, False])
def test_of_a_confirm_and_a_takeover_racing_exactly_one_wins(formed_first):
    store = HashStore()
    holder, newcomer = node("10.0.0.2"), node("10.0.0.9")
    claim(store, KEY, holder, RANK)
    if formed_first:
        confirm(store, KEY, holder, RANK)
        with pytest.raises(DuplicateNodeRankError, match="that round has formed: its workers run"):
            claim(store, KEY, newcomer, RANK)
        assert NodeRecord.decode(store.get(KEY)).addr == "10.0.0.2"
    else:
        claim(store, KEY, newcomer, RANK)
        with pytest.raises(DuplicateNodeRankError):
            confirm(store, KEY, holder, RANK)


def test_a_node_that_would_take_over_with_another_number_of_workers_is_refused():
    store = HashStore()
    claim(store, KEY, node("10.0.0.2", workers=8), RANK)
    with pytest.raises(DuplicateNodeRankError, match=r"which holds it, runs 8: .* --nproc_per_node 8"):
        claim(store, KEY, node("10.0.0.9", workers=4), RANK)
    assert NodeRecord.decode(store.get(KEY)).addr == "10.0.0.2"
    with pytest.raises(DuplicateNodeRankError, match="this node's previous agent ran 8"):
        claim(store, KEY, node("10.0.0.2", workers=4), RANK)  # (restarted with other flags)
    assert claim(store, KEY, node("10.0.0.9", workers=None), RANK) is Claim.TAKEN_OVER  # (under torchrun: unknown)


def test_a_record_that_is_not_a_nodes_names_no_address():
    assert NodeRecord.decode(b"not json").addr == "?"
    assert NodeRecord.decode(b'{"nonce": 1}').addr == "?"
    record = node("10.0.0.2")
    assert NodeRecord.decode(record.encode()) == record
