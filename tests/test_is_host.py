"""``--rdzv_conf is_host`` as torch's c10d backend reads it, in tierrun's elastic
backends driven as torch's agent drives them (each handler starts real store processes):
an inferred host whose store cannot start becomes a client; an explicit one fails in
one line. ``tierrun-etcd``: ``is_host`` chooses which nodes may host a round's store.
(Explicit hosting on a node the endpoint does not name, with real agents under torch's
own torchrun: ``test_torchrun_plugin.py``.)"""

import socket
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from etcd_server import EtcdServer
from launch import free_port
from tierrun.rendezvous import elastic, etcd as etcd_backend
from tierrun.settings import Settings


def _rendezvous(handlers, stagger: float = 0.0):
    infos, errors = [None] * len(handlers), [None] * len(handlers)

    def run(i):
        try:
            infos[i] = handlers[i].next_rendezvous()
        except Exception as e:
            errors[i] = e

    threads = []
    for i in range(len(handlers)):
        threads.append(threading.Thread(target=run, args=(i,), daemon=True))
        threads[-1].start()
        time.sleep(stagger)
    for t in threads:
        t.join(60)
    return infos, errors


def _shutdown(handlers):
    for h in sorted(handlers, key=lambda h: h.job is not None and h.job.hosting):  # the store host last
        h.shutdown()


def _taken_port() -> socket.socket:
    """A listening socket on every address: no store can bind its port."""
    s = socket.socket()
    s.bind(("0.0.0.0", free_port()))
    s.listen()
    return s


def test_tierrun_backend_an_inferred_host_that_cannot_bind_becomes_a_client():
    """Two agents on this machine whose endpoint names it (no --local_addr: both infer
    they host, as torch's c10d would): one hosts, the other's store cannot take the
    port and it joins as a client; a third told is_host=true fails, in one line."""
    port = free_port()
    params = dict(join_timeout="30", last_call_timeout="1", progress="off")
    pair = [elastic.create_handler(RendezvousParameters("tierrun", f"127.0.1.1:{port}", "infer", 2, 2, **params),
                                   Settings.from_env())
            for _ in range(2)]
    try:
        assert all(h.job.hosting for h in pair)  # both inferred
        infos, errors = _rendezvous(pair)
        assert errors == [None, None] and sorted(i.rank for i in infos) == [0, 1], errors
        assert sorted(h.job.hosting for h in pair) == [False, True]
        told = elastic.create_handler(RendezvousParameters("tierrun", f"127.0.1.1:{port}", "infer", 2, 2,
                                                           is_host="true", **params), Settings.from_env())
        with pytest.raises(RendezvousConnectionError) as e:
            told.next_rendezvous()
        assert f"could not start the job's store on port {port} of this node (port {port} is taken)" in str(e.value)
        assert "is_host=false" in str(e.value) and "\n" not in str(e.value)
    finally:
        _shutdown(pair)


def test_tierrun_etcd_is_host_chooses_the_store_host(tmp_path):
    """3 nodes on etcd, arriving in this order: 127.0.1.1 with is_host=false, 127.0.1.2
    whose store_port is taken, 127.0.1.3. Round 0 picks 127.0.1.2 (it may host and came
    first); its store cannot start, so it re-forms as a client and 127.0.1.3 hosts."""
    server = EtcdServer(tmp_path / "etcd-data").start()
    taken = _taken_port()
    conf = [{"is_host": "false"}, {"store_port": str(taken.getsockname()[1])}, {}]
    handlers = [etcd_backend.create_handler(RendezvousParameters(
        "tierrun-etcd", server.endpoint, "hosts", 3, 3, local_addr=f"127.0.1.{k + 1}",
        last_call_timeout="1", progress="off", **conf[k]), Settings.from_env()) for k in range(3)]
    try:
        infos, errors = _rendezvous(handlers, stagger=0.3)
        assert errors == [None] * 3, errors
        assert {i.world_size for i in infos} == {3}
        assert [h.job.hosting for h in handlers] == [False, False, True]
        assert infos[2].rank == 0 and {h.job.host for h in handlers} == {"127.0.1.3"}
        assert handlers[1]._is_host is False  # a client from now on
        infos[0].store.set("k", "v")  # the round's store works
        assert infos[1].store.get("k") == b"v"
        _shutdown(handlers)
        # told is_host=true, its store cannot start: that node fails in one line
        told, other = [etcd_backend.create_handler(RendezvousParameters(
            "tierrun-etcd", server.endpoint, "told", 2, 2, local_addr=f"127.0.1.{k + 1}", join_timeout="3",
            last_call_timeout="1", progress="off", **conf), Settings.from_env()) for k, conf in enumerate(
                [{"is_host": "true", "store_port": str(taken.getsockname()[1])}, {}])]
        handlers = [told, other]
        infos, errors = _rendezvous(handlers)
        assert isinstance(errors[0], RendezvousConnectionError), errors
        assert str(errors[0]).startswith("node 127.0.1.1 (--rdzv_conf is_host=true): could not start "
                                         "the job's store on port") and "\n" not in str(errors[0])
        assert errors[1] is not None  # (the other re-formed, alone, and timed out)
    finally:
        taken.close()
        _shutdown(handlers)
        server.stop()
