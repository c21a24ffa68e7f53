"""Seeded histories of raw requests, biased to the edges of torch's protocol.

A :class:`History` is a list of steps ``(client, burst)``: the client writes the whole
burst (one or more requests) at once and, in a sequential history, nobody acts again
until every answer the burst must get has come (a WAIT or BARRIER may stay pending).
A burst that ends with requests that have no answer (SET, APPEND, ...) ends with a
*fence*, a request of the same client that is answered: so every step is done, for
every client, before the next begins, and the history is deterministic under any
linearizable server (and torch's single-threaded one is).
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

from tierrun.protocol import Op
from tierrun.protocol.opcodes import VALIDATION_MAGIC

from .wire import (
    BLOCKING, I64_MAX, I64_MIN, KEY_LIMIT, KEYS_LIMIT, RAW, SILENT, VALUE_LIMIT, Big, expects_reply, raw_claim,
    request_size,
)

_pack_u64 = struct.Struct("<Q").pack

MiB = 1024 * 1024
#: Reads a node front-end may answer from a watch (a path of their own).
WATCHED = frozenset({Op.GET, Op.CHECK, Op.WAIT})


@dataclass
class History:
    clients: int
    steps: list[tuple[int, tuple[tuple, ...]]]
    #: In the "mixed" topology, the front-end index each client connects to (else unused).
    where: tuple[int, ...] = ()
    seed: int | None = None
    notes: dict = field(default_factory=dict)

    @property
    def operations(self) -> int:
        return sum(len(burst) for _, burst in self.steps)

    @property
    def wire_bytes(self) -> int:
        return sum(request_size(r) for _, burst in self.steps for r in burst)

    def queue_keys(self) -> set[bytes]:
        from .wire import materialize

        return {materialize(r[1]) for _, b in self.steps for r in b
                if r[0] in (Op.QUEUE_PUSH, Op.QUEUE_POP, Op.QUEUE_LEN)}

    def ops_used(self) -> set[str]:
        from .wire import op_name

        return {op_name(r) for _, b in self.steps for r in b}

    def source(self) -> str:
        """Python source that rebuilds it (for the regression table)."""
        lines = [f"History(clients={self.clients}, where={self.where!r}, steps=["]
        for client, burst in self.steps:
            reqs = ", ".join(_req_source(r) for r in burst)
            lines.append(f"    ({client}, ({reqs},)),")
        lines.append("])")
        return "\n".join(lines)


def _arg_source(a) -> str:
    if isinstance(a, tuple):
        inner = ", ".join(_arg_source(x) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, int) and not isinstance(a, bool) and abs(a) > 1 << 32:
        return {I64_MAX: "I64_MAX", I64_MIN: "I64_MIN"}.get(a, repr(a))
    return repr(a)


def _req_source(r: tuple) -> str:
    head = "RAW" if r[0] == RAW else f"Op.{Op(r[0]).name}"
    args = ", ".join(_arg_source(a) for a in r[1:])
    return f"({head}, {args})" if args else f"({head},)"


# -- the vocabulary ----------------------------------------------------------------------

#: Keys a history draws from. b"" is a key like any other for torch's server.
KEYS = [b"/a", b"/b", b"/c", b"", b"/n", b"/a/0"]
QUEUES = [b"/q", b"/a"]  # (a queue and a plain key may share a name: separate namespaces)
BARRIER_KEYS = [b"/bar", b"/n"]
#: Never written: a MULTI_GET of 128 Ki keys reads it (answers stay small).
NEVER = b"/never"

SMALL_VALUES = [b"", b"0", b"1", b"7", b"-3", b"x", b"abc", b"\x00", b"1\x002", b" 12", b"\t+5", b"12abc",
                b"-", b"+", b"0x10", b"9223372036854775807", b"-9223372036854775808",
                b"9223372036854775808", b"-9223372036854775809", b"00000000000000000000042"]
DELTAS = [0, 1, -1, 2, -2, 100, I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1, 1 << 62, -(1 << 62)]


@dataclass
class Profile:
    """How a history is drawn. ``heavy``: values of megabytes and 128 Ki keys (rare)."""

    clients: tuple[int, int] = (2, 4)
    steps: tuple[int, int] = (4, 14)
    burst: float = 0.3  # chance of a burst of several requests
    heavy: float = 0.01  # chance, per request, of a request of megabytes
    huge: float = 0.0  # chance, per history, of a request past 256 MiB of pipelined SETs
    fronts: int = 4  # front-ends of the mixed topology
    #: Chance, per value, of one of hundreds of bytes: writes that pass a small store
    #: budget (the budget oracle's, tests/test_oracle_budget.py).
    medium: float = 0.0
    #: Patterns not to draw (names of regressions.KNOWN_BUGS): bugs already handed over.
    avoid: frozenset = frozenset()


CI = Profile()
FUZZ = Profile(clients=(2, 5), steps=(4, 24), heavy=0.02)


class Generator:
    def __init__(self, seed: int, profile: Profile = CI) -> None:
        self.rnd = random.Random(seed)
        self.seed = seed
        self.p = profile
        r = self.rnd
        # a few keys per history, so that requests meet on them
        self.keys = r.sample(KEYS, r.randint(2, 4))
        self.appended: dict[bytes, int] = {}  # bytes APPENDed per key so far (an upper bound)
        self.values = r.sample(SMALL_VALUES, 6) + [b"1", b"2"]
        # (a queue of a key's name meets the WAITs on that key: torch counts them its way)
        self.queues = QUEUES[:1] if {"wait-on-queue-key", "queue-push-wait-count"} & profile.avoid else QUEUES

    # (each returns one request)
    def key(self) -> bytes:
        r = self.rnd
        x = r.random()
        if x < 0.004:
            return Big(KEY_LIMIT, b"k")
        if x < 0.006:
            return Big(KEY_LIMIT + 1, b"k")  # past torch's limit: the connection closes
        return r.choice(self.keys)

    def value(self):
        r = self.rnd
        if r.random() < self.p.heavy:
            return r.choice([Big(5 * MiB), Big(VALUE_LIMIT), Big(VALUE_LIMIT, b"w"), Big(VALUE_LIMIT + 1),
                             Big(3 * MiB, b"z")])
        if self.p.medium and r.random() < self.p.medium:  # (no draw otherwise: CI's histories stay as they are)
            return Big(r.randint(200, 1500), r.choice([b"m", b"n"]))
        return r.choice(self.values)

    def keylist(self):
        r = self.rnd
        x = r.random()
        if x < self.p.heavy / 2:
            return (NEVER,) * KEYS_LIMIT
        if x < self.p.heavy * 0.6:
            return (NEVER,) * (KEYS_LIMIT + 1)
        n = r.choice([0, 1, 1, 1, 2, 2, 3, 4])
        keys = [self.key() for _ in range(n)]
        if n and r.random() < 0.3:
            keys.append(r.choice(keys))  # repeated
        return tuple(keys)

    def delta(self) -> int:
        r = self.rnd
        return r.choice(DELTAS) if r.random() < 0.6 else r.randint(-5, 5)

    def request(self) -> tuple:
        r = self.rnd
        op = r.choices(OPS, WEIGHTS)[0]
        if op == Op.SET:
            return (op, self.key(), self.value())
        if op == Op.COMPARE_SET:
            expected = b"" if r.random() < 0.3 else self.value()
            return (op, self.key(), expected, self.value())
        if op in (Op.GET, Op.DELETE_KEY):
            return (op, self.key())
        if op == Op.ADD:
            return (op, self.key(), self.delta())
        if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET):
            return (op, self.keylist())
        if op == Op.APPEND:
            return (op, self.key(), self.value())
        if op == Op.MULTI_SET:
            n = r.choice([0, 1, 2, 2, 3])
            keys = [self.key() for _ in range(n)]
            if n and r.random() < 0.3:
                keys.append(keys[0])
            return (op, tuple(keys), tuple(self.value() for _ in keys))
        if op == Op.QUEUE_PUSH:
            return (op, r.choice(self.queues), self.value())
        if op in (Op.QUEUE_POP, Op.QUEUE_LEN):
            return (op, r.choice(self.queues))
        if op == Op.BARRIER:  # (/n may hold any number: a count that overflows)
            keys = BARRIER_KEYS[:1] if "barrier-overflow" in self.p.avoid else BARRIER_KEYS
            return (op, r.choice(keys), r.choice([1, 2, 2, 3, 3, 0, -1]))
        if op == Op.PING:
            return (op, r.getrandbits(32))
        if op == Op.VALIDATE:
            return (op, VALIDATION_MAGIC if r.random() < 0.5 else r.getrandbits(32))
        if op == RAW:
            return r.choice([
                (RAW, bytes((r.randint(19, 255),))),  # an opcode torch does not know
                raw_claim(Op.GET, 1 << 40),  # a key that claims a terabyte
                (RAW, b"\x01" + _pack_u64(2) + b"/a" + _pack_u64(VALUE_LIMIT + 1)),  # a value past the limit
                (RAW, bytes((r.choice([Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET]),))
                 + _pack_u64(KEYS_LIMIT + 1)),  # too many keys
            ])
        return (op,)  # GETNUMKEYS, CANCEL_WAIT, LIST_KEYS

    def fence(self) -> tuple:
        r = self.rnd
        fences = [(Op.GETNUMKEYS,), (Op.QUEUE_LEN, r.choice(self.queues)), (Op.LIST_KEYS,), (Op.PING, 7),
                  (Op.CHECK, (r.choice(self.keys),)), (Op.GET, r.choice(self.keys))]
        if "tree-reply-order" in self.p.avoid:
            fences = fences[:4]
        if "reply-order" in self.p.avoid:
            fences = [f for f in fences if f[0] != Op.PING]
        return r.choice(fences)

    def special_burst(self) -> list[tuple]:
        """What a node front-end merges: several writes of one client back to back."""
        r = self.rnd
        k = r.choice(self.keys)
        kind = r.randrange(6)
        if kind == 0 and r.random() < self.p.heavy * 20:  # (issue 32: 2 x 5 MiB APPENDs)
            return [(Op.APPEND, k, Big(5 * MiB, b"p")), (Op.APPEND, k, Big(5 * MiB, b"q")), (Op.GET, k)]
        if kind <= 1:  # ADDs whose sum leaves int64
            big = r.choice([I64_MAX, I64_MIN, I64_MAX - 1])
            return [(Op.ADD, k, big), (Op.ADD, k, r.choice([1, -1, big, 2])), (Op.ADD, k, r.choice([0, 1, -1]))]
        if kind == 2:
            return [(Op.APPEND, k, self.value()) for _ in range(r.randint(2, 4))] + [(Op.GET, k)]
        if kind == 3:
            return [(Op.SET, self.key(), self.value()) for _ in range(r.randint(2, 5))] + [self.fence()]
        if kind == 4:
            return [(Op.GET, self.key()) for _ in range(r.randint(2, 5))]
        return [(Op.SET, k, self.value()), (Op.PING, 1), (Op.GET, k)]

    def burst(self) -> tuple[tuple, ...]:
        r = self.rnd
        if r.random() < 0.08:
            burst = self.special_burst()
        elif r.random() < self.p.burst:
            burst = [self.request() for _ in range(r.randint(2, 4))]
        else:
            burst = [self.request()]
        # a WAIT or BARRIER may be pending: only last (a torch client sends nothing after
        # one but CANCEL_WAIT, and the runner sends that itself)
        out = []
        for req in burst:
            out.append(req)
            if req[0] in BLOCKING:
                break
        out = self.avoiding(out) or [self.fence()]  # (all of it a known pattern)
        if not expects_reply(out[-1]) and out[-1][0] != RAW:
            out.append(self.fence())
        return tuple(out)

    def avoiding(self, burst: list[tuple]) -> list[tuple]:
        """The burst without the patterns of known bugs (``Profile.avoid``)."""
        avoid = self.p.avoid
        if "validate-midstream" in avoid:
            burst = [(Op.VALIDATE, VALIDATION_MAGIC ^ 1) if r[0] == Op.VALIDATE else r for r in burst]
        if "bad-after-good" in avoid:
            bad = [r for r in burst if refused(r)]
            if bad and len(burst) > 1:
                burst = bad[:1]
        if "tree-reply-order" in avoid:  # (reads a front-end may answer from a watch: alone)
            answered = [r for r in burst if expects_reply(r)]
            if len(answered) > 1 and any(r[0] in WATCHED for r in answered):
                burst = [r for r in burst if r[0] not in WATCHED] or burst[:1]
        if "reply-order" in avoid:  # (PING and CANCEL_WAIT only first in a burst)
            burst = burst[:1] + [r for r in burst[1:] if r[0] not in (Op.PING, Op.CANCEL_WAIT)]
        if "empty-multi-set" in avoid:
            burst = [(Op.MULTI_SET, (b"/a",), (b"1",)) if r[0] == Op.MULTI_SET and not r[1] else r for r in burst]
        if "after-failure-executed" in avoid:  # (an ADD may fail: nothing after it)
            adds = [i for i, r in enumerate(burst) if r[0] == Op.ADD]
            if adds:
                burst = burst[:adds[0] + 1]
        if "multi-set-partial" in avoid:  # (a refused pair first: nothing before it applied)
            burst = [_refused_first(r) if r[0] == Op.MULTI_SET else r for r in burst]
        if "add-overflow-merge" in avoid:
            seen, out = set(), []
            for r in burst:
                if r[0] == Op.ADD:
                    if r[1] in seen:
                        r = (Op.GET, r[1])
                    seen.add(r[1])
                out.append(r)
            burst = out
        if "append-past-value-limit" in avoid:  # (no key's APPENDs pass the value limit in a history)
            size, out = self.appended, []
            for r in burst:
                if r[0] == Op.APPEND:
                    n = size.get(r[1], 0) + request_size(r)
                    if r[1] in size and n > VALUE_LIMIT:
                        continue
                    size[r[1]] = n
                elif r[0] in (Op.SET, Op.COMPARE_SET):  # (the value an APPEND would grow)
                    size[r[1]] = size.get(r[1], 0) + request_size(r)
                elif r[0] == Op.ADD:  # (a number of up to 20 characters)
                    size[r[1]] = size.get(r[1], 0) + 20
                elif r[0] == Op.MULTI_SET:
                    for k, v in zip(r[1], r[2]):
                        size[k] = size.get(k, 0) + (v.n if isinstance(v, Big) else len(v)) + 32
                out.append(r)
            burst = out
        return burst

    def history(self) -> History:
        r = self.rnd
        clients = r.randint(*self.p.clients)
        steps = [(r.randrange(clients), self.burst()) for _ in range(r.randint(*self.p.steps))]
        if r.random() < self.p.huge:  # 33 x 8 MiB SETs: one fold would pass 256 MiB
            steps.insert(r.randrange(len(steps) + 1), (0, tuple(
                (Op.SET, k, Big(VALUE_LIMIT, b"h")) for k in [b"/h%d" % i for i in range(33)]) + ((Op.GETNUMKEYS,),)))
        where = tuple(r.randrange(self.p.fronts) for _ in range(clients))
        return History(clients, steps, where, seed=self.seed)


def _refused_first(req: tuple) -> tuple:
    pairs = list(zip(req[1], req[2]))
    pairs.sort(key=lambda kv: not refused((Op.SET, *kv)))
    return (Op.MULTI_SET, tuple(k for k, _ in pairs), tuple(v for _, v in pairs))


def refused(req: tuple) -> bool:
    """A request torch's server answers by closing the connection (a malformed one,
    one past a limit; not those the store refuses, like ADD on a non-number)."""
    op = req[0]
    if op in (RAW, Op.VALIDATE):
        return True

    def n(x):
        return x.n if isinstance(x, Big) else len(x)

    for i, a in enumerate(req[1:], 1):
        limit = KEY_LIMIT if i == 1 else VALUE_LIMIT
        if isinstance(a, (bytes, Big)) and n(a) > limit:
            return True
        if isinstance(a, tuple) and (len(a) > KEYS_LIMIT or any(n(k) > limit for k in a)):
            return True
    return False


OPS = [Op.SET, Op.COMPARE_SET, Op.GET, Op.ADD, Op.CHECK, Op.WAIT, Op.GETNUMKEYS, Op.DELETE_KEY, Op.APPEND,
       Op.MULTI_GET, Op.MULTI_SET, Op.CANCEL_WAIT, Op.PING, Op.QUEUE_PUSH, Op.QUEUE_POP, Op.QUEUE_LEN,
       Op.LIST_KEYS, Op.BARRIER, Op.VALIDATE, RAW]
WEIGHTS = [14, 7, 10, 10, 7, 8, 4, 5, 5, 5, 4, 2, 2, 4, 4, 2, 2, 4, 0.6, 0.6]

assert SILENT and len(OPS) == len(WEIGHTS)


def generate(seed: int, profile: Profile = CI) -> History:
    return Generator(seed, profile).history()
