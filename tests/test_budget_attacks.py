"""Greedy and hostile clients with legal requests against real ``tierrun store`` and
``tierrun proxy`` processes (issue 33, items 1 and 6): each attack by an adversarial
client while an unrelated torch client keeps being served; the store host's peak RSS
stays within its budgets plus a fixed overhead, its links to the nodes stay up, and the
adversary alone is closed (or held back, for one that does not read), with the reason
logged, as torch's server closes a client whose request fails."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierrun.client import StoreClient
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_handshake, encode_request
from tierrun.server import StoreProcess

ENV = dict(os.environ, TIERRUN_TOKEN="budget-attacks-test")
MiB = 1 << 20


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


def closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Read (and discard) until the server closes; False if it did not within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def wait_for_log(proc: StoreProcess, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in proc.output and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in proc.output.splitlines() if text in line]
    assert lines, f"no {text!r} in the output of tierrun {proc.command_name}:\n{proc.output[-3000:]}"
    return lines[0]


class Node:
    """A store host, and (tiered) a node proxy linked to it: ``port`` is where clients go."""

    def __init__(self, tiered: bool, store_args: tuple[str, ...] = (), proxy_args: tuple[str, ...] = ()) -> None:
        self.root = StoreProcess(host="127.0.0.1", port=0, controlled=True, env=ENV, extra_args=list(store_args))
        self.root.start()
        self.proxy = None
        if tiered:
            self.proxy = StoreProcess(host="127.0.0.1", port=0, command="proxy", env=ENV, controlled=True,
                                      extra_args=["--upstream", f"127.0.0.1:{self.root.port}", *proxy_args])
            self.proxy.start()
        self.front = self.proxy or self.root
        self.port = self.front.port

    def torch_client(self) -> dist.TCPStore:
        """A well-behaved client; it counts in a key of its own, there from the start (a
        store whose budget of keys an attack spent takes no new key, from anyone)."""
        c = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=20))
        c.add("bystander", 1)
        return c

    def still_served(self, bystander: dist.TCPStore) -> None:
        """Everything but the adversary is up: the bystander, the node's link, both processes."""
        before = bystander.add("bystander", 1)
        assert bystander.add("bystander", 1) == before + 1
        assert self.root.exited() is None and (self.proxy is None or self.proxy.exited() is None)
        stats = self.root.stats()
        if self.proxy is not None:
            assert (stats["links"], stats["sessions_expired"], stats["link_resumes"]) == (1, 0, 0)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.root.stop()


@pytest.fixture(params=[False, True], ids=["flat", "tiered"])
def node(request):
    n = Node(request.param)
    yield n
    n.close()


def send_until_closed(sock: socket.socket, data: bytes) -> None:
    """Send ``data``; the server may close the connection before it is all sent."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def round_trips(bystander: dist.TCPStore, seconds: float) -> list[float]:
    """The bystander's ADD round trips, one every 20 ms for ``seconds``."""
    rtts = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        bystander.add("ticks", 1)
        rtts.append(time.monotonic() - t0)
        time.sleep(0.02)
    return rtts


def adversary(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(encode_handshake(1))
    sock.settimeout(20)
    assert sock.recv(4, socket.MSG_WAITALL) == b"\x01\x00\x00\x00"  # (the PING's answer)
    return sock


def test_a_22_kb_multi_get_of_2000_copies_of_a_1_mib_value(node):
    """Issue 33's first symptom: the answer (2 GiB) is measured before it is built."""
    bystander = node.torch_client()
    bystander.set("v", b"x" * MiB)
    assert bystander.check(["v"])  # (a SET has no answer: this one's is in)
    hog = adversary(node.port)
    request = encode_request((Op.MULTI_GET, (b"/v",) * 2000))
    assert len(request) < 22_000
    hog.sendall(request)
    assert closed_by_server(hog), node.front.output
    line = wait_for_log(node.front, "MULTI_GET failed")
    assert "its answer would be 2,097,168,000 bytes, past the limit (--max-reply-bytes)" in line
    assert bystander.get("v") == b"x" * MiB
    node.still_served(bystander)
    assert peak_rss_mb(node.root.pid) < 150


@pytest.mark.solo
def test_300_pipelined_gets_of_a_1_mib_value_through_a_proxy_by_a_client_that_never_reads():
    """Issue 33's second symptom: the proxy sends a client's next request up only while
    what it owes the client (each GET counted at a value's size) is small, so the store
    host holds next to nothing for it, and the node's link never fills up."""
    n = Node(tiered=True)
    try:
        bystander = n.torch_client()
        bystander.set("big", b"x" * MiB)
        assert bystander.check(["big"])
        hog = adversary(n.port, rcvbuf=4096)
        before = n.proxy.stats()["upstream_ops"]
        hog.sendall(encode_request((Op.GET, b"/big")) * 300)
        rtts = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            t = time.monotonic()
            bystander.add(f"rtt{len(rtts)}", 1)
            rtts.append(time.monotonic() - t)
            time.sleep(0.05)
        assert max(rtts) < 1.0, rtts
        gets_sent_up = n.proxy.stats()["upstream_ops"] - before - len(rtts)
        assert gets_sent_up < 30  # (of 300: those whose answers the sockets' buffers took)
        n.still_served(bystander)
        assert peak_rss_mb(n.root.pid) < 150
        assert peak_rss_mb(n.proxy.pid) < 200
        hog.close()
    finally:
        n.close()


@pytest.mark.parametrize("budget, key_size, value_size, flag", [
    ("--max-store-bytes=32000000", 16, MiB, "--max-store-bytes"),
    ("--max-store-keys=2000", 16, 8, "--max-store-keys"),
])
@pytest.mark.parametrize("tiered", [False, True], ids=["flat", "tiered"])
def test_sets_past_the_store_budget_close_their_client_only(tiered, budget, key_size, value_size, flag):
    """SETs have no answer: one past the budget is refused and its client closed (so
    its next request fails, as with torch's server); other clients read and write on."""
    n = Node(tiered, store_args=(budget,))
    try:
        bystander = n.torch_client()
        bystander.set("counter", "1")
        assert bystander.check(["counter"])
        hog = adversary(n.port)
        sets = b"".join(encode_request((Op.SET, b"%0*d" % (key_size, i), b"v" * value_size)) for i in range(4000)
                        if i * (key_size + value_size) < 40_000_000)
        send_until_closed(hog, sets + encode_request((Op.GET, b"0")))
        assert closed_by_server(hog)
        line = wait_for_log(n.front, "SET failed")
        assert flag in line and "store holds" in line
        assert bystander.add("counter", 1) == 2  # (a write that fits is taken)
        assert bystander.get("counter") == b"2"
        stats = n.root.stats()
        assert stats["budget_refused"] >= 1
        assert stats["store_bytes"] <= 32_000_000 and stats["store_entries"] <= 4000
        n.still_served(bystander)
        assert peak_rss_mb(n.root.pid) < 200
    finally:
        n.close()


@pytest.mark.solo
def test_a_flood_of_sets_through_a_proxy_waits_for_the_link_instead_of_overflowing_it():
    """SETs have no answer, so nothing bounds them but the link: a client pipelining
    200 MiB of them waits (it is not read) while the node's link has more than 16 MiB
    sent and not acknowledged; before, the proxy buffered them all and the link's
    resend buffer overflowed: the node was lost. Every SET is applied."""
    n = Node(tiered=True)
    try:
        bystander = n.torch_client()
        hog = adversary(n.port)
        value = b"v" * MiB
        flood = threading.Thread(target=send_until_closed, daemon=True, args=(
            hog, b"".join(encode_request((Op.SET, b"/flood/%d" % i, value)) for i in range(200))))
        flood.start()
        rtts = []
        while flood.is_alive() and len(rtts) < 10_000:
            t = time.monotonic()
            bystander.add("ticks", 1)
            rtts.append(time.monotonic() - t)
            time.sleep(0.01)
        flood.join(60)
        hog.sendall(encode_request((Op.CHECK, (b"/flood/199",))))
        hog.settimeout(20)
        assert hog.recv(1) == b"\x00"  # (READY: all 200 in)
        assert max(rtts) < 5.0, rtts
        assert n.root.stats()["store_bytes"] >= 200 * MiB
        n.still_served(bystander)
        assert peak_rss_mb(n.proxy.pid) < 160  # (~90 MB; it held all 200 MiB before: ~260 MB)
    finally:
        n.close()


def test_appends_past_the_value_limit_close_their_client_only(node):
    """APPEND copies the whole value each time: its result is held to the value limit
    (8 MiB), where torch's server lets it grow without end."""
    bystander = node.torch_client()
    hog = adversary(node.port)
    send_until_closed(hog, encode_request((Op.APPEND, b"/grow", b"a" * MiB)) * 40 + encode_request((Op.GET, b"/grow")))
    assert closed_by_server(hog)
    line = wait_for_log(node.front, "APPEND failed")
    # (the 9th MiB past the value limit; a proxy never merges APPENDs)
    assert "the value of key b'/grow' would be" in line and "past the limit (--max-value-bytes) of 8,388,608" in line
    assert bystander.get("grow") == b"a" * 8 * MiB
    node.still_served(bystander)
    assert peak_rss_mb(node.root.pid) < 200


@pytest.mark.solo
def test_long_scans_never_stall_the_store_host_past_the_link_heartbeat_timeout():
    """Clients listing 400,000 keys over and over: full scans get at most half the store
    host's time (those past it are refused, their clients closed), so a node's link
    never goes silent and the bystander is answered within a second or so."""
    n = Node(tiered=True)
    try:
        with StoreClient(("127.0.0.1", n.root.port)) as c:
            for part in range(4):
                keys = tuple(b"/scan/%d/%06d" % (part, i) for i in range(100_000))
                c.multi_set(list(keys), [b""] * len(keys))
            assert c.num_keys() == 400_000
        bystander = n.torch_client()
        stop = threading.Event()
        refused = []

        answer = 8 + 400_000 * (8 + 14)  # (keys of 14 bytes)
        buffer = bytearray(1 << 20)

        def scan_forever() -> None:  # (reads each answer whole, and asks again)
            while not stop.is_set():
                sock = adversary(n.root.port)
                try:
                    while not stop.is_set():
                        sock.sendall(encode_request((Op.LIST_KEYS,)))
                        left = answer
                        while left:
                            got = sock.recv_into(buffer, min(left, len(buffer)))
                            if not got:
                                raise ConnectionResetError
                            left -= got
                except (ConnectionResetError, BrokenPipeError):
                    refused.append(1)  # (refused: closed; it comes back)
                finally:
                    sock.close()

        scanners = [threading.Thread(target=scan_forever, daemon=True) for _ in range(3)]
        for t in scanners:
            t.start()
        rtts = round_trips(bystander, 5)
        stop.set()
        for t in scanners:
            t.join(30)
        assert refused, "no scan was refused"
        wait_for_log(n.root, "have taken their share of its time")
        assert max(rtts) < 4.0, f"the store host stalled {max(rtts):.1f} s (the link's heartbeat timeout: 5 s)"
        n.still_served(bystander)
    finally:
        n.close()


@pytest.mark.solo
def test_clients_pipelining_without_pause_do_not_starve_the_links_or_other_clients():
    """Two clients, one at the store host and one at the node's proxy, each pipelining
    tiny requests without pause (1 MiB of CHECKs at a time) and reading every answer:
    each gets its turn of the event loop, not the whole loop, so the node's link keeps
    its heartbeat and the bystander is answered at once. (Served a whole read at a time,
    such a flood kept the store host's loop for seconds: the proxies lost their link to
    it and exited, and a bystander waited 26 s.)"""
    n = Node(tiered=True)
    try:
        bystander = n.torch_client()
        stop = threading.Event()
        blob = encode_request((Op.CHECK, (b"/x",))) * ((1 << 20) // 19)
        answered = []

        def flood(port: int) -> None:
            sock = adversary(port)
            reader = threading.Thread(target=lambda: answered.append(sum(iter(lambda: len(sock.recv(1 << 16)), 0))),
                                      daemon=True)
            reader.start()
            try:
                while not stop.is_set():
                    sock.sendall(blob)
            finally:
                sock.shutdown(socket.SHUT_WR)
                reader.join(30)
                sock.close()

        flooders = [threading.Thread(target=flood, args=(port,), daemon=True) for port in (n.root.port, n.port)]
        for t in flooders:
            t.start()
        rtts = round_trips(bystander, 8)
        stop.set()
        for t in flooders:
            t.join(60)
        assert len(answered) == 2 and min(answered) > 100_000, answered  # (answers of a byte: both were served)
        # (a bystander's request crosses three processes that share this machine's 2 cores
        # with both floods: under a second each alone, up to ~2 s with both)
        assert max(rtts) < 4.0, f"the bystander waited {max(rtts):.1f} s (the link's heartbeat timeout: 5 s)"
        n.still_served(bystander)
    finally:
        n.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["flat", "tiered"])
def test_unfinished_requests_past_the_budget_close_the_one_parked_longest(tiered):
    """Clients that each send most of a large SET and stop (the store host holds what
    came, to finish the request later): their bytes count against one budget per
    process (--max-unfinished-bytes); when one more takes the total past it, the one
    parked longest is closed, with the reason logged; the others, and a bystander,
    are served."""
    limits = ("--max-value-bytes", str(4 * MiB), "--max-request-bytes", str(8 * MiB),
              "--max-reply-bytes", str(5 * MiB), "--max-unread-bytes", str(7 * MiB),
              "--max-unfinished-bytes", str(10 * MiB))
    n = Node(tiered, limits, proxy_args=limits)  # (the proxy's own budgets, as the store host's)
    try:
        bystander = n.torch_client()
        whole = encode_request((Op.SET, b"/big", b"v" * (4 * MiB)))
        part, rest = whole[: 3 * MiB + MiB // 2], whole[3 * MiB + MiB // 2:]
        held = []
        for _ in range(2):  # (7 MiB held: within the budget)
            sock = adversary(n.port)
            sock.sendall(part)
            held.append(sock)
        time.sleep(0.5)
        third = adversary(n.port)
        third.sendall(part)
        assert closed_by_server(held[0])
        assert "--max-unfinished-bytes" in wait_for_log(n.front, "unfinished request")
        for sock in (held[1], third):  # (still open: they may finish their requests)
            sock.sendall(rest + encode_request((Op.PING, 9)))
            assert sock.recv(4, socket.MSG_WAITALL) == b"\t\x00\x00\x00"
        n.still_served(bystander)
    finally:
        n.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["flat", "tiered"])
def test_waits_on_many_missing_keys_count_against_the_store_budget(tiered):
    """A WAIT on 131,072 missing keys is a 2 MiB request, but the store holds a
    registration per key while it waits (~40 MB at the store host, more through a
    proxy: a ticket per key): 25 such clients took 1 GB, whatever the store's budgets.
    Keys waited for count as keys while they are waited for: the WAIT that passes the
    budget is refused (its client closed), a bystander's WAIT and writes go on."""
    n = Node(tiered, store_args=("--max-store-keys=300000",))
    try:
        bystander = n.torch_client()
        hogs = []
        closed = 0
        for c in range(6):
            hog = adversary(n.port)
            send_until_closed(hog, encode_request((Op.WAIT, tuple(b"/%d/%06d" % (c, i) for i in range(128 * 1024)))))
            hog.settimeout(1)
            try:
                if hog.recv(1) == b"":
                    closed += 1
            except socket.timeout:
                pass  # (waiting: within the budget)
            except ConnectionResetError:
                closed += 1
            hogs.append(hog)
        assert closed >= 4, n.front.output[-3000:]
        assert "--max-store-keys" in wait_for_log(n.front, "WAIT failed")
        waiter = dist.TCPStore("127.0.0.1", n.port, is_master=False, timeout=timedelta(seconds=20))
        woken = threading.Thread(target=waiter.wait, args=(["go"],), daemon=True)
        woken.start()
        time.sleep(0.2)
        bystander.set("go", "1")
        woken.join(20)
        assert not woken.is_alive()
        n.still_served(bystander)
        assert peak_rss_mb(n.root.pid) < 250
        for hog in hogs:
            hog.close()
    finally:
        n.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["flat", "tiered"])
def test_parked_small_unfinished_requests_do_not_get_a_large_request_closed(tiered):
    """Clients that each park just under 1 MiB of a request and stop were never closed
    (only a connection holding over 1 MiB was), so a dozen of them filled the budget of
    unfinished requests and the next client to send a large value, a well-behaved one,
    was closed in their place. Past the budget, the requests that have waited longest
    go: the parked ones, not the one arriving now."""
    limits = ("--max-value-bytes", str(4 * MiB), "--max-request-bytes", str(8 * MiB),
              "--max-reply-bytes", str(5 * MiB), "--max-unread-bytes", str(7 * MiB),
              "--max-unfinished-bytes", str(10 * MiB))
    n = Node(tiered, limits, proxy_args=limits)  # (the proxy's own budgets, as the store host's)
    try:
        bystander = n.torch_client()
        parked = []
        for _ in range(12):  # (12 x ~1 MiB: past the 10 MiB budget, each under 1 MiB)
            sock = adversary(n.port)
            sock.sendall(encode_request((Op.SET, b"/parked", b"p" * (4 * MiB)))[: MiB - 4096])
            parked.append(sock)
        time.sleep(0.5)
        bystander.set("large", b"L" * (3 * MiB))
        assert bystander.get("large") == b"L" * (3 * MiB)
        wait_for_log(n.front, "unfinished request")
        assert sum(closed_by_server(sock, timeout=0.2) for sock in parked) >= 2
        n.still_served(bystander)
    finally:
        n.close()


def test_a_scanner_opening_a_connection_per_scan_does_not_lock_other_hosts_scanners_out():
    """Scans are paced per scanner, and a client connection was a scanner: one that
    opened a new connection for each LIST_KEYS never owed anything, scanned on the
    overdraft until it was spent, and every other client's LIST_KEYS was refused (its
    client closed). A connection's scans now count as its source host's: the greedy
    host is refused, a client of another host that scans now and then is served."""
    n = Node(tiered=False)
    try:
        with StoreClient(("127.0.0.1", n.root.port)) as c:
            keys = tuple(b"/scan/%06d" % i for i in range(200_000))
            for part in (keys[:100_000], keys[100_000:]):
                c.multi_set(list(part), [b""] * len(part))
        bystander = n.torch_client()
        stop = threading.Event()
        answer = 8 + 200_001 * 8 + len(keys) * 12 + len(b"bystander")

        def list_keys(source: str) -> bool:
            """One LIST_KEYS on a new connection from ``source``: False if refused."""
            sock = socket.create_connection(("127.0.0.1", n.root.port), source_address=(source, 0))
            try:
                sock.sendall(encode_handshake(1))
                sock.settimeout(20)
                assert sock.recv(4, socket.MSG_WAITALL) == b"\x01\x00\x00\x00"
                sock.sendall(encode_request((Op.LIST_KEYS,)))
                left = answer
                while left:
                    got = len(sock.recv(min(left, 1 << 20)))
                    if not got:
                        return False
                    left -= got
                return True
            except (ConnectionResetError, BrokenPipeError):
                return False
            finally:
                sock.close()

        def greedy() -> None:
            while not stop.is_set():
                list_keys("127.0.0.1")

        hogs = [threading.Thread(target=greedy, daemon=True) for _ in range(2)]
        for t in hogs:
            t.start()
        time.sleep(3)  # (the bucket, and the overdraft, spent)
        served = []
        for _ in range(4):
            served.append(list_keys("127.0.1.7"))
            time.sleep(1.5)
        stop.set()
        for t in hogs:
            t.join(30)
        wait_for_log(n.root, "have taken their share of its time")
        assert all(served), served
        n.still_served(bystander)
    finally:
        n.close()


def test_one_key_waits_past_the_budget_through_a_proxy_close_their_client_not_the_nodes_link():
    """A proxy sends its clients' one-key WAITs up together (a WAITS entry); one refused
    there (the keys budget) fails its client alone: the node's session goes on. (One
    WAIT per client: a client's second WAIT before its first one's answer closes it at
    the proxy, see test_answer_order.)"""
    n = Node(tiered=True, store_args=("--max-store-keys=20",))
    try:
        bystander = n.torch_client()
        hogs = [adversary(n.port) for _ in range(40)]
        for i, hog in enumerate(hogs):
            hog.sendall(encode_request((Op.WAIT, (b"/w/%d" % i,))))
        assert "--max-store-keys" in wait_for_log(n.front, "WAIT failed")
        closed = [hog for hog in hogs if closed_by_server(hog, 0.2)]
        assert 10 <= len(closed) < len(hogs), len(closed)  # (about 20 keys' worth wait on)
        n.still_served(bystander)
        for hog in hogs:
            hog.close()  # (their WAITs are forgotten once their connections are gone)
        deadline = time.monotonic() + 10
        while n.root.stats()["store_entries"] > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert n.root.stats()["store_entries"] == 1
    finally:
        n.close()


def test_waits_that_fill_the_key_budget_make_room_for_other_hosts():
    """From a hostile review: 8 connections of one host, each waiting on 131,072 missing
    keys (torch's limit per request), held the whole default budget of keys; every
    other client's next new key, and next WAIT (torch's get), was refused. Here 3
    connections from 127.0.0.9 wait on 3,333 keys each (a budget of 10,000): another
    host's client still sets a new key and waits for it, the hog's largest waits are
    dropped (their clients closed) to make the room, and the hog cannot take it back."""
    n = Node(tiered=False, store_args=("--max-store-keys=10000",))
    try:
        bystander = n.torch_client()
        hogs = []
        for c in range(3):  # (with the bystander's key: 10,000)
            hog = socket.socket()
            hog.bind(("127.0.0.9", 0))
            hog.connect(("127.0.0.1", n.port))
            hog.sendall(encode_handshake(1) + encode_request((Op.WAIT, tuple(b"/h/%d/%d" % (c, i) for i in range(3333)))))
            assert hog.recv(4, socket.MSG_WAITALL) == b"\x01\x00\x00\x00"
            hogs.append(hog)
        deadline = time.monotonic() + 10
        while n.root.stats()["waiters"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        bystander.set("fresh", b"v")
        assert bystander.get("fresh") == b"v"  # (a WAIT, then a GET)
        assert "dropped to make room" in wait_for_log(n.root, "dropped to make room")
        waiting = [h for h in hogs if not closed_by_server(h, 0.5)]
        assert len(waiting) == 2
        again = socket.socket()  # (the hog's host asks for the room back: refused)
        again.bind(("127.0.0.9", 0))
        again.connect(("127.0.0.1", n.port))
        send_until_closed(again, encode_handshake(1) + encode_request((Op.WAIT, tuple(b"/h/9/%d" % i for i in range(3333)))))
        assert closed_by_server(again)
        assert not any(closed_by_server(h, 0.2) for h in waiting)  # (the 2 others: still waiting)
        n.still_served(bystander)
        assert bystander.get("fresh") == b"v"
    finally:
        n.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["flat", "tiered"])
def test_clients_that_never_read_large_answers_are_held_to_one_budget_together(tiered):
    """Each client's unread answers are held to --max-unread-bytes, but nothing held
    them all together: 6 clients each sending one MULTI_GET of 16 values of 8 MiB and
    never reading made the store host hold 6 x 128 MiB (1 GB, growing with every
    client). Answers not read, all connections of a process together, are held to
    --max-unread-total-bytes: past it, the connections that stopped reading longest
    ago (2 s or more: readers in a burst are not closed) are closed at once, freeing
    what they hold; a client that reads gets its large answer, a bystander is served.
    Here 24 clients that never read, one every 0.2 s, each asking for an 8 MiB answer
    (192 MiB in all), with a budget of 24 MiB: ~24 MiB plus 2 s of them are held."""
    limits = ("--max-value-bytes", str(MiB), "--max-request-bytes", str(4 * MiB),
              "--max-reply-bytes", str(10 * MiB), "--max-unread-bytes", str(12 * MiB),
              "--max-unfinished-bytes", str(16 * MiB), "--max-unread-total-bytes", str(24 * MiB))
    n = Node(tiered, limits, proxy_args=limits)  # (the proxy's own budgets, as the store host's)
    try:
        bystander = n.torch_client()
        for i in range(8):
            bystander.set(f"v{i}", bytes([65 + i]) * (MiB - 64))
        assert bystander.check(["v7"])
        multi_get = encode_request((Op.MULTI_GET, tuple(b"/v%d" % i for i in range(8))))  # (an 8 MiB answer)
        before = peak_rss_mb(n.front.pid)
        hogs = []
        for _ in range(24):
            hog = adversary(n.port, rcvbuf=4096)
            hog.sendall(multi_get)
            hogs.append(hog)
            time.sleep(0.2)
        assert peak_rss_mb(n.front.pid) < before + 140  # (192 MiB held before; here 24 + ~10 x 8, an answer)
        assert closed_by_server(hogs[0], timeout=5)  # (the one that stopped reading first)
        assert "--max-unread-total-bytes" in wait_for_log(n.front, "not reading")
        assert bystander.multi_get([f"v{i}" for i in range(8)])[7] == b"H" * (MiB - 64)
        n.still_served(bystander)
        for hog in hogs:
            hog.close()
    finally:
        n.close()


def test_clients_reading_large_answers_at_once_are_not_closed_for_the_total():
    """16 torch clients each reading an 8 MiB answer at the same moment (128 MiB) with a
    budget of unread answers of 24 MiB all get theirs: they read, so none of them
    stays paused for the 2 s after which the total may close one."""
    n = Node(False, ("--max-value-bytes", str(MiB), "--max-request-bytes", str(4 * MiB),
                     "--max-reply-bytes", str(10 * MiB), "--max-unread-bytes", str(12 * MiB),
                     "--max-unfinished-bytes", str(16 * MiB), "--max-unread-total-bytes", str(24 * MiB)))
    try:
        bystander = n.torch_client()
        for i in range(8):
            bystander.set(f"v{i}", bytes([65 + i]) * (MiB - 64))
        readers = [n.torch_client() for _ in range(16)]
        go = threading.Barrier(16)
        got = []

        def read(c: dist.TCPStore) -> None:
            go.wait()
            for _ in range(3):
                got.append(c.multi_get([f"v{i}" for i in range(8)])[7] == b"H" * (MiB - 64))

        threads = [threading.Thread(target=read, args=(c,)) for c in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == [True] * 48
        assert "not reading" not in n.root.output
        n.still_served(bystander)
    finally:
        n.close()
