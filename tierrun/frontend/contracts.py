"""What a front-end and its client connections rely on: where requests go (the
upstream), the gate that may hold answers back, and who takes a connection that turns
out to be a link."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from ..core import Waiter
from ..core.watch_state import WATCH_READ
from ..logs import FloodLog
from ..protocol import Limits, Request


class Upstream(Protocol):
    """Where a front-end sends requests: the core itself (flat) or a link (tiered)."""

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        """Reply now, or return None and deliver a reply later through ``waiter.wake``.

        Raises ``StoreError`` for a request that must fail.
        """

    def forget(self, waiter: Waiter) -> None:
        """The waiter's connection closed: drop whatever it was waiting for."""

    def execute_watching(self, req: Request, waiter: Waiter, watcher: object, how: int = WATCH_READ) -> bytes | None:
        """A one-key CHECK, GET or WAIT that also watches its key, ``how``: one of
        ``core.watch_state``'s WATCH_READ (a link's WATCH entry), FETCH (a WAIT of a
        WATCHES entry), FETCH_AFTER_WRITES (of a FETCHES entry): see
        ``StoreCore.execute_watching``."""


#: ``(transport, peer, rest, on_closed)``: takes over a connection that turned out to be
#: a front-end's link (on the store host's public port); ``rest`` is what was read after
#: the link's first byte, or None: nothing was read yet (a links-only port hands every
#: connection over at once; the acceptor checks its first byte, and refuses a torch
#: client with :data:`TORCH_CLIENT_REFUSED`); ``on_closed()`` once the connection is gone
#: (the front-end that accepted it counts it against its ``max_connections`` until then).
LinkAcceptor = Callable[[asyncio.Transport, str, "bytes | None", Callable[[], None]], None]

#: Why a links-only port (a tiered job's store host's) closes a torch-protocol client.
TORCH_CLIENT_REFUSED = (
    "a torch-protocol client, refused: this tiered job's store host takes only node links on this port (its "
    "agents and workers use their node's store front-end); allow such clients with --rdzv_conf "
    "store_public_clients=true (`tierrun store`: without --links-only)")


class Gate(Protocol):
    """Holds answers back while ``closed`` (``hub.reply_gate.ReplyGate``)."""

    closed: bool

    def emit(self, send: Callable[[bytes], None], data: bytes) -> None: ...


class ConnectionOwner(Protocol):
    """What a connection needs of the front-end that accepted it (``FrontEnd``)."""

    upstream: Upstream
    limits: Limits
    link_acceptor: LinkAcceptor | None
    gate: Gate | None
    #: Refuse torch-protocol clients: only links (a tiered job's store host's public port).
    links_only: bool
    #: Who may connect on a Unix socket (SO_PEERCRED's uid).
    unix_uids: frozenset[int]
    #: Bytes held for unfinished requests, all its connections together.
    unfinished: int
    #: Its connections holding an unfinished request, the one begun longest ago first.
    unfinished_since: dict[Any, None]
    #: Bytes of answers its clients have not read (those of connections whose writing
    #: is paused: at most what they held when paused, plus what was written since).
    unread: int
    #: Those connections, the one paused longest ago first.
    unread_since: dict[Any, None]
    #: Where a connection closed for what its client did says so (a flood: in part).
    closed_log: FloodLog

    def admit(self, conn: Any) -> bool:
        """Count ``conn`` as a client; False: refused (it is closed at once)."""

    def release(self, conn: Any) -> None:
        """``conn`` closed."""

    def became_link(self, conn: Any) -> Callable[[], None]:
        """``conn`` turned out to be a front-end's link: it is not a client after all,
        but counts as a connection until the returned callable is called."""
