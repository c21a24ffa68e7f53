"""Deeper trees: node proxies that take other proxies' links (``tierrun proxy
--link-listen``), so the store host sees only the top of the tree. Real processes,
torch's own client."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launch import SCRIPTS, children, finish, free_port, kill_tree, results, tierrun
from test_launcher import check_world, served_by_store_host
from tierrun.rendezvous.tree import TreePlace
from tierrun.server import StoreProcess

ENV = dict(os.environ, TIERRUN_TOKEN="tree-test")


def proxy(upstream_port: int, takes_links: bool = False, env=ENV) -> StoreProcess:
    extra = ["--upstream", f"127.0.0.1:{upstream_port}", "--connect-timeout", "10"]
    if takes_links:
        extra += ["--link-listen", "127.0.0.1:0"]
    p = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=env, extra_args=extra)
    p.start()
    return p


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


@pytest.fixture
def tree():
    """root <- a <- {b <- d, c}: three levels under the store host."""
    with StoreProcess(port=0, controlled=True, env=ENV) as root:
        a = proxy(root.port, takes_links=True)
        b = proxy(a.link_port, takes_links=True)
        c = proxy(a.link_port)
        d = proxy(b.link_port)
        try:
            yield root, {"a": a, "b": b, "c": c, "d": d}
        finally:
            for p in (d, c, b, a):
                p.stop()


def test_every_level_sees_one_store_and_the_root_one_link(tree):
    root, proxies = tree
    clients = {name: [client(p.port) for _ in range(3)] for name, p in proxies.items()}
    everyone = [c for cs in clients.values() for c in cs]
    assert sorted(c.add("n", 1) for c in everyone) == list(range(1, 13))
    clients["d"][0].set("k", "from d")
    assert {c.get("k") for c in everyone} == {b"from d"}
    woken = []
    waiters = [threading.Thread(target=lambda c=c: (c.wait(["go"]), woken.append(1))) for c in everyone[:-1]]
    for t in waiters:
        t.start()
    time.sleep(0.3)
    everyone[-1].set("go", "1")
    for t in waiters:
        t.join(10)
    assert len(woken) == 11
    assert root.stats()["links"] == 1  # only a links to the store host
    assert proxies["a"].stats()["links"] == 2 and proxies["b"].stats()["links"] == 1


def test_a_failed_request_deep_in_the_tree_fails_that_client_only(tree):
    _, proxies = tree
    bad, good = client(proxies["d"].port), client(proxies["d"].port)
    bad.set("text", "hello")
    with pytest.raises(dist.DistError):
        bad.add("text", 1)
    assert good.add("counter", 1) == 1
    deadline = time.monotonic() + 5
    while "not a number" not in proxies["d"].output and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "not a number" in proxies["d"].output  # the reason travelled down two links


def test_a_client_reads_its_own_writes_two_proxies_down(tree):
    """torch's client under the deepest proxy: ADD, SET the number, GET it (WAIT and
    GET), over and over; every GET sees the SET before it (a relay once answered the
    WAIT from its watch while the SET was still on its way up: tests/test_watches.py)."""
    _, proxies = tree
    store = client(proxies["d"].port)
    for _ in range(40):
        v = store.add("c", 1)
        store.set("c/v", str(v))
        assert store.get("c/v") == str(v).encode()


def test_the_link_port_takes_only_authenticated_links(tree):
    root, proxies = tree
    port = proxies["a"].link_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # a torch client, say
        s.sendall(b"\x0f\x00\x00\x00\x00")
        while s.recv(100):  # the link handshake's HELLO, then the connection closes
            pass
    wrong = dict(ENV, TIERRUN_TOKEN="not-the-token")
    with pytest.raises(Exception, match="wrong job token|does not know the job token"):
        proxy(port, env=wrong)
    assert client(proxies["c"].port).add("still", 1) == 1
    assert proxies["a"].stats()["links"] == 2


def _static_job(tmp_path, name: str, *tree: object) -> tuple[list, float]:
    """A 5-node static tiered job (``tree``: extra flags); its logs and wall time."""
    port = free_port()
    logs = [tmp_path / f"{name}{k}.log" for k in range(5)]
    env = {"TIERRUN_TOKEN": "tree-job-token", "TIERRUN_LOG_LEVEL": "DEBUG"}
    start = time.monotonic()
    procs = [tierrun("--nnodes", 5, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                     "--master_port", port, "--node_rank", k, "--tiered", *tree,
                     "--nproc_per_node", 1, "--local_addr", f"127.0.1.{k + 1}",
                     SCRIPTS / "collectives.py", log=logs[k], env=env) for k in range(5)]
    assert finish(procs) == [0] * 5, logs[4].read_text()[-3000:]
    return logs, time.monotonic() - start


def test_static_job_with_store_fanout_node0_sees_fanout_links_and_ends_as_flat_does(tmp_path):
    """5 nodes, --store-fanout 2: node 0's front-end (in the store process, no link)
    and node 1's link on the store host, nodes 2 and 3 link to node 1's proxy, node 4 to
    node 2's. The job ends as a flat one does: every relay serves until its subtree has
    left, and nobody warns (a relay that stopped first cut its subtree off: they waited
    out the link's grace period, and node 0 called every node dead)."""
    logs, tree_wall = _static_job(tmp_path, "tree", "--store-fanout", 2)
    check_world(results(*logs), 5, 15)
    for log in logs:
        assert "WARNING" not in log.read_text(), log.read_text()[-3000:]
    _, flat_wall = _static_job(tmp_path, "flat")
    assert tree_wall < flat_wall + 10, (tree_wall, flat_wall)  # (cut off: 15 s more; a loaded machine: ~5 s)
    served = served_by_store_host(logs[0])
    # 1 link; nodes 2, 3 and 4 each looked up their parent once (a LOOKUP: no session,
    # closed once answered), and no torch client reached the public port (links only)
    assert served["links_accepted"] == 1 and served["lookups"] == 3 and served["clients_accepted"] == 0
    assert served["node_frontend"]["clients_accepted"] >= 2  # node 0's agent and worker


def test_a_node_whose_tree_parent_never_comes_says_so_in_one_line(tmp_path):
    log = tmp_path / "node2.log"
    p = tierrun("--nnodes", 3, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                "--master_port", free_port(), "--node_rank", 2, "--tiered", "--store-fanout", 2,
                "--local_addr", "127.0.1.3", "--rdzv_conf", "timeout=3,progress_interval=1",
                SCRIPTS / "collectives.py", log=log, env={"TIERRUN_TOKEN": "tree-job-token"})
    assert finish([p], 60) == [1]
    text = log.read_text()
    assert ("tierrun: error: node rank 2 did not learn where its parent in the store tree, node rank 1, "
            "takes links within 3 s") in text
    # (while it waits, it names what it waits for: the store host, and its parent)
    assert "to say where its parent in the store tree, node rank 1, takes links after" in text, text


def _running_static_tree(tmp_path, nodes: int, env: dict[str, str] | None = None) -> tuple[list, list]:
    """A static tiered job of ``nodes`` nodes on a tree of fanout 2, its idle workers up
    on every node: (the agents' processes, their logs)."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(nodes)]
    procs = [tierrun("--nnodes", nodes, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                     "--master_port", port, "--node_rank", k, "--tiered", "--store-fanout", 2,
                     "--nproc_per_node", 1, "--local_addr", f"127.0.1.{k + 1}",
                     SCRIPTS / "sleep_worker.py", log=logs[k], env={"TIERRUN_TOKEN": "tree-job-token", **(env or {})})
             for k in range(nodes)]
    deadline = time.monotonic() + 90
    while len(results(*logs, tag="UP")) < nodes and time.monotonic() < deadline:
        time.sleep(0.2)
    if len(results(*logs, tag="UP")) < nodes:
        finish(procs, 1)
        pytest.fail("not every node's workers came up:\n" + logs[-1].read_text()[-3000:])
    return procs, logs


def test_a_dead_proxy_in_the_tree_stops_the_static_job_with_a_message(tmp_path):
    """Node 1's proxy carries the links of nodes 2 and 3, and through node 2's node 4's
    (--store-fanout 2). Killed: node 1 reports its lost store, the store host executes
    node 1's will (its link went silent), node 2 names its lost parent once its link's grace period ends,
    node 4 hears it from node 2's relay at once, and the job stops, no hang. (Workers idle: no collective fails first.)"""
    procs, logs = _running_static_tree(tmp_path, 5, {"TIERRUN_LINK_GRACE": "4", "TIERRUN_LINK_TIMEOUT": "2"})
    try:
        proxy = next(c for c in children(procs[1].pid)
                     if b"tierrun\0proxy" in open(f"/proc/{c}/cmdline", "rb").read())
        os.kill(proxy, signal.SIGKILL)
        killed = time.monotonic()
        codes = finish(procs, 60)
    finally:
        finish(procs, 1)
    assert all(c != 0 for c in codes) and time.monotonic() - killed < 40, codes
    assert "the store proxy of node 127.0.1.2 was killed by SIGKILL" in logs[1].read_text()
    # node 2 linked through node 1's proxy: it names that, not the store host
    assert "lost its parent in the store tree (node rank 1's proxy" in logs[2].read_text(), \
        logs[2].read_text()[-3000:]
    # node 4 linked through node 2's relay, which told it why it gave up: no second grace period
    assert "the relay, the proxy at tcp 127.0.1.3:" in logs[4].read_text(), logs[4].read_text()[-3000:]
    # (node 1's link went silent at the store host; nodes 2 to 4's at their relays, whose
    # links died with node 1's proxy: whichever will ran first is named)
    assert re.search(r"node rank [1234] \(127\.0\.1\.[2345]\) has not answered", logs[0].read_text())


@pytest.mark.parametrize("what", ["node", "agent"])
def test_a_frozen_node_or_agent_is_noticed_by_its_relay_and_stops_the_static_job(tmp_path, what):
    """A tiered static job beats with its links (``hub.wills``): node 3 links to node
    1's relay (--store-fanout 2), which holds node 3's will. ``node``: every process of
    node 3 frozen (SIGSTOP), its link goes silent. ``agent``: only its agent frozen, its
    proxy would keep its link beating, but stops once its agent has written nothing on
    its control pipe for 5 s (``AGENT_SILENCE``). Either way node 1's relay runs the
    will, and every other node stops within seconds naming node 3, as the watchers of
    its heartbeat did (the reason's ending says a will named it)."""
    procs, logs = _running_static_tree(tmp_path, 4)
    try:
        time.sleep(2.0)  # (past a few heartbeats: nobody is silent while all run)
        if what == "node":
            kill_tree(procs[3].pid, signal.SIGSTOP)
        else:
            os.kill(procs[3].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        codes = finish(procs[:3], 40)
        stopped = time.monotonic() - frozen
    finally:
        kill_tree(procs[3].pid, signal.SIGKILL)
        finish(procs, 5)
    assert all(c != 0 for c in codes) and stopped < 25, (codes, stopped)
    for log in logs[:3]:
        assert "node rank 3 (127.0.1.4) has not answered for 4 s (its link to the store went silent" in \
            log.read_text(), log.read_text()[-3000:]


@pytest.mark.parametrize("nodes,fanout", [(1, 2), (2, 2), (3, 2), (5, 2), (8, 8), (9, 8), (100, 3), (256, 8),
                                          (512, 8), (1024, 8), (777, 5)])
def test_the_tree_reaches_every_node_with_at_most_fanout_links_each_and_node0_relays_none(nodes, fanout):
    places = [TreePlace(r, nodes, fanout, "", "") for r in range(nodes)]
    children: dict[int | None, list[int]] = {}
    for p in places:
        children.setdefault(p.parent, []).append(p.rank)
    assert all(len(c) <= fanout for c in children.values())
    assert all(p.has_children == (p.rank in children) for p in places)
    # the store host's proxy links straight to its store and carries only its own node
    assert places[0].parent is None and not places[0].has_children
    depth = [0] * nodes
    for p in places:  # every node reaches the store host, without a cycle
        seen, up = set(), p.rank
        while up is not None:
            assert up not in seen
            seen.add(up)
            up = places[up].parent
        depth[p.rank] = len(seen) if p.rank else 0  # (its own proxy and those it links through)
    if nodes <= fanout:
        assert children == {None: list(range(nodes))}
    # as shallow as fanout F allows: ceil(log_F K) proxies from any node to the store host
    assert max(depth) == next(d for d in range(nodes + 1) if fanout ** d >= nodes)


def test_a_relay_without_local_addr_takes_links_where_it_reaches_the_store_host():
    """Not its host name's address, which /etc/hosts often maps to 127.0.1.1 where other
    nodes cannot reach it: the kernel's route to the store host names the interface the
    other nodes reach this one on (no packet sent, no reverse lookup)."""
    from tierrun.rendezvous.sockets import link_address

    assert link_address("10.0.0.5", "127.0.1.1", 29500) == "10.0.0.5"  # given: kept as is
    assert link_address(None, "127.0.1.1", 29500) == "127.0.0.1"  # (loopback: lo's own address)
    assert link_address(None, "::1", 29500) == "::1"
    assert link_address(None, "no-such-host.invalid", 29500) == socket.gethostname()


def test_a_relay_takes_links_on_the_route_of_the_first_store_host_address_it_can_reach(monkeypatch):
    """A store host's name may resolve to several addresses, the first of them one this
    machine has no route to (an IPv6 address on a node without IPv6, say): the next is
    tried, as a TCP connection tries them, not the host name's address at once (which
    /etc/hosts often maps to 127.0.1.1, where no other node reaches this one)."""
    from tierrun.rendezvous import sockets

    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host != "store-host.example":
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("fe80::1", port, 0, 12345)),  # no such interface
                (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.1.1", port))]

    monkeypatch.setattr(sockets.socket, "getaddrinfo", resolve)
    assert sockets.link_address(None, "store-host.example", 29500) == "127.0.0.1"


def test_a_node_that_cannot_link_to_its_parent_says_what_to_open_or_drop(tmp_path):
    """From 64 nodes a job runs a tree by default, whose relays take links on an
    ephemeral port: a cluster that opened only the store port between nodes ran flat
    until now. A node whose parent cannot be reached says which port to open, or how to
    run without a tree."""
    from tierrun.rendezvous.job_store import JobStore
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    closed = free_port()  # (nothing listens there: as a relay's port behind a firewall)
    job = JobStore("127.0.0.1", free_port(), hosting=False, timeout=timedelta(seconds=5), token=b"t")
    name = f"its parent in the store tree (node rank 1's proxy, 127.0.0.1:{closed})"
    with pytest.raises(RendezvousConnectionError) as e:
        job._start_proxy(f"127.0.0.1:{closed}", name, 1.0)
    assert str(e.value).startswith(f"node {socket.gethostname()}: its store proxy could not link to {name}")
    assert "open it between the job's nodes" in str(e.value) and "--store-fanout 0" in str(e.value)
    assert "\n" not in str(e.value)
