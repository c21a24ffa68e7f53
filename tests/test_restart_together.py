"""restart_together: members count themselves in once a node joined; the last releases
the others; a member back on its own counts in without waiting; each member counts
once per round; a member that never comes ends the wait."""

import threading
import time
from datetime import timedelta

from torch.distributed import HashStore

from tierrun.rendezvous import restart_together


def key(name: str) -> str:
    return f"job/0/{name}"


def store_wait(store):
    return lambda keys, t: store.wait(keys, timedelta(seconds=t))


def test_the_last_member_releases_the_others():
    store = HashStore()
    released: list[float] = []

    def member() -> None:
        restart_together.Barrier().wait(0, store, key, 3, store_wait(store), "test")
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
    barrier.wait(0, store, key, 3, lambda keys, t: waits.append(keys), "test")
    barrier.back(0, store, key, 3)  # (it restarted for the change, and is back: not counted twice)
    barrier.wait(0, store, key, 3, lambda keys, t: waits.append(keys), "test")
    assert store.add(key("seen"), 0) == 1 and waits == [[key("all_seen")]]
    barrier.wait(1, store, lambda name: f"job/1/{name}", 3, lambda keys, t: waits.append(keys), "test")
    assert store.add("job/1/seen", 0) == 1 and len(waits) == 2


def test_a_member_that_never_comes_ends_the_wait():
    store = HashStore()

    def times_out(keys, timeout):
        assert keys == [key("all_seen")] and timeout == restart_together.TIMEOUT
        raise TimeoutError

    restart_together.Barrier().wait(0, store, key, 2, times_out, "test")  # returns: the restart goes on
    assert store.add(key("seen"), 0) == 1
