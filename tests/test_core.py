"""Store semantics in the core, without I/O."""

import pytest

from tierrun.core import StoreCore, StoreError
from tierrun.protocol import Op


class Client:
    def __init__(self):
        self.woken = []

    def wake(self, reply):
        self.woken.append(reply)


def test_partial_wait_completes_on_last_key_only():
    core, a, w = StoreCore(), Client(), Client()
    core.execute((Op.SET, b"k1", b"1"), w)
    assert core.execute((Op.WAIT, (b"k1", b"k2", b"k3")), a) is None
    core.execute((Op.SET, b"k2", b"2"), w)
    assert a.woken == []
    core.execute((Op.APPEND, b"k3", b"x"), w)
    assert a.woken == [b"\x00"]
    assert core.num_waiters == 0


def test_delete_does_not_wake():
    core, a, w = StoreCore(), Client(), Client()
    core.execute((Op.WAIT, (b"k",)), a)
    core.execute((Op.DELETE_KEY, b"k"), w)
    assert a.woken == []


def test_cancel_wait_always_answers_and_forgets():
    core, a, w = StoreCore(), Client(), Client()
    assert core.execute((Op.CANCEL_WAIT,), a) == b"\x01"
    core.execute((Op.WAIT, (b"k",)), a)
    assert core.execute((Op.CANCEL_WAIT,), a) == b"\x01"
    core.execute((Op.SET, b"k", b"v"), w)
    assert a.woken == []


def test_forget_on_disconnect_keeps_keys():
    core, a = StoreCore(), Client()
    core.execute((Op.SET, b"mine", b"v"), a)
    core.execute((Op.WAIT, (b"other",)), a)
    core.forget(a)
    assert core.num_waiters == 0
    assert core.snapshot() == {b"mine": b"v"}


def test_queue_push_wakes_one_waiter():
    core, a, b, w = StoreCore(), Client(), Client(), Client()
    core.execute((Op.WAIT, (b"q",)), a)
    core.execute((Op.WAIT, (b"q",)), b)
    core.execute((Op.QUEUE_PUSH, b"q", b"1"), w)
    assert (a.woken, b.woken) == ([b"\x00"], [])
    core.execute((Op.QUEUE_PUSH, b"q", b"2"), w)
    assert b.woken == [b"\x00"]
    assert core.execute((Op.QUEUE_POP, b"q"), a) == (2).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"1"


def test_barrier_releases_all_at_world_size():
    core, a, b, c = StoreCore(), Client(), Client(), Client()
    assert core.execute((Op.BARRIER, b"bar", 3), a) is None
    assert core.execute((Op.BARRIER, b"bar", 3), b) is None
    assert core.execute((Op.BARRIER, b"bar", 3), c) == b"\x00"
    assert a.woken == b.woken == [b"\x00"]
    assert core.snapshot()[b"bar"] == b"3"


@pytest.mark.parametrize("stored, delta, result", [(b"41", 1, 42), (b"  7abc", 1, 8), (b"-5", 5, 0), (b"+3", 0, 3)])
def test_add_reads_numbers_like_stoll(stored, delta, result):
    core, a = StoreCore(), Client()
    core.execute((Op.SET, b"n", stored), a)
    assert core.execute((Op.ADD, b"n", delta), a) == result.to_bytes(8, "little", signed=True)


@pytest.mark.parametrize("stored", [b"", b"abc", b" -", b"99999999999999999999"])
def test_add_on_non_number_raises_and_changes_nothing(stored):
    core, a = StoreCore(), Client()
    core.execute((Op.SET, b"n", stored), a)
    with pytest.raises(StoreError):
        core.execute((Op.ADD, b"n", 1), a)
    assert core.snapshot()[b"n"] == stored


def test_compare_set_on_missing_key_with_expected_wakes_but_stores_nothing():
    core, a, w = StoreCore(), Client(), Client()
    core.execute((Op.WAIT, (b"k",)), a)
    assert core.execute((Op.COMPARE_SET, b"k", b"exp", b"new"), w) == b"\x03" + b"\x00" * 7 + b"exp"
    assert a.woken == [b"\x00"]
    assert b"k" not in core.snapshot()
