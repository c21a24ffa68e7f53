"""The parallel (static) rendezvous's arrival count, on torch's in-memory store: O(1)
operations per node, and an agent restarted into the same round is not counted twice."""

from datetime import timedelta

from torch.distributed import HashStore

from tierrun.rendezvous.job_store import JobStore
from tierrun.rendezvous.parallel import ParallelRendezvousHandler


def handler(rank: int, nodes: int) -> ParallelRendezvousHandler:
    job = JobStore("127.0.0.1", 29500, hosting=False, timeout=timedelta(seconds=5))
    return ParallelRendezvousHandler(job, rank, nodes, "job", timedelta(seconds=5), f"10.0.0.{rank + 1}", {})


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
