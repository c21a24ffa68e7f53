"""restart_together: members count themselves in once a node joined; the last releases
the others; a death or a leave waits for no one; a member that never comes ends the wait."""

import threading
import time
from datetime import timedelta

from torch.distributed import HashStore

from tierrun.rendezvous import restart_together


def key(name: str) -> str:
    return f"job/0/{name}"


def test_the_last_member_releases_the_others():
    store = HashStore()
    store.set(key("changed"), "joined")
    released: list[float] = []

    def member() -> None:
        restart_together.wait_for_members(store, key, 3, lambda keys, t: store.wait(keys, timedelta(seconds=t)), "test")
        released.append(time.monotonic())

    threads = [threading.Thread(target=member) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert released == [] and store.add(key("seen"), 0) == 2
    last = time.monotonic()
    assert restart_together.count_in(store, key, 3)
    for t in threads:
        t.join(5)
    assert len(released) == 2 and all(r >= last for r in released)


def test_a_death_or_a_leave_waits_for_no_one():
    store = HashStore()
    for change in ("dead 127.0.1.2", "left 127.0.1.2: stopped"):
        store.set(key("changed"), change)
        waits = []
        restart_together.wait_for_members(store, key, 3, lambda keys, t: waits.append(keys), "test")
        assert waits == [] and not store.check([key("seen")])


def test_a_member_that_never_comes_ends_the_wait(monkeypatch):
    store = HashStore()
    store.set(key("changed"), "joined")

    def times_out(keys, timeout):
        assert keys == [key("all_seen")] and timeout == restart_together.TIMEOUT
        raise TimeoutError

    restart_together.wait_for_members(store, key, 2, times_out, "test")  # returns: the restart goes on
    assert store.add(key("seen"), 0) == 1

