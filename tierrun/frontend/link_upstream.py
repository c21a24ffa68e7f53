"""A front-end's upstream over a link: batching and coalescing (design.md's rule).

Requests that arrive during one event-loop iteration form one *batch*, sent in one
frame and executed atomically, in order, by the core. Within a batch:
- identical read-only requests (WAIT, CHECK, GET, MULTI_GET, GETNUMKEYS, QUEUE_LEN)
  with no write to their keys between them are sent once and the answer fanned out;
- consecutive ADDs to one key with no other operation on that key between them become
  one ADD of the sum; the i-th caller gets ``final - sum + prefix_i``, exactly what
  sequential execution returns.
Nothing is cached or merged across batches. Each WAIT runs at the core under its own
link client id, so one client's CANCEL_WAIT (answered here) never cancels the others'.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import defaultdict
from collections.abc import Callable

from ..core import Waiter
from ..link import auth
from ..link.frames import (
    ERROR, HELLO, LINK_MAGIC, OK, REPLIES, WELCOME, FrameDecoder, LinkError,
    decode_replies, encode_batch, entry_close, entry_open, entry_request,
)
from ..protocol import Op, Request
from ..protocol.opcodes import NO_REPLY_OPS, STOP_WAITING, WAIT_CANCELED
from ..protocol.requests import encode_request

log = logging.getLogger("tierrun.frontend")

_i64 = struct.Struct("<q")
_DEDUP_OPS = frozenset({Op.WAIT, Op.CHECK, Op.GET, Op.MULTI_GET, Op.GETNUMKEYS, Op.QUEUE_LEN})
_ALL_KEYS = b"\x00*"  # pseudo-key touched by every write: GETNUMKEYS depends on all


def _keys(req: Request) -> tuple[bytes, ...]:
    op = req[0]
    if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET):
        return req[1]
    if op in (Op.GETNUMKEYS, Op.LIST_KEYS, Op.CANCEL_WAIT):
        return ()
    return (req[1],)


class _Upstream:
    """One operation sent upstream, and who gets its answer."""

    __slots__ = ("req", "cid", "waiters", "deltas", "group")

    def __init__(self, req: Request, cid: int, waiter: Waiter | None) -> None:
        self.req = req
        self.cid = cid
        self.waiters: list[Waiter] = [waiter] if waiter is not None else []
        self.deltas: list[int] | None = None  # set for a merged ADD
        self.group = False  # a WAIT group: waiters may cancel one by one


class CoalescingStats:
    """What a front-end merged before its requests left the node."""

    def __init__(self) -> None:
        self.requests = 0  # from local clients
        self.upstream_ops = 0
        self.batches = 0
        self.merged_reads = 0
        self.merged_waits = 0
        self.merged_adds = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class LinkUpstream(asyncio.Protocol):
    """The link to the core (or to another front-end). Use :meth:`view` per namespace."""

    def __init__(self, token: bytes, on_lost: Callable[[str], None]) -> None:
        self._token = token
        self._on_lost = on_lost
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._client_nonce = b""
        self._server_nonce = b""
        self._pending: list[tuple[Waiter, bytes, Request]] = []
        self._extra: list[bytes] = []  # CLOSE entries for the next batch
        self._inflight: dict[int, _Upstream] = {}
        self._cids: dict[tuple[Waiter, bytes], int] = {}
        self._wait_of: dict[Waiter, _Upstream] = {}
        self._next_id = 1
        self.stats = CoalescingStats()

    # -- connection and handshake -----------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._transport = transport
        transport.write(bytes([LINK_MAGIC]))

    def data_received(self, data: bytes) -> None:
        try:
            for ftype, payload in self._decoder.feed(data):
                if ftype == REPLIES:
                    self._on_replies(payload)
                elif ftype == HELLO:
                    self._server_nonce = payload[2:]
                    frame, self._client_nonce = auth.answer_hello(self._token, payload)
                    assert self._transport is not None
                    self._transport.write(frame)
                elif ftype == WELCOME:
                    auth.check_welcome(self._token, self._server_nonce, self._client_nonce, payload)
                    self.ready.set_result(None)
                elif ftype == ERROR:
                    raise LinkError("the store host refused the link: " + payload.decode(errors="replace"))
                else:
                    raise LinkError(f"unexpected frame type {ftype}")
        except LinkError as e:
            self._fail(str(e))

    def _fail(self, reason: str) -> None:
        if not self.ready.done():
            self.ready.set_exception(LinkError(reason))
        if self._transport is not None:
            self._transport.close()
        self._on_lost(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"link to the store host lost ({exc or 'closed by the peer'})"
        if not self.ready.done():
            self.ready.set_exception(LinkError(reason))
        self._on_lost(reason)

    # -- requests ---------------------------------------------------------------------

    def view(self, namespace: str = "") -> LinkView:
        return LinkView(self, namespace.encode())

    def submit(self, req: Request, waiter: Waiter, ns: bytes) -> bytes | None:
        op = req[0]
        if op == Op.CANCEL_WAIT:
            group = self._wait_of.pop(waiter, None)
            if group is not None or (waiter, ns) not in self._cids:
                if group is not None:
                    self._leave_group(group, waiter)
                return WAIT_CANCELED
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((waiter, ns, req))
        self.stats.requests += 1
        return None

    def forget(self, waiter: Waiter, ns: bytes) -> None:
        group = self._wait_of.pop(waiter, None)
        if group is not None:
            self._leave_group(group, waiter)
        cid = self._cids.pop((waiter, ns), None)
        if cid is not None:
            self._queue_extra(entry_close(cid))

    def _leave_group(self, group: _Upstream, waiter: Waiter) -> None:
        if waiter in group.waiters:
            group.waiters.remove(waiter)
        if not group.waiters:
            self._queue_extra(entry_close(group.cid))

    def _queue_extra(self, entry: bytes) -> None:
        if not self._pending and not self._extra:
            asyncio.get_running_loop().call_soon(self._flush)
        self._extra.append(entry)

    def _new_id(self) -> int:
        n = self._next_id
        self._next_id += 1
        return n

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        entries, self._extra = self._extra, []
        ops: list[_Upstream] = []
        open_reads: dict[tuple[bytes, bytes], _Upstream] = {}
        reads_on: dict[tuple[bytes, bytes], list[tuple[bytes, bytes]]] = defaultdict(list)
        add_runs: dict[tuple[bytes, bytes], _Upstream] = {}
        stats = self.stats

        def touched(ns: bytes, keys, write: bool) -> None:
            for k in keys:
                add_runs.pop((ns, k), None)
                if write:
                    for dk in reads_on.pop((ns, k), ()):
                        open_reads.pop(dk, None)
            if write:
                for dk in reads_on.pop((ns, _ALL_KEYS), ()):
                    open_reads.pop(dk, None)

        for waiter, ns, req in pending:
            op = req[0]
            if (waiter, ns) not in self._cids and op != Op.WAIT:
                cid = self._cids[(waiter, ns)] = self._new_id()
                entries.append(entry_open(cid, ns))
            if op in _DEDUP_OPS:
                keys = _keys(req) or (_ALL_KEYS,)
                dk = (ns, encode_request(req))
                same = open_reads.get(dk)
                touched(ns, _keys(req), write=False)
                if same is not None:
                    same.waiters.append(waiter)
                    if op == Op.WAIT:
                        self._wait_of[waiter] = same
                        stats.merged_waits += 1
                    else:
                        stats.merged_reads += 1
                    continue
                if op == Op.WAIT:
                    u = _Upstream(req, self._new_id(), waiter)
                    u.group = True
                    entries.append(entry_open(u.cid, ns))
                    self._wait_of[waiter] = u
                else:
                    u = _Upstream(req, self._cids[(waiter, ns)], waiter)
                open_reads[dk] = u
                for k in keys:
                    reads_on[(ns, k)].append(dk)
                ops.append(u)
            elif op == Op.ADD:
                key = (ns, req[1])
                run = add_runs.get(key)
                touched(ns, (req[1],), write=True)
                if run is not None:
                    run.waiters.append(waiter)
                    run.deltas.append(req[2])  # type: ignore[union-attr]
                    add_runs[key] = run
                    stats.merged_adds += 1
                    continue
                u = _Upstream(req, self._cids[(waiter, ns)], waiter)
                u.deltas = [req[2]]
                add_runs[key] = u
                ops.append(u)
            else:
                touched(ns, _keys(req), write=True)
                u = _Upstream(req, self._cids[(waiter, ns)], None if op in NO_REPLY_OPS else waiter)
                ops.append(u)
        for u in ops:
            req = u.req
            if u.deltas is not None and len(u.deltas) > 1:
                req = (Op.ADD, req[1], sum(u.deltas))
            rid = 0 if not u.waiters else self._new_id()
            if rid:
                self._inflight[rid] = u
            entries.append(entry_request(u.cid, rid, encode_request(req)))
        if entries and self._transport is not None and not self._transport.is_closing():
            stats.batches += 1
            stats.upstream_ops += len(ops)
            self._transport.write(encode_batch(entries))

    def _on_replies(self, payload: bytes) -> None:
        for rid, status, data in decode_replies(payload):
            u = self._inflight.pop(rid, None)
            if u is None:
                continue
            if status != OK:
                reason = data.decode(errors="replace")
                for w in u.waiters:
                    w.drop(f"{Op(u.req[0]).name} failed: {reason}")  # type: ignore[attr-defined]
                continue
            if u.group:
                for w in u.waiters:
                    self._wait_of.pop(w, None)
                    w.wake(STOP_WAITING)
                self._queue_extra(entry_close(u.cid))
            elif u.deltas is not None and len(u.deltas) > 1:
                final = _i64.unpack(data)[0]
                prefix = final - sum(u.deltas)
                for w, d in zip(u.waiters, u.deltas):
                    prefix += d
                    w.wake(_i64.pack(prefix))
            else:
                for w in u.waiters:
                    w.wake(data)


class LinkView:
    """The link as seen by one front-end listener: every client in ``namespace``."""

    def __init__(self, link: LinkUpstream, namespace: bytes) -> None:
        self._link = link
        self._ns = namespace

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        return self._link.submit(req, waiter, self._ns)

    def forget(self, waiter: Waiter) -> None:
        self._link.forget(waiter, self._ns)


async def connect_link(host: str, port: int, token: bytes, on_lost: Callable[[str], None],
                       timeout: float = 60.0) -> LinkUpstream:
    """Connect and authenticate, retrying while the store host is not up yet (backoff
    0.1 s to 2 s). Raises LinkError (refused, wrong token, version) or TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.1
    while True:
        try:
            _, link = await loop.create_connection(lambda: LinkUpstream(token, on_lost), host, port)
            break
        except OSError as e:
            if loop.time() + delay > deadline:
                raise TimeoutError(f"cannot connect to the store host {host}:{port}: {e}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
    await asyncio.wait_for(link.ready, max(deadline - loop.time(), 1.0))
    return link
