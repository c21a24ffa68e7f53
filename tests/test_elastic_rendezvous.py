"""The ``tierrun`` elastic rendezvous driven directly, as torch's agent drives it."""

import os
import signal
import threading
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters

from launch import free_port
from tierrun.rendezvous.elastic import create_handler
from tierrun.settings import Settings


def _handlers(port: int, nodes: int):
    return [create_handler(RendezvousParameters(
        "tierrun", f"127.0.1.1:{port}", "proxy-killed", nodes, nodes, local_addr=f"127.0.1.{k + 1}",
        tiered="1", last_call_timeout="1", join_timeout="20", progress="off"), Settings.from_env())
        for k in range(nodes)]


def _rendezvous_all(handlers):
    infos = [None] * len(handlers)

    def run(i):
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert None not in infos, "a node did not complete the rendezvous within 30 s"
    return infos


def test_a_restart_after_the_node_proxy_was_killed_starts_a_new_proxy(monkeypatch):
    """A killed node proxy also fails the node's workers, and torch's agent restarts
    failed workers by calling next_rendezvous without asking num_nodes_waiting first:
    next_rendezvous replaces the dead proxy itself, and the new round's store works
    through the new one."""
    monkeypatch.setenv("TIERRUN_TOKEN", "a-job-token-for-this-test")
    handlers = _handlers(free_port(), 2)
    try:
        first = _rendezvous_all(handlers)
        assert sorted(i.rank for i in first) == [0, 1]
        node = handlers[1]
        old = node.job.proxy
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while old.exited() is None:
            assert time.monotonic() < deadline, "the killed proxy was never reaped"
            time.sleep(0.05)
        again = _rendezvous_all(handlers)
        assert sorted(i.rank for i in again) == [0, 1] and {i.world_size for i in again} == {2}
        assert node.job.proxy is not old and node.job.proxy.exited() is None
        again[1].store.set("through-the-new-proxy", "v")
        assert again[0].store.get("through-the-new-proxy") == b"v"
    finally:
        for h in reversed(handlers):  # the store host last, as its agent waits for the others
            h.shutdown()
