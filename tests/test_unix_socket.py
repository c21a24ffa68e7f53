"""The same operations over a Unix socket, where torch's client cannot go."""

import os
import stat
import threading
import time

import pytest

from tierrun.client import StoreClient
from tierrun.server import StoreProcess


@pytest.fixture
def client(store):
    with StoreClient(store.unix) as c:
        yield c


def test_basic_operations(client, store):
    client.set(b"k", b"v")
    assert client.get(b"k") == b"v"
    assert client.add(b"n", 2) == 2
    assert client.compare_set(b"k", b"v", b"w") == b"w"
    assert client.compare_set(b"missing", b"x", b"y") == b"x"
    assert client.check([b"k", b"n"]) and not client.check([b"missing"])
    client.append(b"k", b"!")
    client.multi_set([b"a", b"b"], [b"1", b"2"])
    assert client.multi_get([b"a", b"b", b"k"]) == [b"1", b"2", b"w!"]
    assert client.num_keys() == 4
    assert sorted(client.list_keys()) == [b"a", b"b", b"k", b"n"]
    assert client.delete_key(b"a") and not client.delete_key(b"a")
    client.queue_push(b"q", b"x")
    assert client.queue_len(b"q") == 1
    assert client.queue_pop(b"q") == b"x"
    assert client.queue_pop(b"q", block=False) is None
    client.barrier(b"bar", 1)
    assert client.ping(99) == 99
    # the TCP side sees the same store
    with StoreClient(("127.0.0.1", store.port)) as tcp:
        assert tcp.get(b"k") == b"w!"


def test_wait_later_and_timeout(client, store):
    with StoreClient(store.unix) as other:
        threading.Timer(0.2, lambda: other.set(b"late", b"1")).start()
        client.wait([b"late"], timeout=5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            client.wait([b"never"], timeout=0.3)
        assert time.monotonic() - t0 < 3
        assert client.add(b"still-usable", 1) == 1


def test_filesystem_socket_is_owner_only(tmp_path):
    path = str(tmp_path / "store.sock")
    with StoreProcess(host="127.0.0.1", port=0, unix=path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0
        with StoreClient(path) as c:
            c.set(b"k", b"v")
            assert c.get(b"k") == b"v"


def test_a_tiered_agent_talks_to_its_node_proxy_over_a_unix_socket():
    """torch's client needs TCP (the agent's TCPStore and the workers use loopback); the
    agent's own tierrun clients (heartbeats, progress, reports) use the proxy's Unix socket."""
    import os
    from datetime import timedelta

    from tierrun.client import StoreClient
    from tierrun.rendezvous.job_store import JobStore
    from tierrun.server import StoreProcess

    with StoreProcess(host="127.0.0.1", port=0, env=dict(os.environ, TIERRUN_TOKEN="unix-tok")) as root:
        job = JobStore("127.0.0.1", root.port, hosting=False, timeout=timedelta(seconds=20), token="unix-tok")
        job.start()
        try:
            assert isinstance(job.agent_address, str) and job.agent_address.startswith("@tierrun-proxy-")
            with StoreClient(job.agent_address) as c:
                c.set(b"/via-unix", b"1")
            assert job.client().get("via-unix") == b"1"  # torch's client, over loopback TCP
        finally:
            job.stop()
