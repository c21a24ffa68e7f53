"""Wills (``tierrun/hub/wills.py``): the first hop above a node (the store host, or a
relay of a tree) executes the node's will when the node's link goes silent, its session
ends without the will revoked, or its agent is gone; never once revoked. Real processes:
``tierrun store``, a ``tierrun proxy`` relay and a leaf ``tierrun proxy``; the node's
"agent" is tierrun's own client on the leaf's will namespace."""

from __future__ import annotations

import os
import signal
import time

import pytest

from oracle.targets import _env
from tierrun.client import StoreClient, StoreClientError
from tierrun.link.frames import WILL_KEY, WILL_NAMESPACE
from tierrun.rendezvous.liveness import LinkWill
from tierrun.server import StoreProcess

FAILED = b"/job/failed"


@pytest.fixture(params=["store", "relay"])
def hop(request):
    """(the store's port, where the leaf links: the store host or a relay, its process)."""
    env = _env()
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as store:
        if request.param == "store":
            yield env, store, store.port, store
            return
        with StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                          extra_args=["--upstream", f"127.0.0.1:{store.port}", "--connect-timeout", "10",
                                      "--link-listen", "127.0.0.1:0"]) as relay:
            yield env, store, relay.link_port, relay


def _leaf(env: dict, upstream: int) -> StoreProcess:
    leaf = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                        extra_args=["--upstream", f"127.0.0.1:{upstream}", "--connect-timeout", "10"])
    leaf.start()
    return leaf


def _will(leaf: StoreProcess, text: bytes) -> bytes:
    """Write the will through the leaf, as an agent does; return what the hop holds."""
    port = leaf.open_namespace(WILL_NAMESPACE.decode())
    with StoreClient(("127.0.0.1", port), timeout=10) as c:
        c.set(WILL_KEY, text)
        return c.get(WILL_KEY)


def _wait_for(store: StoreProcess, seconds: float) -> bytes | None:
    """The failed key's value at the store host once set, within ``seconds``; else None."""
    end = time.monotonic() + seconds
    with StoreClient(("127.0.0.1", store.port), timeout=10) as c:
        while time.monotonic() < end:
            if c.check([FAILED]):
                return c.get(FAILED)
            time.sleep(0.05)
    return None


def test_a_silent_node_is_noticed_by_its_hop(hop) -> None:
    env, store, upstream, held = hop
    leaf = _leaf(env, upstream)
    try:
        assert _will(leaf, b"3\n" + FAILED + b"\nnode 1 went silent") == b"3\n" + FAILED + b"\nnode 1 went silent"
        assert _wait_for(store, 4.0) is None  # (it beats: its link's ACKs, one a second)
        assert held.stats()["wills_held"] == 1
        os.kill(leaf.pid, signal.SIGSTOP)  # (a frozen node: its connection stays open)
        t0 = time.monotonic()
        assert _wait_for(store, 6.0) == b"node 1 went silent"
        assert time.monotonic() - t0 < 5.0
        assert held.stats()["wills_executed"] == 1 and held.stats()["wills_held"] == 0
    finally:
        os.kill(leaf.pid, signal.SIGCONT)
        leaf.stop()


def test_a_proxy_that_stalls_right_after_a_batch_is_not_called_dead(hop) -> None:
    """A front-end that just sent a batch lets its next heartbeat ride with its next batch,
    so a healthy link may be silent for two heartbeat intervals; a stall of 1.5 s right
    then (a loaded node) must not run a will of the agents' default silence, the
    heartbeat timeout (3 s) and one interval."""
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    try:
        for _ in range(3):
            _will(leaf, b"4\n" + FAILED + b"\nnode 1 went silent")  # (a batch, and its answer)
            os.kill(leaf.pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(leaf.pid, signal.SIGCONT)
            assert _wait_for(store, 3.0) is None
    finally:
        os.kill(leaf.pid, signal.SIGCONT)
        leaf.stop()


def test_an_agent_asking_for_too_long_a_silence_gets_the_longest() -> None:
    """liveness.LinkWill caps the silence at what the hop takes (an agent's
    heartbeat_timeout of 4000 s must not stop its job)."""
    env = _env()
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as store:
        leaf = _leaf(env, store.port)
        try:
            will = LinkWill(("127.0.0.1", leaf.open_namespace(WILL_NAMESPACE.decode())))
            will.leave(4000.0, FAILED, b"x")
            assert _will(leaf, b"3600\n" + FAILED + b"\nx") == b"3600\n" + FAILED + b"\nx"
            will.revoke()
            assert _will(leaf, b"") == b""
        finally:
            leaf.stop()


def test_a_node_whose_agent_is_gone_is_noticed_at_once(hop) -> None:
    """The agent dies: the proxy's stdin closes, it ends its session; the will was not
    revoked, so the hop executes it then, not a silence later."""
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    _will(leaf, b"30\n" + FAILED + b"\nnode 1's agent is gone")
    t0 = time.monotonic()
    leaf.proc.stdin.close()
    assert _wait_for(store, 10.0) == b"node 1's agent is gone"
    assert time.monotonic() - t0 < 5.0
    leaf.stop()


def test_a_killed_node_is_noticed_after_its_silence(hop) -> None:
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    _will(leaf, b"1\n" + FAILED + b"\nnode 1 was killed")
    leaf.proc.kill()
    leaf.stop()
    assert _wait_for(store, 6.0) == b"node 1 was killed"


def test_a_revoked_will_is_never_executed(hop) -> None:
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    _will(leaf, b"0.5\n" + FAILED + b"\nnever")
    assert _will(leaf, b"") == b""
    leaf.stop()  # (its session ends in order)
    assert _wait_for(store, 2.0) is None


def test_a_will_replaced_and_the_first_reason_kept(hop) -> None:
    """A new will replaces the last; executed, it does not overwrite a reason already
    there (COMPARE_SET with an empty expected value)."""
    env, store, upstream, _ = hop
    with StoreClient(("127.0.0.1", store.port), timeout=10) as c:
        c.set(b"/job/other", b"x")
    leaf = _leaf(env, upstream)
    _will(leaf, b"0.5\n/job/other\nfirst")
    _will(leaf, b"0.5\n" + FAILED + b"\nsecond")
    with StoreClient(("127.0.0.1", store.port), timeout=10) as c:
        c.set(FAILED, b"an earlier reason")
    leaf.proc.kill()
    leaf.stop()
    time.sleep(2.0)
    with StoreClient(("127.0.0.1", store.port), timeout=10) as c:
        assert c.get(FAILED) == b"an earlier reason"
        assert c.get(b"/job/other") == b"x"


def test_the_will_stays_at_the_first_hop(hop) -> None:
    """The will namespace is the hop's: nothing of it reaches the store's keys."""
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    try:
        _will(leaf, b"5\n" + FAILED + b"\nx")
        with StoreClient(("127.0.0.1", store.port), timeout=10) as c:
            assert not any(k.startswith(WILL_NAMESPACE) for k in c.list_keys())
        _will(leaf, b"")
    finally:
        leaf.stop()


@pytest.mark.parametrize("text, req", [
    (b"garbage", "set"), (b"0\n/k\nv", "set"), (b"nan\n/k\nv", "set"), (b"1\n\nv", "set"),
    (b"1\n/k\n" + b"v" * 5000, "set"), (b"", "add"), (b"", "other-key"),
])
def test_a_bad_will_closes_its_client_only(hop, text: bytes, req: str) -> None:
    env, store, upstream, _ = hop
    leaf = _leaf(env, upstream)
    try:
        port = leaf.open_namespace(WILL_NAMESPACE.decode())
        with StoreClient(("127.0.0.1", port), timeout=10) as c:
            with pytest.raises((StoreClientError, OSError)):
                if req == "set":
                    c.set(WILL_KEY, text)
                elif req == "add":
                    c.add(WILL_KEY, 1)
                else:
                    c.set(b"/other", b"1")
                c.get(WILL_KEY)
        assert _will(leaf, b"") == b""  # (the hop and the leaf serve on)
        with StoreClient(("127.0.0.1", leaf.port), timeout=10) as c:
            c.set(b"/k", b"v")
            assert c.get(b"/k") == b"v"
    finally:
        leaf.stop()



def test_a_proxy_whose_agent_froze_stops_and_its_will_runs() -> None:
    """A proxy started with --agent-silence stops once its agent has written nothing on
    its control pipe for that long (a frozen or hung agent, whose proxy would otherwise
    keep its link beating); its session ends with the will standing."""
    env = _env()
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as store:
        leaf = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                            extra_args=["--upstream", f"127.0.0.1:{store.port}", "--agent-silence", "2"])
        leaf.start()  # (no keepalive from here: this test is the frozen agent)
        _will(leaf, b"30\n" + FAILED + b"\nits agent froze")
        assert _wait_for(store, 8.0) == b"its agent froze"
        assert leaf.proc.wait(5) is not None and "frozen or hung" in leaf.output
        leaf.stop()


def test_an_agent_that_runs_keeps_its_proxy() -> None:
    env = _env()
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env) as store:
        with StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env, agent_silence=1.5,
                          extra_args=["--upstream", f"127.0.0.1:{store.port}"]) as leaf:
            _will(leaf, b"30\n" + FAILED + b"\nnever")
            time.sleep(4.0)
            assert leaf.exited() is None and _wait_for(store, 0.1) is None
            _will(leaf, b"")
