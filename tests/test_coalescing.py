"""Coalescing within a batch, with the front-end's link upstream and a real core,
driven in one event loop without sockets to the clients: N clients issue the same
request in the same loop iteration; the core sees one operation; every client gets
the answer sequential execution would have given it."""

import asyncio
import struct

import pytest
from inproc import Client, linked, settle

from tierrun.core import StoreCore
from tierrun.link.config import LinkConfig
from tierrun.protocol import Op


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("n", [1, 5])
def test_adds_on_one_counter_become_one(n):
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/c", b"10"), None)
        link, stats = await linked(core)
        view = link.view()
        clients = [Client() for _ in range(n)]
        for i, c in enumerate(clients):
            view.execute((Op.ADD, b"/c", i + 1), c)
        await settle()
        assert core.snapshot()[b"/c"] == str(10 + n * (n + 1) // 2).encode()
        got = [struct.unpack("<q", c.replies[0])[0] for c in clients]
        assert got == [10 + (i + 1) * (i + 2) // 2 for i in range(n)]  # sequential results
        assert stats.operations == 1 and link.stats.merged_adds == n - 1

    run(main())


def test_link_ids_only_for_requests_sent_and_reused_by_later_waits():
    """An id costs the core an OPEN entry: merged clients get none, and one client's
    successive WAITs run under one id."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"v"), None)
        link, stats = await linked(core)
        view = link.view()
        clients = [Client() for _ in range(5)]
        for c in clients:
            view.execute((Op.GET, b"/k"), c)
        await settle()
        assert all(c.replies for c in clients)
        assert link.stats.ids_opened == 1  # the GET that went upstream
        waiter = clients[0]
        for i in range(3):
            view.execute((Op.WAIT, (f"/w{i}".encode(),)), waiter)
            await settle()
            core.execute((Op.SET, f"/w{i}".encode(), b"1"), None)
            await settle()
        assert len(waiter.replies) == 4  # the GET, then three WAITs answered
        assert link.stats.ids_opened == 2  # + one id for the three WAITs

    run(main())


def test_identical_gets_checks_and_multi_gets_are_sent_once():
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"v"), None)
        link, stats = await linked(core)
        view = link.view()
        for req, want in [((Op.GET, b"/k"), b"\x01" + b"\x00" * 7 + b"v"),
                          ((Op.CHECK, (b"/k",)), b"\x00"),
                          ((Op.MULTI_GET, (b"/k", b"/k")), (b"\x01" + b"\x00" * 7 + b"v") * 2),
                          ((Op.GETNUMKEYS,), b"\x01" + b"\x00" * 7),
                          ((Op.QUEUE_LEN, b"/q"), b"\x00" * 8)]:
            before = stats.operations
            clients = [Client() for _ in range(4)]
            for c in clients:
                view.execute(req, c)
            await settle()
            assert [c.replies for c in clients] == [[want]] * 4, req
            assert stats.operations - before == 1, req

    run(main())


def test_a_write_between_identical_reads_splits_them():
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"1"), None)
        link, stats = await linked(core)
        view = link.view()
        a, w, b = Client(), Client(), Client()
        view.execute((Op.GET, b"/k"), a)
        view.execute((Op.SET, b"/k", b"2"), w)
        view.execute((Op.GET, b"/k"), b)
        await settle()
        assert a.replies == [b"\x01" + b"\x00" * 7 + b"1"]
        assert b.replies == [b"\x01" + b"\x00" * 7 + b"2"]
        assert stats.operations == 3

    run(main())


def test_waits_on_one_key_are_one_upstream_wait_released_in_one_frame():
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        clients = [Client() for _ in range(10)]
        for c in clients:
            view.execute((Op.WAIT, (b"/id",)), c)
        await settle()
        assert stats.operations == 1 and core.num_waiters == 1
        writer = Client()
        view.execute((Op.SET, b"/id", b"x"), writer)
        await settle()
        assert all(c.replies == [b"\x00"] for c in clients)

    run(main())


def test_cancel_of_one_merged_wait_leaves_the_others_waiting():
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        a, b = Client(), Client()
        view.execute((Op.WAIT, (b"/k",)), a)
        view.execute((Op.WAIT, (b"/k",)), b)
        await settle()
        assert view.execute((Op.CANCEL_WAIT,), a) == b"\x01"
        view.execute((Op.SET, b"/k", b"1"), Client())
        await settle()
        assert a.replies == [] and b.replies == [b"\x00"]

    run(main())


def test_add_on_a_non_number_fails_every_merged_caller():
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/t", b"text"), None)
        link, _ = await linked(core)
        view = link.view()
        a, b = Client(), Client()
        view.execute((Op.ADD, b"/t", 1), a)
        view.execute((Op.ADD, b"/t", 1), b)
        await settle()
        assert a.replies[0][0] == "dropped" and b.replies[0][0] == "dropped"
        assert core.snapshot()[b"/t"] == b"text"

    run(main())


def test_a_batch_window_merges_requests_from_several_loop_iterations():
    """batch_window keeps a batch open after its first request: ADDs issued in
    different loop iterations within it still reach the core as one."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(batch_window=0.05))
        view = link.view()
        clients = [Client() for _ in range(3)]
        for c in clients:
            view.execute((Op.ADD, b"/w", 1), c)
            await asyncio.sleep(0)  # a new loop iteration each time
        await asyncio.sleep(0.1)
        await settle()
        assert sorted(struct.unpack("<q", c.replies[0])[0] for c in clients) == [1, 2, 3]
        assert stats.operations == 1 and stats.batches == 1

    run(main())
