"""Attacks on node links, with real `tierrun store` and `tierrun proxy` processes and
adversarial clients on raw sockets: a man in the middle (``relay.Relay``) that forges,
replays and injects frames or answers as an impostor; link-looking connections that
never finish their handshake. Each time an unrelated client must keep being served.

Short link timings through the environment, as the launcher passes them."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from relay import GARBAGE, IMPOSTOR, FORWARD, Relay, forged
from tierrun.client import StoreClient
from tierrun.link.frames import BATCH, ERROR, LINK_MAGIC, encode_batch, entry_request
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_request
from tierrun.server import StoreProcess

TIMING = {"TIERRUN_TOKEN": "link-attacks", "TIERRUN_LINK_HEARTBEAT": "0.2", "TIERRUN_LINK_TIMEOUT": "1",
          "TIERRUN_LINK_GRACE": "8"}


def store(*extra: str, **env: str) -> StoreProcess:
    s = StoreProcess(host="127.0.0.1", port=0, controlled=True, env={**os.environ, **TIMING, **env},
                     extra_args=list(extra))
    s.start()
    return s


def proxy(port: int, source: str | None = None, **env: str) -> StoreProcess:
    p = StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True,
                     env={**os.environ, **TIMING, **env},
                     extra_args=["--upstream", f"127.0.0.1:{port}", "--connect-timeout", "10"]
                     + (["--link-source", source] if source else []))
    p.start()
    return p


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))


def wait_for(predicate, timeout: float, output: Callable[[], str] = lambda: "") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out\n" + output()[-3000:]
        time.sleep(0.05)


@pytest.fixture
def relayed():
    """The store host, a relay in front of it, a proxy linked through the relay, a client
    of the proxy and an unrelated client of the store host."""
    root = store()
    relay = Relay(("127.0.0.1", root.port))
    node = proxy(relay.port)
    try:
        yield root, relay, node, client(node.port), StoreClient(("127.0.0.1", root.port))
    finally:
        node.stop()
        relay.close()
        root.stop()


def test_a_replayed_batch_is_not_applied_twice_and_the_node_resumes(relayed):
    """The relay sends the store host a BATCH it saw (an ADD) a second time: it fails its
    MAC (frames are numbered per connection), the store host drops that connection only
    and keeps the session; the node resumes, and the ADD counted once."""
    root, relay, node, c, other = relayed
    assert c.add("n", 5) == 5
    wait_for(lambda: relay.last_batch is not None, 5)
    relay.inject(relay.last_batch, upward=True)
    wait_for(lambda: "fails its MAC" in root.output, 5)
    assert other.add(b"unrelated", 1) == 1  # (served meanwhile)
    assert c.add("n", 1) == 6  # once resumed: 5 + 1, not 5 + 5 + 1
    stats = root.stats()
    assert stats["sessions_expired"] == 0 and stats["link_resumes"] == 1 and node.exited() is None


def test_a_forged_batch_is_dropped_before_it_reaches_the_store(relayed):
    """A well-formed BATCH with a wrong MAC (an attacker without the session's keys)
    is never executed."""
    root, relay, node, c, other = relayed
    assert c.add("n", 1) == 1
    request = encode_request((Op.SET, b"/forged", b"by the relay"))
    relay.inject(forged(BATCH, encode_batch([entry_request(1, 9999, request)])[5:]), upward=True)
    wait_for(lambda: "fails its MAC" in root.output, 5)
    assert c.add("n", 1) == 2
    assert not other.check([b"/forged"]) and root.stats()["sessions_expired"] == 0


def test_a_forged_error_towards_the_node_costs_it_one_reconnect(relayed):
    """An ERROR frame injected towards the node ("the store host ended the link
    session": before, the node gave up for good) fails its MAC: the node drops that
    connection, reconnects and resumes; its clients see only latency."""
    root, relay, node, c, other = relayed
    assert c.add("n", 1) == 1
    relay.inject(forged(ERROR, b"the store host ended the link session"), upward=False)
    wait_for(lambda: "fails its MAC" in node.output, 5)
    assert c.add("n", 1) == 2 and other.add(b"n2", 1) == 1
    assert node.exited() is None and root.stats()["link_resumes"] == 1


def test_a_reconnecting_node_ignores_impostors_until_the_store_host_is_back(relayed):
    """The link is cut; for ~2 s every new connection reaches an impostor (an unsealed
    ERROR after HELLO: what a store host without the session says, but unproved) or
    garbage. The node keeps trying, then resumes with the real store host: its pending
    ADD is applied once."""
    root, relay, node, c, other = relayed
    assert c.add("n", 1) == 1
    relay.mode = IMPOSTOR
    relay.cut()
    results = []
    adder = threading.Thread(target=lambda: results.append(c.add("n", 1)))
    adder.start()  # (waits for the link)
    wait_for(lambda: relay.impostors >= 2, 5)
    relay.mode = GARBAGE
    wait_for(lambda: relay.impostors >= 4, 5)
    assert other.add(b"unrelated", 1) == 1
    relay.mode = FORWARD
    adder.join(15)
    assert results == [2] and node.exited() is None
    assert "refused the link: this store host does not know" in node.output  # (logged, not believed)
    assert "frame of 4294967295 bytes" in node.output
    stats = root.stats()
    assert stats["sessions_expired"] == 0 and stats["link_resumes"] == 1


def test_a_node_facing_only_impostors_gives_up_after_its_grace_period():
    """Trying again has an end: past the grace period (2 s here) the node gives up and
    says what its last attempt met."""
    root = store(TIERRUN_LINK_GRACE="2")
    relay = Relay(("127.0.0.1", root.port))
    node = proxy(relay.port, TIERRUN_LINK_GRACE="2")
    try:
        relay.mode = IMPOSTOR
        t0 = time.monotonic()
        relay.cut()
        wait_for(lambda: node.exited() is not None, 10)
        assert 1.5 < time.monotonic() - t0 < 6
        assert node.exited() == 3
        assert "not back within the 2 s grace period (last attempt: Unauthenticated" in node.last_error()
    finally:
        node.stop()
        relay.close()
        root.stop()


def _linkish(source: str, port: int) -> socket.socket:
    """A connection from ``source`` that looks like a link (its first byte)."""
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    s.sendall(bytes([LINK_MAGIC]))
    return s


def _closed(s: socket.socket, timeout: float) -> bool:
    """Whether the store host closed ``s`` within ``timeout`` (reading past its HELLO)."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_link_handshakes_are_bounded_in_time_and_per_source_address():
    """Connections that begin like a link and then trickle a byte every 0.2 s (a
    slow-loris that never authenticates): at most 3 per source address at once (a 4th
    closes the oldest; another address is not affected), and each is closed 1 s after
    it connected, however it trickles. A linked node and a torch client keep going."""
    root = store(TIERRUN_LINK_HANDSHAKE_TIMEOUT="1", TIERRUN_LINK_HANDSHAKES_PER_ADDRESS="3")
    node = proxy(root.port)
    try:
        c, other = client(node.port), StoreClient(("127.0.0.1", root.port))
        first = _linkish("127.0.1.7", root.port)
        time.sleep(0.1)  # (accepted in this order)
        attackers = [_linkish("127.0.1.7", root.port) for _ in range(3)]
        t0 = time.monotonic()
        assert _closed(first, 1.0)  # the oldest from that address, for the 4th
        wait_for(lambda: "from 127.0.1.7 in their handshake" in root.output, 5)
        elsewhere = _linkish("127.0.1.8", root.port)
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.2):
                for s in attackers:
                    try:
                        s.send(b"\x00")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        try:
            assert c.add("n", 1) == 1 and other.add(b"m", 1) == 1
            assert all(_closed(s, 3.0) for s in attackers)
            assert 0.8 < time.monotonic() - t0 < 2.5
            assert _closed(elsewhere, 3.0)
        finally:
            stop.set()
        wait_for(lambda: "no link session within 1 s of connecting" in root.output, 5)
        assert c.add("n", 1) == 2 and other.add(b"m", 1) == 2
        assert root.stats()["links"] == 1 and node.exited() is None
    finally:
        node.stop()
        root.stop()


def test_stalled_handshakes_from_a_nodes_address_do_not_keep_its_link_out():
    """Another process on a node holds every handshake slot of the node's address
    (connections that never authenticate, renewed as they time out) when the node's
    link drops: the node's reconnection closes the oldest of them and resumes."""
    root = store(TIERRUN_LINK_HANDSHAKE_TIMEOUT="30", TIERRUN_LINK_HANDSHAKES_PER_ADDRESS="4")
    node = proxy(root.port, source="127.0.1.9")
    try:
        c = client(node.port)
        assert c.add("n", 1) == 1
        squatters = [_linkish("127.0.1.9", root.port) for _ in range(4)]
        for s in squatters:  # (a frame of 4,000 bytes begins, trickled a byte at a time)
            s.sendall((4000).to_bytes(4, "little"))
        stop = threading.Event()

        def trickle():  # (a byte now and then: not silent, never authenticated)
            while not stop.wait(0.2):
                for s in squatters:
                    try:
                        s.send(b"\x00")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        os.kill(node.pid, signal.SIGSTOP)  # its link goes silent: the store host drops it
        wait_for(lambda: "nothing heard for" in root.output, 15)
        os.kill(node.pid, signal.SIGCONT)  # and the node reconnects, from its address
        assert c.add("n", 1) == 2
        assert _closed(squatters[0], 5.0)
        wait_for(lambda: "resumed" in node.output, 5)
        assert node.exited() is None
        assert not any(_closed(s, 0.5) for s in squatters[1:])  # (the others wait their deadline)
        stop.set()
    finally:
        try:
            os.kill(node.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        node.stop()
        root.stop()


def test_link_looking_connections_count_against_max_connections():
    """With --max-connections 3 and one node linked, two connections that begin like a
    link fill the store: a torch client is refused until their handshake deadline
    closes them, then served."""
    root = store("--max-connections", "3", TIERRUN_LINK_HANDSHAKE_TIMEOUT="1")
    node = proxy(root.port)
    try:
        c = client(node.port)
        holders = [_linkish("127.0.0.1", root.port) for _ in range(2)]
        refused = socket.create_connection(("127.0.0.1", root.port))
        assert _closed(refused, 1.0)
        wait_for(lambda: "3 connections open (the limit: --max-connections)" in root.output, 5)
        assert all(_closed(s, 3.0) for s in holders)
        other = StoreClient(("127.0.0.1", root.port))  # room again
        assert other.add(b"m", 1) == 1 and c.add("n", 1) == 1
    finally:
        node.stop()
        root.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_silent_connections_to_a_links_only_port_are_bounded_like_handshakes(workers):
    """A tiered store host's public port takes links only, but a connection that sent
    nothing yet was a client-to-be: no deadline, no cap per address. 8 silent
    connections from one address (--max-connections 8) kept every node's link out for
    good. Now they are handshakes from the start: at most TIERRUN_LINK_HANDSHAKES_PER_ADDRESS
    from one address (a new one closes the oldest), each closed after
    TIERRUN_LINK_HANDSHAKE_TIMEOUT; a node links meanwhile. With --workers 2 the
    front-end processes hand them over to the store's process at once."""
    root = store("--links-only", "--max-connections", "8", "--workers", workers,
                 TIERRUN_LINK_HANDSHAKE_TIMEOUT="1", TIERRUN_LINK_HANDSHAKES_PER_ADDRESS="4")
    try:
        silent = [socket.create_connection(("127.0.0.1", root.port), source_address=("127.0.1.7", 0))
                  for _ in range(8)]
        time.sleep(0.2)
        node = proxy(root.port)
        try:
            c = client(node.port)
            assert c.add("n", 1) == 1
            assert all(_closed(s, 5.0) for s in silent)
            # (with --workers 2 the store's process also counts its front-end processes' links:
            # some of the 8 may be refused at --max-connections before the cap per address;
            # and the front-end processes hand them over as they get to it: on a loaded
            # machine so slowly that fewer than the cap wait at once, closed at their deadline)
            reasons = ["from 127.0.1.7 in their handshake", "link connections open (the limit)"]
            if workers == "2":
                reasons.append("no link session within 1 s of connecting")
            wait_for(lambda: any(r in root.output for r in reasons), 5, lambda: root.output)
            torch_client = socket.create_connection(("127.0.0.1", root.port))
            torch_client.sendall(b"\x00\xce\xf7\x85\x3c")  # (a torch client's VALIDATE: refused, saying why)
            assert _closed(torch_client, 3.0)
            wait_for(lambda: "a torch-protocol client, refused" in root.output, 5)
            assert c.add("n", 1) == 2 and root.stats()["links"] == 1
        finally:
            node.stop()
    finally:
        root.stop()


def test_a_proxy_refuses_what_the_store_host_would():
    """The store host started with --max-value-bytes 1000, the proxy with the defaults:
    the proxy learns the store's limits when it links, and refuses a 2000-byte SET
    itself (that client only; before, it went up the link)."""
    root = store("--max-value-bytes", "1000")
    node = proxy(root.port)
    try:
        greedy, c = StoreClient(("127.0.0.1", node.port)), client(node.port)
        greedy.set(b"big", b"x" * 2000)
        with pytest.raises(Exception):
            greedy.ping()  # closed
        wait_for(lambda: "value of 2000 bytes exceeds the limit of 1000" in node.output, 5)
        assert c.add("n", 1) == 1 and root.stats()["link_operations"] <= 2
        assert "invalid request" not in root.output
    finally:
        node.stop()
        root.stop()
