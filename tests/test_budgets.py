"""The store's budgets without I/O (issue 33, item 1): what the core holds and answers,
the pace of full scans, what a connection owes its client, the writes a proxy keeps
until they cannot be refused any more, and the limits' consistency."""

from __future__ import annotations

import pytest

from tierrun.core import BudgetExceeded, StoreCore
from tierrun.core.budget import MIN_VALUE_BYTES, PACED_SCAN_KEYS, ScanPacer
from tierrun.frontend.namespace import NamespacedUpstream
from tierrun.frontend.owed import REQUEST_RESERVE, Owed, largest_answer
from tierrun.protocol import Limits, Op
from tierrun.tier.fanout import failure
from tierrun.tier.plan import UpOp
from tierrun.tier.writes import WritesInFlight, refused_write

MiB = 1 << 20


class Client:
    def __init__(self):
        self.woken = []
        self.dropped = None

    def wake(self, reply):
        self.woken.append(reply)

    def drop(self, reason):
        self.dropped = reason


def core_of(**limits) -> StoreCore:
    return StoreCore(Limits(**limits))


def totals(core: StoreCore) -> tuple[int, int]:
    """The budget's running totals, and what they must be, counted the slow way."""
    data = core.snapshot()
    queues = core._queues
    held = (sum(len(k) + max(len(v), MIN_VALUE_BYTES) for k, v in data.items())
            + sum(len(k) + sum(map(len, q)) for k, q in queues.items()))
    entries = len(data) + len(queues) + sum(map(len, queues.values()))
    waited = [k for _, keys in core._pending.values() for k in keys]  # (waits count as keys)
    held += sum(map(len, waited))
    entries += len(waited)
    assert (core.budget.bytes, core.budget.entries) == (held, entries)
    assert core._key_bytes == sum(map(len, data))
    return held, entries


def test_a_set_past_the_bytes_budget_is_refused_and_changes_nothing():
    core, c = core_of(max_store_bytes=100), Client()
    core.execute((Op.SET, b"a", b"x" * 50), c)
    with pytest.raises(BudgetExceeded, match=r"holds 51 bytes .* adds 50, past its budget \(--max-store-bytes\) of 100"):
        core.execute((Op.SET, b"b", b"y" * 49), c)
    assert core.snapshot() == {b"a": b"x" * 50}
    core.execute((Op.SET, b"a", b"x" * 99), c)  # (replacing a value counts only the difference)
    core.execute((Op.SET, b"a", b"z"), c)  # (a write that shrinks is always taken)
    core.execute((Op.SET, b"b", b"y" * 49), c)
    assert totals(core) == (71, 2)  # ("z" counts as 20 bytes)


def test_a_value_counts_as_at_least_20_bytes_so_an_add_never_changes_what_its_key_counts():
    """So ADDs merged into one ADD of their sum (a node proxy's) are refused exactly when
    the first of them alone would be: an ADD creating a key counts it as 20 bytes
    whatever the delta, an ADD to a number changes nothing the budget counts, and the
    budget is never passed."""
    core, c = core_of(max_store_bytes=100), Client()
    core.execute((Op.SET, b"pad", b"p" * 77), c)  # (80 bytes held: 20 left)
    with pytest.raises(BudgetExceeded, match="adds 21"):
        core.execute((Op.ADD, b"n", 1), c)  # (the key's byte and 20 for its number)
    core.execute((Op.SET, b"pad", b"p" * 76), c)  # (21 left)
    core.execute((Op.ADD, b"n", 9), c)
    assert totals(core) == (100, 2)  # (the budget full)
    core.execute((Op.ADD, b"n", 1), c)  # ("9" -> "10": still 20)
    core.execute((Op.ADD, b"n", -(1 << 62)), c)  # (19 digits and a sign: still 20)
    assert totals(core) == (100, 2)
    with pytest.raises(BudgetExceeded):
        core.execute((Op.SET, b"pad", b"p" * 77), c)
    with pytest.raises(BudgetExceeded, match="adds 1,"):  # (21 bytes: one more than it counts for)
        core.execute((Op.APPEND, b"n", b"0"), c)
    core.execute((Op.DELETE_KEY, b"n"), c)
    assert totals(core) == (79, 1)


def test_the_keys_budget_counts_keys_queues_and_queued_values():
    core, c = core_of(max_store_keys=4), Client()
    core.execute((Op.ADD, b"n", 1), c)
    core.execute((Op.QUEUE_PUSH, b"q", b"v1"), c)  # (the queue and its value: 2)
    core.execute((Op.SET, b"k", b"v"), c)
    with pytest.raises(BudgetExceeded, match="--max-store-keys"):
        core.execute((Op.QUEUE_PUSH, b"q", b"v2"), c)
    with pytest.raises(BudgetExceeded, match="--max-store-keys"):
        core.execute((Op.BARRIER, b"b", 2), c)
    assert core.execute((Op.ADD, b"n", 99), c) == (100).to_bytes(8, "little")  # (no new key)
    assert core.execute((Op.QUEUE_POP, b"q"), c)[:8] == (1).to_bytes(8, "little")
    core.execute((Op.QUEUE_PUSH, b"q", b"v2"), c)  # (the popped value made room)
    assert core.execute((Op.DELETE_KEY, b"k"), c) == (1).to_bytes(8, "little")
    core.execute((Op.COMPARE_SET, b"c", b"", b"new"), c)
    totals(core)


def test_keys_waited_for_count_as_keys_while_they_are_waited_for():
    core, a, b = core_of(max_store_keys=6), Client(), Client()
    core.execute((Op.SET, b"k", b"v"), a)
    assert core.execute((Op.WAIT, (b"x", b"y", b"x")), a) is None  # (a key twice counts once)
    assert totals(core) == (23, 3)  # ("v" counts as 20 bytes)
    with pytest.raises(BudgetExceeded, match=r"wait on 4 missing keys .*--max-store-keys 6"):
        core.execute((Op.WAIT, (b"p", b"q", b"r", b"s")), b)
    core.execute((Op.BARRIER, b"bar", 9), b)  # (it waits: its key counts twice)
    assert totals(core) == (49, 5) and core.snapshot()[b"bar"] == b"1"
    core.forget(b)
    core.execute((Op.SET, b"x", b"1"), b)
    core.execute((Op.SET, b"y", b"2"), b)
    assert a.woken == [b"\x00"] and totals(core) == (86, 4)  # (STOP_WAITING)
    one = core_of(max_store_keys=1)
    with pytest.raises(BudgetExceeded):  # (a BARRIER that would wait, refused: nothing changed)
        one.execute((Op.BARRIER, b"p", 9), b)
    assert totals(one) == (0, 0) and one.snapshot() == {} and one.num_waiters == 0


def test_a_multi_set_is_counted_exactly_and_refused_whole():
    core, c = core_of(max_store_bytes=60), Client()
    core.execute((Op.SET, b"a", b"0" * 30), c)
    # a key set twice counts once, with its last value; a replaced value its difference
    core.execute((Op.MULTI_SET, (b"b", b"a", b"b"), (b"x" * 40, b"", b"yy")), c)
    assert totals(core) == (42, 2)  # (each short value as 20 bytes)
    with pytest.raises(BudgetExceeded):
        core.execute((Op.MULTI_SET, (b"c", b"d"), (b"1" * 10, b"2" * 20)), c)
    assert core.snapshot() == {b"a": b"", b"b": b"yy"}  # (nothing of it applied)


def test_an_append_past_the_value_limit_is_refused():
    core, c = core_of(max_value_bytes=10, max_reply_bytes=100, max_unread_bytes=2 * MiB), Client()
    core.execute((Op.APPEND, b"k", b"12345"), c)
    core.execute((Op.APPEND, b"k", b"67890"), c)
    with pytest.raises(BudgetExceeded, match=r"the value of key b'k' would be 11 bytes, past the limit"):
        core.execute((Op.APPEND, b"k", b"x"), c)
    assert core.snapshot() == {b"k": b"1234567890"}
    totals(core)


def test_answers_are_measured_before_they_are_built():
    core, c = core_of(max_reply_bytes=MiB, max_unread_bytes=2 * MiB, max_value_bytes=MiB // 2), Client()
    core.execute((Op.SET, b"big", b"x" * (MiB // 2)), c)
    assert len(core.execute((Op.MULTI_GET, (b"big", b"missing")), c)) == MiB // 2 + 16
    with pytest.raises(BudgetExceeded, match=r"its answer would be 1,048,600 bytes, past the limit \(--max-reply-bytes\)"):
        core.execute((Op.MULTI_GET, (b"big", b"big", b"missing")), c)
    core.execute((Op.MULTI_SET, tuple(b"k%06d" % i for i in range(80_000)), (b"",) * 80_000), c)
    with pytest.raises(BudgetExceeded, match="its answer would be"):
        core.execute((Op.LIST_KEYS,), c)  # (8 + 80,001 x 15 bytes: known from running totals)


def test_a_namespace_lists_its_keys_within_the_answer_limit():
    core, c = core_of(max_reply_bytes=9 * MiB, max_unread_bytes=10 * MiB), Client()
    ns, other = NamespacedUpstream(core, b"r1/"), NamespacedUpstream(core, b"r2/")
    ns.execute((Op.SET, b"a", b"1"), c)
    other.execute((Op.MULTI_SET, tuple(b"k%07d" % i for i in range(600_000)), (b"",) * 600_000), c)
    assert ns.execute((Op.LIST_KEYS,), c) == (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"a"
    assert ns.execute((Op.GETNUMKEYS,), c) == (1).to_bytes(8, "little")
    with pytest.raises(BudgetExceeded, match="its answer would be"):
        other.execute((Op.LIST_KEYS,), c)


def test_full_scans_of_a_large_store_are_paced():
    now = [0.0]
    pacer = ScanPacer(share=0.5, burst=1.0, clock=lambda: now[0])

    def scan(seconds: float, keys: int = PACED_SCAN_KEYS) -> None:
        started = pacer.start(keys)
        now[0] += seconds
        pacer.done(started)

    for _ in range(4):  # (scanning all the time: the 1 s burst lasts 2 s, refilled at half speed)
        scan(0.6)
    assert pacer.credit == pytest.approx(-0.2)  # (1 - 4 x 0.6 x (1 - 0.5))
    with pytest.raises(BudgetExceeded, match="have taken their share of its time"):
        pacer.start(PACED_SCAN_KEYS)
    pacer.done(pacer.start(PACED_SCAN_KEYS - 1))  # (a small scan is never refused)
    now[0] += 0.5  # (+0.25)
    scan(0.1)
    assert (pacer.scans, pacer.refused) == (5, 1)
    now[0] += 100
    scan(0.0)
    assert pacer.credit == 1.0  # (never more than the burst)


def test_a_greedy_scanner_does_not_lock_the_others_out():
    now = [0.0]
    pacer = ScanPacer(share=0.5, burst=1.0, clock=lambda: now[0])
    greedy, polite, other, fourth, fifth = (object() for _ in range(5))

    def scan(who: object, seconds: float) -> None:
        started = pacer.start(PACED_SCAN_KEYS, who)
        now[0] += seconds
        pacer.done(started, who)

    for _ in range(4):  # the greedy one empties the bucket (1 - 4 x 0.6 x 0.5 = -0.2)...
        scan(greedy, 0.6)
    with pytest.raises(BudgetExceeded, match="this client's among them"):
        pacer.start(PACED_SCAN_KEYS, greedy)  # ... and is refused,
    scan(polite, 0.3)  # while one that has not scanned lately still scans, on the overdraft
    with pytest.raises(BudgetExceeded):
        pacer.start(PACED_SCAN_KEYS, polite)  # (once: now it owes too)
    scan(other, 0.6)  # the overdraft: at most one burst past empty ...
    assert pacer.credit == pytest.approx(-0.2 - 0.15 - 0.3)
    scan(fourth, 0.8)
    assert pacer.credit == pytest.approx(-0.65 - 0.4)
    with pytest.raises(BudgetExceeded):  # ... after which nobody scans until it refills
        pacer.start(PACED_SCAN_KEYS, fifth)
    assert pacer.refused == 3
    now[0] += 100  # debts are paid back at the share's rate, the bucket refilled
    scan(greedy, 0.1)


def test_a_connection_owes_each_request_at_its_largest_answer():
    limits, owed = Limits(), Owed()
    get = owed.sent((Op.GET, b"k"), limits)
    assert get == 16 + limits.max_value_bytes + REQUEST_RESERVE
    wait = owed.sent((Op.WAIT, (b"k",)), limits)
    mg = owed.sent((Op.MULTI_GET, (b"a",) * 1000), limits)
    assert mg == limits.max_reply_bytes + REQUEST_RESERVE
    assert owed.reserved == get + wait + mg
    owed.answered(b"\x00")  # (the WAIT's, whenever it comes)
    owed.answered(b"\x05" + b"\x00" * 7 + b"hello")  # (the GET's: answers of the others come in order)
    assert owed.reserved == mg
    owed.sent((Op.BARRIER, b"b", 3), limits)
    owed.cancelled()
    owed.answered(b"\x01")  # (a CHECK's after the CANCEL_WAIT forgot it: ignored)
    owed.answered(b"")  # (the MULTI_GET of keys that hold nothing... of one key: empty answer)
    assert owed.reserved == 0
    assert largest_answer((Op.LIST_KEYS,), limits) == limits.max_reply_bytes
    assert largest_answer((Op.ADD, b"k", 1), limits) == 8


def test_a_proxy_forgets_a_write_once_a_later_answer_came():
    writes = WritesInFlight(max_writes=3)
    a, b, c = Client(), Client(), Client()
    writes.sent([(2, Op.SET, a), (4, Op.APPEND, c)])
    assert writes.answered(3) is None and len(writes) == 1  # (2 executed before 3: not refused)
    assert writes.answered(4) == (Op.APPEND, c)
    refused_write(Op.APPEND, c, b"the value would be too long")
    assert c.dropped == "APPEND failed: the value would be too long" and a.dropped is None
    refused_write(Op.SET, b, b"SET failed: past the budget")  # (a relay's reason, from the level above)
    assert b.dropped == "SET failed: past the budget"  # (not "SET failed: SET failed: ...")
    u = UpOp((Op.WAIT, (b"k",)), b"", None, 0)
    assert failure(u, b"WAIT failed: past it") == failure(u, b"past it") == "WAIT failed: past it"
    writes.sent([(5, Op.SET, a), (6, Op.SET, a), (7, Op.SET, a), (8, Op.SET, a)])
    assert len(writes) == 3 and writes.answered(5) is None  # (at most 3 kept: 5 forgotten)


def test_a_clients_latest_write_stays_unsettled_while_in_flight_or_refused():
    writes = WritesInFlight(max_writes=3)
    a, b = Client(), Client()
    writes.sent([(2, Op.SET, a), (3, Op.SET, b)])
    assert (writes.unsettled(a), writes.unsettled(b)) == (2, 3)
    writes.sent([(4, Op.APPEND, a)])
    assert writes.unsettled(a) == 4  # (its latest)
    assert writes.answered(3) == (Op.SET, b)  # (refused: 2 landed before it)
    assert (writes.unsettled(a), writes.unsettled(b)) == (4, 3)  # (b's refused write stays)
    assert writes.answered(5) is None  # (a later answer: 4 landed)
    assert (writes.unsettled(a), writes.unsettled(b)) == (0, 3)


@pytest.mark.parametrize("change, flag", [
    (dict(max_reply_bytes=8 * MiB), "--max-reply-bytes"),
    (dict(max_unread_bytes=136 * MiB), "--max-unread-bytes"),
    (dict(max_store_keys=0), "--max-store-keys 0"),
])
def test_inconsistent_limits_name_the_flag_to_change(change, flag):
    assert Limits().problem() is None
    assert flag in Limits(**change).problem()
