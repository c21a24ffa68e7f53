"""Resumable links: a link cut mid-frame, frozen, or away too long; the root restarted.

A real root store (core, public port, link server) and a real front-end link run in one
event loop over loopback TCP, with a relay between them that the test cuts, freezes or
refuses at chosen moments. Every ADD is of 1, so exactly-once shows as the results of
all clients together being exactly 1..N.
"""

import asyncio

import pytest

from tierrun.tier import connect_link
from tierrun.link.config import LinkConfig
from tierrun.link.frames import ACK, BATCH, FrameDecoder
from tierrun.protocol import Op
from tierrun.server.root import serve_root
from tierrun.server.service import ServiceConfig

from inproc import Client

FAST = LinkConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5, grace=3.0)


class Relay:
    """A TCP relay the test controls: forwards bytes both ways until told otherwise."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut_at: int | None = None  # cut every connection once this many bytes went up
        self.frozen = False  # stop forwarding, keep the connections open
        self.hold_down = False  # stop forwarding what the store host sends (kept)
        self.drop_up = False  # lose what the front-end sends
        self.refusing = False  # close new connections at once
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.pairs.append((writer, up_writer))
        sent = [0]

        async def pump(src, dst, upward):
            try:
                while data := await src.read(65536):
                    if upward and self.drop_up:
                        continue
                    while self.frozen or (self.hold_down and not upward):
                        await asyncio.sleep(0.01)
                    if upward and self.cut_at is not None and sent[0] + len(data) >= self.cut_at:
                        part = self.cut_at - sent[0]
                        self.cut_at = None
                        dst.write(data[:part])  # part of a frame: the core must drop it
                        await dst.drain()
                        self.cut_all()
                        return
                    if upward:
                        sent[0] += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def close(self) -> None:
        self.server.close()
        self.cut_all()

    def cut_all(self) -> None:
        for a, b in self.pairs:
            a.transport.abort()
            b.transport.abort()
        self.pairs.clear()


def run(coro, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


async def start_root(port: int = 0):
    stop = asyncio.Event()
    lines: list[str] = []
    listening = asyncio.Event()

    def announce(line):
        lines.append(line)
        listening.set()

    task = asyncio.ensure_future(serve_root(ServiceConfig(host="127.0.0.1", port=port), announce, stop,
                                            token=b"tok", link_config=FAST))
    await asyncio.wait_for(listening.wait(), 10)
    port = lines[0].port
    return port, stop, task


async def relayed_link(port: int):
    """A front-end link to the root at ``port`` through a new relay: (relay, link, lost
    reasons)."""
    relay = Relay(port)
    lost: list[str] = []
    link = await connect_link("127.0.0.1", await relay.start(), b"tok", lost.append, 10, FAST)
    return relay, link, lost


async def request(link, req, client=None):
    """Submit one request as ``client``; wait for its reply."""
    client = client or Client()
    n = len(client.replies)
    link.view("").execute(req, client)
    while len(client.replies) == n:
        await asyncio.sleep(0.005)
    return client.replies[-1]


def counter(reply) -> int:
    return int.from_bytes(reply, "little", signed=True)


async def run_adds(link, clients: int, each: int) -> list[int]:
    results: list[int] = []

    async def one(c):
        for _ in range(each):
            reply = await request(link, (Op.ADD, b"/n", 1), c)
            assert not isinstance(reply, tuple), reply
            results.append(counter(reply))
            await asyncio.sleep(0)

    await asyncio.gather(*(one(Client()) for _ in range(clients)))
    return results


@pytest.mark.parametrize("cut_at", [1, 40, 150, 151, 500, 1000])
def test_link_cut_mid_frame_loses_and_doubles_nothing(cut_at):
    """The relay cuts every connection once ``cut_at`` bytes went upstream (handshake,
    mid-batch or between batches); the front-end resumes and every ADD counts once."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        waiter = Client()
        link.view("").execute((Op.WAIT, [b"/go"]), waiter)
        relay.cut_at = cut_at
        results = await asyncio.wait_for(run_adds(link, clients=8, each=40), 30)
        assert sorted(results) == list(range(1, 321))
        assert waiter.replies == []
        link.view("").execute((Op.SET, b"/go", b"1"), Client())  # SET has no reply
        await request(link, (Op.GET, b"/go"))
        assert waiter.replies and not isinstance(waiter.replies[0], tuple)
        assert counter(await request(link, (Op.ADD, b"/n", 0))) == 320
        assert relay.cut_at is None and relay.connections == 2 and not lost
        link.close()
        relay.close()
        stop.set()
        await task

    run(main())


def test_frozen_link_is_detected_by_heartbeat_and_resumed(caplog):
    """A silent partition (nothing forwarded, nothing closed): both ends notice within the
    heartbeat timeout; the front-end reconnects, and a wake released meanwhile arrives."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        direct = await connect_link("127.0.0.1", port, b"tok", lost.append, 10, FAST)
        waiter = Client()
        link.view("").execute((Op.WAIT, [b"/k"]), waiter)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1
        relay.frozen = True
        direct.view("").execute((Op.SET, b"/k", b"v"), Client())  # wakes the waiter while cut off
        await request(direct, (Op.GET, b"/k"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while link._conn is not None:
            await asyncio.sleep(0.02)
        detected = loop.time() - t0
        assert FAST.heartbeat_timeout - FAST.heartbeat_interval <= detected < FAST.heartbeat_timeout + 2 * FAST.heartbeat_interval + 0.3
        await asyncio.sleep(FAST.heartbeat_interval * 2)
        core_side = [r.message for r in caplog.records if r.name == "tierrun.store"]
        assert any("nothing heard for" in m for m in core_side), core_side
        relay.frozen = False
        reply = await asyncio.wait_for(request(link, (Op.ADD, b"/n", 1)), 10)
        assert counter(reply) == 2
        assert waiter.replies and not isinstance(waiter.replies[0], tuple)
        assert relay.connections >= 2 and not lost
        link.close()
        relay.close()
        direct.close()
        stop.set()
        await task

    run(main())


def test_link_away_past_grace_fails_its_clients_cleanly():
    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        waiter = Client()
        link.view("").execute((Op.WAIT, [b"/never"]), waiter)
        await request(link, (Op.ADD, b"/n", 1))
        relay.refusing = True
        relay.cut_all()
        t0 = asyncio.get_running_loop().time()
        while not lost:
            await asyncio.sleep(0.05)
        elapsed = asyncio.get_running_loop().time() - t0
        assert FAST.grace - 0.5 < elapsed < FAST.grace + 2
        assert "grace period" in lost[0]
        assert waiter.replies and waiter.replies[0][0] == "dropped" and "grace" in waiter.replies[0][1]
        late = Client()
        with pytest.raises(Exception, match="grace"):
            link.view("").execute((Op.GET, b"/n"), late)
        # the core dropped the session: no waiter left behind
        await asyncio.sleep(1.0)
        direct = await connect_link("127.0.0.1", port, b"tok", lost.append, 10, FAST)
        assert counter(await request(direct, (Op.ADD, b"/n", 0))) == 1
        direct.close()
        stop.set()
        await task

    run(main())


def test_restarted_root_refuses_the_old_session_at_once():
    """A new store process knows nothing of the old sessions: resuming into it would
    silently lose data, so the front-end fails fast with the reason."""

    async def main():
        port, stop, task = await start_root()
        lost = []
        link = await connect_link("127.0.0.1", port, b"tok", lost.append, 10, FAST)
        await request(link, (Op.ADD, b"/n", 1))
        stop.set()
        await task
        port2, stop2, task2 = await start_root(port)
        t0 = asyncio.get_running_loop().time()
        while not lost:
            await asyncio.sleep(0.05)
        assert asyncio.get_running_loop().time() - t0 < FAST.grace
        assert "does not know the node's link session" in lost[0]
        stop2.set()
        await task2

    run(main())


def test_a_busy_links_heartbeat_rides_with_its_batches():
    """A lone frame costs the store host a wake-up. A link that sends batches sends its
    heartbeat ACK in the same write as its next batch; an idle one sends it alone, at
    most two intervals apart. Its watch lease never lapses either way."""

    async def main():
        port, stop, task = await start_root()
        link = await connect_link("127.0.0.1", port, b"tok", lambda reason: None, 10, FAST)
        conn = link._conn
        writes: list[list[int]] = []
        write = conn.write

        def record(data: bytes) -> None:
            writes.append([ftype for ftype, _ in FrameDecoder().feed(data)])
            write(data)

        conn.write = record
        loop = asyncio.get_running_loop()
        end = loop.time() + 10 * FAST.heartbeat_interval
        while loop.time() < end:  # busy: a batch every 20 ms, heartbeats every 100 ms
            await request(link, (Op.ADD, b"/n", 1))
            await asyncio.sleep(0.02)
            assert link.lease_left() > 0
        with_ack = [w for w in writes if ACK in w]
        assert len(with_ack) >= 3 and all(BATCH in w for w in with_ack), writes
        writes.clear()
        await asyncio.sleep(10 * FAST.heartbeat_interval)  # idle
        assert link.lease_left() > 0
        assert writes.count([ACK]) >= 5 and all(w == [ACK] for w in writes), writes
        link.close()
        stop.set()
        await task

    run(main())


def test_a_connection_lost_as_it_resumes_is_reconnected_not_left_idle():
    """A new connection is lost right after the store host resumed the session on it,
    before the task that reconnected it has run again (the peer died as it answered).
    The link must go on reconnecting (and an ADD go through), never sit with no
    connection and nothing trying: a node that would neither recover nor give up."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1
        established = link.established
        to_lose = [2]

        def established_then_lost(conn, *args):
            established(conn, *args)
            if to_lose[0]:
                to_lose[0] -= 1
                asyncio.get_running_loop().call_soon(conn.abort, "lost as it resumed")

        link.established = established_then_lost
        relay.cut_all()
        reply = await asyncio.wait_for(request(link, (Op.ADD, b"/n", 1)), FAST.grace + 2)
        assert counter(reply) == 2 and not to_lose[0] and not lost
        link.close()
        relay.close()
        stop.set()
        await task

    run(main())


def test_a_link_left_with_no_connection_and_nothing_reconnecting_reconnects_at_its_next_heartbeat(caplog):
    """Whatever path could leave the link with no connection and no reconnecting task
    (a loss its handler never heard of), the next heartbeat notices, says so, and
    reconnects: a node must never sit neither recovering nor giving up."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1
        unnoticed, link._conn = link._conn, None  # (its loss below is not the current one's)
        unnoticed.abort("lost unnoticed")
        reply = await asyncio.wait_for(request(link, (Op.ADD, b"/n", 1)), FAST.heartbeat_interval * 3 + 2)
        assert counter(reply) == 2 and not lost
        assert any("was not reconnecting" in r.message for r in caplog.records)
        link.close()
        relay.close()
        stop.set()
        await task

    run(main())


@pytest.mark.parametrize("lost_after", [None, 0.05])
def test_a_healthy_resume_lost_before_or_after_its_task_ran_again_gets_a_fresh_grace_period(lost_after):
    """Down 2 s of a 3 s grace period, then resumed, healthy (its first PONG came with
    RESUMED), and lost at once: before the reconnecting task ran again (None) or just
    after (0.05 s). Either way the new loss starts a new grace period: the link comes
    back, not a "not back within the grace period" from the first outage's clock."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1
        loop = asyncio.get_running_loop()
        established = link.established
        healthy = []
        to_lose = [1]

        def established_then_lost(conn, *args):
            established(conn, *args)
            if to_lose[0]:
                to_lose[0] -= 1
                loop.call_soon(lambda: healthy.append(link.down_since is None))  # (before the abort)
                if lost_after is None:
                    loop.call_soon(conn.abort, "lost as it resumed")
                else:
                    loop.call_later(lost_after, conn.abort, "lost just after it resumed")

        link.established = established_then_lost
        relay.refusing = True
        relay.cut_all()
        await asyncio.sleep(FAST.grace - 1.0)
        relay.refusing = False
        reply = await asyncio.wait_for(request(link, (Op.ADD, b"/n", 1)), FAST.grace + 2)
        assert healthy == [True] and not lost, lost
        assert counter(reply) == 2
        link.close()
        relay.close()
        stop.set()
        await task

    run(main())


def test_an_error_in_a_heartbeat_ends_the_session_and_the_agent_hears_it():
    """A bug in a heartbeat (here its subclass hook raising) must not stop the
    heartbeats silently, which would leave a node that notices no silence and no lost
    connection again: the session ends fail-stop, with the reason."""

    async def main():
        port, stop, task = await start_root()
        relay, link, lost = await relayed_link(port)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1

        def failing_on_beat():
            raise RuntimeError("a bug in on_beat")

        link.on_beat = failing_on_beat
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FAST.heartbeat_interval * 3
        while not lost and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert lost and "internal error" in lost[0] and "a bug in on_beat" in lost[0], lost
        relay.close()
        stop.set()
        await task

    run(main())


def test_a_session_resumed_as_its_first_attempt_times_out_is_kept_not_dropped(monkeypatch):
    """The store host resumes the session on the first connection in the very loop pass
    in which the attempt's timeout fires (here: the attempt never sees it, as when the
    timeout's callback runs first). The connection the session is on is kept. Before,
    the attempt dropped it: ``connect_link``, its deadline passed, said the store host
    could not be reached, while the drop started reconnecting a session nobody used."""

    async def main():
        port, stop, task = await start_root()
        relay = Relay(port)
        relay_port = await relay.start()
        real_shield = asyncio.shield
        missed = []

        def shield_missing_the_first(fut):
            if not missed:  # (the first attempt's wait never completes: it times out)
                missed.append(fut)
                return asyncio.get_running_loop().create_future()
            return real_shield(fut)

        monkeypatch.setattr(asyncio, "shield", shield_missing_the_first)
        lost: list[str] = []
        link = await connect_link("127.0.0.1", relay_port, b"tok", lost.append, 1.0, FAST)
        monkeypatch.setattr(asyncio, "shield", real_shield)
        assert missed and missed[0].done() and missed[0].exception() is None  # (it had resumed)
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 1
        await asyncio.sleep(FAST.heartbeat_interval * 3)
        assert relay.connections == 1 and link._reconnecting is None and not lost
        assert counter(await request(link, (Op.ADD, b"/n", 1))) == 2
        link.close()
        relay.close()
        stop.set()
        await task

    run(main())
