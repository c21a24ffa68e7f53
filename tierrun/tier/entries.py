"""A plan's operations as link entries: request ids, link client ids (an OPEN entry for
a namespace's first), and BATCH frames: a batch past a frame's size leaves as several
(a single entry is at most one request, which the limits keep below a frame). No I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..link.frames import (
    PEEKS, WAITS, encode_batch, entry_after, entry_open, entry_request, entry_waits, entry_watch,
)
from ..protocol import Op
from ..protocol.opcodes import WAITING_OPS
from ..protocol.requests import encode_request
from .plan import Plan, UpOp, nothing_unsettled

#: Bytes of a BATCH frame besides its entries (length, type, entry count), and a margin.
_FRAME_HEAD = 64


@dataclass
class Ids:
    """A session's request and link client ids (one counter), and its namespaces' ids."""

    next: int = 1
    of_namespace: dict[bytes, int] = field(default_factory=dict)

    def new(self) -> int:
        n = self.next
        self.next += 1
        return n


@dataclass
class Encoded:
    frames: list[bytes] = field(default_factory=list)  # BATCH frames, in order
    ops: int = 0  # operations sent (a WAITS entry's keys each count)
    opened: int = 0  # namespaces opened (OPEN entries)
    watches: int = 0  # watching reads sent
    peeks: int = 0  # keys read ahead
    #: The request id of the batch's last answer the upstream gives at once (0: none).
    answered_at_once: int = 0
    #: Writes with no answer: (request id, opcode, the client whose write it is).
    writes: list[tuple[int, int, Any]] = field(default_factory=list)
    #: Client -> request id of its latest write with no answer in this batch.
    latest: dict[Any, int] = field(default_factory=dict)


def encode_plan(plan: Plan, extra: list[bytes], ids: Ids, inflight: dict[int, UpOp], max_frame: int,
                gate: Callable[[Any], int] = nothing_unsettled) -> Encoded:
    """Give ``plan``'s ops their ids (registered in ``inflight`` when an answer is
    expected; a write with no answer has one too, in ``writes``) and entries, after the
    ``extra`` ones (CANCELs), in BATCH frames of at most ``max_frame`` bytes: several,
    in order, when a batch holds more (each is executed in turn; a fold never spans
    two). An op with ``after`` goes behind an AFTER entry naming its client's latest
    write that may yet be refused (this batch's, else ``gate(client)``: its id, or
    REFUSED once its refusal came: ``WritesInFlight.gate``), if any.
    O(bytes of the entries)."""
    out = Encoded()
    if not extra and len(plan.ops) == 1:  # (a batch of one plain request: most of a trickle)
        u = plan.ops[0]
        if u.watchers is None and not u.members and not u.fetch:
            new: list[bytes] = []
            _plain(u, _client_id(u, ids, new, out), ids, inflight, out, new, gate)
            out.frames = [encode_batch(new)]
            return out
    frames: list[list[bytes]] = []
    entries = list(extra)
    size = sum(map(len, entries))
    room = max_frame - _FRAME_HEAD
    for u in plan.ops:
        new = []
        cid = _client_id(u, ids, new, out)
        members = u.members or ()
        if members or u.fetch:  # one WAITS (WATCHES, ...) entry: request ids rid, rid + 1, ...
            u.rid = ids.new()
            inflight[u.rid] = u
            for m in members:
                m.cid = cid
                m.rid = ids.new()
                inflight[m.rid] = m
            new.append(entry_waits(cid, u.rid, [u.req[1][0]] + [m.req[1][0] for m in members], u.fetch or WAITS))
            out.ops += 1 + len(members)
            if u.fetch == PEEKS:
                out.peeks += 1 + len(members)
            elif u.fetch:
                out.watches += 1 + len(members)
        elif u.watchers is not None:
            u.rid = ids.new()
            inflight[u.rid] = u
            if u.req[0] != Op.WAIT:
                out.answered_at_once = u.rid
            new.append(entry_watch(cid, u.rid, encode_request(u.req)))
            out.watches += 1
            out.ops += 1
        else:
            _plain(u, cid, ids, inflight, out, new, gate)
        added = sum(map(len, new))
        if entries and size + added > room:
            frames.append(entries)
            entries, size = [], 0
        entries += new
        size += added
    if entries:
        frames.append(entries)
    out.frames = [encode_batch(f) for f in frames]
    return out


def _client_id(u: UpOp, ids: Ids, new: list[bytes], out: Encoded) -> int:
    """``u``'s link client id: its namespace's (an OPEN entry in ``new`` for the first)."""
    cid = ids.of_namespace.get(u.ns)
    if cid is None:
        cid = ids.of_namespace[u.ns] = ids.new()
        new.append(entry_open(cid, u.ns))
        out.opened += 1
    u.cid = cid
    return cid


def _plain(u: UpOp, cid: int, ids: Ids, inflight: dict[int, UpOp], out: Encoded, new: list[bytes],
           gate: Callable[[Any], int]) -> None:
    """A plain request's entry (not a watching read, not WAITs folded in one entry),
    behind an AFTER entry if it must follow a write that may yet be refused."""
    if u.after is not None:
        after = out.latest.get(u.after) or gate(u.after)
        if after:
            new.append(entry_after(cid, after))
    req = u.request()
    if u.waiters:
        u.rid = ids.new()
        inflight[u.rid] = u
        if req[0] not in WAITING_OPS:
            out.answered_at_once = u.rid
    elif u.writer is not None:  # (answered only if refused: see .writes)
        u.rid = ids.new()
        out.writes.append((u.rid, req[0], u.writer))
        out.latest[u.writer] = u.rid
    new.append(entry_request(cid, u.rid, encode_request(req)))
    out.ops += 1
