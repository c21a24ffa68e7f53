"""Liveness with a real store: every member beats, the first ranks watch all the others
in one MULTI_GET each, and a member that stops beating is declared dead by each
watcher, once, within the timeout."""

import threading
import time
from types import SimpleNamespace

from tierrun.client import StoreClient
from tierrun.rendezvous.handler_base import StoreRendezvousHandler
from tierrun.rendezvous.liveness import LEFT, WATCHERS, Heartbeat, until, watched_by


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


def test_a_member_that_leaves_stays_left_and_its_stopped_beat_ends_answered(store):
    """A beat is a SET of the member's next count, with no answer: leave() waits for the
    heartbeat's last beat to be taken before it sets LEFT, which a beat landing after it
    would overwrite (its watchers would then call the member dead); a stopped heartbeat
    ends once its last beat is taken (a CHECK answered after it), so join() says so."""
    key = lambda name: f"/leaving/{name}".encode()  # noqa: E731
    for m in range(12):  # leave at every phase of a fast beat
        beat = Heartbeat(("127.0.0.1", store.port), key, m, [], 0.02, 10.0, lambda m: None).start()
        time.sleep(0.05 + 0.003 * m)
        beat.leave()
        assert beat.join(0)  # (leave() waited for it)
        time.sleep(0.06)  # three intervals: a late beat would have landed
        with StoreClient(("127.0.0.1", store.port)) as c:
            assert c.get(key(f"beat/{m}")) == LEFT
    stopped = Heartbeat(("127.0.0.1", store.port), key, 99, [], 0.02, 10.0, lambda m: None).start()
    time.sleep(0.1)
    stopped.stop()
    assert stopped.join(5.0)
    with StoreClient(("127.0.0.1", store.port)) as c:
        count = int(c.get(key("beat/99")))
        time.sleep(0.06)
        assert int(c.get(key("beat/99"))) == count >= 3  # it counted, and stopped


def test_until_gives_the_next_moment_at_a_phase_of_the_interval():
    assert until(0.0, 1.0, 100.25) == 0.75
    assert until(0.5, 1.0, 100.25) == 0.25
    assert until(0.5, 1.0, 100.75) == 0.75
    assert until(0.0, 1.0, 100.0) == 1.0  # (never 0: a beat just happened)
    assert 0 < until(0.0, 2.0, 7.3) <= 2.0 and (7.3 + until(0.0, 2.0, 7.3)) % 2.0 < 1e-9


def test_every_member_beats_at_the_same_moments_of_the_wall_clock(store):
    """Beats fall on multiples of the interval, on every node alike, so the store host
    gets them together (front-ends carry them up in a few batches): between 0.3 and
    0.7 of an interval no counter moves, and across the next multiple each moves once."""
    n, interval = 5, 1.0
    key = lambda name: f"/aligned/{name}".encode()  # noqa: E731
    beats = []
    try:
        for m in range(n):  # members that start at different moments
            beats.append(Heartbeat(("127.0.0.1", store.port), key, m, [], interval, 10.0, lambda m: None).start())
            time.sleep(0.17)
        with StoreClient(("127.0.0.1", store.port)) as c:
            def counters() -> list[int]:
                return [int(v or b"0") for v in c.multi_get([key(f"beat/{m}") for m in range(n)], wait=False)]

            time.sleep(until(0.3, interval, time.time()))
            early = counters()
            time.sleep(until(0.7, interval, time.time()))
            late = counters()
            time.sleep(until(0.3, interval, time.time()))
            after = counters()
    finally:
        for b in beats:
            b.stop()
    assert min(early) >= 1 and early == late
    assert after == [v + 1 for v in late]


def test_a_stopped_rounds_late_declaration_does_not_count_in_the_next_round(store):
    """A round's heartbeat thread may still be declaring a member dead (it reads the
    member's address first) when the next round's watch replaces it: that declaration
    is the ended round's, and the next round's failure report must not count its
    address as dead (``declared_dead``). The new round's own declarations count."""
    class Watching(StoreRendezvousHandler):  # (only the round watch is used here)
        get_backend = is_closed = next_rendezvous = num_nodes_waiting = set_closed = shutdown = None

    handler = Watching(None, "late", "127.0.0.1", {"heartbeat_interval": "0.1", "heartbeat_timeout": "0.5"})
    handler.job = SimpleNamespace(agent_address=("127.0.0.1", store.port))
    declaring, go_on, stale_noted, fresh_noted = (threading.Event() for _ in range(4))

    def late(member: int) -> None:  # round 0's: blocks until round 1 has begun
        declaring.set()
        go_on.wait(10)
        handler._note_dead(f"10.0.0.{member}")
        stale_noted.set()

    def fresh(member: int) -> None:
        handler._note_dead(f"10.0.0.{member}")
        fresh_noted.set()

    key = lambda r: lambda name: f"/late/{r}/{name}".encode()  # noqa: E731
    try:
        handler._watch_round(key(0), "failed", lambda c: None, 0, [1], late)  # member 1 never beats
        assert declaring.wait(10)
        handler._watch_round(key(1), "failed", lambda c: None, 0, [2], fresh)  # nor does member 2
        go_on.set()
        assert stale_noted.wait(10) and fresh_noted.wait(10)
        assert set(handler.declared_dead()) == {"10.0.0.2"}
    finally:
        go_on.set()
        handler._stop_watching()
