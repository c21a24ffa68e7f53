"""The order of a client's answers through node front-ends, byte for byte against torch's
own server: requests pipelined in one write (what a client that does not wait for each
answer sends), through a real ``tierrun store`` (flat), a ``tierrun proxy`` linked to it
and a second proxy linked to the first (a tree). From a hostile review of the fence
(frontend/connection.py): a CHECK's answer told apart from a WAIT's, PING and
CANCEL_WAIT after what the store host may have answered already, several WAITs
cancelled at once.
"""

from __future__ import annotations

import select
import socket
import struct
import subprocess
import sys
import time

import pytest

from oracle.targets import _env
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_request
from tierrun.server import StoreProcess

_TORCH = """
import sys, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                  timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""
_HELLO = bytes([0]) + struct.pack("<I", 0x3C85F7CE) + bytes([Op.PING]) + struct.pack("<I", 7)


@pytest.fixture(scope="module")
def servers():
    """name -> port: torch's server, tierrun's store, a proxy, a proxy behind it."""
    env = _env()
    torch_server = subprocess.Popen([sys.executable, "-c", _TORCH], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
    try:
        ports = {"torch": int(torch_server.stdout.readline())}
        with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as store:
            ports["flat"] = store.port
            relay_args = ["--upstream", f"127.0.0.1:{store.port}", "--connect-timeout", "10",
                          "--link-listen", "127.0.0.1:0"]
            with StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                              extra_args=relay_args) as relay:
                ports["proxy"] = relay.port
                with StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                                  extra_args=["--upstream", f"127.0.0.1:{relay.link_port}",
                                              "--connect-timeout", "10"]) as leaf:
                    ports["tree"] = leaf.port
                    yield ports
    finally:
        torch_server.stdin.close()
        torch_server.wait(10)


def _conn(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(_HELLO)
    assert _read_for(s, 10.0, 4) == struct.pack("<I", 7)
    return s


def _read_for(s: socket.socket, seconds: float, want: int = 1 << 30) -> bytes:
    """What arrives within ``seconds`` (or until ``want`` bytes, or the close)."""
    end, got = time.monotonic() + seconds, b""
    while len(got) < want and time.monotonic() < end:
        if select.select([s], [], [], max(0.0, end - time.monotonic()))[0]:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    return got


def _enc(*reqs: tuple) -> bytes:
    return b"".join(encode_request(r) for r in reqs)


SEQUENCES = {
    # a WAIT that blocks, a CHECK whose one-byte answer is not the WAIT's, CANCEL_WAIT
    # (answered at the front-end), another CHECK, PING (answered at the front-end)
    "wait-check-cancel-check-ping": [(Op.WAIT, (b"/missing",)), (Op.CHECK, (b"/k",)), (Op.CANCEL_WAIT,),
                                     (Op.CHECK, (b"/absent",)), (Op.PING, 0x11223344)],
    # a WAIT the store host answers at once: torch answers it, then WAIT_CANCELED
    "wait-answered-then-cancel": [(Op.WAIT, (b"/k",)), (Op.CANCEL_WAIT,), (Op.GET, b"/k"), (Op.PING, 5)],
    "wait-then-ping": [(Op.WAIT, (b"/k",)), (Op.PING, 6)],
    "checks-then-ping": [(Op.CHECK, (b"/absent",)), (Op.CHECK, (b"/k",)), (Op.PING, 8)],
    "add-then-cancel-then-ping": [(Op.WAIT, (b"/missing",)), (Op.ADD, b"/n", 1), (Op.CANCEL_WAIT,), (Op.PING, 9)],
    "set-then-ping": [(Op.QUEUE_PUSH, b"/q", b"1"), (Op.SET, b"/s", b"1"), (Op.PING, 10), (Op.GET, b"/s")],
    # a write that wakes the client's own WAIT: the WAIT's answer first (at the store
    # host, a lone request's answer went ahead of the wake it caused)
    "wait-woken-by-own-add": [(Op.WAIT, (b"/n",)), (Op.ADD, b"/n", 1), (Op.PING, 11)],
    "wait-queue-len-add": [(Op.WAIT, (b"/n",)), (Op.QUEUE_LEN, b"/q0"), (Op.ADD, b"/n", 1), (Op.PING, 12)],
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_answers_come_in_torchs_order(servers, name):
    seq = SEQUENCES[name]
    answers = {}
    for target, port in servers.items():
        setter = _conn(port)
        setter.sendall(_enc((Op.SET, b"/k", b"v"), (Op.DELETE_KEY, b"/n"), (Op.GETNUMKEYS,)))
        assert len(_read_for(setter, 10.0, 16)) == 16
        c = _conn(port)
        c.sendall(_enc(*seq))
        answers[target] = _read_for(c, 1.0)
        c.close()
        setter.close()
    assert answers["torch"], "torch's server answered nothing"
    for target in ("flat", "proxy", "tree"):
        assert answers[target] == answers["torch"], f"{target}: {answers[target].hex(' ')}; " \
                                                    f"torch: {answers['torch'].hex(' ')}"


def test_two_waits_cancelled_at_once(servers):
    """Both of a client's WAITs go with its CANCEL_WAIT: nothing comes when their keys
    are set later (torch drops every wait of the client). At the store host: a node
    proxy closes a client that sends a second WAIT before the first one's answer (below)."""
    for target, port in servers.items():
        if target in ("proxy", "tree"):
            continue
        c = _conn(port)
        c.sendall(_enc((Op.WAIT, (b"/w1",)), (Op.WAIT, (b"/w2",)), (Op.CANCEL_WAIT,)))
        assert _read_for(c, 1.0) == b"\x01", target  # (WAIT_CANCELED)
        setter = _conn(port)
        setter.sendall(_enc((Op.SET, b"/w1", b"1"), (Op.SET, b"/w2", b"1"), (Op.GETNUMKEYS,)))
        assert len(_read_for(setter, 10.0, 8)) == 8
        assert _read_for(c, 0.5) == b"", target
        c.sendall(_enc((Op.PING, 3)))
        assert _read_for(c, 10.0, 4) == struct.pack("<I", 3), target
        setter.sendall(_enc((Op.DELETE_KEY, b"/w1"), (Op.DELETE_KEY, b"/w2")))
        assert len(_read_for(setter, 10.0, 16)) == 16
        c.close()
        setter.close()


#: A client that sends a WAIT or BARRIER before reading its previous one's answer (torch's
#: client never does). torch's server keeps one count of awaited keys per connection,
#: which the second overwrites while the first one's keys still count it down.
PIPELINED_WAITS = {
    "two-waits-one-key": [(Op.WAIT, (b"/p1",)), (Op.WAIT, (b"/p1",)), (Op.SET, b"/p1", b"x"), (Op.PING, 1)],
    "wait-a-wait-b-set-b": [(Op.WAIT, (b"/p2",)), (Op.WAIT, (b"/p3",)), (Op.SET, b"/p3", b"x"), (Op.PING, 2),
                            (Op.SET, b"/p2", b"x"), (Op.PING, 3)],
    "three-barriers": [(Op.BARRIER, b"/p4", 3), (Op.BARRIER, b"/p4", 3), (Op.BARRIER, b"/p4", 3), (Op.PING, 4)],
}


@pytest.mark.parametrize("name", PIPELINED_WAITS)
def test_a_wait_sent_before_the_previous_ones_answer(servers, name):
    """The store host answers as torch's server does (here, where its one count per
    connection and the store host's "a new WAIT replaces the previous one" agree); a
    node proxy, which cannot, closes that client with nothing answered past its first
    WAIT, and goes on serving the others."""
    keys = [b"/p1", b"/p2", b"/p3", b"/p4"]
    answers = {}
    for target, port in servers.items():
        c = _conn(port)
        c.sendall(_enc(*PIPELINED_WAITS[name]))
        answers[target] = _read_for(c, 1.0)
        if target in ("proxy", "tree"):
            assert answers[target] == b"", f"{target}: {answers[target].hex(' ')}"
            c.settimeout(10)
            assert c.recv(1) == b"", f"{target}: the connection is still open"
        c.close()
        other = _conn(port)  # (the node's other clients: served)
        other.sendall(_enc(*[(Op.DELETE_KEY, k) for k in keys], (Op.PING, 99)))
        assert len(_read_for(other, 10.0, 8 * len(keys) + 4)) == 8 * len(keys) + 4, target
        other.close()
    assert answers["torch"], "torch's server answered nothing"
    assert answers["flat"] == answers["torch"], f"flat: {answers['flat'].hex(' ')}; torch: {answers['torch'].hex(' ')}"


def test_the_clients_pipeline_gets_torchs_answers_in_one_round_trip(servers):
    """``StoreClient.pipeline`` (what a tierrun agent's rendezvous sends: an APPEND and two
    ADDs, then a COMPARE_SET and a GET, each group in one write) reads the same answers
    from every set-up as from torch's server; an op it cannot read is refused before
    anything is sent."""
    from tierrun.client import StoreClient

    answers = {}
    for name, port in servers.items():
        with StoreClient(("127.0.0.1", port), timeout=10) as c:
            k = f"/pipe/{name}/".encode()  # (one namespace per server: the proxies share the flat store)
            first = c.pipeline((Op.APPEND, k + b"arrivals", b"0 a 2\n"), (Op.ADD, k + b"lws", 1),
                               (Op.ADD, k + b"arrived", 1 + (2 << 21)), (Op.SET, k + b"all", b"1"),
                               (Op.WAIT, (k + b"all",)))
            second = c.pipeline((Op.COMPARE_SET, k + b"node", b"", b"mine"), (Op.COMPARE_SET, k + b"node", b"x", b"y"),
                                (Op.GET, k + b"lws"), (Op.CHECK, (k + b"all", k + b"none")),
                                (Op.ADD, k + b"lws", -(1 << 63)), (Op.GET, k + b"arrivals"))
            with pytest.raises(ValueError, match="cannot be pipelined"):
                c.pipeline((Op.ADD, k + b"lws", 1), (Op.LIST_KEYS,))
            with pytest.raises(ValueError, match="cannot be pipelined by this client but last"):
                c.pipeline((Op.WAIT, (k + b"late",)), (Op.ADD, k + b"lws", 1))  # (its answer may come after the ADD's)
            assert c.add(k + b"lws", 0) == 1 - (1 << 63)  # (the refused pipeline sent nothing)
            answers[name] = (first, second)
    assert answers["torch"] == ([None, 1, 1 + (2 << 21), None, 0], [b"mine", b"mine", b"1", 1, 1 - (1 << 63), b"0 a 2\n"])
    assert all(a == answers["torch"] for a in answers.values()), answers
