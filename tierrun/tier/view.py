"""What one front-end listener sees of its link: every client in one namespace."""

from __future__ import annotations

from typing import Any, Protocol

from ..core import Waiter
from ..core.watch_state import WATCH_READ
from ..protocol import Request


class Link(Protocol):
    """What a view asks of its link (``.upstream.LinkUpstream``)."""

    def submit(self, req: Request, waiter: Waiter, ns: bytes) -> bytes | None: ...

    def submit_watching(self, req: Request, waiter: Waiter, watcher: Any, ns: bytes, how: int) -> bytes | None: ...

    def forget(self, waiter: Waiter, ns: bytes) -> None: ...

    def write_room(self, client: Any) -> bool: ...


class LinkView:
    """The link as seen by one front-end listener: every client in ``namespace``."""

    #: A write with no answer may be refused after ``execute`` returned: its waiter's
    #: ``drop`` is called then (``hub.waiters.WriteTicket``: a relaying proxy's).
    defers_refusals = True

    def __init__(self, link: Link, namespace: bytes) -> None:
        self._link = link
        self._ns = namespace

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        return self._link.submit(req, waiter, self._ns)

    def execute_watching(self, req: Request, waiter: Waiter, watcher: Any, how: int = WATCH_READ) -> bytes | None:
        return self._link.submit_watching(req, waiter, watcher, self._ns, how)

    def forget(self, waiter: Waiter) -> None:
        self._link.forget(waiter, self._ns)

    def write_room(self, client: Any) -> bool:
        return self._link.write_room(client)
