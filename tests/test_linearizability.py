"""Linearizability of the tiered store, checked with hypothesis.

Several clients, each on one of several front-ends (two node front-ends linked to the
root core, two more stacked on one of them as in a deeper tree, and the root's own
front-end, i.e. the core directly), issue random
operations one at a time, as torch's client does, while the event loop runs for random
stretches in between, so requests meet in batches, get merged, and race across links.
Every history is checked against a sequential model of the store (Wing & Gong's
search): some order of the operations, consistent with real time, must give every
client exactly the reply it got.

Replies with no answer (SET, APPEND, MULTI_SET, QUEUE_PUSH) are done, for real-time
purposes, when the client's next answered request is (its connection is FIFO) or
at the end of the history; a WAIT still pending at the end must be on a key that is
absent at the end.

Left out of the model on purpose: COMPARE_SET on a missing key that a WAIT waits for.
torch's server wakes that WAIT although the key is still missing (a spurious wake-up,
not a linearizable one); tierrun does the same, and test_core checks that byte for byte.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inproc import RootFrontEnd, linked, settle
from linearizability import Call
from linearizability import linearizable as check_linearizable
from tierrun.link.config import LinkConfig
from tierrun.core import StoreCore, StoreError
from tierrun.protocol import Op
from tierrun.protocol.opcodes import CHECK_NOT_READY, CHECK_READY, NO_REPLY_OPS, STOP_WAITING
from tierrun.protocol.replies import encode_bytes, encode_i64, encode_many, encode_queue_pop

# numbered keys: a fetch of one makes a front-end read the others ahead (PEEKS)
COUNTERS = (b"/k2", b"/k3")  # always present, always numbers: ADD, GET, COMPARE_SET go here
FREE = b"/k0"  # set, deleted, appended to, waited for
NEW = b"/k1"  # absent until set: a SET of it changes GETNUMKEYS
QUEUE = b"/k4"
DIGITS = st.sampled_from([b"0", b"1", b"2", b"3"])

_hot = (  # what coalescing touches most, on one key: drawn more often, so that it collides
    st.tuples(st.just(Op.SET), st.just(b"/k2"), DIGITS),
    st.tuples(st.just(Op.GET), st.just(b"/k2")),
    st.tuples(st.just(Op.ADD), st.just(b"/k2"), st.integers(-2, 3)),
    st.tuples(st.just(Op.WAIT), st.just((FREE,))),
    # distinct keys: GETs of several keys fold into one MULTI_GET
    st.tuples(st.just(Op.SET), st.just(b"/k3"), DIGITS),
    st.tuples(st.just(Op.GET), st.just(b"/k3")),
)
ops = st.one_of(
    *_hot * 4,
    st.tuples(st.just(Op.SET), st.sampled_from(COUNTERS + (FREE,)), DIGITS),
    st.tuples(st.just(Op.GET), st.sampled_from(COUNTERS + (FREE,))),
    st.tuples(st.just(Op.SET), st.just(NEW), DIGITS),
    st.tuples(st.just(Op.ADD), st.sampled_from(COUNTERS), st.integers(-2, 3)),
    st.tuples(st.just(Op.COMPARE_SET), st.sampled_from(COUNTERS), st.sampled_from([b"", b"0", b"1", b"2"]), DIGITS),
    st.tuples(st.just(Op.CHECK), st.sampled_from([(FREE,), (b"/k2", FREE), (b"/k2",)])),
    st.tuples(st.just(Op.WAIT), st.sampled_from([(FREE,), (b"/k2", FREE)])),
    st.tuples(st.just(Op.DELETE_KEY), st.just(FREE)),
    st.tuples(st.just(Op.APPEND), st.just(FREE), DIGITS),
    st.tuples(st.just(Op.MULTI_GET), st.sampled_from([COUNTERS, (b"/k2", b"/k2"), (b"/k3", b"/k2")])),
    st.tuples(st.just(Op.MULTI_SET), st.just(COUNTERS), st.tuples(DIGITS, DIGITS)),
    st.tuples(st.just(Op.QUEUE_PUSH), st.just(QUEUE), DIGITS),
    st.tuples(st.just(Op.QUEUE_POP), st.just(QUEUE)),
    st.tuples(st.just(Op.QUEUE_LEN), st.just(QUEUE)),
    st.tuples(st.just(Op.GETNUMKEYS)),
)


# -- the sequential model -----------------------------------------------------------------


def apply(state: tuple, req: tuple) -> tuple[tuple, bytes | None] | None:
    """(new state, reply) of one request in a state; None if it cannot happen now (a
    WAIT on a missing key). A state is (sorted key/value pairs, queue contents)."""
    data, queue = dict(state[0]), deque(state[1])
    op = req[0]
    if op == Op.SET:
        data[req[1]] = req[2]
        reply = None
    elif op == Op.GET:
        reply = encode_bytes(data.get(req[1], b""))
    elif op == Op.ADD:
        data[req[1]] = str(int(data[req[1]]) + req[2]).encode()
        reply = encode_i64(int(data[req[1]]))
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
    elif op == Op.CHECK:
        reply = CHECK_READY if all(k in data for k in req[1]) else CHECK_NOT_READY
    elif op == Op.WAIT:
        if not all(k in data for k in req[1]):
            return None
        reply = STOP_WAITING
    elif op == Op.DELETE_KEY:
        reply = encode_i64(1 if data.pop(req[1], None) is not None else 0)
    elif op == Op.APPEND:
        data[req[1]] = data.get(req[1], b"") + req[2]
        reply = None
    elif op == Op.MULTI_GET:
        reply = encode_many([data[k] for k in req[1]])
    elif op == Op.MULTI_SET:
        data.update(zip(req[1], req[2]))
        reply = None
    elif op == Op.QUEUE_PUSH:
        queue.append(req[2])
        reply = None
    elif op == Op.QUEUE_POP:
        reply = encode_queue_pop(len(queue), queue.popleft() if queue else None)
    elif op == Op.QUEUE_LEN:
        reply = encode_i64(len(queue))
    elif op == Op.GETNUMKEYS:
        reply = encode_i64(len(data))
    else:
        raise AssertionError(op)
    return (tuple(sorted(data.items())), tuple(queue)), reply


INITIAL = ((tuple(sorted((k, b"0") for k in COUNTERS))), ())


def linearizable(calls: list[Call]) -> bool:
    """The shared Wing & Gong search (linearizability.py) with this file's model."""
    return check_linearizable(calls, apply, INITIAL)


# -- running a history --------------------------------------------------------------------


@dataclass(eq=False)  # hashable by identity, as connections are
class SimClient:
    """A torch client: one connection, one answered request at a time."""

    index: int
    upstream: object
    clock: list[int]
    calls: list[Call]
    script: deque
    in_flight: Call | None = None
    unanswered: list[Call] = field(default_factory=list)  # sent, no reply expected
    failed: list = field(default_factory=list)

    def issue(self) -> None:
        """Send the next request; after one with no answer, go on at once, as torch's
        client does."""
        while self.in_flight is None and self.script and self._issue_one():
            pass

    def _issue_one(self) -> bool:
        """True if the request sent expects no answer."""
        req = self.script.popleft()
        self.clock[0] += 1
        call = Call(self.index, req, self.clock[0])
        self.calls.append(call)
        try:
            reply = self.upstream.execute(req, self)
        except StoreError as e:
            self.failed.append((req, e))
            return False
        if req[0] in NO_REPLY_OPS:
            self.unanswered.append(call)
            return True
        if reply is not None:
            self.wake(reply, call)
        else:
            self.in_flight = call
        return False

    def wake(self, reply: bytes, call: Call | None = None) -> None:
        call = call or self.in_flight
        self.in_flight = None
        self.clock[0] += 1
        call.returned, call.reply = self.clock[0], reply
        for earlier in self.unanswered:  # FIFO: they were done before this reply
            earlier.returned = self.clock[0]
        self.unanswered.clear()

    def drop(self, reason: str) -> None:
        self.failed.append(reason)


async def run_history(scripts: list[list[tuple]], where: list[int], schedule: list[tuple[list[int], int]],
                      hold: float = 0.0):
    """``hold``: the front-ends' LinkConfig.contended_write_hold; 0 (no timers): the
    history depends on the schedule alone."""
    core = StoreCore()
    for k in COUNTERS:
        core.execute((Op.SET, k, b"0"), None)
    config = LinkConfig(contended_write_hold=hold)
    # links of different delays: answers on one race the invalidations on another
    link1, _ = await linked(core, config, delay=2)
    link2, _ = await linked(core, config)
    link3, _ = await linked(link1, config, delay=1)
    link4, _ = await linked(link1, config)  # (two below one: a second node's fetch is a poll there)
    links = [link1, link2, link3, link4]
    upstreams = [RootFrontEnd(core), link1.view(), link2.view(), link3.view(), link4.view()]
    clock = [0]
    calls: list[Call] = []
    clients = [SimClient(i, upstreams[where[i]], clock, calls, deque(s)) for i, s in enumerate(scripts)]
    for order, spins in schedule:  # every idle client issues its next request, in this order
        for who in order:
            if who < len(clients):
                clients[who].issue()
        for _ in range(spins):
            await asyncio.sleep(0)
    for i in range(200):  # let everything finish; clients issue what is left of their scripts
        for c in clients:
            c.issue()
        await asyncio.sleep(hold if hold and i % 10 == 0 else 0)  # (held batches leave)
    if hold:
        await asyncio.sleep(2 * hold)
        await settle()
    clock[0] += 1
    for c in clients:
        for call in c.unanswered:
            call.returned = clock[0]
    return core, clients, calls, links


@st.composite
def client_scripts(draw, ops=ops, clients: tuple[int, int] = (2, 4)) -> list[list[tuple]]:
    """Scripts drawn from a small vocabulary of requests, so that identical and
    conflicting requests meet in one batch often."""
    vocabulary = draw(st.lists(ops, min_size=1, max_size=5))
    return draw(st.lists(st.lists(st.sampled_from(vocabulary), min_size=1, max_size=5),
                         min_size=clients[0], max_size=clients[1]))


# Requests on a few distinct keys, where GETs and WAITs fold (and what must stop a fold:
# a write between, the client's own order), among SETs, MULTI_SETs and GETNUMKEYS.
FOLDING_VOCABULARY = (
    [(Op.SET, k, d) for k in COUNTERS + (FREE, NEW) for d in (b"1", b"2")]
    + [(Op.GET, k) for k in COUNTERS + (FREE, NEW)] * 2
    + [(Op.WAIT, (k,)) for k in COUNTERS + (FREE, NEW)]
    + [(Op.ADD, b"/k2", 1), (Op.ADD, b"/k2", 2), (Op.APPEND, FREE, b"3"), (Op.DELETE_KEY, NEW), (Op.GETNUMKEYS,)]
    + [(Op.MULTI_SET, (FREE, NEW), (b"4", b"5"))]
)
HOLD_VOCABULARY = FOLDING_VOCABULARY + [(Op.ADD, k, 1) for k in COUNTERS] * 4
# mostly node front-ends (where batches form), mostly no loop turn between requests
where = st.lists(st.sampled_from([0, 1, 1, 1, 2, 3, 3, 4]), min_size=4, max_size=4)
schedule = st.lists(st.tuples(st.permutations(range(4)), st.sampled_from([0, 1, 4])), min_size=1, max_size=8)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts=client_scripts(), where=where, schedule=schedule)
def test_every_history_is_linearizable(scripts, where, schedule):
    check_history(scripts, where, schedule)


def test_histories_of_folded_gets_and_waits_are_linearizable():
    """Crowded histories (6 clients, mostly on one front-end, no loop turn between their
    requests), seeded: hypothesis favours small examples, where folds are rare."""
    folded = [0, 0]
    watched = [0, 0, 0]
    # (+ seeds that once failed: 644 and 1203 caught a stacked proxy answering a read from
    # its watch while the reader's own write was still on its way up)
    for seed in [*range(300), 644, 1203]:
        rnd = random.Random(seed)
        vocabulary = [rnd.choice(FOLDING_VOCABULARY) for _ in range(6)]
        scripts = [[rnd.choice(vocabulary) for _ in range(rnd.randint(2, 5))] for _ in range(6)]
        where = [rnd.choice([0, 1, 1, 3, 4]) for _ in range(6)]
        schedule = [(rnd.sample(range(6), 6), rnd.choice([0, 0, 1])) for _ in range(8)]
        stats = check_history(scripts, where, schedule)
        folded[0] += sum(s.folded_gets for s in stats)
        folded[1] += sum(s.folded_waits for s in stats)
        watched[0] += sum(s.watch_answers for s in stats)
        watched[1] += sum(s.watch_joins for s in stats)
        watched[2] += sum(s.invalidations for s in stats)
    print(folded, watched)
    assert min(folded) > 10, folded  # the folds did happen (WAITs: WAITS and WATCHES entries)
    # reads answered from watches, WAITs joined, invalidations. Joins are rare here: only
    # a clean client's poll sends a WAIT others may join (a key's first WAIT, and any WAIT
    # of a client with a write in flight, fetches, and nothing joins a fetch); the join
    # rules have their own tests in test_watches.py
    assert watched[0] > 20 and watched[1] >= 3 and watched[2] > 20, watched


def test_histories_with_held_contended_writes_are_linearizable():
    """The same crowded histories with front-ends that hold a batch opening with a
    contended write (LinkConfig.contended_write_hold, on by default): a held write
    leaves with whatever joins it, on a timer, at any point of the schedule. Seeded;
    the holds did happen (ADDs merged across loop turns). More ADDs than elsewhere: a
    record (SET) whose family is being read is not held (Gloo's addresses), and every
    family here is read."""
    merged = held = 0
    for seed in range(120):
        rnd = random.Random(seed)
        vocabulary = [rnd.choice(HOLD_VOCABULARY) for _ in range(6)]
        scripts = [[rnd.choice(vocabulary) for _ in range(rnd.randint(2, 5))] for _ in range(6)]
        where = [rnd.choice([0, 1, 1, 3, 4]) for _ in range(6)]
        schedule = [(rnd.sample(range(6), 6), rnd.choice([0, 0, 1])) for _ in range(8)]
        stats = check_history(scripts, where, schedule, hold=0.002)
        merged += sum(s.merged_adds for s in stats)
        held += sum(s.held_batches for s in stats)
    assert held > 50 and merged > 10, (held, merged)


# One counter that clients on every node front-end poll (GET, CHECK: the front-ends come
# to answer them from watches) while others change it (ADD, COMPARE_SET: each change
# starts an invalidation round at the store host, and its answer must wait for it).
POLLED_COUNTER = [(Op.GET, b"/k2")] * 3 + [(Op.CHECK, (b"/k2",)), (Op.ADD, b"/k2", 1),
                                           (Op.COMPARE_SET, b"/k2", b"1", b"2")]


def test_histories_of_a_polled_counter_are_linearizable():
    """Seeded histories where reads answered from watches race the writes that break
    them: a write's answer reaching its client before a watching front-end has heard of
    the change lets that front-end's next read be stale. The random histories above
    rarely make this race (it needs polls of one key on one front-end, a write of it
    alone in a batch from another, and a read right after the write's answer). Written
    after such a bug was fixed (eeed776: a store-host short path answered such an ADD
    at once), it fails on that bug in 22 of these 300 seeds."""
    watch_answers = invalidations = 0
    for seed in range(300):
        rnd = random.Random(seed)
        scripts = [[rnd.choice(POLLED_COUNTER) for _ in range(rnd.randint(2, 6))] for _ in range(6)]
        where = [rnd.choice([1, 2, 3, 4]) for _ in range(6)]
        schedule = [(rnd.sample(range(6), 6), rnd.choice([0, 1, 2])) for _ in range(12)]
        stats = check_history(scripts, where, schedule)
        watch_answers += sum(s.watch_answers for s in stats)
        invalidations += sum(s.invalidations for s in stats)
    assert watch_answers > 1000 and invalidations > 1000, (watch_answers, invalidations)


def test_a_read_does_not_pass_its_clients_set_in_a_stacked_front_end():
    """A history the soak of polled-counter histories found (seed 6281), kept as it is:
    clients 2 and 3 on a front-end stacked below client 0 and 1's. Client 2's GET of
    /k2, sent after its own SET of /k0, once joined client 3's earlier GET in a batch,
    was answered from the upper front-end's watch while the SET was still on its way,
    and client 1's CHECK of /k0 after that answer missed the SET. Random histories
    rarely make this race, so it stays here."""
    get, k0 = (lambda k: (Op.GET, k)), b"/k0"
    scripts = [
        [(Op.SET, k0, b"1"), get(b"/k2"), get(k0)],
        [get(b"/k2"), get(b"/k2"), (Op.SET, k0, b"1"), (Op.DELETE_KEY, k0), get(k0), (Op.CHECK, (k0,))],
        [get(k0), (Op.SET, k0, b"1"), (Op.SET, k0, b"1"), get(b"/k2"), (Op.SET, k0, b"1"), get(b"/k2")],
        [(Op.CHECK, (b"/k2",)), get(k0), get(b"/k2"), get(b"/k2"), (Op.SET, k0, b"1"), (Op.ADD, b"/k2", 1)],
    ]
    schedule = [([2, 0, 1, 3], 2), ([3, 2, 1, 0], 2), ([3, 0, 2, 1], 0), ([2, 1, 0, 3], 3), ([3, 1, 0, 2], 0),
                ([0, 3, 2, 1], 3), ([2, 3, 1, 0], 2), ([3, 0, 2, 1], 0), ([2, 3, 0, 1], 3), ([3, 1, 0, 2], 0),
                ([2, 0, 1, 3], 2), ([0, 2, 1, 3], 1), ([1, 0, 2, 3], 0), ([3, 2, 1, 0], 0), ([3, 2, 0, 1], 3),
                ([0, 1, 3, 2], 0)]
    check_history(scripts, [1, 1, 4, 4], schedule)


def test_histories_whose_watches_are_broken_for_room_are_linearizable(monkeypatch):
    """The same crowded histories with a store host that keeps one watch per link
    session: every new watch breaks the session's older one (an invalidation round, as
    for a change of its key), at any point of any batch."""
    import tierrun.core.store as store

    monkeypatch.setattr(store, "MAX_WATCHES_PER_OWNER", 1)
    invalidations = 0
    for seed in range(2000, 2300):
        rnd = random.Random(seed)
        vocabulary = [rnd.choice(FOLDING_VOCABULARY) for _ in range(6)]
        scripts = [[rnd.choice(vocabulary) for _ in range(rnd.randint(2, 5))] for _ in range(6)]
        where = [rnd.choice([0, 1, 1, 3, 4]) for _ in range(6)]
        schedule = [(rnd.sample(range(6), 6), rnd.choice([0, 0, 1])) for _ in range(8)]
        invalidations += sum(s.invalidations for s in check_history(scripts, where, schedule))
    assert invalidations > 500, invalidations  # (about 2.5x what key changes alone cause)


def check_history(scripts, where, schedule, hold: float = 0.0) -> list:
    """Run and check one history; returns the front-ends' coalescing statistics."""
    core, clients, calls, links = asyncio.run(run_history(scripts, where, schedule, hold))
    assert not any(c.failed for c in clients), [c.failed for c in clients]
    for call in calls:
        if call.returned is None:
            assert call.req[0] == Op.WAIT, f"{call.req} never answered"
            assert not all(k in core.snapshot() for k in call.req[1]), f"{call.req} missed its wake-up"
    assert linearizable(calls), "\n".join(
        f"client {c.client}: {c.req} [{c.invoked}, {c.returned}] -> {c.reply!r}" for c in calls)
    return [link.stats for link in links]


def test_the_checker_rejects_a_stale_read():
    """The model is not vacuous: a GET that misses a SET answered before it began fails,
    and so does one that misses its own client's earlier SET."""
    calls = [Call(0, (Op.ADD, b"/k2", 1), 1, 2, encode_i64(1)), Call(1, (Op.GET, b"/k2"), 3, 4, encode_bytes(b"0"))]
    assert not linearizable(calls)
    calls[1].reply = encode_bytes(b"1")
    assert linearizable(calls)
    own = [Call(0, (Op.SET, b"/k2", b"1"), 1, 3), Call(0, (Op.GET, b"/k2"), 2, 3, encode_bytes(b"0"))]
    assert not linearizable(own)
