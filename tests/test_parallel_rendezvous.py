"""The parallel (static) rendezvous's arrival count, on torch's in-memory store: O(1)
operations per node, an agent restarted into the same round is not counted twice, and a
second node started with a node rank already held is told so."""

from datetime import timedelta

from torch.distributed import HashStore

from tierrun.rendezvous.job_store import JobStore
import pytest

from tierrun.rendezvous.parallel import DuplicateNodeRankError, ParallelRendezvousHandler


def handler(rank: int, nodes: int, addr: str | None = None) -> ParallelRendezvousHandler:
    job = JobStore("127.0.0.1", 29500, hosting=False, timeout=timedelta(seconds=5))
    return ParallelRendezvousHandler(job, rank, nodes, "job", timedelta(seconds=5), addr or f"10.0.0.{rank + 1}", {})


def test_the_last_node_to_arrive_sets_the_one_key_all_wait_for():
    store = HashStore()
    for rank in (2, 0):
        handler(rank, 3)._arrive(store, "r")
        assert not store.check(["r/all_arrived"])
    handler(1, 3)._arrive(store, "r")
    assert store.check(["r/all_arrived"])
    assert store.add("r/arrived", 0) == 3


def test_an_agent_restarted_into_the_same_round_is_not_counted_twice():
    store = HashStore()
    handler(1, 2)._arrive(store, "r")
    handler(1, 2)._arrive(store, "r")  # node 1's agent again, before node 0 arrived
    assert store.add("r/arrived", 0) == 1 and not store.check(["r/all_arrived"])
    handler(0, 2)._arrive(store, "r")
    assert store.check(["r/all_arrived"])


def test_a_second_node_with_a_node_rank_already_held_is_refused_and_not_counted():
    store = HashStore()
    handler(1, 3)._arrive(store, "r")
    with pytest.raises(DuplicateNodeRankError) as e:
        handler(1, 3, addr="10.0.0.9")._arrive(store, "r")  # another node, the same --node_rank
    assert "node 10.0.0.9 was started with --node_rank 1, which node 10.0.0.2 already holds" in str(e.value)
    assert "0 to 2" in str(e.value)
    assert store.add("r/arrived", 0) == 1  # not counted; the first holder's record stays
    assert b"10.0.0.2" in store.get("r/node/1")
    handler(0, 3)._arrive(store, "r")
    handler(2, 3)._arrive(store, "r")
    assert store.check(["r/all_arrived"])
