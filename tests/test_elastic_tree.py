"""The tree of node proxies in an elastic job (``tierrun`` backend, ``--store-fanout``):
each round's tree is built from that round's members; after a node dies, the survivors'
proxies move to their places in the new round's tree. Real processes, Gloo on CPU,
simulated nodes on 127.0.1.x."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from launch import SCRIPTS, finish, free_port, kill_tree, results, tierrun
from tierrun.rendezvous.elastic import create_handler
from tierrun.rendezvous.tree import RoundTree, store_fanout_from
from tierrun.server import StoreProcess, StoreStartError
from tierrun.settings import Settings

NODES = 6
TREE_LINE = re.compile(r"store tree of round (\d+): node (\S+) \(node rank (\d+)\) links to (.*?); "
                       r"(?:node ranks? ([\d, ]+) links? to its proxy|no node links to it)")


def tree_lines(log) -> dict[int, tuple[str, int, int | None, list[int]]]:
    """Round -> (node, its rank, its parent's rank (None: the store host), its children)."""
    rounds = {}
    for m in TREE_LINE.finditer(log.read_text()):
        parent = re.search(r"node rank (\d+)'s proxy", m.group(4))
        children = [int(c) for c in m.group(5).split(", ")] if m.group(5) else []
        rounds[int(m.group(1))] = (m.group(2), int(m.group(3)), int(parent.group(1)) if parent else None, children)
    return rounds


def start_nodes(count: int, logs: list, *flags: object, env: dict | None = None) -> list:
    """``count`` tierrun nodes on 127.0.1.1.. (``flags``: all but --local_addr, the
    script last). The store host (127.0.1.1) first, the others once it listens: nodes
    that retry connecting to a loopback port nobody listens on yet can connect a socket
    to itself on that very port (TCP self-connect), which the store host then finds taken."""
    env = {"TIERRUN_TOKEN": "elastic-tree-token", "TIERRUN_LOG_LEVEL": "INFO", **(env or {})}
    script = [i for i, f in enumerate(flags) if str(f).endswith(".py")][0]

    def argv(k: int) -> tuple:
        return (*flags[:script], "--local_addr", f"127.0.1.{k + 1}", *flags[script:])

    procs = [tierrun(*argv(0), log=logs[0], env=env)]
    deadline = time.monotonic() + 60
    while "this node hosts the job's store" not in logs[0].read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    return procs + [tierrun(*argv(k), log=logs[k], env=env) for k in range(1, count)]


def _subtree(tree: RoundTree, rank: int) -> list[int]:
    """``rank`` and every rank below it."""
    ranks = [rank]
    for r in ranks:
        ranks += tree.children(r)
    return ranks


@pytest.mark.parametrize("members,host_rank", [(6, 0), (6, 3), (6, 5), (5, -1), (1, 0), (9, 4)])
def test_a_round_tree_leaves_out_the_store_host_wherever_its_rank_falls(members, host_rank):
    tree = RoundTree(members, 2, host_rank)
    kids = {rank: tree.children(rank) for rank in range(members)}
    assert kids.get(host_rank, []) == [] and tree.parent(host_rank) is None
    top = [r for r in range(members) if r != host_rank and tree.parent(r) is None]
    assert len(top) == min(1, tree.places)  # (fanout 2: the store host's front-end is the other link)
    for rank in range(members):
        assert len(kids[rank]) <= 2 and tree.has_children(rank) == bool(kids[rank])
        for child in kids[rank]:
            assert tree.parent(child) == rank
        assert host_rank < 0 or tree.parent(rank) != host_rank  # (the store host relays nobody)
        seen, up = set(), rank  # every member reaches the store host, no cycle
        while up is not None:
            assert up not in seen
            seen.add(up)
            up = tree.parent(up)


@pytest.mark.parametrize("conf, message", [
    ({"tiered": "1", "store_fanout": "abc"}, r"store_fanout=abc is not a whole number: write 0 \(no tree\) or 2"),
    ({"tiered": "1", "store_fanout": "1"}, r"store_fanout=1: write 0 \(no tree\) or 2 or more"),
    ({"tiered": "1", "store_fanout": "-2"}, r"store_fanout=-2: write 0"),
    ({"store_fanout": "2"}, r"store_fanout=2 stacks the node proxies of tiered wire-up in a tree: add tiered=1"),
])
def test_a_store_fanout_the_tree_cannot_use_says_what_to_write(conf, message):
    """--rdzv_conf store_fanout=F (torchrun's spelling) is checked as --store-fanout is:
    garbage is named, and a fanout without tiering is refused, not silently flat."""
    with pytest.raises(ValueError, match=message):
        store_fanout_from(conf)
    assert store_fanout_from({"tiered": "true", "store_fanout": "3"}) == 3
    assert store_fanout_from({"store_fanout": "0"}) == store_fanout_from({}) == 0


@pytest.mark.parametrize("victim_place", ["middle", "top"])
def test_a_relay_killed_mid_job_the_survivors_reform_their_tree_and_finish(tmp_path, victim_place):
    """6 nodes, elastic 3:6, tiered, --store-fanout 2. Round 0's tree: the store host's
    front-end and one node's link at the store host (the top relay), below it a relay
    with two leaves (the middle one) and a leaf. A relay is killed (agent, proxy,
    workers) while every worker ADDs to the store and all_reduces: the middle one (a
    parent and children), or the top one (its subtree's path to the store is cut two
    levels deep). The survivors re-form in a round of 5, their proxies move to the new
    round's tree, and every ADD of the final round is counted once."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(NODES)]
    start = time.monotonic()
    procs = start_nodes(NODES, logs, "--nnodes", f"3:{NODES}", "--nproc_per_node", 1, "--max_restarts", 3,
                        "--monitor_interval", "0.1", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "etree",
                        "--tiered", "--store-fanout", 2, SCRIPTS / "tree_worker.py", "--want", NODES - 1)
    try:
        deadline = time.monotonic() + 90
        while len([r for r in results(*logs, tag="UP") if r["world"] == str(NODES)]) < NODES:
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.2)
        first = {k: tree_lines(log)[0] for k, log in enumerate(logs) if 0 in tree_lines(log)}
        assert len(first) == NODES - 1, {k: log.read_text()[-2000:] for k, log in enumerate(logs)}
        # round 0: a heap of fanout 2 under the store host, as RoundTree lays it out
        ranks = {rank: k for k, (_, rank, _, _) in first.items()}
        host_rank = ({*range(NODES)} - set(ranks)).pop()
        first_tree = RoundTree(NODES, 2, host_rank)
        for k, (_, rank, parent, kids) in first.items():
            assert (parent, kids) == (first_tree.parent(rank), first_tree.children(rank)), (k, first)
        victim = next(k for k, (_, _, parent, kids) in first.items()
                      if kids and (parent is not None) == (victim_place == "middle"))
        kill_tree(procs[victim].pid)
        killed = time.monotonic()
        survivors = [k for k in range(NODES) if k != victim]
        codes = finish([procs[k] for k in survivors], timeout=120)
    finally:
        finish(procs, 1)
    assert codes == [0] * len(survivors), {k: logs[k].read_text()[-3000:] for k in survivors}
    rows = results(*(logs[k] for k in survivors))
    assert len(rows) == NODES - 1, rows
    assert all(r["world"] == str(NODES - 1) and r["ok"] == "1" and r["sum"] == "15" for r in rows), rows
    # the final round's tree: built from its 5 members, every survivor in its place
    final = {k: max(tree_lines(logs[k]).items()) for k in survivors if tree_lines(logs[k])}
    last_round = max(r for r, _ in final.values())
    placed = {k: line for k, (r, line) in final.items() if r == last_round}
    assert len(placed) == NODES - 2, final  # (the store host has no place)
    host_rank = ({*range(NODES - 1)} - {rank for _, rank, _, _ in placed.values()}).pop()
    tree = RoundTree(NODES - 1, 2, host_rank)
    for k, (_, rank, parent, kids) in placed.items():
        assert (parent, kids) == (tree.parent(rank), tree.children(rank)), (k, placed)
    assert any(parent is not None for _, _, parent, _ in placed.values())  # (a tree, not flat)
    # what a person reads: the dead node named, the nodes below it saying why they re-form;
    # nothing else (a node below it whose beats were cut off over 3 s may be named too; on a
    # loaded machine a node may join the first round late, and an agent that did not see it
    # within 5 s says it restarts its workers for it: an elastic scale-up, not this failure)
    below = _subtree(first_tree, first[victim][1])
    names = {rank: node for node, rank, _, _ in first.values()}
    for k in survivors:
        for line in logs[k].read_text().splitlines():
            if "WARNING" in line:
                if "not every member saw the new node" in line and "round 0," in line:
                    continue
                assert (any(f"node {names[r]} has not answered for 3 s" in line for r in below)
                        or re.search(r"lost its parent in the store tree \(node rank (\d+)'s proxy", line)
                        and int(re.search(r"node rank (\d+)'s proxy", line).group(1)) in below), line
        assert "cannot publish this node's record" not in logs[k].read_text()
    assert time.monotonic() - killed < 60, time.monotonic() - killed
    print(f"wall {time.monotonic() - start:.1f} s, {time.monotonic() - killed:.1f} s after the kill")


def test_a_node_joining_mid_job_the_members_re_form_in_a_tree_with_it_and_finish(tmp_path):
    """Scale-up: 3 nodes of --nnodes 3:4, tree of fanout 2, running; a 4th node arrives.
    The running members restart their workers, go flat, rejoin with it, and take their
    places in the 4-member round's tree (the newcomer among them); every ADD of that
    round counts once, every node exits 0, nobody warns."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(4)]
    flags = ("--nnodes", "3:4", "--nproc_per_node", 1, "--max_restarts", 3, "--monitor_interval", "0.1",
             "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "etree-up", "--rdzv_conf", "last_call_timeout=2",
             "--tiered", "--store-fanout", 2, SCRIPTS / "tree_worker.py", "--want", 4)
    procs = start_nodes(3, logs, *flags)
    try:
        deadline = time.monotonic() + 60
        while len([r for r in results(*logs[:3], tag="UP") if r["world"] == "3"]) < 3:
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        procs.append(tierrun(*flags[:-3], "--local_addr", "127.0.1.4", *flags[-3:], log=logs[3],
                             env={"TIERRUN_TOKEN": "elastic-tree-token", "TIERRUN_LOG_LEVEL": "INFO"}))
        codes = finish(procs, timeout=60)
    finally:
        finish(procs, 1)
    assert codes == [0] * 4, {k: log.read_text()[-3000:] for k, log in enumerate(logs)}
    rows = results(*logs)
    assert len(rows) == 4 and all(r["world"] == "4" and r["ok"] == "1" for r in rows), rows
    final = {k: max(tree_lines(log).items()) for k, log in enumerate(logs[1:], 1)}
    assert {r for r, _ in final.values()} == {1}, final  # (the newcomer's first round is the members' second)
    host_rank = ({*range(4)} - {line[1] for _, line in final.values()}).pop()
    tree = RoundTree(4, 2, host_rank)
    for k, (_, (_, rank, parent, kids)) in final.items():
        assert (parent, kids) == (tree.parent(rank), tree.children(rank)), (k, final)
    for log in logs:
        assert not [line for line in log.read_text().splitlines() if "WARNING" in line], log.read_text()[-3000:]


def test_stats_of_a_proxy_that_just_died_raises_store_start_error_as_its_callers_expect():
    """``link_in_doubt`` (every monitor interval, in ``num_nodes_waiting``) and ``_drain``
    (a retired proxy's thread, every 50 ms) look at ``exited()`` and then ask ``stats()``,
    catching ``StoreStartError``: a proxy that dies between the two must not raise
    BrokenPipeError (a traceback in the agent, or a retire thread that ends without
    stopping its proxy)."""
    proc = StoreProcess(host="127.0.0.1", port=0, controlled=True)
    proc.start()
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.wait(10)  # (dead and reaped: what exited() would say a moment later)
        with pytest.raises(StoreStartError, match="exited"):
            proc.stats(timeout=1.0)
    finally:
        proc.stop()


def _tree_handlers(port: int, nodes: int, run_id: str):
    return [create_handler(RendezvousParameters(
        "tierrun", f"127.0.1.1:{port}", run_id, nodes, nodes, local_addr=f"127.0.1.{k + 1}",
        tiered="1", store_fanout="2", last_call_timeout="1", join_timeout="20", progress="off"),
        Settings.from_env()) for k in range(nodes)]


def _rendezvous_all(handlers):
    infos: list = [None] * len(handlers)
    errors: list = []

    def run(i):
        try:
            infos[i] = handlers[i].next_rendezvous()
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and None not in infos, errors
    return infos


def _eventually(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_every_round_rebuilds_the_tree_the_store_host_keeps_fanout_links_and_workers_see_their_round(
        monkeypatch, caplog):
    """6 nodes, fanout 2, the tierrun handlers driven as torch's agent drives them, twice
    (a re-formation: every node re-joins, the nodes below the top going through the
    store host, a relay among them whose old proxy still carries its children until they
    have moved). Each time every proxy holds the links its place in the round's tree
    gives it, the store host one (its own front-end is the other of its 2), the proxies
    left behind stop without a warning, ADDs through the tree count once, and a worker
    endpoint serves only its round's keys."""
    monkeypatch.setenv("TIERRUN_TOKEN", "elastic-tree-handlers")
    nodes = 6
    handlers = _tree_handlers(free_port(), nodes, "tree-handlers")
    handlers[0].job.start()  # (the store host listening first: see start_nodes)
    root = handlers[0].job.root
    assert root is not None

    def worker(info) -> dist.TCPStore:
        endpoint = info.bootstrap_store_info
        return dist.TCPStore(endpoint.master_addr, endpoint.master_port, is_master=False,
                             timeout=timedelta(seconds=10))

    try:
        replaced = []
        for round_ in range(2):
            before = [h.job.proxy for h in handlers]
            infos = _rendezvous_all(handlers)
            assert sorted(i.rank for i in infos) == list(range(nodes))
            tree = RoundTree(nodes, 2, infos[0].rank)
            for h, info in zip(handlers[1:], infos[1:]):
                assert h.job.proxy.exited() is None
                parent = tree.parent(info.rank)
                assert (h.job.parent is None) == (parent is None)
                if parent is not None:
                    assert f"node rank {parent}'s proxy" in h.job.upstream_name
                kids = len(tree.children(info.rank))
                _eventually(lambda: h.job.proxy.stats()["links"] == kids, f"round {round_}: rank {info.rank}")
            replaced += [p for p, h in zip(before, handlers) if p is not None and p is not h.job.proxy]
            _eventually(lambda: root.stats()["links"] == 1, f"round {round_}: {root.stats()['links']} links")
            # the agents' store and the workers' round, through the tree
            infos[-1].store.set(f"agents-{round_}", "seen")
            assert {i.store.get(f"agents-{round_}") for i in infos} == {b"seen"}
            workers = [worker(i) for i in infos]
            workers[0].set("mine", f"round {round_}")
            assert {w.get("mine") for w in workers} == {f"round {round_}".encode()}
            assert sorted(w.add("ranks", 1) for w in workers) == list(range(1, nodes + 1))  # once each
            assert not workers[-1].check([f"round-{round_ - 1}-only"])
            workers[-1].set(f"round-{round_}-only", "x")
        # round 1: the 4 nodes below the top left their round-0 proxies (for one linked to
        # the store host, then one under their parent)
        assert len(replaced) == 4, replaced
        _eventually(lambda: all(p.exited() is not None for p in replaced), "a replaced proxy still runs")
        assert not [r for r in caplog.records if r.levelno >= 30 and r.name.startswith("tierrun")], caplog.text
    finally:  # as agents do, at once (a relay waits for the nodes linked to it), the store host last
        leaving = [threading.Thread(target=h.shutdown) for h in handlers if h.job.root is None]
        for t in leaving:
            t.start()
        for t in leaving:
            t.join(30)
        for h in handlers:
            if h.job.root is not None:
                h.shutdown()


def test_the_store_host_dies_every_node_of_the_tree_stops_naming_it(tmp_path):
    """4 nodes, elastic 2:4, tree of fanout 2 (a top relay with two leaves): the store
    host is killed. The top relay loses its own link; the leaves lose their path through
    it and try the store host themselves. Every node stops, non-zero, naming the store
    host, within the link timeout and grace period (here 2 s and 4 s): no hang."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(4)]
    procs = start_nodes(4, logs, "--nnodes", "2:4", "--nproc_per_node", 1, "--max_restarts", 3,
                        "--monitor_interval", "0.1", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "etree-host",
                        "--tiered", "--store-fanout", 2, SCRIPTS / "heartbeat_worker.py", "--want", 5,
                        env={"TIERRUN_LINK_GRACE": "4", "TIERRUN_LINK_TIMEOUT": "2"})
    try:
        deadline = time.monotonic() + 90
        while len([r for r in results(*logs, tag="UP") if r["world"] == "4"]) < 4:
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        kill_tree(procs[0].pid)
        killed = time.monotonic()
        codes = finish(procs[1:], timeout=60)
    finally:
        finish(procs, 1)
    elapsed = time.monotonic() - killed
    assert all(c != 0 for c in codes), (codes, [log.read_text()[-2000:] for log in logs[1:]])
    assert elapsed < 30, elapsed
    for log in logs[1:]:
        error = [line for line in log.read_text().splitlines() if line.startswith("tierrun: error:")]
        assert error and f"127.0.1.1:{port}" in error[-1], log.read_text()[-3000:]
        assert "Restart the job when the store host" in error[-1]
        assert not any(line.startswith("Traceback") for line in log.read_text().splitlines())  # (the agent's)


@pytest.mark.parametrize("spelling", ["yes", "Y", "t", "TRUE", "1"])
def test_the_handlers_read_tiered_in_torchs_boolean_spellings(spelling):
    """Under torch's own torchrun (no tierrun launcher in between), ``--rdzv-conf
    tiered=yes`` is tiered, as torch's get_as_bool reads it, not a flat store in silence;
    a value that is no boolean stops the node saying what to write."""
    from tierrun.rendezvous.conf import token_from
    from tierrun.settings import Settings

    assert token_from({"tiered": spelling}, Settings(token="secret")) == b"secret"
    assert store_fanout_from({"tiered": spelling, "store_fanout": "4"}) == 4
    assert token_from({"tiered": "no"}, Settings(token="secret")) is None
    with pytest.raises(ValueError, match="tiered=ja is not a boolean: write tiered=true or tiered=false"):
        token_from({"tiered": "ja"}, Settings(token="secret"))
