"""Liveness of a round's members: heartbeat counters in the job's store.

Every member of round ``r`` counts its beats in ``r/beat/<id>``, one every ``interval``
seconds: an ADD first (the counter exists, and the answer is where its count starts),
then a SET of the next count (every ``CONFIRM_EVERY``-th an ADD again). A SET has no
answer: nothing comes back down a tree of proxies for it (an ADD's answer would travel
back through every level), and once a tiered job runs, beats are most of what reaches
its store host. The first ``WATCHERS`` members (by rank) watch every other member,
reading all their counters in one MULTI_GET per interval; the others only beat. So the
store gets N + WATCHERS requests per interval for N members (a ring, where each member
reads its neighbour's counter, costs 2N: at 512 nodes, 500 reads a second more at the
store host, none of which a front-end can merge). A death goes unnoticed only if every
watcher dies with it at once. A counter that has not changed for ``timeout`` seconds is
a dead member: its watchers mark it, setting a round key on which every member holds a
WAIT, and their agents restart their workers to re-form without it, even when those
workers are stuck in a collective with the dead node. A member that leaves in order (its
agent shuts down: its workers ended) sets its counter to ``LEFT`` first, once its last
beat was taken, and its watchers stop watching it without a word.

In a tiered static job the members do not beat through the store: each node's link
beats already, and the first hop above its proxy holds its will (:class:`LinkWill`,
``hub.wills``), so the store host reads nothing a second for the nodes' liveness.

Counters, not timestamps: nodes' clocks do not have to agree; each observer times
the silence on its own monotonic clock. Beats fall on the wall clock's multiples of the
interval, and watchers read half an interval later: so on nodes whose clocks agree to a
few milliseconds (NTP), every member's beat of one interval reaches the store host at
about the same moment, and node front-ends carry them up in a few batches instead of
one frame per node (a frame costs the store host far more than the beat it carries).
Clocks that disagree cost only that merging.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..client import StoreClient, StoreClientError
from ..link.frames import MAX_WILL_AFTER, WILL_KEY

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 3.0
#: Members (the lowest ranks) that watch all the others.
WATCHERS = 3
#: A member's counter once it left in order: not a death.
LEFT = b"left"
#: Every this many beats, the beat is an ADD: its answer confirms the SETs before it to
#: the node's proxy (and every relay on the way), which remember a write with no answer
#: until some later answer on their link (``tier.writes``): a node that only beats would
#: otherwise make them hold up to their cap of such writes.
CONFIRM_EVERY = 16


def watched_by(rank: int, me: int, members: range) -> list[int]:
    """The member ids a member (id ``me``, rank ``rank``) watches: every other member for
    the first ``WATCHERS`` ranks, none for the rest."""
    return [m for m in members if m != me] if rank < WATCHERS else []


def until(phase: float, interval: float, now: float) -> float:
    """Seconds from ``now`` (wall clock) to the next moment ``phase`` seconds past a
    multiple of ``interval``: in (0, interval]."""
    return (phase - now) % interval or interval


class Stillness:
    """Which counters stopped moving: feed samples, ask which have been still for
    ``timeout`` seconds of the caller's clock. O(counters) per sample."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._seen: dict[int, tuple[bytes, float]] = {}

    def sample(self, values: dict[int, bytes], now: float) -> None:
        for key, value in values.items():
            last = self._seen.get(key)
            if last is None or last[0] != value:
                self._seen[key] = (value, now)

    def still(self, now: float) -> set[int]:
        return {k for k, (_, since) in self._seen.items() if now - since >= self._timeout}


class Heartbeat:
    """Beat for member ``index`` of round r and watch the members ``watched`` (see
    ``watched_by``; empty: beat only). ``keys(name)`` gives a round key as sent on the
    wire. ``on_dead(member)`` is called once per member, from the heartbeat thread, when
    that watched member goes silent. After ``stop`` the thread ends at once, or, when a
    beat it sent is not yet confirmed by an answer, once a CHECK is answered (at most
    the store client's timeout: ``max(timeout, 10)`` seconds), so that an ended heartbeat
    has had its last request taken. Store errors end it quietly: the store going away is
    reported by the rendezvous itself.
    It beats at once, then on the wall clock's multiples of ``interval``; watchers read
    half an interval after each beat (see the module docstring).
    """

    def __init__(self, address: tuple[str, int] | str, key: Callable[[str], bytes], index: int,
                 watched: list[int], interval: float, timeout: float,
                 on_dead: Callable[[int], None]) -> None:
        self._address = address
        self._key = key
        self._index = index
        self._watched = watched
        self._interval = interval
        self._timeout = timeout
        self._on_dead = on_dead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierrun-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """After ``stop``: wait up to ``timeout`` seconds for the thread to end (its last
        request answered); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def in_its_thread(self) -> bool:
        """Whether the caller runs in this heartbeat's thread (an ``on_dead`` of this one)."""
        return threading.current_thread() is self._thread

    def leave(self, timeout: float = 5.0) -> None:
        """Stop, and tell the watchers this member left in order: its counter becomes
        ``LEFT`` (one SET, on a connection of its own, then a CHECK). Blocks until this
        heartbeat's last beat was taken (a beat landing after ``LEFT`` would overwrite
        it), at most ``timeout`` seconds, then until ``LEFT`` is answered, at most
        ``timeout`` seconds more; store errors are ignored: a member whose store is gone
        is not watched through it any more."""
        self._stop.set()
        if not self.in_its_thread():
            self._thread.join(timeout)
        try:
            with StoreClient(self._address, timeout=timeout) as store:
                store.set(self._key(f"beat/{self._index}"), LEFT)
                store.check([self._key(f"beat/{self._index}")])  # (an answer: the SET was taken)
        except (OSError, StoreClientError):
            log.debug("member %d could not say it left", self._index, exc_info=True)

    def _run(self) -> None:
        interval = self._interval
        mine = self._key(f"beat/{self._index}")
        theirs = {m: self._key(f"beat/{m}") for m in self._watched}
        still = Stillness(self._timeout)
        try:
            with StoreClient(self._address, timeout=max(self._timeout, 10.0)) as store:
                count = store.add(mine, 1)  # (at once: the counter exists from the start)
                unconfirmed = False  # a SET sent since the last answer
                while True:
                    if theirs:  # half an interval after the beats
                        if self._stop.wait(until(interval / 2, interval, time.time())):
                            break
                        now = time.monotonic()
                        members = list(theirs)
                        # (a member that has not beaten yet reads as empty: still too)
                        values = store.multi_get([theirs[m] for m in members], wait=False)
                        unconfirmed = False
                        for m, value in zip(members, values):
                            if value == LEFT:
                                del theirs[m]
                        still.sample(dict(zip(members, values)), now)
                        for m in sorted(still.still(now) & theirs.keys()):
                            del theirs[m]  # once: the round is ending
                            self._on_dead(m)
                    if self._stop.wait(until(0.0, interval, time.time())):
                        break
                    if (count + 1) % CONFIRM_EVERY:
                        count += 1
                        store.set(mine, b"%d" % count)
                        unconfirmed = True
                    else:
                        count = store.add(mine, 1)
                        unconfirmed = False
                if unconfirmed:
                    store.check([mine])  # (answered: every beat sent before it was taken)
        except (OSError, StoreClientError):
            log.debug("heartbeat of member %d stopped", self._index, exc_info=True)


class LinkWill:
    """A member's liveness in a tiered job: its link's (``hub.wills``). The first hop
    above the node (the store host, or its parent relay) executes the will, a
    COMPARE_SET of a round key from empty to ``reason``, when the node's link is silent
    for ``timeout`` seconds (at least three link heartbeats) or its proxy ends its
    session with the will standing (its agent gone). No request reaches the store host
    while the node lives: its link's heartbeat is the beat. ``address``: the node
    proxy's will namespace (``JobStore.will_address``)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address
        self.standing = False

    def leave(self, timeout: float, key: bytes, reason: bytes) -> None:
        """Write the will (replacing any; ``timeout`` at most ``MAX_WILL_AFTER``), and read
        it back: once this returns, the hop holds it. Blocks one round trip to the hop;
        raises ``StoreClientError``/``OSError`` if the proxy is gone (the will may stand:
        ``revoke`` takes it back)."""
        text = b"%g\n%s\n%s" % (min(timeout, MAX_WILL_AFTER), key, reason)
        self.standing = True  # (from the SET on, whether or not its read-back comes)
        with StoreClient(self._address, timeout=10.0) as hop:
            hop.set(WILL_KEY, text)
            held = hop.get(WILL_KEY)
        if held != text:
            raise StoreClientError(f"the node proxy's link holds another will: {held!r}")

    def revoke(self) -> None:
        """Take the will back (this member leaves in order, or its round ends), and wait
        until the hop has: a proxy that ends its session next must not have it executed.
        Store errors are ignored: a node whose proxy is gone has no link to watch."""
        if not self.standing:
            return
        self.standing = False
        try:
            with StoreClient(self._address, timeout=10.0) as hop:
                hop.set(WILL_KEY, b"")
                hop.get(WILL_KEY)
        except (OSError, StoreClientError):
            log.debug("the will could not be revoked", exc_info=True)
