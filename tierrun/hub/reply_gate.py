"""Invalidation rounds, and the answers they hold back (docs/architecture.md: standing watches).

A front-end that watches a key answers reads of it from what it saw. When the key
changes, every front-end watching it must stop doing so before anyone can learn of
the change. So the change starts a *round*: each watching session is sent an
INVALIDATE (after whatever it was owed before the change), and every answer produced
from then on, to anyone, is held until each of them has answered INVALIDATED or its
lease has run out. Rounds complete in order; held answers leave in the order they
were produced, so per-connection order is kept.

Cost: one flag test per answer while no round is open; O(watchers) per round. A
watcher that stops answering holds every answer of the store for at most its lease
(``WATCH_LEASE`` + ``LEASE_MARGIN`` after its last heartbeat), so changes of watched
keys should be rare: they are (an NCCL dump request, a unique id written once, a
barrier's release).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from time import monotonic
from typing import Protocol

from ..link.frames import LEASE_MARGIN, WATCH_LEASE, encode_invalidate

log = logging.getLogger("tierrun.store")

Send = Callable[[bytes], None]


class SessionHost(Protocol):
    """The link server a watching session belongs to (``LinkServer``)."""

    @property
    def gate(self) -> ReplyGate: ...

    @property
    def sessions(self) -> Mapping[bytes, object]:
        """The open sessions, by session id."""


class WatchingSession(Protocol):
    """A link session that watches keys (the link server's ``Session``)."""

    @property
    def server(self) -> SessionHost: ...

    @property
    def sid(self) -> bytes: ...

    @property
    def peer(self) -> str: ...

    @property
    def last_ping_rx(self) -> float:
        """When its last ACK arrived (``time.monotonic``): its watch lease began before."""

    def send(self, data: bytes) -> None:
        """Send a frame on its connection, or keep it for a resume."""

    def flush_answers(self) -> None:
        """Send the answers it is owed now, ahead of anything emitted later."""


class _Round:
    __slots__ = ("id", "awaiting", "on_done", "timer")

    def __init__(self, round_id: int, on_done: Callable[[], None] | None) -> None:
        self.id = round_id
        self.awaiting: dict[WatchingSession, None] = {}
        self.on_done = on_done
        self.timer: asyncio.TimerHandle | None = None


class ReplyGate:
    """The order of a store's outgoing answers across invalidation rounds."""

    def __init__(self) -> None:
        self.closed = False  # a round is open: answers are held
        self._begun = 0
        self._completed = 0
        self._held: deque[tuple[int, Send, bytes]] = deque()
        self._rounds: deque[_Round] = deque()
        self.rounds = 0  # begun, ever
        self.lapsed = 0  # sessions that let a round run to their lease's end

    def emit(self, send: Send, data: bytes) -> None:
        """``send(data)`` now, or once the rounds begun so far are complete."""
        if self.closed:
            self._held.append((self._begun, send, data))
        else:
            send(data)

    def begin(self, watches: dict[WatchingSession, list[int]], on_done: Callable[[], None] | None = None) -> None:
        """Start a round: tell each session which of its watches broke, hold every
        later answer until all have confirmed. ``on_done`` runs when the round is
        complete (at once if ``watches`` is empty)."""
        if not watches:
            if on_done is not None:
                on_done()
            return
        rnd = _Round(self._begun + 1, on_done)
        now = monotonic()
        latest = now
        for session, ids in watches.items():
            session.flush_answers()  # what it was owed before the change goes first
            self.emit(session.send, encode_invalidate(rnd.id, ids))
            rnd.awaiting[session] = None
            latest = max(latest, session.last_ping_rx + WATCH_LEASE + LEASE_MARGIN)
        self._begun = rnd.id
        self.closed = True
        self.rounds += 1
        rnd.timer = asyncio.get_running_loop().call_later(latest - now, self._lapse, rnd)
        self._rounds.append(rnd)

    def confirmed(self, session: WatchingSession, round_id: int) -> None:
        """``session`` answered INVALIDATED for ``round_id`` (unknown rounds: ignored)."""
        rounds = self._rounds
        if rounds:
            index = round_id - rounds[0].id
            if 0 <= index < len(rounds):
                rounds[index].awaiting.pop(session, None)
                self._advance()

    def _lapse(self, rnd: _Round) -> None:
        """Every lease the round waits for has run out: those watches are void anyway."""
        if rnd.awaiting:
            self.lapsed += len(rnd.awaiting)
            log.warning("invalidation round %d: no answer from %s within its lease; going on without it",
                        rnd.id, ", ".join(s.peer for s in rnd.awaiting))
            rnd.awaiting.clear()
            self._advance()

    def _advance(self) -> None:
        rounds = self._rounds
        while rounds and not rounds[0].awaiting:
            rnd = rounds.popleft()
            if rnd.timer is not None:
                rnd.timer.cancel()
            self._completed = rnd.id
            if rnd.on_done is not None:
                rnd.on_done()
        held = self._held
        completed = self._completed
        while held and held[0][0] <= completed:
            _, send, data = held.popleft()
            send(data)
        self.closed = self._begun != completed

    def close(self) -> None:
        for rnd in self._rounds:
            if rnd.timer is not None:
                rnd.timer.cancel()


def break_watches(watchers: list, on_done: Callable[[], None] | None = None) -> None:
    """Keys watched by ``watchers`` ((session, watch id) pairs, as ``execute_watching``
    got them) changed: run an invalidation round for the sessions still open, on their
    link server's gate (one round per gate), and ``on_done`` when all are over. The
    core's ``on_watches_broken``; a stacked front-end's, for the front-ends below it."""
    by_gate: dict[ReplyGate, dict[WatchingSession, list[int]]] = {}
    for session, wid in watchers:
        server = session.server
        if server.sessions.get(session.sid) is session:
            by_gate.setdefault(server.gate, {}).setdefault(session, []).append(wid)
    if not by_gate:
        if on_done is not None:
            on_done()
        return
    left = [len(by_gate)]

    def one_done() -> None:
        left[0] -= 1
        if not left[0] and on_done is not None:
            on_done()

    for gate, sessions in by_gate.items():
        gate.begin(sessions, one_done)
