"""A client whose write with no answer the store host refuses is closed, and none of the
requests with an effect it sent after that write runs, through proxies and relays as
on the store host alone (``tier.writes``, AFTER entries, UNORDERED answers). In
process: a core, front-ends linked to it and to each other through in-memory pipes."""

import asyncio
import gc
import struct

import pytest
from inproc import Client, linked, settle, value
from test_link_resume import Relay

from tierrun.core import StoreCore
from tierrun.frontend.frontend import FrontEndConfig
from tierrun.hub.session import Session
from tierrun.link.config import LinkConfig
from tierrun.link.frames import OK, UNORDERED, LinkError, decode_replies, replies_frames
from tierrun.protocol import Op
from tierrun.protocol.limits import Limits
from tierrun.server.root import serve_root
from tierrun.server.service import ServiceConfig
from tierrun.tier import connect_link
from tierrun.tier.writes import WritesInFlight

BIG = b"A" * 20_000  # past the 10,000-byte budget of these cores
RESUMING = LinkConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5, grace=3.0)


def dropped(client: Client) -> bool:
    return bool(client.replies) and all(not isinstance(r, bytes) for r in client.replies)


async def chain(core: StoreCore, levels: int, delay: int = 0):
    """A front-end ``levels`` deep: linked to the core (1), to a relay linked to it (2)."""
    link, _ = await linked(core, delay=delay)
    for _ in range(levels - 1):
        link, _ = await linked(link)
    return link


def test_an_answers_status_keeps_its_unordered_mark_and_an_unknown_one_ends_the_link():
    (frame,) = replies_frames([(5, OK | UNORDERED, b"x" * 1000), (6, OK, b"y")], max_frame=200)
    (rid, status, _), after = decode_replies(frame[5:])  # (past the frame head: length, type)
    assert (rid, status, after) == (5, 3, (6, OK, b"y"))  # (FAILED: no frame holds it; still UNORDERED)
    bad = struct.pack("<I", 1) + struct.pack("<QBI", 1, 4, 0)
    with pytest.raises(LinkError):
        decode_replies(bad)


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
    """Thousands of writes of a neighbour land while a client's write is on its way
    (a relay once kept the latest 4,096): the relay still knows that write (its ADD
    behind it is not run once it is refused), and forgets every write once it landed
    or was refused."""

    async def main():
        core = StoreCore(Limits(max_store_bytes=400_000))
        leaf = await chain(core, 2)
        v = leaf.view("")
        a, b = Client(), Client()
        v.execute((Op.SET, b"/a-big", b"A" * 500_000), a)
        for i in range(4200):
            v.execute((Op.SET, b"/b%d" % i, b"x"), b)
        v.execute((Op.ADD, b"/a-count", 1), a)
        for _ in range(100):
            await settle()
        snap = core.snapshot()
        assert dropped(a) and not b.replies
        assert snap.get(b"/a-count") is None and sum(k.startswith(b"/b") for k in snap) == 4200
        v.execute((Op.ADD, b"/b-count", 1), b)  # (its answer lands what came before)
        for _ in range(20):
            await settle()
        assert b.replies == [b"\x01" + bytes(7)]
        loop = asyncio.get_running_loop()
        sessions = [o for o in gc.get_objects() if type(o) is Session and o._loop is loop]
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


@pytest.mark.parametrize("batches_in_flight", [0, 1])
def test_a_clients_read_after_its_own_add_behind_a_write_sees_that_add(batches_in_flight):
    """At a relay, a client's ADD that follows its relayed write (AFTER) is still on its
    way up when the same client reads the key, which the relay watches: the read is not
    answered from the watch ahead of the ADD (the ADD's waiter counts as its client),
    so it sees the ADD, and the answers come in order. (With one batch in flight, a
    store host slower than a heartbeat lets the next batch go: ``on_beat``.)"""

    async def main():
        core = StoreCore()
        relay, _ = await linked(core, delay=60)
        poller, _ = await linked(relay)
        leaf, _ = await linked(relay, config=LinkConfig(batches_in_flight=batches_in_flight))
        p = Client()
        poller.view("").execute((Op.SET, b"/k", b"5"), p)
        for _ in range(20):
            await settle()
        for _ in range(3):  # (a poll: the relay watches /k)
            poller.view("").execute((Op.GET, b"/k"), p)
            for _ in range(20):
                await settle()
        assert (b"", b"/k") in relay.watches.values
        a = Client()
        v = leaf.view("")
        v.execute((Op.SET, b"/w", b"x"), a)
        await asyncio.sleep(0)
        v.execute((Op.GET, b"/x"), a)  # (its answer: the relay takes the link client as clean)
        if batches_in_flight:
            for _ in range(3):
                await asyncio.sleep(0)
            leaf.on_beat()
        await asyncio.sleep(0)
        v.execute((Op.ADD, b"/k", 1), a)  # (AFTER /w)
        for _ in range(5):
            await asyncio.sleep(0)
        if batches_in_flight:
            leaf.on_beat()
        for _ in range(400):
            await asyncio.sleep(0)
            if a.replies:
                break
        v.execute((Op.GET, b"/k"), a)
        if batches_in_flight:
            await asyncio.sleep(0)
            leaf.on_beat()
        for _ in range(80):
            await settle()
        assert a.replies == [value(b""), b"\x06" + bytes(7), value(b"6")]

    asyncio.run(main())


def test_writes_with_no_answer_are_settled_by_a_ping_and_past_a_bound_their_writers_wait(monkeypatch):
    """A client that only writes gets no answers to settle its writes by: past
    ``SYNC_AT`` in flight the front-end sends a PING of its own, whose answer settles
    them; past ``STALL_AT`` its writers get no room (they are read no more) until
    then. So the bound of writes remembered (``MAX_WRITES``, shared at a relay by
    every node below it) is not reached, and no write's refusal is forgotten."""
    from tierrun.tier import connection, writes

    monkeypatch.setattr(writes, "SYNC_AT", 20)
    monkeypatch.setattr(connection, "STALL_AT", 40)

    class Writer(Client):
        rooms = 0

        def room_again(self):
            self.rooms += 1

    async def main():
        core = StoreCore()
        leaf, _ = await linked(core, delay=50)
        v, w = leaf.view(""), Writer()
        for i in range(45):
            v.execute((Op.SET, b"/k%d" % i, b""), w)
        await asyncio.sleep(0)
        assert len(leaf._writes) == 45 and leaf._writes.sync.due
        assert not leaf.write_room(w)
        for _ in range(20):
            await settle()
        assert len(leaf._writes) == 0 and not leaf._writes.sync.due
        assert w.rooms == 1 and leaf.write_room(w) and not w.replies
        assert len(core.snapshot()) == 45
        # writes queued count too; those that went behind the PING, as many again, get
        # a PING of their own once its answer came
        for i in range(45):
            v.execute((Op.SET, b"/j%d" % i, b""), w)
        assert not leaf.write_room(w)  # (45 queued)
        await asyncio.sleep(0)
        for i in range(30):
            v.execute((Op.SET, b"/l%d" % i, b""), w)  # (behind the PING)
        for _ in range(40):
            await settle()
        assert len(leaf._writes) == 0 and not leaf._writes.sync.due
        assert w.rooms == 2 and leaf.write_room(w) and len(core.snapshot()) == 120

    asyncio.run(main())


@pytest.mark.parametrize("levels", [1, 2])
def test_a_refused_write_is_forgotten_once_acknowledged_and_named_refused_after(levels):
    """The store host (and a relay) remember a refused write only until the front-end
    below acknowledged its FAILED (not the latest 4,096 refusals: another client's
    refusals pushed it out). A request of that client sent after the front-end read the
    refusal names it REFUSED, and is not run."""

    async def main():
        core = StoreCore(Limits(max_store_bytes=10_000))
        fast = LinkConfig(heartbeat_interval=0.5)
        link, _ = await linked(core, config=fast)
        for _ in range(levels - 1):
            link, _ = await linked(link, config=fast)
        v, a, others = link.view(""), Client(), Client()
        v.execute((Op.SET, b"/a-big", BIG), a)
        for i in range(5000):  # (another client's refusals: the old window's 4,096 and more)
            v.execute((Op.SET, b"/o%d" % i, BIG), others)
        for _ in range(20):
            await settle()
        assert dropped(a) and len(others.replies) == 5000
        loop = asyncio.get_running_loop()
        sessions = [o for o in gc.get_objects() if type(o) is Session and o._loop is loop]
        assert max(len(o.refused_writes) for o in sessions) >= 5001
        await asyncio.sleep(1.5)  # (heartbeats: every front-end acknowledged)
        assert not any(o.refused_writes for o in sessions)
        v.execute((Op.ADD, b"/a-count", 1), a)
        for _ in range(20):
            await settle()
        assert len(a.replies) == 2 and dropped(a)
        assert core.snapshot().get(b"/a-count") is None

    asyncio.run(main())


def test_a_refusal_survives_the_acknowledgement_that_comes_before_a_resumed_links_resent_batches():
    """A front-end that resumes its session resends the BATCH frames the store host
    lacked, encoded before it read the FAILEDs it acknowledged in its handshake (they
    may name a refused write by its id): so the first ACK after a resume forgets no
    refusal, the next one does."""
    from types import SimpleNamespace

    from tierrun.link.frames import FAILED

    async def main():
        host = SimpleNamespace(config=LinkConfig(), max_frame=1 << 20, gate=SimpleNamespace(closed=False),
                               sessions={})
        session = Session(host, b"s" * 16, "test")  # type: ignore[arg-type]
        host.sessions[session.sid] = session
        session.refused(7)
        session.queue_reply(7, FAILED, b"past the budget")
        session.flush_answers()
        assert session.ledger.outbox.sent == 1 and 7 in session.refused_writes
        session.ledger.resume(1)  # (its SESSION: it has read the FAILED)
        session.resumed = True
        session.acknowledged()  # (its handshake's ACK: before the resent batches)
        assert 7 in session.refused_writes
        session.acknowledged()  # (an ACK after them)
        assert 7 not in session.refused_writes

    asyncio.run(main())

def test_a_refused_write_stays_known_across_a_resume_whose_resent_batch_names_it():
    """The store host refuses a write; the front-end's next batch (an ADD of that client,
    AFTER the write's id) is lost on the way up while the FAILED comes down and is read;
    the link resumes and the front-end resends that batch as it was. The store host
    still knows the refused write (the handshake's ACK forgets nothing): the ADD does
    not run."""
    assert asyncio.run(asyncio.wait_for(_resume_after_a_refusal(), 30)) == 0


async def _resume_after_a_refusal() -> int:
    stop, lines, ev = asyncio.Event(), [], asyncio.Event()
    task = asyncio.ensure_future(serve_root(
        ServiceConfig(host="127.0.0.1", port=0, frontend=FrontEndConfig(limits=Limits(max_store_bytes=10_000))),
        lambda line: (lines.append(line), ev.set()), stop, token=b"tok", link_config=RESUMING))
    await asyncio.wait_for(ev.wait(), 10)
    relay = Relay(lines[0].port)
    link = await connect_link("127.0.0.1", await relay.start(), b"tok", print, 10, RESUMING)
    v = link.view("")
    probe = Client()
    v.execute((Op.SET, b"/fill", b"F" * 9_900), Client())
    v.execute((Op.GET, b"/fill"), probe)
    while not probe.replies:
        await asyncio.sleep(0.01)
    a = Client()
    relay.hold_down = True
    v.execute((Op.SET, b"/a", b"A" * 500), a)   # refused by the store host (budget)
    await asyncio.sleep(0.2)                      # reached the host; its FAILED is held
    relay.drop_up = True
    v.execute((Op.ADD, b"/a-count", 1), a)        # pipelined: AFTER <raw id of the SET>
    await asyncio.sleep(0.2)                      # lost on the way up
    relay.hold_down = False                       # the FAILED reaches the front-end
    await asyncio.sleep(0.2)
    assert dropped(a), a.replies
    relay.drop_up = False
    relay.cut_all()                               # resume: the lost BATCH is re-sent
    await asyncio.sleep(1.5)
    chk = Client()
    v.execute((Op.ADD, b"/a-count", 0), chk)
    while not chk.replies:
        await asyncio.sleep(0.01)
    n = int.from_bytes(chk.replies[0], "little", signed=True)
    link.close()
    relay.server.close()
    stop.set()
    await task
    return n
