"""Bad input closes one connection with a logged reason; the server carries on."""

import socket
import struct
import time

import pytest

from tierrun.client import StoreClient
from tierrun.link.frames import VERSION
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_handshake, encode_request
from tierrun.server import StoreProcess


def closed_by_server(sock, timeout=5.0):
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def wait_for_log(store, text, timeout=5.0):
    deadline = time.monotonic() + timeout
    while text not in store.output and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in store.output


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\x00" + struct.pack("<I", 0xBADBAD) + b"\x00" * 8, "VALIDATE magic"),
        (encode_handshake(1) + b"\x63", "unknown opcode 99"),
        (encode_handshake(1) + b"\x01" + struct.pack("<Q", 1 << 40), "key of"),
        (encode_handshake(1) + encode_request((Op.GET, b"k"))[:1] + struct.pack("<Q", 9000), "key of 9000"),
        (encode_handshake(1) + b"\x06" + struct.pack("<Q", 10**9), "keys in one request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "invalid request"),
    ],
)
def test_bad_input_closes_only_that_connection(store, payload, reason):
    good = StoreClient(("127.0.0.1", store.port))
    good.set(b"before", b"1")
    bad = socket.create_connection(("127.0.0.1", store.port))
    bad.sendall(payload)
    assert closed_by_server(bad)
    assert wait_for_log(store, reason)
    line = [l for l in store.output.splitlines() if reason in l][0]
    assert "127.0.0.1:" in line  # names the peer
    assert good.get(b"before") == b"1"
    assert good.add(b"after", 1) == 1


def test_silent_scanner_and_idle_connections_do_not_block_others(store):
    idle = [socket.create_connection(("127.0.0.1", store.port)) for _ in range(200)]
    try:
        with StoreClient(("127.0.0.1", store.port)) as c:
            assert c.add(b"k", 1) == 1
    finally:
        for s in idle:
            s.close()


def test_connection_cap():
    with StoreProcess(host="127.0.0.1", port=0, extra_args=["--max-connections", "3"]) as sp:
        keep = [StoreClient(("127.0.0.1", sp.port)) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", sp.port))
        assert closed_by_server(extra)
        assert wait_for_log(sp, "connections open (the limit: --max-connections)")
        keep[0].close()
        time.sleep(0.2)
        with StoreClient(("127.0.0.1", sp.port)) as c:
            assert c.add(b"k", 1) == 1


def test_client_that_never_reads_replies_is_throttled_not_buffered(store):
    hog = socket.create_connection(("127.0.0.1", store.port))
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with StoreClient(("127.0.0.1", store.port)) as c:
        c.set(b"big", b"x" * 1_000_000)
    request = encode_request((Op.GET, b"big"))
    hog.sendall(encode_handshake(1))
    hog.sendall(request * 2000)  # asks for 2 GB of replies, in one read, and never reads them
    time.sleep(0.5)
    with StoreClient(("127.0.0.1", store.port)) as c:
        assert c.add(b"alive", 1) == 1
    rss_kb = int(open(f"/proc/{store.pid}/status").read().split("VmRSS:")[1].split()[0])
    assert rss_kb < 400_000, f"store holds {rss_kb} kB for one slow client"
    hog.close()


def test_sigterm_stops_cleanly(store):
    assert store.stop() == 0


def test_five_thousand_idle_connections_do_not_starve_real_clients(store):
    """A connection flood that sends nothing: the store keeps answering the real clients
    promptly, and drops nothing of theirs."""
    idle = []
    try:
        for _ in range(5000):
            idle.append(socket.create_connection(("127.0.0.1", store.port)))
        with StoreClient(("127.0.0.1", store.port)) as c:
            t0 = time.monotonic()
            for i in range(100):
                assert c.add(b"k", 1) == i + 1
            assert time.monotonic() - t0 < 5
    finally:
        for s in idle:
            s.close()


@pytest.fixture
def linked_store():
    import os

    env = dict(os.environ, TIERRUN_TOKEN="bad-input-token")
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as root:
        with StoreProcess(command="proxy", host="127.0.0.1", port=0, env=env,
                          extra_args=["--upstream", f"127.0.0.1:{root.port}"]) as proxy:
            yield root, proxy


def _link_frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack("<IB", len(payload) + 1, ftype) + payload


@pytest.mark.parametrize(
    "payload, reason",
    [
        (_link_frame(2, struct.pack("<H", VERSION) + b"\x00" * 64), "wrong job token"),
        (_link_frame(2, b"\x00" * 66), "link version 0"),
        (_link_frame(5, b"\x00" * 8), "expected AUTH"),
        (struct.pack("<IB", 1 << 30, 2), "frame of 1073741824 bytes"),
        (struct.pack("<IB", 100_000, 2) + b"\x00" * 1000, "frame of 100000 bytes"),
        (struct.pack("<IB", 0, 2), "frame of 0 bytes"),
    ],
)
def test_garbage_on_the_link_port_closes_only_that_peer(linked_store, payload, reason):
    """Before authentication a peer may send only a small AUTH frame: a huge length is
    refused before anything is buffered for it."""
    root, proxy = linked_store
    bad = socket.create_connection(("127.0.0.1", root.port))
    bad.sendall(b"\xa7" + payload)
    assert closed_by_server(bad)
    assert wait_for_log(root, reason)
    with StoreClient(("127.0.0.1", proxy.port)) as c:  # the real link still works
        assert c.add(b"k", 1) >= 1
    assert root.stats()["links"] == 1


def test_truncated_link_frame_then_silence_is_dropped_by_the_heartbeat_timeout():
    import os

    env = dict(os.environ, TIERRUN_TOKEN="t", TIERRUN_LINK_TIMEOUT="1", TIERRUN_LINK_HEARTBEAT="0.2")
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as root:
        bad = socket.create_connection(("127.0.0.1", root.port))
        bad.sendall(b"\xa7" + struct.pack("<IB", 67, 2) + b"\x00" * 10)  # AUTH, cut short
        assert closed_by_server(bad, timeout=5)
        assert wait_for_log(root, "nothing heard for 1 s")
