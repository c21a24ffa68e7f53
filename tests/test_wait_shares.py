"""Keys waited for, shared out by source (``core.wait_shares``), without sockets: a host
whose WAITs fill the key budget loses its largest waits to another host's request; a
host that waits on few keys is never refused for them; a store full of keys (not of
waits) refuses as before. From a hostile review: 8 connections of one host, each
waiting on 131,072 missing keys, held the whole default budget, and every other
client's next new key and next WAIT were refused."""

from __future__ import annotations

import pytest

from tierrun.core import StoreCore, StoreError
from tierrun.protocol import Limits, Op
from tierrun.protocol.opcodes import STOP_WAITING


class Client:
    """A waiter from a host (``scan_source``), as a client connection is."""

    def __init__(self, host: str) -> None:
        self.scan_source = host
        self.answers: list[bytes] = []
        self.dropped: str | None = None

    def wake(self, reply: bytes) -> None:
        self.answers.append(reply)

    def drop(self, reason: str) -> None:
        self.dropped = reason


def keys(prefix: str, n: int) -> tuple[bytes, ...]:
    return tuple(f"/{prefix}/{i}".encode() for i in range(n))


def wait(core: StoreCore, client: Client, ks: tuple[bytes, ...]) -> bytes | None:
    return core.execute((Op.WAIT, ks), client)


@pytest.fixture
def core() -> StoreCore:
    return StoreCore(Limits(max_store_keys=100))


def test_a_write_takes_room_from_the_host_that_waits_on_the_most_keys(core):
    hog1, hog2, writer = Client("10.0.0.9"), Client("10.0.0.9"), Client("10.0.0.2")
    assert wait(core, hog1, keys("a", 60)) is None
    assert wait(core, hog2, keys("b", 40)) is None  # (the budget is full of waits)
    core.execute((Op.SET, b"/new", b"v"), writer)  # (refused before: the store was full)
    assert hog1.dropped and "--max-store-keys" in hog1.dropped and "60 keys" in hog1.dropped
    assert hog2.dropped is None and writer.dropped is None
    assert core.snapshot() == {b"/new": b"v"}
    assert core.budget.entries == 41 and core.budget.refused == 0
    core.execute((Op.MULTI_SET, keys("b", 40), (b"x",) * 40), writer)  # (hog2's keys: it is woken)
    assert hog2.answers == [STOP_WAITING]
    assert core.shares.total == 0 and core.budget.entries == 41


def test_a_small_wait_takes_room_a_greedy_one_is_refused(core):
    hog, other, small = Client("10.0.0.9"), Client("10.0.0.8"), Client("10.0.0.2")
    assert wait(core, hog, keys("h", 70)) is None
    assert wait(core, other, keys("o", 25)) is None
    assert wait(core, small, keys("s", 10)) is None  # (70 + 25 + 10 > 100: hog's wait goes)
    assert hog.dropped and other.dropped is None
    with pytest.raises(StoreError, match="--max-store-keys"):  # (the greediest asks for more: refused)
        wait(core, Client("10.0.0.8"), keys("p", 70))
    assert other.dropped is None and small.dropped is None
    assert core.budget.refused == 1 and core.shares.total == 35
    core.execute((Op.SET, b"/s/3", b"v"), Client("10.0.0.3"))
    core.execute((Op.MULTI_SET, keys("s", 10), (b"v",) * 10), Client("10.0.0.3"))
    assert small.answers == [STOP_WAITING]


def test_a_requester_never_takes_room_from_a_smaller_waiter(core):
    """Two greedy hosts do not take turns dropping each other: the one asking must end
    up waiting on fewer keys than the one it would drop."""
    first, second = Client("10.0.0.8"), Client("10.0.0.9")
    assert wait(core, first, keys("f", 50)) is None
    with pytest.raises(StoreError):
        wait(core, second, keys("g", 60))  # (60 > 50: it would become the greediest)
    assert first.dropped is None and core.shares.total == 50


def test_a_store_full_of_keys_not_waits_refuses_as_before(core):
    """Waits hold less than half the budget: nobody's wait is dropped for a write or
    another wait (else a client filling the store with keys would drop every wait)."""
    filler, waiter = Client("10.0.0.9"), Client("10.0.0.8")
    assert wait(core, waiter, keys("w", 30)) is None
    core.execute((Op.MULTI_SET, keys("k", 70), (b"v",) * 70), filler)
    with pytest.raises(StoreError, match="--max-store-keys"):
        core.execute((Op.SET, b"/one-more", b"v"), filler)
    with pytest.raises(StoreError, match="--max-store-keys"):
        wait(core, Client("10.0.0.7"), keys("x", 1))
    assert waiter.dropped is None and core.shares.total == 30


def test_a_nodes_waits_count_as_one_source_its_largest_go_first():
    """Through a node proxy every WAIT waits under a ticket of the node's link session
    (its ``scan_source``): the node's largest wait goes first, not its small ones."""
    core = StoreCore(Limits(max_store_keys=100))
    session = object()
    node_big, node_small = Client("?"), Client("?")
    node_big.scan_source = node_small.scan_source = session  # type: ignore[assignment]
    assert wait(core, node_small, keys("n", 5)) is None
    assert wait(core, node_big, keys("m", 94)) is None
    core.execute((Op.ADD, b"/count", 1), Client("10.0.0.2"))
    core.execute((Op.SET, b"/b", b"v"), Client("10.0.0.2"))
    core.execute((Op.SET, b"/c", b"v"), Client("10.0.0.2"))
    assert node_big.dropped and node_small.dropped is None


def test_barrier_and_watching_waits_take_room_too(core):
    hog, member = Client("10.0.0.9"), Client("10.0.0.2")
    assert wait(core, hog, keys("h", 99)) is None
    assert core.execute((Op.BARRIER, b"/bar", 2), member) is None  # (its count and its wait)
    assert hog.dropped
    hog2 = Client("10.0.0.9")
    assert wait(core, hog2, keys("h", 98)) is None
    assert core.execute_watching((Op.WAIT, (b"/late",)), Client("10.0.0.3"), ("session", 1)) is None
    assert hog2.dropped


def test_nothing_is_dropped_when_dropping_cannot_make_the_room():
    """A refusal for bytes that waits do not hold, or a request larger than all the
    waits: refused, and every wait kept (from a hostile review: each such request
    dropped waits, then was refused anyway)."""
    core = StoreCore(Limits(max_store_keys=100, max_store_bytes=4000))
    hog = Client("10.0.0.9")
    assert wait(core, hog, keys("h", 60)) is None
    with pytest.raises(StoreError, match="--max-store-bytes"):
        core.execute((Op.SET, b"/big", b"x" * 5000), Client("10.0.0.2"))
    with pytest.raises(StoreError, match="--max-store-keys"):
        core.execute((Op.MULTI_SET, keys("k", 120), (b"v",) * 120), Client("10.0.0.2"))
    assert hog.dropped is None and core.shares.total == 60 and core.budget.refused == 2


def test_a_nodes_writes_count_as_the_node_and_take_no_room_from_its_own_waits():
    """Through a node proxy a write's waiter is the node's link client: the same source
    as the node's waits (as a flat host's SET is its WAITs')."""
    core = StoreCore(Limits(max_store_keys=100))
    node = Client("?")
    node.scan_source = 4242  # type: ignore[assignment]  (a session's id, as hub.session's clients say)
    assert wait(core, node, keys("n", 99)) is None
    core.execute((Op.ADD, b"/c", 1), node)
    with pytest.raises(StoreError, match="--max-store-keys"):
        core.execute((Op.SET, b"/d", b"v"), node)
    assert node.dropped is None
    core.execute((Op.SET, b"/d", b"v"), Client("10.0.0.2"))  # (another host's write: room from the node)
    assert node.dropped


def test_making_room_for_a_large_request_drops_many_small_waits_in_one_pass():
    """From a hostile review: each wait dropped retried the whole request (a MULTI_SET of
    4,000 keys re-counted 4,000 times: seconds of the store host's time). One plan,
    one retry: the request goes, and exactly the waits it needs are dropped."""
    core = StoreCore(Limits(max_store_keys=8000))
    node = [Client("?") for _ in range(8000)]
    for i, c in enumerate(node):
        c.scan_source = 7  # type: ignore[assignment]
        assert wait(core, c, (b"/w/%d" % i,)) is None
    core.execute((Op.MULTI_SET, keys("k", 4000), (b"v",) * 4000), Client("10.0.0.2"))
    assert sum(c.dropped is not None for c in node) == 4000
    assert core.shares.total == 4000 and core.budget.entries == 8000 and core.budget.refused == 0
