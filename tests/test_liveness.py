"""Liveness with a real store: every member beats, the first ranks watch all the others
in one MULTI_GET each, and a member that stops beating is declared dead by each
watcher, once, within the timeout."""

import threading
import time

from tierrun.client import StoreClient
from tierrun.rendezvous.liveness import WATCHERS, Heartbeat, watched_by


def test_the_first_ranks_watch_everyone_the_others_only_beat():
    members = range(1, 7)  # elastic ids: arrivals 1..6; rank r has id 6 - r here
    assert watched_by(0, 6, members) == [1, 2, 3, 4, 5]
    assert watched_by(WATCHERS - 1, 4, members) == [1, 2, 3, 5, 6]
    assert watched_by(WATCHERS, 3, members) == []


def test_a_silent_member_is_declared_dead_by_every_watcher_once(store):
    n, silent = 6, 4
    key = lambda name: f"/round/{name}".encode()  # noqa: E731
    dead: list[tuple[int, int]] = []
    lock = threading.Lock()

    def on_dead(watcher: int):
        def note(member: int) -> None:
            with lock:
                dead.append((watcher, member))
        return note

    beats = [Heartbeat(("127.0.0.1", store.port), key, m, watched_by(m, m, range(n)), 0.1, 1.0, on_dead(m)).start()
             for m in range(n) if m != silent]
    try:
        with StoreClient(("127.0.0.1", store.port)) as c:  # the silent member beat once, then froze
            c.add(key(f"beat/{silent}"), 1)
        time.sleep(3.0)
        with StoreClient(("127.0.0.1", store.port)) as c:
            assert all(int(c.get(key(f"beat/{m}"))) >= 5 for m in range(n) if m != silent)
    finally:
        for b in beats:
            b.stop()
    assert sorted(dead) == [(w, silent) for w in range(WATCHERS)]
