"""A client whose write with no answer the store host refuses is closed, and none of the
requests with an effect it sent after that write runs, through proxies and relays as
on the store host alone (``tier.writes``, AFTER entries, UNORDERED answers). In
process: a core, front-ends linked to it and to each other through in-memory pipes."""

import asyncio
import gc

import pytest
from inproc import Client, linked, settle, value

from tierrun.core import StoreCore
from tierrun.hub.session import Session
from tierrun.hub.waiters import KEPT
from tierrun.protocol import Op
from tierrun.protocol.limits import Limits
from tierrun.tier.writes import WritesInFlight

BIG = b"A" * 20_000  # past the 10,000-byte budget of these cores


def dropped(client: Client) -> bool:
    return bool(client.replies) and all(not isinstance(r, bytes) for r in client.replies)


async def chain(core: StoreCore, levels: int, delay: int = 0):
    """A front-end ``levels`` deep: linked to the core (1), to a relay linked to it (2)."""
    link, _ = await linked(core, delay=delay)
    for _ in range(levels - 1):
        link, _ = await linked(link)
    return link


def test_an_answer_out_of_order_settles_no_earlier_write():
    writes = WritesInFlight()
    a, b = object(), object()
    writes.sent([(1, Op.SET, a), (2, Op.SET, b)])
    assert writes.answered(3, ordered=False) is None
    assert writes.unsettled(a) == 1 and writes.unsettled(b) == 2 and len(writes) == 2
    assert writes.answered(2, ordered=False) == (Op.SET, b)  # (refused, out of order)
    assert writes.unsettled(a) == 1
    assert writes.answered(4) is None  # (in order: what came before it landed)
    assert writes.unsettled(a) == 0 and len(writes) == 0


@pytest.mark.parametrize("read", ["check", "get"])
def test_a_relays_answer_from_its_watch_does_not_settle_a_write_it_relayed_before(read):
    """The store host answers the relay late. A neighbour's read, answered by the
    relay's watch at once, comes back before the write's refusal (a CHECK: a watching
    read, in the frame that carried the write; a GET of another namespace, whose link
    client has nothing unanswered: a plain request, in a frame of its own). It is
    marked UNORDERED, so the leaf still holds the write unsettled, closes its client
    when the refusal comes, and the client's pipelined ADD does not run."""

    async def main():
        core = StoreCore(Limits(max_store_bytes=10_000))
        relay, _ = await linked(core, delay=30)
        poller, _ = await linked(relay)
        leaf, _ = await linked(relay)
        ns = "" if read == "check" else "job"
        poller.view(ns).execute((Op.SET, b"/w", b"ready"), Client())
        await asyncio.sleep(0.2)  # (the relay's lease)
        polling = Client()
        for _ in range(3):  # (a poll: the relay watches /w from the second read)
            poller.view(ns).execute((Op.CHECK, (b"/w",)) if read == "check" else (Op.GET, b"/w"), polling)
            for _ in range(5):
                await settle()
        assert (ns.encode(), b"/w") in relay.watches.values
        a, b = Client(), Client()
        leaf.view(ns).execute((Op.ADD, b"/opened", 1), Client())  # (its link client opened)
        for _ in range(5):
            await settle()
        leaf.view("").execute((Op.SET, b"/a-big", BIG), a)
        if read == "get":
            await asyncio.sleep(0)
            leaf.view(ns).execute((Op.GET, b"/w"), b)
        else:
            leaf.view(ns).execute((Op.CHECK, (b"/w",)), b)
        await settle()  # (20 loop turns: the store host's frames take 30)
        assert b.replies == [value(b"ready") if read == "get" else b"\x00"]  # (before the refusal came)
        assert leaf._writes.unsettled(a)
        leaf.view("").execute((Op.ADD, b"/a-count", 1), a)
        for _ in range(40):
            await settle()
        assert dropped(a), a.replies
        assert core.snapshot().get(b"/a-count") is None

    asyncio.run(main())


def test_a_relay_keeps_a_write_in_flight_however_many_of_its_neighbours_land():
    """More than ``KEPT`` writes of a neighbour land while a client's write is on its
    way: the relay still knows that write (its ADD behind it is not run once it is
    refused), and forgets every write once it landed or was refused."""

    async def main():
        core = StoreCore(Limits(max_store_bytes=400_000))
        leaf = await chain(core, 2)
        v = leaf.view("")
        a, b = Client(), Client()
        v.execute((Op.SET, b"/a-big", b"A" * 500_000), a)
        for i in range(KEPT + 100):
            v.execute((Op.SET, b"/b%d" % i, b"x"), b)
        v.execute((Op.ADD, b"/a-count", 1), a)
        for _ in range(100):
            await settle()
        snap = core.snapshot()
        assert dropped(a) and not b.replies
        assert snap.get(b"/a-count") is None and sum(k.startswith(b"/b") for k in snap) == KEPT + 100
        v.execute((Op.ADD, b"/b-count", 1), b)  # (its answer lands what came before)
        for _ in range(20):
            await settle()
        assert b.replies == [b"\x01" + bytes(7)]
        sessions = [o for o in gc.get_objects() if type(o) is Session]
        assert sessions and not any(s.relayed or s.relayed_refused for s in sessions)

    asyncio.run(main())


@pytest.mark.parametrize("levels", [1, 2])
def test_a_barrier_after_a_refused_write_is_not_counted(levels):
    """A client pipelines a SET past the budget and a BARRIER of two: the store host
    alone would have closed it at the SET, so its arrival does not count. Through a
    proxy (1) and a relay (2) too: the barrier completes only with two other arrivals."""

    async def main():
        core = StoreCore(Limits(max_store_bytes=10_000))
        leaf = await chain(core, levels)
        v = leaf.view("")
        a, b, c = Client(), Client(), Client()
        v.execute((Op.SET, b"/a-big", BIG), a)
        v.execute((Op.BARRIER, b"/bar", 2), a)
        for _ in range(20):
            await settle()
        assert dropped(a), a.replies
        v.execute((Op.BARRIER, b"/bar", 2), b)
        for _ in range(20):
            await settle()
        assert b.replies == []  # (one arrival counted: its own)
        v.execute((Op.BARRIER, b"/bar", 2), c)
        for _ in range(20):
            await settle()
        assert len(b.replies) == len(c.replies) == 1 and isinstance(b.replies[0], bytes)

    asyncio.run(main())
