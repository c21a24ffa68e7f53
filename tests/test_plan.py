"""The batch planner and the answer fan-out as tables of cases: pending requests in,
what goes upstream and who gets which answer out. No event loop, no sockets."""

from __future__ import annotations

import struct

import pytest

from tierrun.core.values import wrap_i64
from tierrun.link.frames import FETCHES, PEEKS, WATCHES, LinkError
from tierrun.protocol import Op
from tierrun.protocol.replies import encode_bytes
from tierrun.tier.fanout import answers, split_values, watch_answers
from tierrun.tier.plan import (
    FETCH_AFTER_WRITES_MARK, FETCH_MARK, WATCH_MARK, PlanLimits, plan_batch,
)
from tierrun.tier.readahead import plan_peeks

from oracle.wire import request_size

MiB = 1 << 20
I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)
i64 = struct.Struct("<q")


def shape(pending, limits=PlanLimits()):
    """The plan as data: per op, (the request sent, its waiters, its members' requests)."""
    plan = plan_batch([(c, b"", r) for c, r in pending], limits)
    return [(u.request(), u.waiters, [m.req for m in u.members or ()]) for u in plan.ops]


GET, SET, ADD, APPEND, WAIT, CHECK = Op.GET, Op.SET, Op.ADD, Op.APPEND, Op.WAIT, Op.CHECK
MULTI_SET, MULTI_GET, DELETE, NUMKEYS = Op.MULTI_SET, Op.MULTI_GET, Op.DELETE_KEY, Op.GETNUMKEYS

CASES = {
    "identical reads of two clients: sent once": (
        [("a", (GET, b"k")), ("b", (GET, b"k"))],
        [((GET, b"k"), ["a", "b"], [])]),
    "a client's repeated read is not merged with its own": (
        [("a", (GET, b"k")), ("a", (GET, b"k"))],
        [((GET, b"k"), ["a"], []), ((GET, b"k"), ["a"], [])]),
    "a write between two reads keeps them apart": (
        [("a", (GET, b"k")), ("b", (SET, b"k", b"v")), ("c", (GET, b"k"))],
        [((GET, b"k"), ["a"], []), ((SET, b"k", b"v"), [], []), ((GET, b"k"), ["c"], [])]),
    "GETs of distinct keys fold into one MULTI_GET": (
        [("a", (GET, b"x")), ("b", (GET, b"y")), ("c", (GET, b"x"))],
        [((MULTI_GET, (b"x", b"y")), ["a", "b", "c"], [])]),
    "a GET does not fold ahead of a write to its key": (
        [("a", (GET, b"x")), ("b", (SET, b"y", b"1")), ("c", (GET, b"y"))],
        [((GET, b"x"), ["a"], []), ((SET, b"y", b"1"), [], []), ((GET, b"y"), ["c"], [])]),
    "ADDs to one key: one ADD of the sum": (
        [("a", (ADD, b"n", 1)), ("b", (ADD, b"n", 2)), ("c", (ADD, b"n", -5))],
        [((ADD, b"n", -2), ["a", "b", "c"], [])]),
    "ADDs near the int64 bounds: the sum wraps as torch's server adds": (
        [("a", (ADD, b"n", I64_MAX)), ("b", (ADD, b"n", I64_MAX)), ("c", (ADD, b"n", 2))],
        [((ADD, b"n", 0), ["a", "b", "c"], [])]),
    "an ADD run is cut by another request on its key": (
        [("a", (ADD, b"n", 1)), ("b", (GET, b"n")), ("c", (ADD, b"n", 1))],
        [((ADD, b"n", 1), ["a"], []), ((GET, b"n"), ["b"], []), ((ADD, b"n", 1), ["c"], [])]),
    "a client's pipelined ADDs to one key join its run": (
        [("a", (ADD, b"n", 1)), ("a", (ADD, b"n", 1))],
        [((ADD, b"n", 2), ["a", "a"], [])]),
    "APPENDs to one key are never merged (the store host refuses a merged one whose result "
    "passes its value limit or budget, where the first piece alone would land)": (
        [("a", (APPEND, b"k", b"x")), ("a", (APPEND, b"k", b"y")), ("b", (APPEND, b"k", b"z"))],
        [((APPEND, b"k", b"x"), [], []), ((APPEND, b"k", b"y"), [], []), ((APPEND, b"k", b"z"), [], [])]),
    "SETs and MULTI_SETs go as they are, a client's too (the store host refuses a write "
    "past its budget whole: a fold would take the client's writes before it along)": (
        [("a", (SET, b"x", b"1")), ("a", (SET, b"y", b"2")), ("b", (SET, b"z", b"3")),
         ("a", (MULTI_SET, (b"u", b"v"), (b"4", b"5")))],
        [((SET, b"x", b"1"), [], []), ((SET, b"y", b"2"), [], []), ((SET, b"z", b"3"), [], []),
         ((MULTI_SET, (b"u", b"v"), (b"4", b"5")), [], [])]),
    "a GETNUMKEYS between two SETs is answered between them": (
        [("a", (SET, b"x", b"1")), ("b", (NUMKEYS,)), ("c", (SET, b"y", b"2")), ("d", (NUMKEYS,))],
        [((SET, b"x", b"1"), [], []), ((NUMKEYS,), ["b"], []), ((SET, b"y", b"2"), [], []),
         ((NUMKEYS,), ["d"], [])]),
    "one-key WAITs on distinct keys: one WAITS entry": (
        [("a", (WAIT, (b"x",))), ("b", (WAIT, (b"y",))), ("c", (WAIT, (b"x",)))],
        [((WAIT, (b"x",)), ["a", "c"], [(WAIT, (b"y",))])]),
    "a DELETE is sent alone and answered": (
        [("a", (DELETE, b"x")), ("b", (DELETE, b"x"))],
        [((DELETE, b"x"), ["a"], []), ((DELETE, b"x"), ["b"], [])]),
}


@pytest.mark.parametrize("name", CASES)
def test_plan(name):
    pending, expected = CASES[name]
    assert shape(pending) == expected


LIMIT_CASES = {
    "a MULTI_GET fold holds at most max_fold keys": (
        PlanLimits(max_fold=2),
        [(c, (GET, c.encode())) for c in "abcde"],
        [2, 2, 1]),
    "a MULTI_GET fold holds at most max_keys keys": (
        PlanLimits(max_keys=3),
        [(c, (GET, c.encode())) for c in "abcde"],
        [3, 2]),
    "a MULTI_GET fold of long keys holds at most max_request_bytes": (
        PlanLimits(max_request_bytes=request_size((MULTI_GET, (b"k" * 900,) * 3)), max_value_bytes=100),
        [(c, (GET, c.encode() * 900)) for c in "abcde"],
        [3, 2]),
    "a MULTI_GET fold's answer fits in a frame whatever the values": (
        PlanLimits(max_value_bytes=1000, max_frame_bytes=2 * 3 * 1040),
        [(c, (GET, c.encode())) for c in "abcdefg"],
        [3, 3, 1]),
}


@pytest.mark.parametrize("name", LIMIT_CASES)
def test_merges_respect_the_limits_of_one_request(name):
    limits, pending, sizes = LIMIT_CASES[name]
    plan = plan_batch([(c, b"", r) for c, r in pending], limits)
    got = []
    for u in plan.ops:
        req = u.request()
        got.append(len(req[1]) if req[0] in (MULTI_SET, MULTI_GET) else 1)
        assert request_size(req) <= limits.max_request_bytes
    assert got == sizes


def test_the_default_get_fold_answer_fits_a_frame():
    limits = PlanLimits()
    assert limits.max_get_fold * (limits.max_value_bytes + 8) <= limits.max_frame_bytes
    assert limits.max_get_fold >= 16


def test_watching_reads_merge_with_their_like_only():
    w = object()
    pending = [("a", (FETCH_MARK, (WAIT, (b"k",)), None)), ("b", (FETCH_MARK, (WAIT, (b"k",)), None)),
               ("c", (FETCH_AFTER_WRITES_MARK, (WAIT, (b"k",)), None)), ("d", (WATCH_MARK, (CHECK, (b"h",)), w)),
               ("e", (FETCH_MARK, (WAIT, (b"j",)), None))]
    plan = plan_batch([(c, b"ns", r) for c, r in pending])
    kinds = [(u.fetch, u.waiters, [m.waiters for m in u.members or ()]) for u in plan.ops]
    assert kinds == [(WATCHES, ["a", "b"], [["e"]]), (FETCHES, ["c"], []), (0, ["d"], [])]
    assert [u.watchers for u in plan.ops] == [[None, None], [None], [w]]
    assert plan.fetched == [(b"ns", b"k"), (b"ns", b"j")]
    assert [(k, c) for k, c, _ in plan.reads] == [((b"ns", b"k"), "a"), ((b"ns", b"k"), "b"),
                                                  ((b"ns", b"k"), "c"), ((b"ns", b"j"), "e")]


def test_read_ahead_joins_the_batch_peek_fold_and_skips_keys_read():
    plan = plan_batch([("a", b"", (GET, b"r3")), ("b", b"", (GET, b"other"))])
    new = plan_peeks(plan, b"", [b"r3", b"r4", b"r5"], peeking={(b"", b"r5"): None}, limits=PlanLimits(max_fold=8))
    assert [u.req for u in new] == [(WAIT, (b"r4",))]
    assert plan.ops[-1].fetch == PEEKS
    assert plan_peeks(plan, b"", [b"r6", b"r7"], peeking={}, limits=PlanLimits(max_fold=2))
    assert [1 + len(u.members or ()) for u in plan.ops if u.fetch == PEEKS] == [2, 1]  # (2 keys an entry at most)


# -- fan-out --------------------------------------------------------------------------


def test_a_merged_add_answers_each_client_what_sequential_execution_would():
    for start, deltas in [(0, [1, 2, 3]), (I64_MAX - 1, [1, 1, 1]), (I64_MIN + 1, [-1, -1, 5]),
                          (5, [I64_MAX, I64_MAX, I64_MIN]), (-7, [I64_MIN, -1])]:
        plan = plan_batch([(str(i), b"", (ADD, b"n", d)) for i, d in enumerate(deltas)])
        (u,) = plan.ops
        final = wrap_i64(start + sum(deltas))
        assert u.request() == (ADD, b"n", wrap_i64(sum(deltas)))
        got = [i64.unpack(a)[0] for _, a in answers(u, i64.pack(final))]
        expected, v = [], start
        for d in deltas:
            v = wrap_i64(v + d)
            expected.append(v)
        assert got == expected


def test_a_folded_multi_get_hands_each_client_its_value():
    plan = plan_batch([("a", b"", (GET, b"x")), ("b", b"", (GET, b"y")), ("c", b"", (GET, b"x"))])
    (u,) = plan.ops
    data = encode_bytes(b"X") + encode_bytes(b"")
    assert answers(u, data) == [("a", encode_bytes(b"X")), ("b", encode_bytes(b"")), ("c", encode_bytes(b"X"))]


@pytest.mark.parametrize("data", [b"", encode_bytes(b"X"), encode_bytes(b"X") + encode_bytes(b"Y") + b"z",
                                  b"\xff" * 8 + b"x"])
def test_an_answer_that_cannot_be_the_one_asked_for_ends_the_session(data):
    with pytest.raises(LinkError):
        split_values(data, 2)


def test_a_merged_add_answer_of_the_wrong_size_ends_the_session():
    (u,) = plan_batch([("a", b"", (ADD, b"n", 1)), ("b", b"", (ADD, b"n", 1))]).ops
    with pytest.raises(LinkError):
        answers(u, b"\x00" * 4)


def test_a_watch_answer_goes_to_local_clients_as_the_answer_and_below_with_the_state():
    below = object()
    (u,) = plan_batch([("a", b"", (WATCH_MARK, (GET, b"k"), None)), ("b", b"", (WATCH_MARK, (GET, b"k"), below))]).ops
    state = b"\x01" + struct.pack("<Q", 1) + b"v"
    watched, value, out = watch_answers(u, state + encode_bytes(b"v"))
    assert (watched, value) == (True, b"v")
    assert out == [("a", None, encode_bytes(b"v")), ("b", below, state + encode_bytes(b"v"))]
    with pytest.raises(LinkError):
        watch_answers(u, b"\x07")


class _Ticket:
    """A relayed WAIT's ticket (hub.session.Ticket): its client is the link client."""

    def __init__(self, client):
        self.client = client


def test_a_relayed_clients_wait_does_not_fold_ahead_of_its_own_earlier_request():
    """A relaying proxy sees one link client's requests under the client itself (an
    ADD) and under a ticket per WAIT: they are one client's, in order."""
    link = "link-client"
    pending = [(_Ticket(link), b"", (WAIT, (b"k1",))), (link, b"", (ADD, b"n", 1)), (_Ticket(link), b"", (WAIT, (b"k2",)))]
    plan = plan_batch(pending)
    assert [u.request()[0] for u in plan.ops] == [WAIT, ADD, WAIT] and not plan.ops[0].members


def test_a_waits_entry_holds_no_more_keys_than_one_request_may():
    plan = plan_batch([(str(i), b"", (WAIT, (b"k%d" % i,))) for i in range(7)], PlanLimits(max_keys=3))
    assert [1 + len(u.members or ()) for u in plan.ops] == [3, 3, 1]


def test_appends_to_one_key_are_planned_in_linear_time_each_as_sent():
    plan = plan_batch([("a", b"", (APPEND, b"k", b"x"))] * 20000)
    assert len(plan.ops) == 20000 and all(u.request() == (APPEND, b"k", b"x") for u in plan.ops)


@pytest.mark.parametrize("req", [(ADD, b"n", 3), (SET, b"k", b"v")], ids=["ADD", "SET"])
def test_a_batch_of_one_write_is_planned_as_the_same_write_in_a_larger_batch(req):
    """A lone ADD or SET skips the planner's tables (most batches of a trickling
    start-up): its op is the one the planner makes of it."""
    lone = plan_batch([("a", b"", req)])
    planned = plan_batch([("a", b"", req), ("b", b"", (GET, b"elsewhere"))])
    u, p = lone.ops[0], planned.ops[0]
    assert (u.request(), u.waiters, u.writer, u.deltas, u.group, u.pos, u.fold, u.wkey) == (
        p.request(), p.waiters, p.writer, p.deltas, p.group, p.pos, p.fold, p.wkey)
    assert len(lone.ops) == 1 and lone.lone and not lone.reads and not lone.fetched and not lone.read_keys


def test_a_request_with_an_effect_behind_its_clients_write_goes_alone_behind_an_after_entry():
    """Client a SETs, then ADDs and GETs; b ADDs the same key. a's ADD may only run if
    its SET was not refused: it is not merged with b's, and its entry comes behind an
    AFTER naming the SET (a's GET has no effect: as ever). A client whose write is
    still in flight (``unsettled``) is treated alike; one with none merges as before."""
    from tierrun.link.frames import AFTER, REQUEST, decode_batch
    from tierrun.tier.entries import Ids, encode_plan

    pending = [("a", b"", (SET, b"s", b"v")), ("a", b"", (ADD, b"n", 1)), ("b", b"", (ADD, b"n", 2)),
               ("a", b"", (GET, b"s"))]
    plan = plan_batch(pending)
    assert [(u.request(), u.waiters, u.after) for u in plan.ops] == [
        ((SET, b"s", b"v"), [], None), ((ADD, b"n", 1), ["a"], "a"), ((ADD, b"n", 2), ["b"], None),
        ((GET, b"s"), ["a"], None)]
    out = encode_plan(plan, [], Ids(), {}, 1 << 20)
    entries = [(kind, rid) for kind, _, rid, _ in decode_batch(out.frames[0][5:])]
    set_rid = plan.ops[0].rid
    assert entries[entries.index((REQUEST, set_rid)) + 1] == (AFTER, set_rid)  # (then a's ADD)
    assert [k for k, _ in entries].count(AFTER) == 1

    in_flight = {"a": 7}.get  # (a's SET of an earlier batch: request id 7, not answered yet)
    plan = plan_batch([("a", b"", (ADD, b"n", 1)), ("b", b"", (ADD, b"n", 2))], unsettled=in_flight)
    assert [(u.request(), u.after) for u in plan.ops] == [((ADD, b"n", 1), "a"), ((ADD, b"n", 2), None)]
    out = encode_plan(plan, [], Ids(next=10), {}, 1 << 20, in_flight)
    assert [(kind, rid) for kind, _, rid, _ in decode_batch(out.frames[0][5:])][1] == (AFTER, 7)
    (u,) = plan_batch([("a", b"", (ADD, b"n", 1))], unsettled=in_flight).ops  # (not the lone path)
    assert u.after == "a"
    (u,) = plan_batch([("a", b"", (ADD, b"n", 1)), ("b", b"", (ADD, b"n", 2))]).ops  # (nothing unsettled)
    assert u.after is None and u.request() == (ADD, b"n", 3)
