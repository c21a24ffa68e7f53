"""Concurrent histories: several clients at once, each pipelining bursts of requests
(a burst is written at once; the next one after the burst's answers, and a seeded
pause). Each target's answers must be linearizable under a sequential model of torch's
server (tests/linearizability.py's search); torch's own server runs every history too,
which checks the model itself.

The vocabulary keeps to what the model covers exactly: counters that only ever hold
numbers (ADD wraps at the int64 bounds, as torch's server does), WAITs on one key (maybe
repeated) that is never COMPARE_SET (torch wakes a WAIT on a COMPARE_SET even when the
key stays missing, and counts a multi-key WAIT's keys as they appear, deleted again or
not: wake-ups no order explains), one queue, no BARRIER, no CANCEL_WAIT, no request
that closes the connection. A WAIT is only last in its burst; one still pending at the
end of the history may never have taken effect.
"""

from __future__ import annotations

import random
import select
import struct
import time
from collections import deque
from dataclasses import dataclass

from linearizability import Call, linearizable
from tierrun.protocol import Op
from tierrun.protocol.opcodes import CHECK_NOT_READY, CHECK_READY, STOP_WAITING
from tierrun.protocol.replies import encode_bytes, encode_i64, encode_many, encode_queue_pop, encode_u32

from .targets import ClosedError, Conn, Target
from .wire import BLOCKING, I64_MAX, I64_MIN, SILENT, expects_reply, op_name

_pack_u64 = struct.Struct("<Q").pack
#: Reads a node front-end may answer from a watch (a path of their own).
WATCHED = frozenset({Op.GET, Op.CHECK, Op.WAIT})

COUNTERS = (b"/k2", b"/k3")  # only ever numbers
FREE = b"/k0"  # set, appended to, deleted, waited for
NEW = b"/k1"  # set by MULTI_SET / SET, deleted, waited for
QUEUE = b"/q"
DIGITS = (b"0", b"1", b"2", b"3")
BIG_DELTAS = (I64_MAX, I64_MIN, I64_MAX - 1, 1 << 62)


@dataclass
class ConcurrentHistory:
    scripts: list[list[tuple[tuple, ...]]]  # per client, its bursts
    pauses: list[list[float]]  # per client, seconds before each burst
    where: tuple[int, ...]
    seed: int | None = None

    @property
    def operations(self) -> int:
        return sum(len(b) for s in self.scripts for b in s)

    def queue_keys(self) -> set[bytes]:
        return {QUEUE}


def _request(r: random.Random, avoid) -> tuple:
    x = r.randrange(22)
    c = r.choice(COUNTERS)
    if x < 4:
        delta = r.choice(BIG_DELTAS) if r.random() < 0.15 and "add-overflow-merge" not in avoid \
            else r.randint(-2, 3)
        return (Op.ADD, c, delta)
    if x < 6:
        return (Op.GET, r.choice(COUNTERS + (FREE, NEW)))
    if x < 7:
        return (Op.SET, c, r.choice(DIGITS))
    if x < 9:
        return (Op.SET, r.choice((FREE, NEW)), r.choice(DIGITS + (b"",)))
    if x < 10:
        return (Op.COMPARE_SET, c, r.choice((b"", b"0", b"1", b"2")), r.choice(DIGITS))
    if x < 11:
        return (Op.CHECK, tuple(r.sample(COUNTERS + (FREE, NEW, QUEUE), r.randint(1, 2))))
    if x < 12:  # (one key, maybe repeated: torch counts a multi-key WAIT's keys as they appear, so a
        # key deleted again, or a COMPARE_SET of a missing key, wakes it too early for any order)
        return (Op.WAIT, r.choice(((FREE,), (NEW,), (FREE, FREE), (NEW,))))
    if x < 13:
        return (Op.DELETE_KEY, r.choice((FREE, NEW)))
    if x < 14:
        return (Op.APPEND, FREE, r.choice(DIGITS))
    if x < 15:
        keys = r.choice((COUNTERS, (c, c), (FREE, NEW, c), (NEW,)))
        return (Op.MULTI_GET, keys)
    if x < 16:
        return (Op.MULTI_SET, (c, FREE), (r.choice(DIGITS), r.choice(DIGITS)))
    if x < 17:
        return (Op.QUEUE_PUSH, QUEUE, r.choice(DIGITS))
    if x < 18:
        return (Op.QUEUE_POP, QUEUE)
    if x < 19:
        return (Op.QUEUE_LEN, QUEUE)
    if x < 20:
        return (Op.GETNUMKEYS,)
    if x < 21:
        return (Op.LIST_KEYS,)
    return (Op.PING, r.getrandbits(32))


def generate(seed: int, avoid=frozenset(), clients=(2, 4), bursts=(2, 6), fronts: int = 4) -> ConcurrentHistory:
    r = random.Random(seed)
    vocabulary = [_request(r, avoid) for _ in range(r.randint(4, 10))]  # (few: they collide)
    scripts, pauses = [], []
    for _ in range(r.randint(*clients)):
        script = []
        for _ in range(r.randint(*bursts)):
            burst = []
            for _ in range(r.choice((1, 1, 2, 3, 4))):
                req = r.choice(vocabulary) if r.random() < 0.8 else _request(r, avoid)
                if "reply-order" in avoid and burst and req[0] == Op.PING:
                    continue
                if "tree-reply-order" in avoid and _mixes_reads([*burst, req]):
                    continue
                burst.append(req)
                if req[0] in BLOCKING:
                    break
            if not expects_reply(burst[-1]):  # (a fence: the burst is over once answered)
                fence = (Op.GET, r.choice(COUNTERS))
                if "tree-reply-order" in avoid:
                    fence = (Op.GETNUMKEYS,)
                if "tree-reply-order" not in avoid or not _mixes_reads([*burst, fence]):
                    burst.append(fence)
            script.append(tuple(burst))
        scripts.append(script)
        pauses.append([r.choice((0.0, 0.0, 0.0, 0.0005, 0.002)) for _ in script])
    return ConcurrentHistory(scripts, pauses, tuple(r.randrange(fronts) for _ in scripts), seed)


def _mixes_reads(burst) -> bool:
    """A read a front-end may answer from a watch, with another answered request."""
    answered = [q for q in burst if expects_reply(q)]
    return len(answered) > 1 and any(q[0] in WATCHED for q in answered)


# -- the sequential model (torch's libuv server) -------------------------------------------


def _wrap(n: int) -> int:
    return (n - I64_MIN) % (1 << 64) + I64_MIN


def apply(state: tuple, req: tuple):
    data, queue = dict(state[0]), deque(state[1])
    op = req[0]
    reply = None
    if op == Op.SET:
        data[req[1]] = req[2]
    elif op == Op.GET:
        reply = encode_bytes(data.get(req[1], b""))
    elif op == Op.ADD:
        value = req[2] if req[1] not in data else _wrap(int(data[req[1]]) + req[2])
        data[req[1]] = str(value).encode()
        reply = encode_i64(value)
    elif op == Op.COMPARE_SET:
        _, key, expected, desired = req
        if key not in data:
            if expected:
                reply = encode_bytes(expected)
            else:
                data[key] = desired
                reply = encode_bytes(desired)
        else:
            if data[key] == expected:
                data[key] = desired
            reply = encode_bytes(data[key])
    elif op in (Op.CHECK, Op.WAIT):
        present = all(k in data or (k == QUEUE and queue) for k in req[1])
        if op == Op.WAIT:
            if not present:
                return None
            reply = STOP_WAITING
        else:
            reply = CHECK_READY if present else CHECK_NOT_READY
    elif op == Op.DELETE_KEY:
        reply = encode_i64(1 if data.pop(req[1], None) is not None else 0)
    elif op == Op.APPEND:
        data[req[1]] = data.get(req[1], b"") + req[2]
    elif op == Op.MULTI_GET:
        reply = encode_many([data.get(k, b"") for k in req[1]])
    elif op == Op.MULTI_SET:
        data.update(zip(req[1], req[2]))
    elif op == Op.QUEUE_PUSH:
        queue.append(req[2])
    elif op == Op.QUEUE_POP:
        reply = encode_queue_pop(len(queue), queue.popleft() if queue else None)
    elif op == Op.QUEUE_LEN:
        reply = encode_i64(len(queue))
    elif op == Op.GETNUMKEYS:
        reply = encode_i64(len(data))
    elif op == Op.LIST_KEYS:
        reply = encode_i64(len(data)) + b"".join(sorted(_pack_u64(len(k)) + k for k in data))
    elif op == Op.PING:
        reply = encode_u32(req[1])
    else:
        raise AssertionError(op)
    return (tuple(sorted(data.items())), tuple(queue)), reply


INITIAL = ((), ())


# -- running one ----------------------------------------------------------------------------


@dataclass
class Outcome:
    target: str
    calls: list[Call]
    problem: str = ""  # a request never answered, a connection closed, ...
    alive: bool = True
    death: str = ""
    #: Only answers missing at the deadline, nothing cut wrong: maybe a slow machine.
    slow: bool = False

    def describe(self) -> str:
        lines = [f"{self.target}: {self.problem or 'not linearizable'}"]
        for c in self.calls:
            lines.append(f"  c{c.client} {op_name(c.req)} {c.req[1:]!r:.60} [{c.invoked}, {c.returned}] -> {c.reply!r:.60}")
        return "\n".join(lines)


def run(history: ConcurrentHistory, target: Target, deadline: float = 3.0) -> Outcome:
    entries = target.entries
    n = len(history.scripts)
    out = Outcome(target.name, [])
    try:
        conns = [Conn(entries[history.where[i] % len(entries)], nonce=0x2000 + i) for i in range(n)]
    except (OSError, ClosedError) as e:
        out.problem = f"cannot connect: {e}"
        return out
    clock = 0
    calls: list[Call] = out.calls
    by_index: list[dict[int, Call]] = [{} for _ in range(n)]
    silent: list[list[Call]] = [[] for _ in range(n)]  # sent, no answer expected, not yet "done"
    position = [0] * n  # next burst
    marks = [0] * n  # tokens seen
    start = time.monotonic()
    ready_at = [start + history.pauses[i][0] for i in range(n)]
    end = start + deadline
    try:
        while True:
            now = time.monotonic()
            for i, c in enumerate(conns):
                busy = not c.reader.answered or c.reader.waiting
                if not busy and position[i] < len(history.scripts[i]) and ready_at[i] <= now and not c.closed:
                    burst = history.scripts[i][position[i]]
                    position[i] += 1
                    base = c.reader.sent  # (the reader numbers requests as they are sent)
                    for j, req in enumerate(burst):
                        clock += 1
                        call = Call(i, req, clock)
                        calls.append(call)
                        by_index[i][base + j] = call
                        if req[0] in SILENT:
                            silent[i].append(call)
                    c.send(burst)
            for i, c in enumerate(conns):  # answers, in the order they came
                for index, reply in c.reader.tokens[marks[i]:]:
                    clock += 1
                    call = by_index[i][index]
                    call.returned, call.reply = clock, reply
                    for earlier in silent[i]:  # (FIFO: done before this answer)
                        if earlier.invoked < call.invoked:
                            earlier.returned = clock
                    silent[i] = [s for s in silent[i] if s.returned is None]
                    if c.reader.answered and not c.reader.waiting and position[i] < len(history.scripts[i]):
                        ready_at[i] = time.monotonic() + history.pauses[i][position[i]]
                marks[i] = len(c.reader.tokens)
            # over once every client is through its script or blocked in a WAIT (that
            # nothing left to send can release)
            done = all(c.reader.answered and (position[i] == len(history.scripts[i]) or c.reader.waiting)
                       for i, c in enumerate(conns))
            if done or any(c.closed for c in conns) or now > end:
                break
            waits = [ready_at[i] - now for i, c in enumerate(conns)
                     if position[i] < len(history.scripts[i]) and c.reader.answered and not c.reader.waiting]
            open_ = [c for c in conns if not c.closed]
            select.select(open_, [], [], max(min(waits, default=0.05), 0) if waits else 0.05)
            for c in open_:
                c.pump()
        # a pending WAIT may still be answered: a short quiet time
        quiet = time.monotonic() + 0.02
        while time.monotonic() < quiet:
            open_ = [c for c in conns if not c.closed and c.reader.pending]
            if not open_:
                break
            r, _, _ = select.select(open_, [], [], 0.005)
            for c in r:
                c.pump()
        for i, c in enumerate(conns):
            for index, reply in c.reader.tokens[marks[i]:]:
                clock += 1
                call = by_index[i][index]
                call.returned, call.reply = clock, reply
                for earlier in silent[i]:
                    if earlier.invoked < call.invoked:
                        earlier.returned = clock
                silent[i] = [s for s in silent[i] if s.returned is None]
        clock += 1
        for i in range(n):
            for s in silent[i]:
                s.returned = clock
        closed = [i for i, c in enumerate(conns) if c.closed]
        unanswered = [c for c in calls if c.returned is None and c.req[0] not in BLOCKING]
        if closed:
            out.problem = f"connection of client(s) {closed} closed"
        elif unanswered:
            out.problem = f"never answered: {', '.join(f'c{c.client} {op_name(c.req)}' for c in unanswered)}"
            stuck = {c.client for c in unanswered}
            out.slow = not any(conns[i].reader.buf for i in stuck)
            out.problem += "".join(f"; c{i} holds {bytes(conns[i].reader.buf)[:24]!r} (a reply cut wrong: "
                                   "answers out of order?)" for i in sorted(stuck) if conns[i].reader.buf)
        elif any(c.reader.buf for c in conns):
            out.problem = "bytes that answer nothing: " + ", ".join(
                f"c{i} {bytes(c.reader.buf)[:40]!r}" for i, c in enumerate(conns) if c.reader.buf)
    finally:
        for c in conns:
            c.close()
    out.alive, out.death = target.alive(), target.describe_death()
    out.slow = out.slow and out.alive
    if not out.alive and not out.problem:
        out.problem = out.death
    return out


def check(outcome: Outcome) -> bool:
    """The outcome is linearizable (and nothing went wrong)."""
    if outcome.problem:
        return False
    return linearizable(outcome.calls, apply, INITIAL, no_reply=SILENT)


def as_sequential(history: ConcurrentHistory, outcome: Outcome | None = None):
    """The same bursts as a sequential history (for the sequential oracle and its
    minimizer): in the order the run invoked them (``outcome``), else client by client
    round-robin. Bursts never sent (behind a WAIT that never returned) are left out."""
    from .history import History

    if outcome is not None:
        firsts = []
        counts = [0] * len(history.scripts)
        calls = sorted(outcome.calls, key=lambda c: c.invoked)
        i = 0
        while i < len(calls):
            c = calls[i]
            burst = history.scripts[c.client][counts[c.client]]
            firsts.append((c.client, burst))
            counts[c.client] += 1
            i += len(burst)
        steps = firsts
    else:
        steps = []
        for k in range(max(len(s) for s in history.scripts)):
            steps += [(i, s[k]) for i, s in enumerate(history.scripts) if k < len(s)]
    return History(len(history.scripts), steps, history.where, seed=history.seed)
