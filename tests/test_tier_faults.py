"""Bad but legal clients on a node: what a merge builds, what the store host refuses and
an unexpected error while a batch is applied never cost more than the client that asked
(issue 32's symptoms). Real ``tierrun store`` and ``tierrun proxy`` processes; torch's
own server is the oracle where answers are compared; an unrelated client on the node
must keep being served throughout."""

from __future__ import annotations

import asyncio
import os
import struct
from datetime import timedelta

import pytest
import torch.distributed as dist

from inproc import Client, linked, settle
from tierrun.client import StoreClient, StoreClientError
from tierrun.core import StoreCore
from tierrun.protocol import Op
from tierrun.protocol.requests import encode_request
from tierrun.server import StoreProcess

ENV = dict(os.environ, TIERRUN_TOKEN="tier-faults-test")
MiB = 1 << 20
I64_MAX, I64_MIN = (1 << 63) - 1, -(1 << 63)


def node(store_args=(), proxy_args=()):
    """A store host and one node proxy linked to it."""
    root = StoreProcess(host="127.0.0.1", port=0, controlled=True, env=ENV, extra_args=list(store_args))
    root.start()
    proxy = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=ENV,
                         extra_args=["--upstream", f"127.0.0.1:{root.port}", "--connect-timeout", "10",
                                     *proxy_args])
    proxy.start()
    return root, proxy


@pytest.fixture
def tiered():
    root, proxy = node()
    try:
        yield root, proxy
    finally:
        proxy.stop()
        root.stop()


def torch_client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=15))


def still_served(root: StoreProcess, proxy: StoreProcess, bystander: dist.TCPStore) -> None:
    """The node, its link and an unrelated client on it are all still up."""
    before = bystander.add("bystander", 1)
    assert bystander.add("bystander", 1) == before + 1
    assert proxy.exited() is None and root.exited() is None
    stats = root.stats()
    assert stats["links"] == 1 and stats["sessions_expired"] == 0 and stats["link_resumes"] == 0


def pipelined(port: int, reqs: list[tuple], reply_bytes: int) -> bytes:
    """Send ``reqs`` in one write, read ``reply_bytes`` of answers."""
    c = StoreClient(("127.0.0.1", port), timeout=15)
    c._sock.sendall(b"".join(encode_request(r) for r in reqs))
    return c._exact(reply_bytes)


def test_two_pipelined_3_mib_appends_to_one_key_are_both_applied(tiered):
    root, proxy = tiered
    bystander = torch_client(proxy.port)
    bystander.add("bystander", 1)
    writer = torch_client(proxy.port)
    writer.append("big", "x" * (3 * MiB))  # (torch's APPEND has no answer: these two are pipelined)
    writer.append("big", "y" * (3 * MiB))
    assert writer.get("big") == b"x" * (3 * MiB) + b"y" * (3 * MiB)
    still_served(root, proxy, bystander)


def test_of_two_pipelined_5_mib_appends_the_one_past_the_value_limit_fails_alone(tiered):
    """Not merged into one APPEND past the value limit (issue 32): the first is applied,
    the second, whose value would pass the limit (issue 33), is refused and its client
    closed, as torch's server closes a client whose request fails."""
    root, proxy = tiered
    bystander = torch_client(proxy.port)
    bystander.add("bystander", 1)
    writer = torch_client(proxy.port)
    writer.append("big", "x" * (5 * MiB))
    writer.append("big", "y" * (5 * MiB))
    with pytest.raises(dist.DistError):
        writer.get("big")
    assert bystander.get("big") == b"x" * (5 * MiB)
    still_served(root, proxy, bystander)


def test_merged_adds_past_the_int64_bounds_answer_as_torchs_server_does(tiered):
    """Clients ADD to one key in the same moment, the sum past int64's bounds: the proxy
    merges them, and every answer is one that torch's server, which wraps (checked
    here with torch's own server), gives in some order of the same ADDs: starting from
    0, each client's answer is the one before plus its delta, wrapped. (One client's
    pipelined ADDs no longer merge: each waits for the one before's answer.)"""
    root, proxy = tiered
    bystander = torch_client(proxy.port)
    deltas = [I64_MAX, 1, I64_MAX, I64_MIN, -1, 5]

    def wrap(x: int) -> int:
        return (x + 2**63) % 2**64 - 2**63

    def run(port: int, key: bytes) -> list[int]:
        clients = [StoreClient(("127.0.0.1", port), timeout=15) for _ in deltas]
        for c, d in zip(clients, deltas):
            c._sock.sendall(encode_request((Op.ADD, key, d)))
        return [struct.unpack("<q", c._exact(8))[0] for c in clients]

    def some_order(answers: list[int]) -> bool:
        left, value = list(zip(deltas, answers)), 0
        while left:
            step = next(((d, a) for d, a in left if wrap(value + d) == a), None)
            if step is None:
                return False
            left.remove(step)
            value = step[1]
        return True

    oracle = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=15))
    assert some_order(run(oracle.port, b"/n"))  # (torch's server wraps)
    for attempt in range(10):
        assert some_order(run(proxy.port, b"/n%d" % attempt))
        if proxy.stats()["merged_adds"] > 0:  # (the case the issue is about: they merged)
            break
    else:
        pytest.fail("ADDs sent in the same moment never merged")
    still_served(root, proxy, bystander)


def test_a_request_the_store_host_refuses_fails_that_client_only():
    """A store host with a smaller value limit than its node's proxy: the proxy learnt
    the store's limits when it linked, so it refuses such a COMPARE_SET or SET itself
    (before, the store host did, after the request crossed the link); its client is
    closed (as torch's server closes it), the link, the proxy and every other client of
    the node carry on."""
    root, proxy = node(store_args=["--max-value-bytes", str(MiB)])
    try:
        bystander = torch_client(proxy.port)
        bad = StoreClient(("127.0.0.1", proxy.port), timeout=15)
        with pytest.raises((StoreClientError, OSError)):  # (closed while it still sends, maybe)
            bad.compare_set(b"k", b"", b"v" * (2 * MiB))
        also_bad = StoreClient(("127.0.0.1", proxy.port), timeout=15)
        with pytest.raises((StoreClientError, OSError)):
            also_bad.set(b"k2", b"v" * (2 * MiB))
            also_bad.check([b"k2"])
        assert not StoreClient(("127.0.0.1", proxy.port)).check([b"k2"])
        still_served(root, proxy, bystander)
        assert f"exceeds the limit of {MiB}" in proxy.output and "invalid request" not in root.output
    finally:
        proxy.stop()
        root.stop()


def test_an_unexpected_error_applying_a_batch_ends_the_session_fail_stop():
    """A bug at the store host (here: the core raising in the middle of a batch) ends
    that link's session at once, with the reason, rather than a resume that would carry
    on past the half-applied batch; the node's front-end gives up (its agent reports
    it), and another node's link is served as before."""

    async def main():
        core = StoreCore()
        execute = core.execute

        def buggy(req, waiter):
            if req[0] == Op.SET and req[1] == b"boom":
                raise RuntimeError("a bug")
            return execute(req, waiter)

        core.execute = buggy
        bad, stats = await linked(core)
        lost = []
        bad._on_lost = lost.append
        good, _ = await linked(core)
        c, d = Client(), Client()
        bad.submit((Op.ADD, b"n", 1), c, b"")
        bad.submit((Op.SET, b"boom", b"1"), c, b"")
        bad.submit((Op.ADD, b"n", 1), c, b"")  # (after the bug in the same batch: never applied)
        await settle()
        assert bad.dead is not None and "a bug" in bad.dead and lost == [bad.dead]
        assert all(isinstance(r, tuple) and r[0] == "dropped" for r in c.replies)
        good.submit((Op.ADD, b"n", 1), d, b"")
        await settle()
        assert d.replies == [struct.pack("<q", 2)]  # (the batch's first ADD, not its last)
        assert stats.sessions_expired == 1

    asyncio.run(main())


def test_no_memory_while_sending_deferred_answers_ends_the_session_instead_of_wedging_it(monkeypatch):
    """The store host's wake-up path (deferred answers of a link, sent at the end of the
    loop turn) failing with MemoryError: that session ends with the reason (no resume
    loop that never expires), the store host and its other links carry on."""
    from tierrun.hub import session as hub_session

    async def main():
        core = StoreCore()
        bad, stats = await linked(core)
        good, _ = await linked(core)
        lost = []
        bad._on_lost = lost.append
        waiting, other = Client(), Client()
        bad.submit((Op.WAIT, (b"go",)), waiting, b"")
        await settle()
        frames = hub_session.replies_frames

        def no_memory(replies, max_frame):
            raise MemoryError()

        monkeypatch.setattr(hub_session, "replies_frames", no_memory)
        core.execute((Op.SET, b"go", b"1"), None)  # (wakes the WAIT: its answer is deferred)
        await settle()
        monkeypatch.setattr(hub_session, "replies_frames", frames)
        assert bad.dead is not None and "MemoryError" in bad.dead and lost == [bad.dead]
        assert waiting.replies and waiting.replies[0][0] == "dropped"
        assert stats.sessions_expired == 1 and stats.link_resumes == 0
        good.submit((Op.ADD, b"n", 1), other, b"")
        await settle()
        assert other.replies == [struct.pack("<q", 1)]

    asyncio.run(main())


def tree(store_args=()):
    """A store host, a relaying proxy linked to it and a node proxy linked to that."""
    root, relay = node(store_args, proxy_args=["--link-listen", "127.0.0.1:0"])
    leaf = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=ENV,
                        extra_args=["--upstream", f"127.0.0.1:{relay.link_port}", "--connect-timeout", "10"])
    leaf.start()
    return root, relay, leaf


def refused_through_a_tree(store_args, writes) -> None:
    """``writes(client)`` sends a write with no answer that the store host refuses: the
    client, two proxies down, is closed (its next request fails), as one proxy level
    closes it; a bystander on the same node proxy is served before and after; no link
    is lost (one link at the store host: the relay's, never expired nor resumed)."""
    root, relay, leaf = tree(store_args)
    try:
        bystander = torch_client(leaf.port)
        bystander.add("bystander", 1)
        c = StoreClient(("127.0.0.1", leaf.port), timeout=15)
        writes(c)
        with pytest.raises((StoreClientError, OSError)):
            c.get(b"/k")
        still_served(root, leaf, bystander)
        assert relay.exited() is None
    finally:
        leaf.stop()
        relay.stop()
        root.stop()


def test_a_write_the_store_host_refuses_closes_its_client_through_a_tree():
    """An APPEND whose result passes the value limit is refused at the store host."""

    def writes(c: StoreClient) -> None:
        c.set(b"/k", b"x")
        c.append(b"/k", b"p" * (5 * MiB))
        c.append(b"/k", b"q" * (5 * MiB))  # (refused: 10 MiB)

    refused_through_a_tree((), writes)


def test_a_set_past_the_store_budget_closes_its_client_through_a_tree():
    """A SET past the store-wide bytes budget (--max-store-bytes) is refused at the
    store host."""

    def writes(c: StoreClient) -> None:
        c.set(b"/k", b"x")
        c.set(b"/big", b"y" * 200_000)

    refused_through_a_tree(["--max-store-bytes", "100000"], writes)


def test_a_set_past_the_budget_does_not_close_a_neighbour_whose_set_came_with_it():
    """The store's bytes budget nearly used up; one client's SET past it and another's
    small SET reach the node proxy in the same moment (several times): only the first
    is closed. (Folded into one MULTI_SET, the store host refused both: a hostile
    review saw the neighbour closed 20 times in 20.)"""
    root, proxy = node(["--max-store-bytes", "1000000"])
    try:
        filler = StoreClient(("127.0.0.1", root.port), timeout=15)
        filler.set(b"/fill", b"z" * 990_000)
        assert filler.check([b"/fill"])  # (a SET has no answer: this one's says it was applied)
        for trial in range(6):
            greedy = StoreClient(("127.0.0.1", proxy.port), timeout=15)
            neighbour = StoreClient(("127.0.0.1", proxy.port), timeout=15)
            greedy._sock.sendall(encode_request((Op.SET, b"/rec/a%d" % trial, b"A" * 20_000)))
            neighbour._sock.sendall(encode_request((Op.SET, b"/rec/b%d" % trial, b"b")))
            assert neighbour.get(b"/rec/b%d" % trial) == b"b"
            with pytest.raises((StoreClientError, OSError)):
                greedy.get(b"/rec/a%d" % trial)
            filler.delete_key(b"/rec/b%d" % trial)
    finally:
        proxy.stop()
        root.stop()


def test_a_clients_sets_before_its_set_past_the_budget_land_as_on_the_store_alone():
    """The store's bytes budget nearly used up; one client pipelines two small SETs and
    a SET past the budget (one batch at the proxy): the small ones land and the client
    is closed, as on the store host alone. (Folded into one MULTI_SET, the store host
    refused all three.)"""
    root, proxy = node(["--max-store-bytes", "1000000"])
    try:
        filler = StoreClient(("127.0.0.1", root.port), timeout=15)
        filler.set(b"/fill", b"z" * 990_000)
        assert filler.check([b"/fill"])  # (a SET has no answer: this one's says it was applied)
        for trial, port in enumerate((root.port, proxy.port, proxy.port, proxy.port)):
            greedy = StoreClient(("127.0.0.1", port), timeout=15)
            keys = [b"/own/%d/%d" % (trial, k) for k in range(3)]
            greedy._sock.sendall(encode_request((Op.SET, keys[0], b"a")) + encode_request((Op.SET, keys[1], b"b"))
                                 + encode_request((Op.SET, keys[2], b"C" * 20_000)))
            with pytest.raises((StoreClientError, OSError)):
                greedy.get(keys[0])
            reader = StoreClient(("127.0.0.1", proxy.port), timeout=15)
            assert [reader.check([k]) for k in keys] == [True, True, False], port
            filler.delete_key(keys[0])
            filler.delete_key(keys[1])
    finally:
        proxy.stop()
        root.stop()


@pytest.mark.parametrize("levels", [0, 1, 2])
def test_a_clients_requests_after_its_refused_write_do_not_land_as_on_the_store_alone(levels):
    """The store's bytes budget nearly used up; a client pipelines a SET past it, then an
    ADD, an APPEND and a SET of small keys. On the store alone the SET is refused, the
    client closed and nothing after it runs. Through a proxy (``levels`` 1), and a
    proxy linked to a relay (2), the later requests left before the refusal came back:
    each goes behind an AFTER entry naming the refused write, and is not run. The
    client's own requests before the refused SET, and another client's, land."""
    env = dict(ENV)
    with StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env,
                      extra_args=["--max-store-bytes", "1000000"]) as root:
        upstream, procs = f"127.0.0.1:{root.port}", []
        try:
            for level in range(levels):
                relay = level < levels - 1
                p = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env,
                                 extra_args=["--upstream", upstream, "--connect-timeout", "10",
                                             *(["--link-listen", "127.0.0.1:0"] if relay else [])])
                p.start()
                procs.append(p)
                upstream = f"127.0.0.1:{p.link_port}"
            port = procs[-1].port if procs else root.port
            filler = StoreClient(("127.0.0.1", root.port), timeout=15)
            filler.set(b"/fill", b"z" * 990_000)
            assert filler.check([b"/fill"])
            for trial in range(3):
                greedy = StoreClient(("127.0.0.1", port), timeout=15)
                k = [b"/t%d/%s" % (trial, name) for name in (b"before", b"big", b"count", b"log", b"after")]
                greedy._sock.sendall(b"".join(encode_request(r) for r in (
                    (Op.SET, k[0], b"a"), (Op.SET, k[1], b"C" * 20_000), (Op.ADD, k[2], 1),
                    (Op.APPEND, k[3], b"x"), (Op.SET, k[4], b"b"))))
                with pytest.raises((StoreClientError, OSError)):
                    greedy.get(k[0])
                other = StoreClient(("127.0.0.1", port), timeout=15)
                assert other.add(b"/t%d/other" % trial, 1) == 1
                assert [other.check([key]) for key in k] == [True, False, False, False, False], (levels, trial)
                filler.delete_key(k[0])
            assert all(p.exited() is None for p in procs) and root.exited() is None
        finally:
            for p in reversed(procs):
                p.stop()


def test_an_unexpected_error_sending_a_batch_ends_the_nodes_session_fail_stop(monkeypatch):
    """A bug at the node (here: the planner raising on one request) ends the node's
    link session with the reason and drops its clients, who would otherwise wait for
    ever for a batch that never left; the node's agent hears of it (``on_lost``)."""
    from tierrun.tier import upstream

    async def main():
        core = StoreCore()
        link, _ = await linked(core)
        lost = []
        link._on_lost = lost.append
        plan_batch = upstream.plan_batch

        def buggy(pending, limits, unsettled):
            if any(req[0] == Op.SET and req[1] == b"boom" for _, _, req in pending):
                raise RuntimeError("a bug")
            return plan_batch(pending, limits, unsettled)

        monkeypatch.setattr(upstream, "plan_batch", buggy)
        c, d = Client(), Client()
        link.submit((Op.ADD, b"n", 1), c, b"")
        link.submit((Op.SET, b"boom", b"1"), d, b"")
        link.submit((Op.GET, b"n"), d, b"")
        await settle()
        assert link.dead is not None and "a bug" in link.dead and lost == [link.dead]
        assert c.replies and d.replies and all(r[0] == "dropped" for r in c.replies + d.replies)

    asyncio.run(main())
