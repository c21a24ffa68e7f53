"""LOOKUP: one key's value for a node of a store tree before its proxy starts
(``tier.lookup``, ``hub.lookup``), against a real `tierrun store` process: answered
once the key is set, in one read of the store host and with no session; refused
without the token; a forged answer is not believed; bad input closes that connection
only; a requester that leaves frees its WAIT. Over UDP first (``hub.lookup_datagrams``):
no answer without the token, PENDING then FOUND, TCP when UDP gives nothing."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time

import pytest
from test_budget_attacks import closed_by_server

from tierrun.client import StoreClient
from tierrun.core import StoreCore
from tierrun.hub import lookup_datagrams
from tierrun.link import auth
from tierrun.link.frames import ERROR, FOUND, LINK_MAGIC, LOOKUP, PENDING, FrameDecoder, LinkError, frame
from tierrun.server import StoreProcess
from tierrun.tier.lookup import read_over_udp, read_over_link

TOKEN = b"lookup-test"


@pytest.fixture
def host():
    """A tiered job's store host (links only on its public port) and a torch-protocol
    client of its own node's front-end."""
    s = StoreProcess(host="127.0.0.1", port=0, controlled=True, node_frontend_unix=f"@tierrun-lookup-{os.getpid()}",
                     env={**os.environ, "TIERRUN_TOKEN": TOKEN.decode()}, extra_args=["--links-only"])
    s.start()
    with StoreClient(("127.0.0.1", s.node_port), timeout=10) as c:
        yield s, c
    s.stop()


def exchange(port: int, data: bytes, timeout: float = 5.0) -> list[tuple[int, bytes]]:
    """Send ``data`` on a new connection; the frames received until the store host closes it."""
    frames = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        decoder = FrameDecoder(1 << 20)
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            frames += list(decoder.frames(chunk))
    return frames


def test_a_lookup_waits_for_its_key_and_takes_no_session(host):
    store, client = host
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(read_over_link(("127.0.0.1", store.port), TOKEN, b"/tree/1", 20)))
    t.start()
    time.sleep(0.5)
    assert not got and store.stats()["waiters"] == 1  # (it waits, at the store host)
    client.set(b"/tree/1", b"10.0.0.2:41234")
    t.join(10)
    assert got == [b"10.0.0.2:41234"]
    assert read_over_link(("127.0.0.1", store.port), TOKEN, b"/tree/1", 5) == b"10.0.0.2:41234"  # (set: at once)
    stats = store.stats()
    assert stats["lookups"] == 2 and stats["links_accepted"] == 0 and stats["waiters"] == 0


def test_a_wrong_token_is_refused_and_the_store_host_serves_on(host):
    store, client = host
    client.set(b"/tree/1", b"secret-ish")
    with pytest.raises(LinkError, match="wrong job token"):
        read_over_link(("127.0.0.1", store.port), b"another job", b"/tree/1", 5)
    request, _ = auth.lookup(TOKEN, b"/tree/1")  # a key swapped under a valid MAC
    tampered = request[:-1] + b"2"
    assert [f for f, _ in exchange(store.port, bytes([LINK_MAGIC]) + tampered)][-1] == ERROR
    assert read_over_link(("127.0.0.1", store.port), TOKEN, b"/tree/1", 5) == b"secret-ish"
    assert store.exited() is None and store.stats()["lookups"] == 1


def test_anything_after_a_lookup_or_an_oversized_one_closes_that_connection_only(host):
    store, client = host
    client.set(b"/tree/1", b"v")
    request, _ = auth.lookup(TOKEN, b"/later")  # (not set: it would wait)
    frames = exchange(store.port, bytes([LINK_MAGIC]) + request + frame(LOOKUP, b"x" * 70))
    assert [f for f, _ in frames][-1] == ERROR and b"nothing may follow a LOOKUP" in frames[-1][1]
    assert store.stats()["waiters"] == 0  # (its WAIT went with it)
    big, _ = auth.lookup(TOKEN, b"/" + b"k" * 8192)  # (past what an unauthenticated peer may send)
    assert FOUND not in [f for f, _ in exchange(store.port, bytes([LINK_MAGIC]) + big)]  # (closed, unread)
    assert read_over_link(("127.0.0.1", store.port), TOKEN, b"/tree/1", 5) == b"v"
    assert store.exited() is None


def test_a_replayed_lookup_holds_no_more_connections_open_than_a_handshake_may():
    """A LOOKUP waits as long as its key takes, but its connection still counts among its
    address's connections in their handshake (the oldest is closed past the cap), and a
    byte after it closes it: a recorded LOOKUP replayed cannot hold connections open by
    the hundred, nor one open by trickling bytes."""
    store = StoreProcess(host="127.0.0.1", port=0, controlled=True, extra_args=["--links-only"],
                         env={**os.environ, "TIERRUN_TOKEN": TOKEN.decode(), "TIERRUN_LINK_HANDSHAKES_PER_ADDRESS": "4"})
    store.start()
    try:
        request, _ = auth.lookup(TOKEN, b"/never/set")
        socks = []
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", store.port), timeout=5)
            sock.sendall(bytes([LINK_MAGIC]) + request)
            socks.append(sock)
            time.sleep(0.05)
        assert [closed_by_server(s, timeout=1.0) for s in socks] == [True] * 4 + [False] * 4
        socks[-1].sendall(b"\x00")  # (a byte after the LOOKUP)
        assert closed_by_server(socks[-1], timeout=1.0)
        for sock in socks:
            sock.close()
        assert store.exited() is None
    finally:
        store.stop()


def test_a_requester_that_leaves_frees_its_wait(host):
    store, _ = host
    request, _ = auth.lookup(TOKEN, b"/never")
    with socket.create_connection(("127.0.0.1", store.port)) as sock:
        sock.sendall(bytes([LINK_MAGIC]) + request)
        deadline = time.monotonic() + 5
        while store.stats()["waiters"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 5
    while store.stats()["waiters"] != 0:
        assert time.monotonic() < deadline, store.stats()
        time.sleep(0.05)


def test_a_replayed_lookup_gets_only_what_its_first_answer_showed(host):
    """Nothing is changed by a lookup, so a recorded one replays harmlessly: it reads
    the same key again, and its answer proves nothing to anyone without the token."""
    store, client = host
    client.set(b"/tree/1", b"10.0.0.2:1")
    request, nonce = auth.lookup(TOKEN, b"/tree/1")
    first = exchange(store.port, bytes([LINK_MAGIC]) + request)
    again = exchange(store.port, bytes([LINK_MAGIC]) + request)
    found = [p for f, p in first if f == FOUND]
    assert found and [p for f, p in again if f == FOUND] == found
    assert auth.check_found(TOKEN, nonce, found[0])[8:] == b"10.0.0.2:1"


def test_an_answer_that_does_not_prove_the_token_is_not_believed():
    """An impostor at the store host's address (a wrong address, a stale DNS record)
    cannot point a node at a relay of its choosing."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def impostor() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                answer = struct.pack("<Q", 14) + b"10.6.6.6:31337"
                conn.sendall(auth.hello(os.urandom(32)) + frame(FOUND, os.urandom(32) + answer))
                time.sleep(0.5)

        t = threading.Thread(target=impostor)
        t.start()
        with pytest.raises(LinkError, match="does not know the job token"):
            read_over_link(server.getsockname(), TOKEN, b"/tree/1", 5)
        t.join()


def test_a_lookup_at_a_relay_goes_up_its_link(host):
    """A relay (a proxy taking links) answers a LOOKUP as the store host does, through
    its own link: the WAIT and the GET go up, the answer comes down."""
    store, client = host
    relay = StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True,
                         env={**os.environ, "TIERRUN_TOKEN": TOKEN.decode()},
                         extra_args=["--upstream", f"127.0.0.1:{store.port}", "--link-listen", "127.0.0.1:0",
                                     "--connect-timeout", "10"])
    relay.start()
    try:
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(
            read_over_link(("127.0.0.1", relay.link_port), TOKEN, b"/tree/9", 20)))
        t.start()
        time.sleep(0.5)
        client.set(b"/tree/9", b"10.0.0.9:1")
        t.join(10)
        assert got == [b"10.0.0.9:1"] and relay.stats()["lookups"] == 1 and relay.exited() is None
    finally:
        relay.stop()


def test_a_lookup_key_over_the_stores_key_limit_is_refused():
    """The store's own key limit holds for a LOOKUP's key as for a request's."""
    s = StoreProcess(host="127.0.0.1", port=0, controlled=True,
                     env={**os.environ, "TIERRUN_TOKEN": TOKEN.decode()}, extra_args=["--max-key-bytes", "64"])
    s.start()
    try:
        request, _ = auth.lookup(TOKEN, b"/" + b"k" * 99)  # (over UDP: sent to TCP, which says why)
        assert [f for f, _ in udp_exchange(s.port, bytes([LINK_MAGIC]) + request)] == [ERROR]
        with pytest.raises(LinkError, match="a LOOKUP key of 100 bytes, over the store's 64"):
            read_over_link(("127.0.0.1", s.port), TOKEN, b"/" + b"k" * 99, 5)
        assert s.exited() is None and s.stats()["waiters"] == 0
    finally:
        s.stop()


# -- LOOKUPs over UDP (hub.lookup_datagrams) ------------------------------------------------


def udp_exchange(port: int, datagram: bytes, wait: float = 0.5) -> list[tuple[int, bytes]]:
    """Send one datagram to the store host's port; the frames of the datagrams that
    come back within ``wait`` seconds."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(datagram, ("127.0.0.1", port))
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 16)
            except (TimeoutError, ConnectionRefusedError):
                break
            out.append((data[4], data[5:]))
    return out


def test_a_lookup_goes_over_udp_first_and_waits_there_for_its_key(host):
    """The datagram path: PENDING while the key is not set (the requester keeps waiting
    on UDP, past the wait that would send it to TCP), FOUND once it is; no connection."""
    store, client = host
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(
        read_over_udp(("127.0.0.1", store.port), TOKEN, b"/tree/2", time.monotonic() + 20, None, 0.3)))
    t.start()
    time.sleep(1.0)  # (past the requester's 0.3 s: PENDING kept it on UDP)
    assert not got and store.stats()["waiters"] == 1
    client.set(b"/tree/2", b"10.0.0.3:1")
    t.join(10)
    assert got == [b"10.0.0.3:1"]  # (None would have meant: ask over TCP)
    assert read_over_udp(("127.0.0.1", store.port), TOKEN, b"/tree/2", time.monotonic() + 5, None, 0.5) \
        == b"10.0.0.3:1"
    stats = store.stats()
    assert stats["lookups"] == 2 and stats["links_accepted"] == 0 and stats["waiters"] == 0


def test_udp_datagrams_without_the_token_get_no_answer_and_harm_nothing(host):
    """Garbage, truncated, tampered, wrong-token and wrong-version datagrams: no answer
    (nothing to reflect), no waiter; the store host serves on, over UDP too."""
    store, client = host
    client.set(b"/tree/1", b"v1")
    request, _ = auth.lookup(TOKEN, b"/tree/1")
    wrong, _ = auth.lookup(b"another job", b"/tree/1")
    old = bytearray(request)
    old[5:7] = struct.pack("<H", 1)  # (another link version, under a MAC that no longer fits)
    for datagram in (b"", b"\x00", os.urandom(200), bytes([LINK_MAGIC]) + request[:-3],
                     bytes([LINK_MAGIC]) + request[:-1] + b"2", bytes([LINK_MAGIC]) + wrong,
                     bytes([LINK_MAGIC]) + bytes(old), bytes([LINK_MAGIC]) + os.urandom(9000)):
        assert udp_exchange(store.port, datagram, 0.2) == []
    assert store.stats()["waiters"] == 0 and store.exited() is None
    assert [f for f, _ in udp_exchange(store.port, bytes([LINK_MAGIC]) + request)] == [FOUND]


def test_a_wrong_token_over_udp_ends_in_tcp_s_refusal(host):
    """With no answer to its datagrams the requester asks over TCP, which says why."""
    store, client = host
    client.set(b"/tree/1", b"v1")
    assert read_over_udp(("127.0.0.1", store.port), b"another job", b"/tree/1",
                          time.monotonic() + 5, None, 0.3) is None
    t0 = time.monotonic()
    with pytest.raises(LinkError, match="wrong job token"):
        read_over_link(("127.0.0.1", store.port), b"another job", b"/tree/1", 5, udp_wait=0.3)
    assert time.monotonic() - t0 < 3


def test_a_value_too_large_for_a_datagram_comes_over_tcp(host):
    """An answer past twice the LOOKUP's size is refused on UDP (no amplification):
    the requester gets it over TCP."""
    store, client = host
    client.set(b"/big", b"x" * 3000)
    assert read_over_udp(("127.0.0.1", store.port), TOKEN, b"/big", time.monotonic() + 5, None, 0.5) is None
    assert read_over_link(("127.0.0.1", store.port), TOKEN, b"/big", 5) == b"x" * 3000


def test_a_resent_lookup_waits_once(host):
    store, client = host
    request, nonce = auth.lookup(TOKEN, b"/later")
    datagram = bytes([LINK_MAGIC]) + request
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        for _ in range(3):  # (resends: PENDING each time, one waiter)
            sock.sendto(datagram, ("127.0.0.1", store.port))
            data = sock.recv(4096)
            assert data[4] == PENDING
            auth.check_pending(TOKEN, nonce, data[5:])
        assert store.stats()["waiters"] == 1
        client.set(b"/later", b"10.0.0.4:1")
        data = sock.recv(4096)
        assert data[4] == FOUND and auth.check_found(TOKEN, nonce, data[5:])[8:] == b"10.0.0.4:1"
    assert store.stats()["waiters"] == 0


class _Sent:
    """A datagram transport that keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple]] = []

    def sendto(self, data: bytes, addr: tuple) -> None:
        self.sent.append((data, addr))

    def is_closing(self) -> bool:
        return False


def test_lookups_nobody_resends_are_forgotten_and_waiting_ones_are_bounded(monkeypatch):
    """In process, on a real core: a requester that went away (no resend within
    FORGET_AFTER) leaves no WAIT; past MAX_WAITING the oldest is forgotten."""
    monkeypatch.setattr(lookup_datagrams, "FORGET_AFTER", 0.1)
    monkeypatch.setattr(lookup_datagrams, "MAX_WAITING", 3)

    async def run() -> None:
        core = StoreCore()
        endpoint = lookup_datagrams.LookupDatagrams(TOKEN, core, 1024)
        transport = _Sent()
        endpoint.connection_made(transport)
        for i in range(5):
            request, _ = auth.lookup(TOKEN, b"/never/%d" % i)
            endpoint.datagram_received(bytes([LINK_MAGIC]) + request, ("127.0.0.1", 5000 + i))
        assert [d[4] for d, _ in transport.sent] == [PENDING] * 5
        assert core.num_waiters == 3  # (the two oldest forgotten)
        await asyncio.sleep(0.5)
        assert core.num_waiters == 0

    asyncio.run(run())


def test_a_store_whose_udp_port_is_taken_still_answers_over_tcp():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        port = squatter.getsockname()[1]
        s = StoreProcess(host="127.0.0.1", port=port, controlled=True,
                         env={**os.environ, "TIERRUN_TOKEN": TOKEN.decode()})
        s.start()
        try:
            with StoreClient(("127.0.0.1", s.port), timeout=10) as c:
                c.set(b"/tree/1", b"v")
            t0 = time.monotonic()
            assert read_over_link(("127.0.0.1", s.port), TOKEN, b"/tree/1", 5, udp_wait=0.3) == b"v"
            assert time.monotonic() - t0 < 3 and s.exited() is None
        finally:
            s.stop()


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"])
def test_a_lookup_before_the_store_host_is_up_is_refused_at_once_not_after_udp_wait(address):
    """Nothing listens on the store's port yet (a node that starts before node 0): the
    datagram's ICMP refusal ends the UDP attempt at once, and TCP's refusal reaches the
    caller, who retries; before, every retry waited out ``udp_wait`` first."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip(f"no {address} here")
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        read_over_link((address, port), TOKEN, b"/tree/1", 10, udp_wait=3.0)
    assert time.monotonic() - t0 < 1.0


def test_a_udp_lookup_uses_the_first_address_its_source_can_bind(host, monkeypatch):
    """A store host's name that resolves to IPv6 first, a requester with an IPv4
    ``source``: TCP (``socket.create_connection``) goes on to the IPv4 address; so does
    the datagram, instead of failing the launch with the bind's error."""
    store, client = host
    client.set(b"/tree/1", b"10.0.0.2:1")
    real = socket.getaddrinfo

    def resolve(host, port, family=0, type=0, proto=0, flags=0):
        if host != "storehost":
            return real(host, port, family, type, proto, flags)
        return [(socket.AF_INET6, type or socket.SOCK_STREAM, 0, "", ("::1", port, 0, 0)),
                (socket.AF_INET, type or socket.SOCK_STREAM, 0, "", ("127.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert read_over_link(("storehost", store.port), TOKEN, b"/tree/1", 5, udp_wait=0) == b"10.0.0.2:1"
    assert read_over_udp(("storehost", store.port), TOKEN, b"/tree/1", time.monotonic() + 5,
                         "127.0.0.1", 0.5) == b"10.0.0.2:1"
    assert read_over_link(("storehost", store.port), TOKEN, b"/tree/1", 5, "127.0.0.1") == b"10.0.0.2:1"


class _IcmpError:
    """A requester's UDP socket whose ``recv`` raises what Linux reports with IP_RECVERR
    for an ICMP error other than port unreachable (host unreachable; a firewall's
    ``REJECT --reject-with icmp-host-prohibited``, RHEL's and firewalld's default:
    EHOSTUNREACH)."""

    def __init__(self, sock: socket.socket, errno_: int) -> None:
        self._sock, self._errno = sock, errno_

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._sock.close()

    def recv(self, n: int) -> bytes:
        raise OSError(self._errno, os.strerror(self._errno))


@pytest.mark.parametrize("errno_name", ["EHOSTUNREACH", "ENETUNREACH", "EACCES"])
def test_an_icmp_error_other_than_a_refusal_on_udp_sends_the_lookup_to_tcp(host, monkeypatch, errno_name):
    """UDP filtered by a firewall that rejects with an ICMP error (host prohibited,
    admin prohibited, net unreachable): with IP_RECVERR on the requester's socket the
    kernel now reports it, and it must send the LOOKUP to TCP as the wait did before,
    not end the node's rendezvous (review: only ConnectionRefusedError was caught, so
    an OSError escaped read_over_link, which the caller does not retry)."""
    import errno

    from tierrun.tier import lookup

    store, client = host
    client.set(b"/tree/1", b"10.0.0.2:1")
    real = lookup._udp_socket

    def filtered(address, source):
        made = real(address, source)
        return None if made is None else (_IcmpError(made[0], getattr(errno, errno_name)), made[1])

    monkeypatch.setattr(lookup, "_udp_socket", filtered)
    t0 = time.monotonic()
    assert read_over_link(("127.0.0.1", store.port), TOKEN, b"/tree/1", 5, udp_wait=3.0) == b"10.0.0.2:1"
    assert time.monotonic() - t0 < 2.0  # (at once, as a refusal: not after udp_wait)
