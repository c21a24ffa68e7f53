"""The tree of node proxies in an elastic job (``tierrun`` backend, ``--store-fanout``):
each round's tree is built from that round's members; after a node dies, the survivors'
proxies move to their places in the new round's tree. Real processes, Gloo on CPU,
simulated nodes on 127.0.1.x."""

from __future__ import annotations

import re
import time

import pytest

from launch import SCRIPTS, finish, free_port, kill_tree, results, tierrun
from tierrun.rendezvous.tree import RoundTree

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


def test_a_relay_killed_mid_job_the_survivors_reform_their_tree_and_finish(tmp_path):
    """6 nodes, elastic 3:6, tiered, --store-fanout 2. Round 0's tree: the store host's
    front-end and one node's link at the store host, two levels of relays below. The
    relay with a parent and children is killed (agent, proxy, workers) while every
    worker ADDs to the store and all_reduces. The survivors re-form in a round of 5,
    their proxies move to the new round's tree, and every final ADD is counted once."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(NODES)]
    env = {"TIERRUN_TOKEN": "elastic-tree-token", "TIERRUN_LOG_LEVEL": "INFO"}
    start = time.monotonic()
    procs = [tierrun("--nnodes", f"3:{NODES}", "--nproc_per_node", 1, "--max_restarts", 3,
                     "--monitor_interval", "0.5", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "etree",
                     "--tiered", "--store-fanout", 2, "--local_addr", f"127.0.1.{k + 1}",
                     SCRIPTS / "tree_worker.py", "--want", NODES - 1, log=logs[k], env=env)
             for k in range(NODES)]
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
        tree = RoundTree(NODES, 2, host_rank)
        for k, (_, rank, parent, kids) in first.items():
            assert (parent, kids) == (tree.parent(rank), tree.children(rank)), (k, first)
        victim = next(k for k, (_, _, parent, kids) in first.items() if parent is not None and kids)
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
    # what a person reads: the dead node named, its children saying why they re-form, nothing else
    dead = f"127.0.1.{victim + 1}"
    for k in survivors:
        for line in logs[k].read_text().splitlines():
            if "WARNING" in line:
                assert (f"node {dead} has not answered for 3 s" in line
                        or f"lost its parent in the store tree (node rank {first[victim][1]}'s proxy" in line), line
        assert "cannot publish this node's record" not in logs[k].read_text()
    assert time.monotonic() - killed < 60, time.monotonic() - killed
    print(f"wall {time.monotonic() - start:.1f} s, {time.monotonic() - killed:.1f} s after the kill")
