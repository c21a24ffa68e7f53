"""Liveness of a round's members: heartbeat counters in the job's store.

Every member of round ``r`` ADDs 1 to ``r/beat/<index>`` every ``interval`` seconds, and
watches one other member: the next rank, in a ring, so each death is noticed by one
node and the store does O(1) operations per node per interval (O(N) in all, never
O(N²)). A counter that has not moved for ``timeout`` seconds is a dead node: its
watcher sets ``r/changed``, on which every member holds a WAIT, and their agents
restart their workers to re-form without it, even when those workers are stuck in a
collective with the dead node.

Counters, not timestamps: nodes' clocks do not have to agree; each observer times
the silence on its own monotonic clock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..client import StoreClient, StoreClientError

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 3.0


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
    """Beat for member ``index`` of round ``r`` and watch member ``watched`` (None: alone).

    ``keys(name)`` gives a round key as sent on the wire. ``on_dead(index)`` is called
    once, from the heartbeat thread, when the watched member goes silent. ``stop``
    ends the thread within one interval. Store errors end it quietly: the store going
    away is reported by the rendezvous itself.
    """

    def __init__(self, address: tuple[str, int] | str, key: Callable[[str], bytes], index: int,
                 watched: int | None, interval: float, timeout: float,
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

    def _run(self) -> None:
        mine = self._key(f"beat/{self._index}")
        theirs = self._key(f"beat/{self._watched}") if self._watched is not None else None
        still = Stillness(self._timeout)
        try:
            with StoreClient(self._address, timeout=max(self._timeout, 10.0)) as store:
                while not self._stop.is_set():
                    store.add(mine, 1)
                    if theirs is not None:
                        now = time.monotonic()
                        still.sample({0: str(store.add(theirs, 0)).encode()}, now)
                        if still.still(now):
                            self._on_dead(self._watched)
                            theirs = None  # once: the round is ending
                    self._stop.wait(self._interval)
        except (OSError, StoreClientError):
            log.debug("heartbeat of member %d stopped", self._index, exc_info=True)
