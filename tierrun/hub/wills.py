"""A node's liveness as its link's: a *will* that the first hop above a node executes
when the node's link goes silent.

In a tiered job every node's front-end keeps a link to the store host, or in a tree to
its parent relay, and that link beats already (an ACK a second, ``LinkConfig``). So a
node's agent need not also beat through the store (K requests a second at the store
host, which no front-end can merge): it leaves a will with the first hop instead, a
COMPARE_SET(key, "", value) that the hop executes, as a write of its own, when the
node's session has been silent (no frame read, or no connection) for ``after`` seconds,
or ends without the agent having revoked it first. The agent writes the will as a SET
of ``WILL_KEY`` by a client of the ``WILL_NAMESPACE`` namespace of its front-end (the
hop holds it for that session and never passes it up), with the value
``"<after>\\n<key>\\n<value>"``; an empty value revokes it; a GET of ``WILL_KEY`` reads
the will the hop holds (empty: none), which also says the SET before it has been taken
(the hop reads a session's frames in order).
A session holds one will; a new one replaces it.

So a static job's store host reads F links' heartbeats a second instead of K beats
(a tree of fanout F), and a node whose agent dies is noticed at once: its proxy, whose
stdin closes, ends its session, and the hop executes the will.

Cost: O(1) per will written; while any session holds one, a check when the earliest
could be due (at most every ``CHECK_EVERY`` seconds), O(sessions holding one).
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic
from typing import Callable, Protocol

from ..core import StoreError
from ..core.watch_state import PEEK, UNWATCHABLE, WATCH_READ
from ..frontend import Upstream
from ..link.frames import MAX_WILL_AFTER, WILL_KEY, WILL_NAMESPACE
from ..link.session import RECHECK_AFTER, DeadlineCheck
from ..protocol import Op, Request
from ..protocol.opcodes import CHECK_READY, STOP_WAITING
from ..protocol.replies import encode_bytes

log = logging.getLogger("tierrun.store")

#: The hop looks for silent sessions that hold a will at most this often (seconds).
CHECK_EVERY = 0.25
#: The most bytes of a will's value (a reason a person reads).
MAX_WILL_VALUE = 4096


class Will:
    """What a node asked: COMPARE_SET(key, "", value) once its link is silent ``after`` s."""

    __slots__ = ("after", "key", "value", "text")

    def __init__(self, text: bytes, max_key_bytes: int) -> None:
        """Parse ``after\\nkey\\nvalue``. Raises StoreError (the writer's client is closed,
        the session goes on) on anything else. O(len(text))."""
        parts = text.split(b"\n", 2)
        try:
            after = float(parts[0])
        except ValueError:
            after = -1.0
        if len(parts) != 3 or not 0 < after <= MAX_WILL_AFTER:
            raise StoreError(f"a will is 'SECONDS\\nKEY\\nVALUE' with 0 < SECONDS <= {MAX_WILL_AFTER:g}")
        if not parts[1] or len(parts[1]) > max_key_bytes or len(parts[2]) > MAX_WILL_VALUE:
            raise StoreError(f"a will's key is 1-{max_key_bytes} bytes, its value at most {MAX_WILL_VALUE}")
        self.after, self.key, self.value, self.text = after, parts[1], parts[2], text


class Session(Protocol):
    """What a will needs of a link session (``.session.Session``)."""

    peer: str
    will: Will | None

    def last_heard(self, now: float) -> float: ...


class WillClient:
    """The upstream of a session's client in ``WILL_NAMESPACE``: SET or GET ``WILL_KEY``
    (and the WAIT and CHECK of it that torch's and tierrun's clients send before a GET:
    it is always there); anything else is refused (that client closed)."""

    def __init__(self, session: Session, wills: Wills) -> None:
        self._session = session
        self._wills = wills

    def execute(self, req: Request, waiter: object) -> bytes | None:
        op = req[0]
        if op == Op.SET and req[1] == WILL_KEY:
            self._wills.write(self._session, req[2])
            return None
        if op == Op.GET and req[1] == WILL_KEY:
            will = self._session.will
            return encode_bytes(will.text if will is not None else b"")
        if (op == Op.WAIT or op == Op.CHECK) and req[1] == (WILL_KEY,):
            return STOP_WAITING if op == Op.WAIT else CHECK_READY
        raise StoreError(f"the will namespace takes only SET and GET of {WILL_KEY.decode()}")

    def execute_watching(self, req: Request, waiter: object, watcher: object, how: int = WATCH_READ) -> bytes | None:
        """As the core answers a watching read, never watched: the will changes with no
        write upstream (a PEEK, a front-end reading ahead: the state alone)."""
        reply = self.execute(req, waiter)
        return UNWATCHABLE if how == PEEK else UNWATCHABLE + (reply or b"")

    def forget(self, waiter: object) -> None:
        pass


class _Executed:
    """The waiter of a will executed through a relay's link: its answer is not needed,
    its loss is logged."""

    __slots__ = ("peer",)

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def wake(self, reply: bytes) -> None:
        pass

    def drop(self, reason: str) -> None:
        log.error("link from %s: its node's will was not executed upstream: %s", self.peer, reason)


class Wills:
    """The wills of one link server's sessions, executed through ``upstream_for(b"")``
    (the core at the store host; a relay's own link upstream)."""

    def __init__(self, upstream_for: Callable[[bytes], Upstream], max_key_bytes: int, heartbeat: float) -> None:
        """``heartbeat``: the links' heartbeat interval (seconds). A front-end that sent a
        batch lets its next beat ride with its next batch, so a healthy link may be silent
        for up to two intervals (``tier.connection``): a will waits at least three,
        whatever its ``after``."""
        self._upstream_for = upstream_for
        self._max_key_bytes = max_key_bytes
        self._least = 3 * heartbeat
        self._held: dict[Session, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._late = DeadlineCheck()
        self.executed = 0

    @property
    def held(self) -> int:
        return len(self._held)

    def write(self, session: Session, text: bytes) -> None:
        """A will written (empty: revoked). Raises StoreError on a malformed one."""
        if not text:
            session.will = None
            self._held.pop(session, None)
            return
        will = Will(text, self._max_key_bytes)
        session.will = will
        self._held[session] = None
        if self._timer is None or self._late.due > monotonic() + self._silence(will):
            self._arm(self._silence(will))

    def ended(self, session: Session, reason: str, quiet: bool) -> None:
        """``session`` ended (``quiet``: its front-end closed it): a will it still holds
        is executed now; the node left without its agent revoking it."""
        if session.will is not None:
            self._execute(session, "its link session ended" + ("" if quiet else f" ({reason})"))

    def _silence(self, will: Will) -> float:
        return max(will.after, self._least)

    def _arm(self, delay: float, again: bool = False) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._late.armed(monotonic(), delay, again), self._check)

    def _check(self) -> None:
        """Execute the wills of sessions silent for their ``after``, and come back when
        the next would be (not every interval: an idle store host wakes for its links'
        heartbeats). A check that ran late (this process was not running) looks again
        once what they sent is read. O(sessions holding a will)."""
        self._timer = None
        now = monotonic()
        soonest = now + self._least
        try:
            silent = []
            for s in self._held:
                will = s.will
                if will is None:
                    continue
                deadline = s.last_heard(now) + self._silence(will)
                if deadline <= now:
                    silent.append(s)
                elif deadline < soonest:
                    soonest = deadline
            if silent and self._late.look_again(now):
                self._arm(RECHECK_AFTER, again=True)
                return
            for session in silent:  # (each once: one revoked or executed meanwhile is skipped)
                self._execute(session, f"nothing heard on its link for {now - session.last_heard(now):.1f} s")
        finally:
            if self._timer is None and self._held:  # (deadlines only move later as frames come)
                self._arm(max(CHECK_EVERY, soonest - monotonic()))

    def _execute(self, session: Session, why: str) -> None:
        will = session.will
        if will is None:
            return
        session.will = None
        self._held.pop(session, None)
        self.executed += 1
        log.warning("link from %s: %s; executing its node's will (%s)", session.peer, why,
                    will.key.decode(errors="replace"))
        try:
            self._upstream_for(b"").execute((Op.COMPARE_SET, will.key, b"", will.value), _Executed(session.peer))
        except StoreError as e:
            log.error("link from %s: its node's will could not be executed: %s", session.peer, e)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
