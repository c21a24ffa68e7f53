"""restart_together: members count themselves in once a node joined; the last releases
the others; a member back on its own counts in without waiting; each member counts
once per round; a member that never comes ends the wait."""

import signal
import threading
import time
from types import SimpleNamespace
from datetime import timedelta

import pytest
from torch.distributed import HashStore

from torch.distributed.elastic.multiprocessing.api import SignalException

from tierrun.rendezvous import restart_together
from tierrun.rendezvous.handler_base import StoreRendezvousHandler


def key(name: str) -> str:
    return f"job/0/{name}"


def store_wait(store):
    return lambda keys, t: store.wait(keys, timedelta(seconds=t))


def test_the_last_member_releases_the_others():
    store = HashStore()
    released: list[float] = []

    def member() -> None:
        restart_together.Barrier().wait(0, store, key, 3, 5.0, store_wait(store), "test")
        released.append(time.monotonic())

    threads = [threading.Thread(target=member) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert released == [] and store.add(key("seen"), 0) == 2
    last = time.monotonic()
    restart_together.Barrier().back(0, store, key, 3)  # (the third: back on its own, it does not wait)
    for t in threads:
        t.join(5)
    assert len(released) == 2 and all(r >= last for r in released)


def test_a_member_counts_in_once_per_round():
    store = HashStore()
    barrier = restart_together.Barrier()
    waits = []
    barrier.wait(0, store, key, 3, 5.0, lambda keys, t: waits.append(keys), "test")
    barrier.back(0, store, key, 3)  # (it restarted for the change, and is back: not counted twice)
    barrier.wait(0, store, key, 3, 5.0, lambda keys, t: waits.append(keys), "test")
    assert store.add(key("seen"), 0) == 1 and waits == [[key("all_seen")]]
    barrier.wait(1, store, lambda name: f"job/1/{name}", 3, 5.0, lambda keys, t: waits.append(keys), "test")
    assert store.add("job/1/seen", 0) == 1 and len(waits) == 2


def test_a_member_that_never_comes_ends_the_wait():
    store = HashStore()

    def times_out(keys, timeout):
        assert keys == [key("all_seen")] and timeout == 7.5
        raise TimeoutError

    restart_together.Barrier().wait(0, store, key, 2, 7.5, times_out, "test")  # returns: the restart goes on
    assert store.add(key("seen"), 0) == 1


def _handler(store, wait):
    """What ``StoreRendezvousHandler._restart_together`` uses of a handler."""
    return SimpleNamespace(job=SimpleNamespace(client=lambda: store), _together=restart_together.Barrier(),
                           _monitor_interval=2.0, _wait_quietly=lambda keys, timeout, check: wait(keys, timeout),
                           check_store_host=lambda: None, run_id="job", node_addr="127.0.1.1")


def test_only_a_join_waits_and_for_the_agents_monitor_interval_too():
    store = HashStore()
    waits = []
    handler = _handler(store, lambda keys, timeout: waits.append(timeout))
    for why in (b"dead 127.0.1.2", b"left 127.0.1.2: received SIGTERM"):
        store.set(key("changed"), why)
        StoreRendezvousHandler._restart_together(handler, 0, key, 3)
    assert waits == [] and not store.check([key("seen")])
    StoreRendezvousHandler._restart_together(handler, 1, key, 3, why=b"joined")
    assert waits == [restart_together.TIMEOUT + 2.0]  # (its agent looks every 2 s)


def test_a_signal_while_waiting_stops_the_agent():
    """torch's agent turns SIGTERM into a SignalException: it must reach the agent, which
    stops its workers and leaves, not be taken for a lost store."""
    def signalled(keys, timeout):
        raise SignalException("Process 1 got signal: 15", signal.SIGTERM)

    with pytest.raises(SignalException):
        StoreRendezvousHandler._restart_together(_handler(HashStore(), signalled), 0, key, 3, why=b"joined")
    StoreRendezvousHandler._restart_together(_handler(HashStore(), _lost), 0, key, 3, why=b"joined")  # (no raise)


def _lost(keys, timeout):
    raise ConnectionResetError("the store host is gone")
