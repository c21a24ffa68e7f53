"""Standing watches (docs/architecture.md): a front-end answers polls of a key from the state its
WATCH brought back, until the core invalidates it, which the core does before anyone
can learn of the change. Driven in one event loop, links through in-memory pipes."""

import asyncio
import struct
import time

import pytest
from inproc import Client, RootFrontEnd, gate_of, linked, settle, value

from tierrun.core import StoreCore
from tierrun.core.watch_state import ABSENT, UNWATCHABLE, decode_watch_answer, encode_watch_state
from tierrun.link.frames import (
    AFTER, PEEKS, WATCHES, LinkError, decode_invalidate, decode_pong, encode_batch, encode_invalidate, encode_pong, entry_open,
    entry_after, entry_request, entry_waits, entry_watch,
)
from tierrun.protocol.requests import encode_request
from tierrun.tier.plan import UpOp
from tierrun.tier.watches import MAX_CHURN, MAX_WATCHED_BYTES, WatchCache
from tierrun.protocol import Op
from tierrun.protocol.opcodes import CHECK_NOT_READY, CHECK_READY, STOP_WAITING

DUMP = b"/default_pg/0/dump_nccl_trace"


def run(coro):
    return asyncio.run(coro)


async def watched(view, req):
    """Read twice from two clients, a batch apart: a poll, so the front-end watches the key."""
    for _ in range(2):
        view.execute(req, Client())
        await settle()


async def answer(view, req):
    """What a new client asking ``req`` gets (from a watch, or once the loop settled)."""
    client = Client()
    ask(view, req, client)
    await settle()
    return client.replies


def ask(view, req, client):
    """Send ``req`` as ``client``; an answer given at once (from a watch) is recorded too."""
    reply = view.execute(req, client)
    if reply is not None:
        client.wake(reply)


async def watched_with_late_confirmation(core, key, v):
    """``key`` = ``v``, watched (by a GET poll) through one link, whose invalidations wait
    until the test calls ``confirm()``, and a second link to write with. Returns (the
    watcher's link, the writer's link, confirm)."""
    core.execute((Op.SET, key, v), None)
    watcher, _ = await linked(core)
    writer, _ = await linked(core)
    await watched(watcher.view(), (Op.GET, key))
    assert watcher.watches.values  # watched
    held = []
    original = watcher.on_invalidate
    watcher.on_invalidate = held.append  # not yet

    def confirm():
        assert held, "no invalidation arrived"
        original(held.pop())

    return watcher, writer, confirm


async def write_through_own_link(core, key, v):
    """SET ``key`` from a node of its own and wait until the write is done: its CHECK
    after it answered (so every invalidation round it started is over)."""
    writer, _ = await linked(core)
    w = Client()
    writer.view().execute((Op.SET, key, v), w)
    writer.view().execute((Op.CHECK, (key,)), w)
    await settle()
    assert w.replies == [CHECK_READY]


def test_heartbeat_checks_reach_the_core_once_then_see_the_dump_request():
    """NCCL's heartbeat monitor: every rank CHECKs the dump key once a second, forever.
    The first poll registers a watch; from then on no CHECK leaves the node, and the
    one SET of the key (on another node) is seen by the next CHECK."""
    async def main():
        core = StoreCore()
        node1, stats = await linked(core)
        node2, _ = await linked(core)
        ranks = [Client() for _ in range(8)]
        for second in range(5):
            for r in ranks:
                ask(node1.view(), (Op.CHECK, (DUMP,)), r)
            await settle()
        assert all(r.replies == [CHECK_NOT_READY] * 5 for r in ranks)
        assert stats.operations == 1  # the first poll, a WATCH; then nothing
        assert node1.stats.watch_answers == 8 * 4
        node2.view().execute((Op.SET, DUMP, b"1"), Client())
        await settle()
        assert node1.stats.invalidations == 1 and gate_of(core).rounds == 1
        for r in ranks:
            ask(node1.view(), (Op.CHECK, (DUMP,)), r)
        await settle()
        assert all(r.replies[-1] == CHECK_READY for r in ranks)

    run(main())


def test_torch_get_is_a_wait_and_a_get_and_the_node_sends_only_the_wait():
    """torch's get() is WAIT then GET. A proxy sends a one-key WAIT up as a WATCH, whose
    answer carries the key's value: the GET that follows is answered on the node, and
    so is every later WAIT and GET of the key there, by any client (an agent reading its
    rank assignment, ranks reading the NCCL unique id). Also for a client with a write
    of its own still in flight (the agent's SET of its role just before)."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/uid", b"id"), None)
        link, stats = await linked(core)
        view = link.view()
        first, second = Client(), Client()
        view.execute((Op.SET, b"/role", b"r"), first)  # (no answer: the client is unconfirmed)
        for c in (first, second):
            ask(view, (Op.WAIT, (b"/uid",)), c)
            await settle()
            ask(view, (Op.GET, b"/uid"), c)
            await settle()
        assert stats.operations == 2 and link.stats.watches_sent == 1  # the SET, the WATCH
        for _ in range(6):
            c = Client()
            assert view.execute((Op.WAIT, (b"/uid",)), c) == STOP_WAITING
            assert view.execute((Op.GET, b"/uid"), c) == value(b"id")
        await settle()
        assert stats.operations == 2
        assert first.replies == second.replies == [STOP_WAITING, value(b"id")]

    run(main())


def test_waits_join_the_wait_sent_for_their_key_across_batches():
    """Ranks reach a barrier's WAIT at different moments: the first WAIT on the key
    fetches it (nothing may join that one), the second is a poll: it goes up as a WATCH,
    and later WAITs on the key join it instead of going to the core."""
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        ranks = [Client() for _ in range(8)]
        view.execute((Op.WAIT, (b"/done",)), ranks[0])
        await settle()
        view.execute((Op.WAIT, (b"/done",)), ranks[1])  # a poll: sent as a WATCH
        await settle()
        for r in ranks[2:]:
            view.execute((Op.WAIT, (b"/done",)), r)
            await settle()
        assert stats.operations == 2 and link.stats.watch_joins == 6
        core.execute((Op.SET, b"/done", b"1"), None)
        await settle()
        assert all(r.replies == [STOP_WAITING] for r in ranks)
        late = Client()
        assert view.execute((Op.WAIT, (b"/done",)), late) == STOP_WAITING  # watched, present

    run(main())


def test_a_first_wait_fetches_its_key_and_its_first_write_starts_no_round():
    """A node's first WAIT on a key goes up in a WATCHES entry (a WAIT that fetches):
    the core does not watch the key while it waits, so the write that releases it
    starts no invalidation round (a frozen node waiting on a key holds nobody's answers
    back); once released, the key is watched, its GET is answered on the node, and a
    later change does start a round. Through a stacked proxy too."""
    async def main():
        core = StoreCore()
        middle, _ = await linked(core)
        leaf, _ = await linked(middle)
        writer, _ = await linked(core)
        waiters = [Client(), Client()]
        leaf.view().execute((Op.WAIT, (b"/rank/0",)), waiters[0])
        middle.view().execute((Op.WAIT, (b"/rank/1",)), waiters[1])
        await settle()
        assert core.num_waiters == 2 and core.num_watches == 0
        w = Client()
        writer.view().execute((Op.MULTI_SET, (b"/rank/0", b"/rank/1"), (b"a", b"b")), w)
        writer.view().execute((Op.CHECK, (b"/rank/0",)), w)
        await settle()
        assert gate_of(core).rounds == 0 and w.replies == [CHECK_READY]
        assert all(c.replies == [STOP_WAITING] for c in waiters)
        assert core.num_watches == 2  # (the leaf's through the middle's)
        operations = core.operations
        for view, key, v in ((leaf.view(), b"/rank/0", b"a"), (middle.view(), b"/rank/1", b"b")):
            c = Client()
            assert view.execute((Op.GET, key), c) == value(v)
        writer.view().execute((Op.SET, b"/rank/0", b"c"), w)
        await settle()
        assert core.operations == operations + 1 and gate_of(core).rounds == 1
        assert leaf.stats.invalidations == 1
        assert await answer(leaf.view(), (Op.GET, b"/rank/0")) == [value(b"c")]

    run(main())


def test_a_fetch_after_a_write_of_its_own_is_answered_by_the_core_only():
    """A client whose write is still on its way up fetches in a FETCHES entry: a stacked
    proxy that watches the key passes it on instead of answering it from its watch (the
    write must execute first); a client with nothing outstanding is answered there."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"old"), None)
        middle, _ = await linked(core)
        leaf, _ = await linked(middle)
        await watched(middle.view(), (Op.GET, b"/k"))  # the middle watches /k
        operations = core.operations
        writer = Client()
        leaf.view().execute((Op.SET, b"/k", b"new"), writer)  # no answer: on its way
        ask(leaf.view(), (Op.WAIT, (b"/k",)), writer)
        await settle()
        ask(leaf.view(), (Op.GET, b"/k"), writer)
        await settle()
        assert writer.replies == [STOP_WAITING, value(b"new")]
        assert core.operations == operations + 2  # the SET and the fetch; the GET on the leaf
        reader = Client()  # nothing outstanding: the middle answers its fetch
        operations = core.operations
        ask(middle.view(), (Op.GET, b"/k"), Client())
        await settle()
        assert core.operations == operations  # the middle's watch, renewed after the change
        leaf2, _ = await linked(middle)
        ask(leaf2.view(), (Op.WAIT, (b"/k",)), reader)
        await settle()
        ask(leaf2.view(), (Op.GET, b"/k"), reader)
        await settle()
        assert reader.replies == [STOP_WAITING, value(b"new")] and core.operations == operations

    run(main())


def test_a_change_is_not_revealed_before_the_watchers_dropped_what_they_saw():
    """The writer's own next answer (and anyone's) waits until every front-end watching
    the key confirmed the invalidation; meanwhile the watchers answer nothing stale."""
    async def main():
        core = StoreCore()
        watcher, writer, confirm = await watched_with_late_confirmation(core, b"/k", b"old")
        w = Client()
        writer.view().execute((Op.SET, b"/k", b"new"), w)
        writer.view().execute((Op.GET, b"/other"), w)
        await settle()
        assert w.replies == [] and gate_of(core).closed  # held
        root = RootFrontEnd(core)
        direct = Client()
        assert root.execute((Op.GET, b"/k"), direct) is None  # the root's own clients too
        confirm()
        await settle()
        assert w.replies == [value(b"")] and direct.replies == [value(b"new")]
        assert await answer(watcher.view(), (Op.GET, b"/k")) == [value(b"new")]

    run(main())


def test_a_lone_add_of_a_watched_counter_is_answered_only_after_the_round():
    """A frame of one ADD takes the store host's short path; if the counter is watched,
    the ADD starts a round and its own answer (which reveals the change) waits for it."""
    async def main():
        core = StoreCore()
        watcher, writer, confirm = await watched_with_late_confirmation(core, b"/n", b"5")
        assert await answer(writer.view(), (Op.GET, b"/other")) == [value(b"")]  # (opens its id)
        w = Client()
        writer.view().execute((Op.ADD, b"/n", 1), w)  # (a frame of its own)
        await settle()
        assert w.replies == [] and gate_of(core).closed  # held
        confirm()
        await settle()
        assert w.replies == [struct.pack("<q", 6)]
        assert await answer(watcher.view(), (Op.GET, b"/n")) == [value(b"6")]

    run(main())


def test_a_watcher_that_never_confirms_holds_answers_only_until_its_lease_ends():
    async def main():
        core = StoreCore()
        watcher, _ = await linked(core)
        await watched(watcher.view(), (Op.CHECK, (b"/k",)))
        watcher.on_invalidate = lambda payload: None  # frozen: never confirms
        watcher.watches.lease_until = 0.0  # and (as a frozen node's would) its lease runs out
        w = Client()
        writer, _ = await linked(core)
        writer.view().execute((Op.SET, b"/k", b"1"), w)
        writer.view().execute((Op.CHECK, (b"/k",)), w)
        await settle()
        assert w.replies == []
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not w.replies and loop.time() - start < 10:
            await asyncio.sleep(0.05)
        assert w.replies == [CHECK_READY] and gate_of(core).lapsed == 1
        assert loop.time() - start < 4.5  # the lease (3 s) and its margin from the last PONG

    run(main())


def test_no_answer_from_a_watch_without_a_lease_or_for_a_client_with_a_write_in_flight():
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        await watched(view, (Op.CHECK, (b"/k",)))
        c = Client()
        assert view.execute((Op.CHECK, (b"/k",)), c) == CHECK_NOT_READY  # from the watch
        view.execute((Op.SET, b"/k", b"1"), c)  # its own write, not yet executed
        assert view.execute((Op.CHECK, (b"/k",)), c) is None  # so: upstream, after it
        await settle()
        assert c.replies == [CHECK_READY]
        before = stats.operations
        await watched(view, (Op.CHECK, (b"/j",)))
        link.watches.lease_until = 0.0  # no PONG for a lease's length
        assert view.execute((Op.CHECK, (b"/j",)), Client()) is None
        await settle()
        assert stats.operations == before + 2  # the WATCH (a CHECK's first poll), then this one

    run(main())


def test_lone_waits_of_many_nodes_on_one_key_join_at_the_proxy_above():
    """The exit barrier: one agent per node WAITs for the last member, so each node
    fetches the key. The proxy above sends the first node's fetch as it is, the second
    as a poll (a WATCH-WAIT), and every later node's WAIT joins that one: the core
    sees two WAITs, however many nodes there are, and the write that releases them is
    seen by everyone, whose GETs are then answered on their nodes."""
    async def main():
        core = StoreCore()
        middle, root_stats = await linked(core)
        leaves = [(await linked(middle))[0] for _ in range(6)]
        agents = [Client() for _ in leaves]
        for leaf, agent in zip(leaves, agents):
            leaf.view().execute((Op.WAIT, (b"/last_member",)), agent)
            await settle()
        assert root_stats.operations == 2 and middle.stats.watch_joins == 4
        assert core.num_waiters == 2
        await write_through_own_link(core, b"/last_member", b"1")
        assert all(a.replies == [STOP_WAITING] for a in agents)
        operations = core.operations
        for leaf in leaves:
            assert leaf.view().execute((Op.GET, b"/last_member"), Client()) == value(b"1")
        assert core.operations == operations
        await write_through_own_link(core, b"/last_member", b"2")
        for leaf in leaves:
            assert await answer(leaf.view(), (Op.GET, b"/last_member")) == [value(b"2")]

    run(main())


def test_a_walk_through_numbered_keys_is_read_ahead_a_fetch_per_lookahead():
    """Gloo's address exchange: each rank WAITs for and GETs every rank's key in turn.
    Once two keys were fetched in order, a key's fetch also peeks at the next
    LOOKAHEAD keys, twice as many each time (present ones come back watched), so
    through a stacked proxy the core sees a few fetches for all the keys, every answer
    is right, a peeked key's change is seen below, and a key that was absent when
    peeked is fetched when it is read."""
    async def main():
        from tierrun.tier.readahead import LOOKAHEAD

        core = StoreCore()
        n = 4 * (LOOKAHEAD + 1)
        for j in range(n):
            if j != 20:  # (rank 20 has not written its address yet)
                core.execute((Op.SET, b"/pg/cpu/%d" % j, b"addr%d" % j), None)
        middle, root_stats = await linked(core)
        leaf, _ = await linked(middle)
        rank = Client()
        late = asyncio.get_running_loop().call_later(0.05, core.execute, (Op.SET, b"/pg/cpu/20", b"addr20"), None)
        for j in range(n):
            key = b"/pg/cpu/%d" % j
            for req in ((Op.WAIT, (key,)), (Op.WAIT, (key,)), (Op.GET, key)):
                reply = leaf.view().execute(req, rank)
                while reply is None and not rank.replies:
                    await asyncio.sleep(0.001)
                assert (reply if reply is not None else rank.replies.pop()) == (
                    STOP_WAITING if req[0] == Op.WAIT else value(b"addr%d" % j))
        late.cancel()
        assert root_stats.batches <= 2 * 4 + 2, root_stats.batches
        assert middle.stats.peeks_sent >= n - 8 and leaf.stats.peeks_sent >= n - 8
        await write_through_own_link(core, b"/pg/cpu/5", b"moved")
        assert await answer(leaf.view(), (Op.GET, b"/pg/cpu/5")) == [value(b"moved")]

    run(main())


def test_a_peek_registers_nothing_for_an_absent_key():
    """The core answers a PEEKS entry at once: a key with a value comes back watched,
    an absent key (or a queue's) unwatched, and nothing waits for it."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k1", b"v"), None)
        core.execute((Op.QUEUE_PUSH, b"/k3", b"x"), None)
        link, _ = await linked(core)
        got = []

        class Peeker:
            def wake(self, reply):
                got.append(reply)

        from tierrun.core.watch_state import PEEK
        for key in (b"/k1", b"/k2", b"/k3"):
            reply = core.execute_watching((Op.WAIT, (key,)), Peeker(), ("owner", key), PEEK)
            got.append(reply)
        assert got == [encode_watch_state(True, b"v"), UNWATCHABLE, UNWATCHABLE]
        assert core.num_watches == 1 and core.num_waiters == 0

    run(main())


def test_stacked_front_ends_answer_from_the_middle_and_pass_invalidations_down():
    """In a tree, a WATCH from a front-end below is answered by the one above from its
    own watch; a change reaches the bottom before the writer hears back."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/uid", b"a"), None)
        middle, root_stats = await linked(core)
        leaves = [await linked(middle) for _ in range(3)]
        for leaf, _ in leaves:
            for _ in range(3):
                leaf.view().execute((Op.GET, b"/uid"), Client())
                await settle()
        assert root_stats.operations == 2  # the middle's first read and its WATCH
        assert middle.stats.watch_answers >= 2  # the other leaves' WATCHes
        await write_through_own_link(core, b"/uid", b"b")
        for leaf, _ in leaves:
            assert leaf.stats.invalidations == 1
            assert await answer(leaf.view(), (Op.GET, b"/uid")) == [value(b"b")]

    run(main())


def test_a_relay_answers_no_watched_read_of_a_client_whose_write_is_on_its_way_up():
    """A client two proxies down SETs a key, WAITs for it, then GETs it, as soon as the
    WAIT is answered. Once the key has changed too often to watch at the bottom, the
    WAIT goes up plain, as a ticket of its link client at the relay: the relay must
    see that client's SET still on its way up and not answer from its own watch (it
    did: the bottom then answered the GET from its stale watch, the value before)."""
    async def main():
        core = StoreCore()
        middle, _ = await linked(core)
        leaf, _ = await linked(middle)
        view, c = leaf.view(), Client()
        for i in range(1, 13):
            v = b"%d" % i
            ask(view, (Op.SET, b"/k", v), c)
            n = len(c.replies)
            ask(view, (Op.WAIT, (b"/k",)), c)
            while len(c.replies) == n:  # (the GET leaves the moment the WAIT is answered)
                await asyncio.sleep(0)
            ask(view, (Op.GET, b"/k"), c)
            await settle()
            assert c.replies[-1] == value(v), f"round {i}"
        assert leaf.watches._churn[(b"", b"/k")] >= MAX_CHURN  # (the plain-WAIT path was taken)

    run(main())


@pytest.mark.parametrize("torch_get", [False, True])
def test_a_relay_counts_a_cancelled_wait_of_a_client_as_that_wait_only(torch_get):
    """At a relay every client of the node below is one link client. Its WAITs that went
    up watching were never counted among what that client has outstanding, so their
    CANCEL_WAITs must not uncount anything: a review found a fix of the test above
    making two cancels hide a SET still on its way up, and the relay then answered the
    writer's GET (or torch's get(): WAIT, then GET) from its watch: the value before."""
    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/k", b"old"), None)
        middle, _ = await linked(core, delay=40)  # (the core's frames reach the middle 40 turns late)
        leaf, _ = await linked(middle)
        mv, lv = middle.view(), leaf.view()
        for _ in range(2):  # the middle watches /k (its own clients poll it)
            ask(mv, (Op.GET, b"/k"), Client())
            await asyncio.sleep(0.05)
        assert middle.watches.values
        w, x1, x2, z, y = (Client() for _ in range(5))
        ask(lv, (Op.WAIT, (b"/a", b"/b")), w)  # plain (two keys): counted at the middle
        ask(lv, (Op.WAIT, (b"/m1",)), x1)  # one key: up watching (fetches), not counted
        ask(lv, (Op.WAIT, (b"/m2",)), x2)
        await asyncio.sleep(0.05)
        ask(lv, (Op.SET, b"/k", b"new"), y)  # y's write on its way up...
        ask(lv, (Op.WAIT, (b"/c", b"/d")), z)  # ...then another request of the link client
        for _ in range(3):
            await asyncio.sleep(0)
        ask(lv, (Op.CANCEL_WAIT,), x1)
        ask(lv, (Op.CANCEL_WAIT,), x2)
        if torch_get:  # (/k changed too often at the leaf: its WAIT goes up plain)
            leaf.watches._churn[(b"", b"/k")] = MAX_CHURN
            ask(lv, (Op.WAIT, (b"/k",)), y)
            while not y.replies:
                await asyncio.sleep(0)
        ask(lv, (Op.GET, b"/k"), y)
        await settle()
        await asyncio.sleep(0.1)
        assert y.replies[-1] == value(b"new")

    run(main())


def test_a_key_that_keeps_changing_is_no_longer_watched():
    async def main():
        core = StoreCore()
        link, stats = await linked(core)
        view = link.view()
        for i in range(MAX_CHURN + 3):
            view.execute((Op.GET, b"/counter"), Client())
            await settle()
            core.execute((Op.ADD, b"/counter", 1), None)
            await settle()
        assert link.stats.invalidations == MAX_CHURN
        assert core.num_watches == 0 and gate_of(core).rounds == MAX_CHURN

    run(main())


def test_the_core_breaks_a_watch_on_every_change_of_its_key_and_only_then():
    """Sans I/O: what ``StoreCore.execute_watching`` registers and when a change breaks
    it (before any waiter on the key is woken, so a woken watching WAIT watches anew)."""
    core = StoreCore()
    broken = []
    core.on_watches_broken = lambda watchers: broken.append(list(watchers))
    w = Client()
    assert core.execute_watching((Op.GET, b"/k"), w, "A") == ABSENT + value(b"")
    core.execute((Op.COMPARE_SET, b"/k", b"x", b"y"), w)  # missing, expected x: no change
    core.execute((Op.DELETE_KEY, b"/k"), w)  # nothing to delete
    assert broken == []
    core.execute((Op.SET, b"/k", b"1"), w)
    assert broken == [["A"]]
    assert core.execute_watching((Op.CHECK, (b"/k",)), w, "B") == encode_watch_state(True, b"1") + CHECK_READY
    core.execute((Op.COMPARE_SET, b"/k", b"1", b"1"), w)  # same value: no change
    assert broken == [["A"]]
    for change in [(Op.ADD, b"/k", 1), (Op.APPEND, b"/k", b"0"), (Op.MULTI_SET, (b"/k",), (b"5",)),
                   (Op.COMPARE_SET, b"/k", b"5", b"6"), (Op.DELETE_KEY, b"/k")]:
        core.execute_watching((Op.GET, b"/k"), w, change[0])
        core.execute(change, w)
        assert broken[-1] == ["B", change[0]] or broken[-1] == [change[0]], change
    waiter = Client()
    assert core.execute_watching((Op.WAIT, (b"/n",)), waiter, "W") is None  # watched as absent
    order = []
    core.on_watches_broken = lambda watchers: order.append(("broken", list(watchers)))
    waiter.wake = lambda reply: order.append(("woken", reply))
    core.execute((Op.SET, b"/n", b"v"), w)
    assert order == [("broken", ["W"]), ("woken", encode_watch_state(True, b"v") + STOP_WAITING)]
    assert core.num_watches == 1  # watched anew, with its value
    core.execute((Op.QUEUE_PUSH, b"/q", b"x"), w)
    assert core.execute_watching((Op.CHECK, (b"/q",)), w, "Q") == UNWATCHABLE + CHECK_READY
    core.execute((Op.QUEUE_POP, b"/q"), w)
    popper = Client()  # torch's blocking queue_pop: a WAIT on the empty queue's key first
    assert core.execute_watching((Op.WAIT, (b"/q",)), popper, "P") is None
    core.execute((Op.QUEUE_PUSH, b"/q", b"y"), w)
    assert popper.replies == [UNWATCHABLE + STOP_WAITING]


def test_watch_states_and_invalidations_round_trip():
    for watched, v in [(True, None), (True, b""), (True, b"\x00" * 9), (False, None)]:
        assert decode_watch_answer(encode_watch_state(watched, v) + b"tail") == (watched, v, b"tail")
    payload = encode_invalidate(7, [1, 2, 1 << 40])[5:]
    assert decode_invalidate(payload) == (7, [1, 2, 1 << 40])
    assert decode_pong(encode_pong(5, 2.5)[5:]) == (5, 2.5)
    assert decode_pong(encode_pong(5, 60)[5:]) == (5, 3.0)  # never more than WATCH_LEASE
    for bad in [b"", b"\x01\x05", b"\x09"]:
        with pytest.raises(ValueError):
            decode_watch_answer(bad)
    with pytest.raises(LinkError):
        decode_invalidate(payload[:-1])


def test_a_watch_of_anything_but_a_one_key_read_closes_the_link(caplog):
    async def main():
        core = StoreCore()
        link, _ = await linked(core)
        link.send(encode_batch([entry_open(99, b""),
                                 entry_watch(99, 1, encode_request((Op.MULTI_GET, (b"/a", b"/b"))))]))
        await settle()

    run(main())
    assert "MULTI_GET cannot watch" in caplog.text


_AFTER_ALONE = "an AFTER entry not followed by a request of its client"


@pytest.mark.parametrize("entries, error", [
    ([entry_waits(77, 1, [b"/a"], WATCHES)], "request for unknown client 77"),
    # three keys announced, one sent
    ([entry_open(99, b""), bytes([WATCHES]) + struct.pack("<IQII", 99, 1, 3, 1) + b"/"], "malformed batch"),
    ([entry_waits(77, 1, [b"/a"], PEEKS)], "request for unknown client 77"),
    ([entry_open(99, b""), bytes([PEEKS]) + struct.pack("<IQII", 99, 1, 3, 1) + b"/"], "malformed batch"),
    ([entry_open(99, b""), bytes([PEEKS]) + struct.pack("<IQII", 99, 1, 1, 70000) + b"/"], "truncated batch"),
    ([entry_open(99, b""), bytes([AFTER + 1]) + b"\0" * 16], "unknown batch entry kind 9"),
    # an AFTER binds the next entry only, a request of its own client
    ([entry_open(99, b""), entry_after(99, 5), entry_waits(99, 1, [b"/a"])], _AFTER_ALONE),
    ([entry_open(99, b""), entry_open(98, b""), entry_after(99, 5),
      entry_request(98, 2, encode_request((Op.ADD, b"/n", 1)))], _AFTER_ALONE),
    ([entry_open(99, b""), entry_after(99, 5)], _AFTER_ALONE),
])
def test_a_bad_watches_entry_closes_the_link(caplog, entries, error):
    async def main():
        core = StoreCore()
        link, _ = await linked(core)
        link.send(encode_batch(entries))
        await settle()
        assert core.num_waiters == 0

    run(main())
    assert error in caplog.text


def test_a_node_proxy_answers_torchs_heartbeat_checks_without_the_store_host():
    """End to end, real processes and torch's own client: ranks on a node poll the dump
    key through their proxy as ProcessGroupNCCL's heartbeat monitor does; after the
    first polls the store host sees no more of them, and a dump request written at the
    store host reaches every rank's next CHECK."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from tierrun.server import StoreProcess

    env = dict(os.environ, TIERRUN_TOKEN="watch-test-token")
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as root, \
            StoreProcess(command="proxy", host="127.0.0.1", port=0, env=env,
                         extra_args=["--upstream", f"127.0.0.1:{root.port}"]) as proxy:
        def client(port):
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

        ranks = [client(proxy.port) for _ in range(4)]
        for _ in range(2):
            assert not any(r.check([DUMP.decode()]) for r in ranks)
        before = root.stats()["link_operations"]
        for _ in range(10):
            assert not any(r.check([DUMP.decode()]) for r in ranks)
        assert root.stats()["link_operations"] == before
        writer = client(root.port)
        writer.set(DUMP.decode(), "1")  # torch's SET has no answer: the writer's next one
        assert writer.check([DUMP.decode()])  # comes once every proxy dropped what it saw
        assert all(r.check([DUMP.decode()]) for r in ranks)
        stats = root.stats()
        assert stats["invalidation_rounds"] == 1 and stats["invalidations_lapsed"] == 0
        assert stats["watches"] >= 1  # (the ranks polled the key again: watched anew)
        proxy.stop()  # its session ends: the store host drops its watches
        deadline = time.monotonic() + 10
        while root.stats()["watches"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert root.stats()["watches"] == 0


def test_a_proxy_watching_more_keys_than_its_limit_stays_correct_end_to_end():
    """Real processes, torch's client: two ranks read more keys through their proxy than
    the store host keeps watches for per session (torch's get is a WAIT that fetches,
    then a GET answered on the node). The store host breaks the older half in one
    round; the proxy forgets those keys, reads one of them again from the store host,
    and sees a change made to it meanwhile (a change that started no round)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from tierrun.core.store import MAX_WATCHES_PER_OWNER
    from tierrun.server import StoreProcess

    n = MAX_WATCHES_PER_OWNER + 8
    env = dict(os.environ, TIERRUN_TOKEN="watch-limit-test-token")
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as root, \
            StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True, env=env,
                         extra_args=["--upstream", f"127.0.0.1:{root.port}"]) as proxy:
        def client(port):
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))

        writer, a, b = client(root.port), client(proxy.port), client(proxy.port)
        writer.multi_set([f"/k{i}" for i in range(n)], [f"v{i}" for i in range(n)])
        for i in range(n):
            assert a.get(f"/k{i}") == b.get(f"/k{i}") == f"v{i}".encode()
        stats = root.stats()
        half = (MAX_WATCHES_PER_OWNER + 1) // 2
        assert stats["watches_evicted"] == half and stats["watches"] == n - half
        assert stats["invalidation_rounds"] == 1 and stats["invalidations_lapsed"] == 0
        writer.set("/k0", "new")  # evicted: no round
        writer.set(f"/k{n - 1}", "new")  # still watched: a round
        assert writer.get("/k0") == b"new"
        assert a.get("/k0") == b"new" and b.get(f"/k{n - 1}") == b"new"
        assert a.get(f"/k{half}") == f"v{half}".encode()
        assert root.stats()["invalidation_rounds"] == 2
        assert proxy.stats()["invalidations"] == half + 1


def test_one_multi_set_of_many_watched_keys_is_one_invalidation_round():
    core = StoreCore()
    rounds = []
    core.on_watches_broken = lambda watchers: rounds.append(sorted(watchers))
    keys = [f"/k{i}".encode() for i in range(5)]
    for i, k in enumerate(keys):
        core.execute_watching((Op.GET, k), Client(), i)
    core.execute((Op.MULTI_SET, tuple(keys), tuple(b"v" for _ in keys)), Client())
    assert rounds == [[0, 1, 2, 3, 4]]


def test_an_owner_past_its_watch_limit_has_its_older_half_broken():
    """Sans I/O. Watchers (owner, id) count against their owner (a link session): past
    the limit, its older half is broken as if their keys had changed, so a finished
    round's keys, which never change again, cannot pile up per node at the store host.
    Other owners' watches, and watchers that are not pairs, are not touched."""
    core = StoreCore()
    core.max_watches_per_owner = 4
    broken = []
    core.on_watches_broken = lambda watchers: broken.append(list(watchers))
    keys = [f"/k{i}".encode() for i in range(5)]
    core.execute_watching((Op.GET, keys[0]), Client(), ("T", 0))
    core.execute_watching((Op.GET, keys[0]), Client(), "plain")
    for i, k in enumerate(keys):
        core.execute_watching((Op.GET, k), Client(), ("S", i))
    assert broken == [[("S", 0), ("S", 1)]]
    assert core.num_watches == 3 + 2
    core.execute((Op.SET, keys[0], b"1"), None)  # only the other owner's and the plain watch
    core.execute((Op.SET, keys[1], b"1"), None)  # nobody's now
    assert broken[1:] == [[("T", 0), "plain"]]
    core.execute((Op.SET, keys[4], b"1"), None)
    assert broken[2:] == [[("S", 4)]]
    for i in range(5, 7):  # S holds 2 (k2, k3): 2 more, no eviction yet
        core.execute_watching((Op.GET, f"/k{i}".encode()), Client(), ("S", i))
    assert len(broken) == 3
    waiter = Client()  # a WAIT watching its missing key counts too; woken, it watches anew
    core.execute_watching((Op.WAIT, (b"/late",)), waiter, ("S", 9))
    assert broken[3:] == [[("S", 2), ("S", 3)]]
    core.execute((Op.SET, b"/late", b"v"), None)
    assert broken[4:] == [[("S", 9)]] and waiter.replies == [encode_watch_state(True, b"v") + STOP_WAITING]
    assert core.num_watches == 3  # /k5, /k6 and /late, all S's
    assert core.watches_evicted == 4


def test_a_session_that_ends_leaves_no_watches_at_the_store_host():
    """Sans I/O, then through a link: the watches of a link session are dropped when the
    session ends (no round: nobody answers from them any more)."""
    core = StoreCore()
    broken = []
    core.on_watches_broken = lambda watchers: broken.append(list(watchers))
    for i in range(3):
        core.execute_watching((Op.GET, f"/k{i}".encode()), Client(), ("S", i))
    core.execute_watching((Op.GET, b"/k0"), Client(), ("T", 0))
    core.drop_watches_of("S")
    assert core.num_watches == 1
    core.execute((Op.SET, b"/k1", b"1"), None)
    core.execute((Op.SET, b"/k0", b"1"), None)
    assert broken == [[("T", 0)]]

    async def main():
        core = StoreCore()
        link, _ = await linked(core)
        for i in range(3):
            await watched(link.view(), (Op.GET, f"/k{i}".encode()))
        assert core.num_watches == 3
        link.close()
        await settle()
        assert core.num_watches == 0

    run(main())


def test_a_front_end_whose_old_watches_are_broken_reads_again_and_sees_changes():
    """Through a link, with a limit of 4 watches per session: watching a 5th key breaks
    the front-end's 2 oldest (it forgets them and confirms); a later change of one of
    them (no round for it) is seen by the next read there, which goes to the core again."""
    async def main():
        core = StoreCore()
        core.max_watches_per_owner = 4
        link, stats = await linked(core)
        view = link.view()
        keys = [f"/k{i}".encode() for i in range(5)]
        for k in keys:
            core.execute((Op.SET, k, b"old"), None)
        for k in keys:
            await watched(view, (Op.GET, k))
        await settle()
        assert link.stats.invalidations == 2 and core.num_watches == 3
        rounds = gate_of(core).rounds
        core.execute((Op.SET, keys[0], b"new"), None)
        core.execute((Op.SET, keys[4], b"new"), None)
        await settle()
        assert gate_of(core).rounds == rounds + 1  # keys[4] only
        before = stats.operations
        assert await answer(view, (Op.GET, keys[0])) == [value(b"new")]
        assert await answer(view, (Op.GET, keys[4])) == [value(b"new")]
        assert await answer(view, (Op.GET, keys[3])) == [value(b"old")]  # still watched
        assert stats.operations == before + 2

    run(main())


def test_watches_are_per_namespace():
    """Each rendezvous round's workers see their own namespace: a watch of a key in one
    is not answered for, nor broken by, the same key in another."""
    async def main():
        core = StoreCore()
        watcher, _ = await linked(core)
        writer, _ = await linked(core)
        for ns in ("round0", "round1"):
            await watched(watcher.view(ns), (Op.CHECK, (b"/done",)))
        w = Client()
        writer.view("round1").execute((Op.SET, b"/done", b"1"), w)
        writer.view("round1").execute((Op.CHECK, (b"/done",)), w)
        await settle()
        assert w.replies == [CHECK_READY] and watcher.stats.invalidations == 1
        old, new = Client(), Client()
        ask(watcher.view("round0"), (Op.CHECK, (b"/done",)), old)
        ask(watcher.view("round1"), (Op.CHECK, (b"/done",)), new)
        await settle()
        assert old.replies == [CHECK_NOT_READY] and new.replies == [CHECK_READY]
        assert core.snapshot() == {b"round1//done": b"1"}

    run(main())


def test_the_watch_cache_holds_values_within_its_byte_budget():
    """A client GETting many large values over and over (each read twice: watched) makes a
    proxy hold their states: at most MAX_WATCHED_BYTES of them (past it the cache starts
    again, as past its count of keys), and an invalidated key's bytes go with it."""
    cache = WatchCache()
    big = b"v" * (8 << 20)
    for i in range(40):
        u = UpOp((Op.GET, b"/k%d" % i), b"", None, 0)
        u.wkey, u.rid = (b"", b"/k%d" % i), i + 1
        cache.answered(u, True, big)
        assert cache.value_bytes == sum(len(v or b"") for v in cache.values.values()) <= MAX_WATCHED_BYTES
    assert len(cache.values) == MAX_WATCHED_BYTES // len(big)
    n, _ = cache.invalidate([40], {})
    assert n == 1 and cache.value_bytes == len(big) * (len(cache.values))
    cache.drop_all()
    assert cache.value_bytes == 0
