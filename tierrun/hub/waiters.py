"""Who gets the answer of a request that came over a link: a link client (one namespace
of a front-end), a ticket of its own for a WAIT or BARRIER (any number wait at once),
a ticket for a relayed write with no answer (answered only if refused upstream), or,
for a relayed request AFTER a relayed write, its link client behind that write.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from ..frontend import Upstream
from ..link.frames import FAILED, OK
from ..protocol import Request
from ..protocol.opcodes import NO_REPLY_OPS, WAITING_OPS


class LinkSession(Protocol):
    """What a waiter needs of its link session (``hub.session.Session``)."""

    relayed: OrderedDict[int, WriteTicket]

    def queue_reply(self, rid: int, status: int, data: bytes) -> None: ...

    def refused(self, rid: int) -> None: ...

    def relayed_write_refused(self, rid: int, reason: bytes) -> None: ...


#: Requests whose answer may go to someone other than their client (``waiter_for``).
OWN_WAITER_OPS = WAITING_OPS | NO_REPLY_OPS
#: Refused requests a session remembers for AFTER entries until acknowledged: the latest
#: this many at most (a client with more refused between two acknowledgements of its
#: node's link may make the store host forget another's).
KEPT = 65536


class RemoteClient:
    """A link client (one namespace of a front-end), as its upstream sees it: the waiter
    of its deferred answers. A WAIT or BARRIER waits under a :class:`Ticket` of its
    own, so any number may wait at once; a front-end's link upstream (a stacked
    front-end) also defers every other answer, delivered in request order. It
    relays: its requests are a whole subtree's (see ``tier.hold.HoldPolicy.contended``)."""

    __slots__ = ("session", "upstream", "pending", "tickets", "relays_writes")
    relay = True

    def __init__(self, session: LinkSession, upstream: Upstream) -> None:
        self.session = session
        self.upstream = upstream
        self.pending: deque[int] = deque()  # request ids of deferred answers, in order
        self.tickets: dict[int, Ticket] = {}  # request id -> its waiting WAIT/BARRIER
        #: Its upstream is a link (this is a relaying proxy): a write it executes may be
        #: refused later, upstream, and is executed under a :class:`WriteTicket`.
        self.relays_writes = bool(getattr(upstream, "defers_refusals", False))

    @property
    def scan_source(self) -> int:
        """Whose share its scans and its keys waited for count in (``core.budget``,
        ``core.wait_shares``): its node's, all of the session's clients together."""
        return id(self.session)

    def wake(self, reply: bytes) -> None:
        self.session.queue_reply(self.pending.popleft(), OK, reply)

    def drop(self, reason: str) -> None:
        """The request failed upstream (or the upstream link is gone)."""
        if self.pending:
            self.session.queue_reply(self.pending.popleft(), FAILED, reason.encode())

    def forget(self) -> None:
        """The session is gone: drop what waits upstream for it."""
        tickets, self.tickets = self.tickets, {}
        for ticket in tickets.values():
            self.upstream.forget(ticket)
        self.upstream.forget(self)


class Ticket:
    """One waiting WAIT or BARRIER of a remote client: answered by its request id. A
    relayed BARRIER AFTER a relayed write has that write's ticket as ``after``."""

    __slots__ = ("client", "rid", "after")

    def __init__(self, client: RemoteClient, rid: int) -> None:
        self.client = client
        self.rid = rid
        self.after: WriteTicket | None = None

    @property
    def scan_source(self) -> int:
        """(As its client's.)"""
        return id(self.client.session)

    def wake(self, reply: bytes) -> None:
        if self.client.tickets.pop(self.rid, None) is not None:
            self.client.session.queue_reply(self.rid, OK, reply)

    def drop(self, reason: str) -> None:
        if self.client.tickets.pop(self.rid, None) is not None:
            self.client.session.queue_reply(self.rid, FAILED, reason.encode())


class WriteTicket:
    """A write with no answer (SET, APPEND, MULTI_SET, QUEUE_PUSH) that a front-end below
    sent with a request id, relayed upstream: answered only if it is refused there
    (FAILED, once), so that the front-end below closes the clients whose writes it
    carried (``tier.writes``), as the store host answers it when it refuses it itself.
    ``client`` is the link client it came from: the planner keeps that client's
    requests in order, the hold policy counts the write as that client's
    (``tier.hold.issuer``)."""

    __slots__ = ("client", "rid", "after")

    def __init__(self, client: RemoteClient, rid: int) -> None:
        self.client = client
        self.rid = rid
        self.after: WriteTicket | None = None  # the relayed write it must follow (AFTER)

    def wake(self, reply: bytes) -> None:
        """(A write has no answer: never called.)"""

    def landed(self) -> None:
        """Executed upstream (``tier.writes``; or forgotten there, past its bound): no longer
        in its session's ``relayed``. O(1)."""
        if self.rid:
            self.client.session.relayed.pop(self.rid, None)
            self.rid = 0

    def drop(self, reason: str) -> None:
        """Refused upstream (or its link lost before it left): answer FAILED. O(1)."""
        if self.rid:
            rid, self.rid = self.rid, 0
            self.client.session.relayed_write_refused(rid, reason.encode())


class Behind:
    """The waiter of a relayed request with an answer that must follow a relayed write
    (AFTER): its link client's, which gets its answer in order, plus that write. It
    counts as its client (equal, same hash): the upstream's bookkeeping of a client's
    answers still due (``LinkUpstream._unanswered``) must see this one, or it would
    answer the client's next read from its watch ahead of this request."""

    __slots__ = ("client", "after")
    relay = True

    def __init__(self, client: RemoteClient, after: WriteTicket) -> None:
        self.client = client
        self.after = after

    def __hash__(self) -> int:
        return hash(self.client)

    def __eq__(self, other: object) -> bool:
        return other is self.client or other is self or (type(other) is Behind and other.client is self.client)

    @property
    def scan_source(self) -> int:
        return id(self.client.session)

    def wake(self, reply: bytes) -> None:
        self.client.wake(reply)

    def drop(self, reason: str) -> None:
        self.client.drop(reason)


def waiter_for(client: RemoteClient, req: Request, rid: int) -> RemoteClient | Ticket | WriteTicket:
    """Who waits for the answer of ``client``'s request ``rid``: a WAIT or BARRIER, a
    :class:`Ticket` of its own (any number wait at once); a relayed write sent with a
    request id, a :class:`WriteTicket`; anything else the client (deferred answers
    leave in request order). O(1)."""
    op = req[0]
    if op in WAITING_OPS:
        return Ticket(client, rid)
    if rid and op in NO_REPLY_OPS and client.relays_writes:
        # (kept until it lands or is refused: bounded by the upstream's writes in flight,
        # ``tier.writes.MAX_WRITES`` at most, and its room for queued ones)
        ticket = client.session.relayed[rid] = WriteTicket(client, rid)
        return ticket
    return client
