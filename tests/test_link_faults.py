"""Link faults with real processes: a root store, node proxies, torch's own clients.

Short link timings (heartbeat 0.2 s, timeout 1 s, grace 4 s) through the environment,
as the launcher passes them."""

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierrun.server import StoreProcess

TIMING = {"TIERRUN_TOKEN": "link-faults", "TIERRUN_LINK_HEARTBEAT": "0.2",
          "TIERRUN_LINK_TIMEOUT": "1", "TIERRUN_LINK_GRACE": "4"}


@pytest.fixture
def root():
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=dict(os.environ, **TIMING)) as r:
        yield r


def start_proxy(root: StoreProcess) -> StoreProcess:
    proxy = StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True,
                         env=dict(os.environ, **TIMING), extra_args=["--upstream", f"127.0.0.1:{root.port}"])
    proxy.start()
    return proxy


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def wait_expecting_loss(store: dist.TCPStore, key: str) -> None:
    try:
        store.wait([key])
    except dist.DistNetworkError:
        pass  # its proxy was killed: the point of the test


def wait_for(predicate, timeout: float) -> float:
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)
    return time.time() - t0


def test_proxy_frozen_past_heartbeat_timeout_resumes_and_counts_once(root):
    """SIGSTOP a proxy for 2.5 s (heartbeat timeout 1 s): the root drops its link and
    keeps its session; on SIGCONT the proxy reconnects and resumes. A torch client's
    ADDs sent while it was frozen are applied exactly once, its pending WAIT released."""
    proxy = start_proxy(root)
    try:
        a, other = client(proxy.port), client(root.port)
        assert a.add("n", 1) == 1
        released = threading.Event()
        threading.Thread(target=lambda: (client(proxy.port).wait(["go"]), released.set()),
                         daemon=True).start()
        time.sleep(0.5)
        os.kill(proxy.pid, signal.SIGSTOP)
        results = []
        adder = threading.Thread(target=lambda: results.extend(a.add("n", 1) for _ in range(5)))
        adder.start()
        other.set("go", "1")  # releases the WAIT while its proxy is frozen
        wait_for(lambda: root.stats()["links"] == 0, 5)  # the root noticed the silence
        time.sleep(1.0)
        os.kill(proxy.pid, signal.SIGCONT)
        adder.join(20)
        assert results == [2, 3, 4, 5, 6]
        assert released.wait(10)
        assert other.add("n", 0) == 6
        stats = root.stats()
        assert stats["links"] == 1 and stats["link_resumes"] == 1 and stats["sessions_expired"] == 0
    finally:
        os.kill(proxy.pid, signal.SIGCONT)
        proxy.stop()


def test_a_frozen_store_host_reads_what_its_nodes_sent_before_it_calls_them_silent(root):
    """SIGSTOP the store host for 2 s, twice (its heartbeat timeout: 1 s) while a proxy, which
    allows the store host 10 s, keeps beating. On SIGCONT the proxy's beats wait in the
    store host's socket: the silence was the store host's own. uvloop runs due timers
    before it reads, so its watchdog condemned the link first and the node had to
    resume; now a check that runs late looks again once it has read."""
    proxy = StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True,
                         env={**os.environ, **TIMING, "TIERRUN_LINK_TIMEOUT": "10"},
                         extra_args=["--upstream", f"127.0.0.1:{root.port}"])
    proxy.start()
    try:
        a = client(proxy.port)
        assert a.add("n", 1) == 1
        for n in (2, 3):  # (twice: every late check looks again, not every other one)
            time.sleep(0.5)
            os.kill(root.pid, signal.SIGSTOP)
            time.sleep(2.0)
            os.kill(root.pid, signal.SIGCONT)
            assert a.add("n", 1) == n
        time.sleep(0.5)
        stats = root.stats()
        assert stats["links"] == 1 and stats["link_resumes"] == 0, stats
        assert "nothing heard" not in root.output
    finally:
        os.kill(root.pid, signal.SIGCONT)
        proxy.stop()


def test_killed_proxy_session_expires_and_its_waits_are_dropped(root):
    proxy = start_proxy(root)
    waiter = client(proxy.port)
    threading.Thread(target=wait_expecting_loss, args=(waiter, "never"), daemon=True).start()
    wait_for(lambda: root.stats()["waiters"] == 1, 5)
    proxy.proc.kill()
    proxy.stop()
    elapsed = wait_for(lambda: root.stats()["sessions_expired"] == 1, 10)
    assert 3 < elapsed < 7  # the grace period (4 s)
    assert root.stats()["waiters"] == 0 and root.stats()["links"] == 0


def test_root_death_stops_the_proxy_with_the_reason_within_grace(root):
    proxy = start_proxy(root)
    try:
        c = client(proxy.port)
        c.set("k", "v")
        root.proc.kill()
        t0 = time.time()
        code = proxy.proc.wait(15)
        elapsed = time.time() - t0
        assert code == 3 and 3.5 < elapsed < 8, (code, elapsed, proxy.output)
        assert f"link to the store host 127.0.0.1:{root.port} lost at" in proxy.output
        assert "not back within the 4 s grace period" in proxy.output
        with pytest.raises(Exception):
            c.get("k")
    finally:
        proxy.stop()
