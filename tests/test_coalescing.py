"""Coalescing within a batch, with the front-end's link upstream and a real core,
driven in one event loop without sockets to the clients: N clients issue the same
request in the same loop iteration; the core sees one operation; every client gets
the answer sequential execution would have given it."""

import asyncio
import struct
import time

import pytest
from inproc import Client, linked, settle, value

from tierrun.core import StoreCore
from tierrun.tier.hold import HOLD_STRETCH
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


def test_one_link_id_per_namespace_and_waits_wait_each_on_its_own():
    """An id costs the core an OPEN entry: a front-end opens one per namespace, and every
    request in it, from any client, goes under it. WAITs on different keys wait at the
    core side by side under that id; cancelling one (CANCEL_WAIT, or its client
    leaving) cancels only that one."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"v"), None)
        link, stats = await linked(core)
        view, other = link.view(), link.view("round1")
        clients = [Client() for _ in range(5)]
        for i, c in enumerate(clients):
            view.execute((Op.GET, b"/k"), c)
            view.execute((Op.WAIT, (f"/w{i}".encode(),)), c)
        other.execute((Op.ADD, b"/n", 1), Client())
        await settle()
        assert all(c.replies == [value(b"v")] for c in clients)
        assert link.stats.ids_opened == 2 and core.num_waiters == 5
        assert view.execute((Op.CANCEL_WAIT,), clients[1]) == b"\x01"
        view.forget(clients[2])  # its connection closed
        await settle()
        assert core.num_waiters == 3
        for i in range(5):
            core.execute((Op.SET, f"/w{i}".encode(), b"1"), None)
        await settle()
        assert [len(c.replies) for c in clients] == [2, 1, 1, 2, 2]
        assert link.stats.ids_opened == 2 and core.num_waiters == 0

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


def test_a_contended_write_is_held_for_the_others_and_a_read_sends_it_at_once():
    """A batch opening with a write to a key family another client wrote within the
    last second (every node's count of a barrier) stays open contended_write_hold
    seconds: the other clients' ADDs, loop turns later, join it. The first writer is
    not held; a read closes a held batch at once (a hold of 60 s: only the read can
    have sent it)."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=0.05))
        view = link.view()
        first, *others = [Client() for _ in range(4)]
        view.execute((Op.ADD, b"/barrier/count", 1), first)
        await settle()
        assert first.replies == [struct.pack("<q", 1)] and stats.batches == 1  # not held
        for c in others:
            view.execute((Op.ADD, b"/barrier/count", 1), c)
            await asyncio.sleep(0)  # a new loop iteration each time
        await settle()
        assert stats.batches == 1 and not any(c.replies for c in others)  # held
        await asyncio.sleep(0.1)
        await settle()
        assert sorted(struct.unpack("<q", c.replies[0])[0] for c in others) == [2, 3, 4]
        assert stats.batches == 2 and stats.operations == 2 and link.stats.held_batches == 1

        link, stats = await linked(core, LinkConfig(contended_write_hold=60))
        view = link.view()
        a, b, reader = Client(), Client(), Client()
        view.execute((Op.ADD, b"/role/1", 1), a)
        await settle()
        view.execute((Op.SET, b"/role/2", b"x"), b)  # (the same family: contended)
        await settle()
        assert stats.batches == 1 and link.stats.held_batches == 1
        view.execute((Op.GET, b"/role/2"), reader)
        await settle()
        assert reader.replies == [value(b"x")] and stats.batches == 2

    run(main())


def test_a_held_batch_waits_one_hold_after_each_joining_write_up_to_a_limit():
    """Writers that keep coming keep a held batch open: it leaves one hold after the
    last write that joined it (so a barrier's last writer waits no more than a hold per
    front-end), but no later than HOLD_STRETCH holds after the write that opened it."""
    async def main():
        hold = 0.2
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=hold))
        view = link.view()
        first, opener, joiner = Client(), Client(), Client()
        view.execute((Op.ADD, b"/barrier/count", 1), first)
        await settle()
        view.execute((Op.ADD, b"/barrier/count", 1), opener)  # held from now
        await asyncio.sleep(0.75 * hold)
        view.execute((Op.ADD, b"/barrier/count", 1), joiner)  # ... until a hold from now
        await asyncio.sleep(0.5 * hold)  # (past the opener's hold)
        assert stats.batches == 1 and not opener.replies
        await asyncio.sleep(hold)
        await settle()
        assert stats.batches == 2 and [len(c.replies) for c in (opener, joiner)] == [1, 1]

        writers = [Client() for _ in range(2 * HOLD_STRETCH + 4)]
        loop = asyncio.get_running_loop()
        start = loop.time()
        for c in writers:  # a write every half hold: each would stretch the hold again
            view.execute((Op.ADD, b"/barrier/count", 1), c)
            await asyncio.sleep(hold / 2)
            if stats.batches > 2:
                break
        # the first of them left with the batch they opened, HOLD_STRETCH holds later
        assert stats.batches > 2 and loop.time() - start < (HOLD_STRETCH + 1.5) * hold
        await settle()  # (its answer is a few loop turns behind the batch)
        assert writers[0].replies

    run(main())


def test_a_held_batch_leaves_on_a_tick_of_the_wall_clock():
    """Its hold over, a held batch waits for the next multiple of hold_grid seconds of
    the wall clock, as every other front-end's held batch does, so that the store host
    gets them together; the hold is not counted twice (a batch whose hold ends on a
    tick leaves at once)."""
    async def main():
        grid = 0.5
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=0.01, hold_grid=grid))
        view = link.view()
        first = Client()
        view.execute((Op.ADD, b"/barrier/count", 1), first)
        await settle()
        for n in (1, 2):  # (twice: a batch leaving by chance within 30 ms of a tick is 12% likely)
            held = Client()
            view.execute((Op.ADD, b"/barrier/count", 1), held)
            while not held.replies:
                await asyncio.sleep(0.002)
            left_at = time.time()
            assert stats.batches == 1 + n and link.stats.held_batches == n
            assert min(left_at % grid, grid - left_at % grid) < 0.03  # (on a tick, give or take a loop turn)

    run(main())


def test_a_writers_wait_stays_in_its_held_batch_at_a_node_and_above():
    """Every agent SETs its role record, then WAITs for its assignment. That WAIT
    stays in the batch that holds the SET (closing it would send a node's records one
    by one), at the node's front-end and at a stacked front-end above (where the WAIT
    waits under a ticket of the link client that sent both). Another client's WAIT,
    or any other read, still sends the batch at once."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=60))
        view = link.view()
        a, b, c = Client(), Client(), Client()
        view.execute((Op.SET, b"/role/1", b"r1"), a)
        await settle()
        sent = stats.batches
        view.execute((Op.SET, b"/role/2", b"r2"), b)  # held: a wrote the family
        view.execute((Op.WAIT, (b"/assigned/2",)), b)
        await settle()
        assert stats.batches == sent and link.stats.held_batches == 1
        view.execute((Op.WAIT, (b"/assigned/3",)), c)  # not a writer's: sends it
        await settle()
        assert stats.batches == sent + 1 and core.execute((Op.GET, b"/role/2"), a) == value(b"r2")
        view.execute((Op.SET, b"/assigned/2", b"ranks"), a)
        await settle()
        assert b.replies[-1] == b"\x00"  # STOP_WAITING

        upper, stats = await linked(core, LinkConfig(contended_write_hold=60))
        below = [(await linked(upper, LinkConfig(contended_write_hold=0)))[0] for _ in range(2)]
        a, b, c = Client(), Client(), Client()
        below[0].view().execute((Op.SET, b"/rank/1", b"r1"), a)
        await settle()
        sent = stats.batches
        below[1].view().execute((Op.SET, b"/rank/2", b"r2"), b)  # held above: another link wrote it
        below[1].view().execute((Op.WAIT, (b"/assignment/2",)), b)
        await settle()
        assert stats.batches == sent and upper.stats.held_batches == 1
        below[0].view().execute((Op.GET, b"/other"), c)  # a read sends it
        await settle()
        assert stats.batches == sent + 1 and core.execute((Op.GET, b"/rank/2"), a) == value(b"r2")

    run(main())


def test_a_contended_write_behind_a_batch_in_flight_is_held_all_the_same():
    """With a batch in flight (one at a time, by default), a contended write waits for
    its answer; it then still leaves when its hold is over, not with the answer, so
    that the writes arriving meanwhile and after leave with it."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=0.2, hold_grid=0), delay=5)
        view = link.view()
        first, held, joiner = Client(), Client(), Client()
        view.execute((Op.ADD, b"/barrier/count", 1), first)  # not held: in flight
        await asyncio.sleep(0)
        view.execute((Op.ADD, b"/barrier/count", 1), held)  # held behind it
        await settle()  # (the answer is back)
        assert first.replies and stats.batches == 1 and link.stats.held_batches == 1
        view.execute((Op.ADD, b"/barrier/count", 1), joiner)
        await settle()
        assert stats.batches == 1 and not held.replies
        await asyncio.sleep(0.3)
        await settle()
        assert stats.batches == 2 and stats.operations == 2  # (the two ADDs merged)
        assert sorted(struct.unpack("<q", c.replies[0])[0] for c in (held, joiner)) == [2, 3]

    run(main())


def test_records_of_a_family_being_read_are_not_held():
    """Gloo's ranks each SET their address and WAIT for every other's, one by one:
    holding a SET of a family that is being read would hold up its readers. Counts
    (ADD) are still held: their readers wait for the last one anyway."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=60))
        view = link.view()
        a, b, reader = Client(), Client(), Client()
        view.execute((Op.SET, b"/addr/0", b"x"), a)
        view.execute((Op.WAIT, (b"/addr/1",)), reader)
        await settle()
        view.execute((Op.SET, b"/addr/1", b"y"), b)  # contended, but read: sent at once
        await settle()
        assert reader.replies and link.stats.held_batches == 0
        view.execute((Op.ADD, b"/count", 1), a)
        view.execute((Op.GET, b"/count"), reader)
        await settle()
        view.execute((Op.ADD, b"/count", 1), b)  # a count: held, though read
        await settle()
        assert link.stats.held_batches == 1 and b.replies == []
        # records read all at once (one WAIT for all of them, as torch's rank
        # assignment does) are still held
        view.execute((Op.SET, b"/role/0", b"r"), a)
        view.execute((Op.WAIT, (b"/role/0", b"/role/1")), reader)
        await settle()
        view.execute((Op.SET, b"/role/1", b"s"), b)
        await settle()
        assert link.stats.held_batches == 2

    run(main())


def test_a_clients_own_repeated_writes_are_not_held():
    """A client writing one family again within a second (ranks counting their steps
    in the store) is never held, at a node's front-end; a front-end relaying a
    subtree's writes is (its repeats are other clients')."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core, LinkConfig(contended_write_hold=60))
        view = link.view()
        a, b, reader = Client(), Client(), Client()
        view.execute((Op.ADD, b"/step", 1), a)
        await settle()
        view.execute((Op.ADD, b"/step", 1), b)  # held: a wrote it
        view.execute((Op.GET, b"/other"), reader)  # ... until this read
        await settle()
        for _ in range(3):  # from now on both only repeat themselves
            for c in (a, b):
                view.execute((Op.ADD, b"/step", 1), c)
                await settle()
        assert len(a.replies) == 4 and len(b.replies) == 4 and link.stats.held_batches == 1

        relay = Client()
        relay.relay = True  # (as a stacked front-end's link client)
        view.execute((Op.ADD, b"/step", 1), relay)  # held: b wrote it last
        await settle()
        assert link.stats.held_batches == 2 and relay.replies == []
        view.execute((Op.ADD, b"/step", 1), a)  # a's repeat: not held; it sends the batch
        await settle()
        assert len(relay.replies) == 1 and len(a.replies) == 5
        view.execute((Op.ADD, b"/step", 1), relay)  # the relay's repeat is held
        await settle()
        assert link.stats.held_batches == 3 and len(relay.replies) == 1

    run(main())


def test_sets_go_as_they_are_and_gets_of_distinct_keys_fold_into_one_multi_get():
    """torch's rank assignment: each agent SETs a key of its own, later GETs another of
    its own. A batch of them reaches the core as one operation per SET (never folded:
    the store host refuses a write past its budget whole, so a fold would take the
    writes before the refused one with it) and one MULTI_GET."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        clients = [Client() for _ in range(8)]
        for i, c in enumerate(clients):
            view.execute((Op.SET, f"/role/{i}".encode(), f"r{i}".encode()), c)
        view.execute((Op.SET, b"/own/0", b"x"), clients[0])
        view.execute((Op.SET, b"/own/1", b"y"), clients[0])  # (one client's pipelined SETs too)
        await settle()
        assert stats.operations == 10
        assert core.snapshot() == {**{f"/role/{i}".encode(): f"r{i}".encode() for i in range(8)},
                                   b"/own/0": b"x", b"/own/1": b"y"}
        for i, c in enumerate(clients):
            view.execute((Op.GET, f"/role/{7 - i}".encode()), c)
        view.execute((Op.GET, b"/role/3"), extra := Client())  # identical to one folded: merged
        await settle()
        assert stats.operations == 11 and link.stats.folded_gets == 7 and link.stats.merged_reads == 1
        assert [c.replies for c in clients] == [[value(f"r{7 - i}".encode())] for i in range(8)]
        assert extra.replies == [value(b"r3")]
        assert link.stats.ids_opened == 1  # one namespace

    run(main())


def test_a_fold_gives_the_answers_of_in_order_execution():
    """A GET joins a fold only past requests it commutes with: not past a write of its key."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/a", b"1"), None)
        core.execute((Op.SET, b"/b", b"1"), None)
        link, stats = await linked(core)
        view = link.view()
        a, w, b, c = Client(), Client(), Client(), Client()
        view.execute((Op.GET, b"/a"), a)
        view.execute((Op.SET, b"/a", b"2"), w)
        view.execute((Op.GET, b"/b"), b)  # folds with a's GET
        view.execute((Op.GET, b"/a"), c)  # after the write: not folded ahead of it
        await settle()
        assert (a.replies, b.replies, c.replies) == ([value(b"1")], [value(b"1")], [value(b"2")])
        assert link.stats.folded_gets == 1

    run(main())


def test_a_client_request_never_joins_one_placed_before_its_own_earlier_request():
    """A client that pipelines an ADD and a GET must get the ADD's answer first, so its
    GET may not merge into another client's GET that stands before its ADD."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"v"), None)
        link, stats = await linked(core)
        view = link.view()
        first, piped = Client(), Client()
        view.execute((Op.GET, b"/k"), first)
        view.execute((Op.ADD, b"/n", 5), piped)
        view.execute((Op.GET, b"/k"), piped)
        await settle()
        assert piped.replies == [struct.pack("<q", 5), value(b"v")]
        assert link.stats.merged_reads == 0 and stats.operations == 3

    run(main())


def test_a_clients_adds_join_its_run_and_its_sets_go_as_they_are():
    """A client's ADDs join a run they are already in (their answers leave in order);
    its SET and MULTI_SET go as they are. An ADD of a client whose SET may yet be refused
    goes alone, behind it (AFTER: ``tier.writes``). The core sees the SET, the
    MULTI_SET, first's ADD, lower's two as one, and the GET, and every answer is
    in-order execution's."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        first, lower = Client(), Client()
        view.execute((Op.SET, b"/role/0", b"r0"), first)
        view.execute((Op.MULTI_SET, (b"/role/1", b"/role/2"), (b"r1", b"r2")), first)
        view.execute((Op.ADD, b"/init", 1), first)
        view.execute((Op.ADD, b"/init", 3), lower)
        view.execute((Op.ADD, b"/init", 2), lower)
        view.execute((Op.GET, b"/role/2"), lower)
        await settle()
        assert first.replies == [struct.pack("<q", 1)]
        assert lower.replies == [struct.pack("<q", 4), struct.pack("<q", 6), value(b"r2")]
        assert link.stats.merged_adds == 1
        assert stats.operations == 5  # the SET, the MULTI_SET, the two ADDs and the GET
        assert core.snapshot() == {b"/init": b"6", b"/role/0": b"r0", b"/role/1": b"r1", b"/role/2": b"r2"}

    run(main())


def test_a_set_keeps_its_clients_later_requests_behind_it():
    """Per-connection order: a client's SET has no answer, but its next answer says the
    SET was done. So its next request joins no merge placed before the SET: a GET that
    joined another client's earlier GET would be answered first (from a watch, or ahead
    of the SET's invalidation round), and another client told of that answer could miss
    the SET. (The linearizability soak found this when a SET did not count: seed 6281 of
    its polled-counter histories.) Nor does its next ADD."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        other, writer = Client(), Client()
        view.execute((Op.GET, b"/k2"), other)
        view.execute((Op.ADD, b"/n", 1), other)  # (an ADD run's place)
        view.execute((Op.SET, b"/flag0", b"0"), writer)
        view.execute((Op.SET, b"/data", b"d"), writer)
        view.execute((Op.SET, b"/flag", b"1"), writer)
        view.execute((Op.GET, b"/k2"), writer)
        await settle()
        assert link.stats.merged_reads == 0
        view.execute((Op.ADD, b"/n", 1), other)
        view.execute((Op.SET, b"/x", b"1"), writer)
        view.execute((Op.ADD, b"/n", 1), writer)
        await settle()
        assert link.stats.merged_adds == 0
        assert writer.replies == [value(b""), struct.pack("<q", 3)]

    run(main())


def test_appends_to_one_key_go_up_one_by_one_in_order():
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        for piece in (b"a", b"b", b"c"):
            view.execute((Op.APPEND, b"/log", piece), Client())
        await settle()
        assert core.snapshot()[b"/log"] == b"abc"
        assert stats.operations == 3

    run(main())


def test_waits_on_distinct_keys_travel_in_one_entry_and_end_one_by_one():
    """Every agent WAITs for its own rank assignment: one WATCHES entry carries a batch
    of them, and each is answered, or cancelled, on its own; each also watches its key,
    so the GET that follows (torch's get() is a WAIT, then a GET) is answered on the node."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/ready", b"1"), None)
        link, stats = await linked(core)
        view = link.view()
        clients = [Client() for _ in range(6)]
        for i, c in enumerate(clients[:5]):
            view.execute((Op.WAIT, (f"/rank/{i}".encode(),)), c)
        view.execute((Op.WAIT, (b"/ready",)), clients[5])  # present: answered at once
        await settle()
        assert link.stats.folded_waits == 5 and stats.batches == 1 and stats.operations == 6
        assert clients[5].replies == [b"\x00"] and core.num_waiters == 5
        assert view.execute((Op.CANCEL_WAIT,), clients[1]) == b"\x01"
        await settle()
        assert core.num_waiters == 4
        for i in (4, 0):
            core.execute((Op.SET, f"/rank/{i}".encode(), b"r"), None)
            await settle()
        assert [len(c.replies) for c in clients] == [1, 0, 0, 0, 1, 1]
        assert core.num_waiters == 2 and link.stats.watches_sent == 6
        operations = stats.operations
        assert view.execute((Op.GET, b"/rank/0"), clients[0]) == value(b"r")
        await settle()
        assert stats.operations == operations

    run(main())
