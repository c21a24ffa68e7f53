"""The link: frames, authentication, and a node proxy in front of the root store."""

import os
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierrun.link import auth
from tierrun.link.frames import (
    BATCH, LINK_MAGIC, FrameDecoder, LinkError, decode_batch, decode_replies, encode_batch,
    encode_replies, entry_cancel, entry_open, entry_request, frame,
)
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_request
from tierrun.server import StoreProcess, StoreStartError

TOKEN = "test-token-0123"


def test_frames_round_trip_at_any_split():
    entries = [entry_open(1, b"ns"), entry_request(1, 7, encode_request((Op.GET, b"/k"))), entry_cancel(1, 5)]
    data = encode_batch(entries) + encode_replies([(7, 0, b"\x01\x00"), (8, 1, b"boom")])
    for cut in range(len(data) + 1):
        d = FrameDecoder()
        frames = d.feed(data[:cut]) + d.feed(data[cut:])
        assert [f[0] for f in frames] == [BATCH, 6]
    batch = decode_batch(frames[0][1])
    assert batch == [
        (0, 1, 0, b"ns"), (1, 1, 7, encode_request((Op.GET, b"/k"))), (2, 1, 5, b"")]
    assert decode_replies(frames[1][1]) == [(7, 0, b"\x01\x00"), (8, 1, b"boom")]


def test_oversized_frame_is_refused_before_allocation():
    with pytest.raises(LinkError, match="frame of"):
        FrameDecoder(max_frame=1000).feed(struct.pack("<IB", 10**9, BATCH))


def test_handshake_is_mutual_and_the_token_never_crosses():
    server_nonce = os.urandom(32)
    hello = auth.hello(server_nonce)
    (_, payload), = FrameDecoder().feed(hello)
    auth_frame, client_nonce = auth.answer_hello(b"secret", payload)
    assert b"secret" not in auth_frame
    (_, auth_payload), = FrameDecoder().feed(auth_frame)
    welcome = auth.check_auth(b"secret", server_nonce, auth_payload)
    (_, w), = FrameDecoder().feed(welcome)
    auth.check_welcome(b"secret", server_nonce, client_nonce, w)
    with pytest.raises(LinkError, match="wrong job token"):
        auth.check_auth(b"other", server_nonce, auth_payload)
    with pytest.raises(LinkError, match="does not know the job token"):
        auth.check_welcome(b"other", server_nonce, client_nonce, w)
    # a reflected client proof is not a valid server proof
    with pytest.raises(LinkError):
        auth.check_welcome(b"secret", server_nonce, client_nonce, auth_payload[2 + 32:])


@pytest.fixture
def tiered():
    env = dict(os.environ, TIERRUN_TOKEN=TOKEN)
    with StoreProcess(host=None, port=0, controlled=True, env=env) as root:
        with StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True, env=env,
                          extra_args=["--upstream", f"127.0.0.1:{root.port}"]) as proxy:
            yield root, proxy


def test_wrong_token_is_refused_and_logged(tiered):
    root, _ = tiered
    env = dict(os.environ, TIERRUN_TOKEN="not-the-token")
    bad = StoreProcess(command="proxy", host="127.0.0.1", port=0, env=env, start_timeout=20,
                       extra_args=["--upstream", f"127.0.0.1:{root.port}", "--connect-timeout", "5"])
    with pytest.raises(StoreStartError, match="wrong job token"):
        bad.start()
    assert "closing link from" in root.output and "wrong job token" in root.output
    assert root.stats()["links"] == 1  # the good proxy is still linked


def test_version_mismatch_is_a_clear_error(tiered):
    root, _ = tiered
    s = socket.create_connection(("127.0.0.1", root.port))
    s.sendall(bytes([LINK_MAGIC]))
    (ftype, payload), = FrameDecoder().feed(s.recv(100))
    s.sendall(frame(2, struct.pack("<H", 99) + os.urandom(64)))
    reply = FrameDecoder().feed(s.recv(1000))
    assert b"install the same tierrun version" in reply[0][1]


def test_proxy_listens_on_loopback_only(tiered):
    _, proxy = tiered
    assert "listening on tcp 127.0.0.1:" in proxy.output
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.1.9", proxy.port)) != 0


def test_root_sees_one_link_however_many_clients(tiered):
    root, proxy = tiered
    clients = [dist.TCPStore("127.0.0.1", proxy.port, is_master=False) for _ in range(8)]
    for i, c in enumerate(clients):
        c.set(f"k{i}", str(i))
    direct = dist.TCPStore("127.0.0.1", root.port, is_master=False)
    assert direct.get("k7") == b"7"
    stats = root.stats()
    assert stats["links"] == 1 and stats["clients_accepted"] == 1  # only `direct`


def test_waits_released_together_and_cancel_is_per_client(tiered):
    root, proxy = tiered
    waiters = [dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=20))
               for _ in range(6)]
    quitter = dist.TCPStore("127.0.0.1", proxy.port, is_master=False, timeout=timedelta(seconds=0.5))
    done = []
    threads = [threading.Thread(target=lambda c=c: (c.wait(["go"]), done.append(1))) for c in waiters]
    for t in threads:
        t.start()
    with pytest.raises(dist.DistStoreError):
        quitter.wait(["go"])  # times out and cancels: the others keep waiting
    time.sleep(0.3)
    assert done == []
    dist.TCPStore("127.0.0.1", root.port, is_master=False).set("go", "1")
    for t in threads:
        t.join(10)
    assert len(done) == 6


def test_torch_client_suite_through_the_proxy(tiered):
    _, proxy = tiered
    _torch_client_suite(proxy.port)


def test_torch_client_suite_through_the_store_hosts_own_front_end():
    """The store host's node front-end runs in its store process (--node-frontend), on
    the core with no link: the same suite passes through it, and the public port sees
    no client and no link."""
    import uuid

    from tierrun.client import StoreClient

    env = dict(os.environ, TIERRUN_TOKEN=TOKEN)
    unix = f"@tierrun-test-{uuid.uuid4().hex}"
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env, node_frontend_unix=unix) as root:
        assert root.node_port not in (None, root.port)
        _torch_client_suite(root.node_port)
        port = root.open_namespace("round1", node=True)
        with StoreClient(("127.0.0.1", port)) as c:
            c.set(b"k", b"in round 1")
        with StoreClient(unix) as c:  # (the agent's own clients use the Unix socket)
            assert c.get(b"round1/k") == b"in round 1"
        stats = root.stats()
        assert stats["links_accepted"] == 0 and stats["clients_accepted"] == 0
        assert stats["node_frontend"]["clients_accepted"] >= 4


def _torch_client_suite(port: int) -> None:
    c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    c.set("a", "1")
    assert c.get("a") == b"1"
    assert c.add("n", 5) == 5 and c.add("n", -2) == 3
    assert c.compare_set("a", "1", "2") == b"2"
    assert c.compare_set("missing", "x", "y") == b"x"
    assert c.compare_set("fresh", "", "v") == b"v"
    c.append("a", "+")
    c.multi_set(["m1", "m2"], ["x", "y"])
    assert c.multi_get(["a", "m1", "m2"]) == [b"2+", b"x", b"y"]
    assert c.check(["a", "m1"]) and not c.check(["nope"])
    assert c.delete_key("m2") and not c.delete_key("m2")
    assert sorted(c.list_keys()) == ["a", "fresh", "m1", "n"]
    assert c.num_keys() == 4
    c.queue_push("q", "1")
    assert c.queue_len("q") == 1 and c.queue_pop("q") == b"1"
    c.barrier("b", 1)
    c.set("text", "x")
    with pytest.raises(dist.DistError):
        c.add("text", 1)
    c2 = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError):
        c2.wait(["never"])
    assert c2.add("after-timeout", 1) == 1


def test_a_heartbeat_riding_with_a_batch_is_answered_in_one_write():
    """A link that was busy sends its heartbeat with its next batch (one write, so the
    store host reads both at once); the store host answers that read in one write too:
    the heartbeat's PONG and the ADD's REPLIES frame together (before: two writes)."""
    import asyncio

    from inproc import Client, linked

    from tierrun.core import StoreCore
    from tierrun.link.frames import PONG, REPLIES

    async def main():
        core = StoreCore()
        link, _ = await linked(core)
        conn = link._conn  # (the connection made by linked())
        reads = []
        deliver = conn.data_received

        def spy(data):
            reads.append(sealed_types(data))
            deliver(data)

        conn.data_received = spy
        link._beat_with_next_batch = True  # (as _beat does for a link busy in the last interval)
        client = Client()
        link.view().execute((Op.ADD, b"/steps", 1), client)
        for _ in range(20):
            await asyncio.sleep(0)
        assert client.replies == [struct.pack("<q", 1)]
        assert reads == [[PONG, REPLIES]]

    asyncio.run(main())


def test_the_handshake_is_one_flight_each_way():
    """After the store host's HELLO, a front-end sends AUTH, SESSION and its first ACK in
    one write: the store host reads them at once (one wake-up per link, not three), and
    the PONG that answers the ACK starts the watch lease."""
    import asyncio

    from inproc import Pipe, gate_of

    from tierrun.core import StoreCore
    from tierrun.tier import LinkUpstream
    from tierrun.link.frames import ACK, AUTH, SESSION
    from tierrun.hub.link_server import LinkServer
    from tierrun.hub.session import core_upstreams

    async def main():
        core = StoreCore()
        server = LinkServer(core_upstreams(core), b"tok", gate=gate_of(core), drop_watches=core.drop_watches_of)
        link = LinkUpstream(b"tok", on_lost=lambda reason: None)
        conn = link.connection()
        host = server.accept("test", sniffed=False)
        reads = []
        feed = host.data_received

        def spy(data):
            reads.append(data)
            feed(data)

        host.data_received = spy
        host.connection_made(Pipe(lambda: conn))
        conn.connection_made(Pipe(lambda: host))
        await asyncio.wait_for(link.ready, 5)
        for _ in range(5):
            await asyncio.sleep(0)
        assert reads[0] == bytes([LINK_MAGIC])
        (flight,) = reads[1:]
        auth_end = 4 + int.from_bytes(flight[:4], "little")  # (AUTH, then the sealed frames)
        assert [t for t, _ in FrameDecoder().feed(flight[:auth_end])] == [AUTH]
        assert sealed_types(flight[auth_end:]) == [SESSION, ACK]
        assert link.lease_left() > 2.0 and server.stats.links == 1

    asyncio.run(main())


def test_a_host_that_skips_welcome_is_refused():
    """The front-end takes RESUMED only after the store host proved it knows the token
    (WELCOME): a host that answers AUTH with RESUMED at once is refused."""
    import asyncio

    from inproc import Pipe

    from tierrun.tier import LinkUpstream
    from tierrun.link.frames import RESUMED, encode_count

    async def main():
        link = LinkUpstream(b"tok", on_lost=lambda reason: None)
        conn = link.connection()

        class FakeHost:
            def data_received(self, data):
                if data != bytes([LINK_MAGIC]):  # (AUTH, SESSION, ACK)
                    conn.data_received(encode_count(RESUMED, 0))

        conn.connection_made(Pipe(lambda: FakeHost()))
        conn.data_received(auth.hello(os.urandom(32)))
        with pytest.raises(LinkError, match="unexpected frame"):
            await asyncio.wait_for(conn.established, 5)

    asyncio.run(main())


def test_every_link_beats_on_the_same_ticks_of_the_wall_clock(monkeypatch):
    """Idle links' heartbeats fall on whole multiples of the interval of the wall clock,
    whenever each link was opened: they reach the store host together, which reads them
    in one wake-up instead of one each. (Links opened 70 ms apart, beating every 200 ms
    from their own start, could not all beat within 50 ms of the same ticks.) Each beats
    once per tick: a timer that fires a little before its tick (uvloop's timers have a
    millisecond's resolution) does not beat again at the tick. Run on uvloop, as the
    store and proxies are."""
    import asyncio

    from inproc import linked

    import uvloop

    from tierrun.core import StoreCore
    from tierrun.tier import LinkConnection
    from tierrun.link.config import LinkConfig

    beats = []
    ack = LinkConnection.ack

    def noted(self, after=b""):
        beats.append((self, time.time()))
        ack(self, after)

    monkeypatch.setattr(LinkConnection, "ack", noted)

    async def main():
        core, config = StoreCore(), LinkConfig(heartbeat_interval=0.2)
        for _ in range(3):
            await linked(core, config)
            await asyncio.sleep(0.07)
        beats.clear()  # (each link's ACK on connecting)
        await asyncio.sleep(2.1)

    uvloop.run(main())
    assert len(beats) >= 27
    off_tick = [min(t % 0.2, 0.2 - t % 0.2) for _, t in beats]
    assert max(off_tick) < 0.05, off_tick
    for conn in {conn for conn, _ in beats}:
        times = [t for c, t in beats if c is conn]
        assert min(b - a for a, b in zip(times, times[1:])) > 0.1, times  # one beat per tick


def test_a_silent_link_is_closed_when_its_timeout_runs_out():
    """The store host checks its links when the one heard from least recently would be
    overdue, not on a fixed tick: a link silent since t is closed at t + timeout (give or
    take a loop turn), one heard from since is kept until it falls silent in turn."""
    import asyncio

    from tierrun.link.config import LinkConfig
    from tierrun.hub.link_server import LinkServer

    closed = {}

    class Transport:
        def __init__(self, name):
            self.name, self.closing = name, False

        def write(self, data):
            pass

        def get_extra_info(self, name):
            return None

        def is_closing(self):
            return self.closing

        def abort(self):
            self.closing = True
            closed[self.name] = time.monotonic()

    async def main():
        server = LinkServer(lambda ns: None, b"tok", config=LinkConfig(heartbeat_timeout=0.3))
        silent = server.accept("silent")
        silent.connection_made(Transport("silent"))
        talking = server.accept("talking")
        talking.connection_made(Transport("talking"))
        for _ in range(6):
            await asyncio.sleep(0.1)
            talking.heartbeat.heard(time.monotonic())
        await asyncio.sleep(0.6)
        server.close()
        return silent.heartbeat.last_rx, talking.heartbeat.last_rx

    silent_since, talking_since = asyncio.run(main())
    assert 0.3 <= closed["silent"] - silent_since < 0.55
    assert 0.3 <= closed["talking"] - talking_since < 0.55


def test_a_lone_request_frame_is_answered_like_any_batch(caplog):
    """Most frames reaching the store host hold one request; it handles those in a
    short path of its own. Answers, failures and waits come out as from the general
    path: an ADD of a non-number fails that client only, a SET is answered by nothing,
    a GET sees it, a WAIT (left to the general path) waits; a lone request for an
    unknown client, or a malformed one, closes the link with the general path's reason."""
    import asyncio

    from inproc import Client, linked, settle, value

    from tierrun.core import StoreCore

    async def main():
        core = StoreCore()
        core.execute((Op.SET, b"/text", b"abc"), None)
        link, stats = await linked(core)
        view = link.view()
        bad, setter, getter, waiter = Client(), Client(), Client(), Client()
        view.execute((Op.ADD, b"/text", 1), bad)
        await settle()
        view.execute((Op.SET, b"/k", b"v"), setter)
        await settle()
        view.execute((Op.GET, b"/k"), getter)
        await settle()
        view.execute((Op.WAIT, (b"/later",)), waiter)
        await settle()
        assert bad.replies and bad.replies[0][0] == "dropped" and "not a number" in bad.replies[0][1]
        assert setter.replies == [] and getter.replies == [value(b"v")] and waiter.replies == []
        core.execute((Op.SET, b"/later", b"1"), None)
        await settle()
        assert waiter.replies == [b"\x00"] and stats.batches == 4 and stats.operations == 4
        return link

    link = asyncio.run(main())
    assert link.dead is None

    for entry, reason in [
        (entry_request(77, 1, encode_request((Op.GET, b"/k"))), "request for unknown client 77"),
        (entry_request(1, 1, encode_request((Op.GET, b"/k")) + b"!"), "a link entry must hold exactly one request"),
    ]:
        async def broken(entry=entry):
            link, _ = await linked(StoreCore())
            link.view().execute((Op.GET, b"/x"), Client())  # (opens client 1)
            await settle()
            link.send(encode_batch([entry]))
            await settle()

        caplog.clear()
        asyncio.run(broken())
        assert reason in caplog.text


def sealed_types(data: bytes) -> list[int]:
    """The types of the sealed frames in ``data`` (each followed by its MAC)."""
    types, pos = [], 0
    while pos < len(data):
        length, ftype = struct.unpack_from("<IB", data, pos)
        types.append(ftype)
        pos += 4 + length + 16
    return types


def test_a_waits_entry_past_the_store_budget_fails_that_wait_only():
    """A WAITS entry (one-key WAITs sent up together): one refused by the store's
    budget (keys waited for count as keys) is answered FAILED, its client alone closed
    by its front-end; before, the refusal escaped the batch and ended the node's
    session (fail-stop) with every client of the node."""
    import asyncio

    from tierrun.core import StoreCore
    from tierrun.hub.link_server import LinkServer
    from tierrun.hub.session import Session, core_upstreams
    from tierrun.link.frames import FAILED, OK, entry_waits
    from tierrun.protocol import Limits

    async def main():
        core = StoreCore(Limits(max_store_keys=2))
        session = Session(LinkServer(core_upstreams(core), b"tok"), b"sid", "test")
        session.execute(encode_batch([entry_open(1, b""), entry_waits(1, 1, [b"/a", b"/b", b"/c"])])[5:])
        replies = list(session._wakes)
        core.execute((Op.DELETE_KEY, b"/x"), None)
        return replies, sorted(session.clients[1].tickets), core

    replies, tickets, core = asyncio.run(main())
    assert [(rid, status) for rid, status, _ in replies] == [(3, FAILED)] and FAILED != OK
    assert b"--max-store-keys" in replies[0][2] and tickets == [1, 2] and core.num_waiters == 2
