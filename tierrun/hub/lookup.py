"""The answer to a LOOKUP (``link.frames``): one key's value once it is set, for a node
that needs it before its proxy can start (``tier.lookup``: where its parent in a tree
takes links). No session: the connection's one read, a WAIT and a GET upstream, one
write, and the connection closes, where a session's handshake, batches and goodbye
cost the store host five reads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..core import StoreError
from ..frontend.contracts import Upstream
from ..protocol import Op, Request


class LookupAnswer:
    """The waiter of one LOOKUP of ``key``: :meth:`start` WAITs for the key, then GETs
    it, and gives ``send`` the GET's torch-encoded reply, or ``fail`` why the store
    refused. :meth:`cancel` if the connection closes first."""

    __slots__ = ("_upstream", "_key", "_send", "_fail", "_got_key", "done")

    def __init__(self, upstream: Upstream, key: bytes, send: Callable[[bytes], None],
                 fail: Callable[[str], None]) -> None:
        self._upstream = upstream
        self._key = key
        self._send = send
        self._fail = fail
        self._got_key = False  # the WAIT is over: the GET is on its way
        self.done = False

    def start(self) -> None:
        self._run((Op.WAIT, (self._key,)))

    def _run(self, req: Request) -> None:
        try:
            reply = self._upstream.execute(req, self)
        except StoreError as e:
            self.done = True
            self._fail(str(e))
            return
        if reply is not None:
            self._answered(reply)

    def wake(self, reply: bytes) -> None:
        """(Called from inside the upstream: the GET goes once it has returned.)"""
        asyncio.get_running_loop().call_soon(self._answered, reply)

    def _answered(self, reply: bytes) -> None:
        if self.done:
            return
        if not self._got_key:
            self._got_key = True
            self._run((Op.GET, self._key))
            return
        self.done = True
        self._send(reply)

    def drop(self, reason: str) -> None:
        """Its upstream gave up on it (a relay's link lost, the request refused)."""
        if not self.done:
            self.done = True
            self._fail(reason)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._upstream.forget(self)
