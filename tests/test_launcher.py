"""The tierrun command end to end: real agents, real workers, Gloo on CPU."""

import json
import socket
import time

import pytest

from launch import SCRIPTS, finish, free_port, kill_tree, results, scale_up_out_of_phase, tierrun


def check_world(rows, world, expected_sum=None):
    assert sorted(int(r["rank"]) for r in rows) == list(range(world)), rows
    assert all(int(r["world"]) == world for r in rows)
    if expected_sum is not None:
        assert all(int(r["sum"]) == expected_sum for r in rows)


def test_standalone_ddp_toy_model(tmp_path):
    log = tmp_path / "out.log"
    p = tierrun("--standalone", "--nproc_per_node", "4", SCRIPTS / "ddp_toy.py", log=log)
    assert finish([p]) == [0], log.read_text()[-3000:]
    rows = results(log)
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2, 3]
    assert len({r["loss"] for r in rows}) >= 1


@pytest.mark.parametrize("nprocs", [(2, 2), (2, 2, 2), (2, 1, 2)])
def test_static_parallel_nodes(tmp_path, nprocs):
    """Ranks follow node ranks. When every node runs as many workers, the agents compute
    them without the store (torch's identical-workers path); otherwise through it."""
    nodes = len(nprocs)
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(nodes)]
    procs = [
        tierrun("--nnodes", nodes, "--nproc_per_node", nprocs[k], "--rdzv_backend", "parallel",
                "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", k,
                "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k],
                env={"TIERRUN_LOG_LEVEL": "INFO"})
        for k in range(nodes)
    ]
    assert finish(procs) == [0] * nodes, logs[-1].read_text()[-3000:]
    world = sum(nprocs)
    rows = results(*logs)
    check_world(rows, world, world * (world + 1) // 2)
    for k, log in enumerate(logs):  # node k holds the next nprocs[k] global ranks
        first = sum(nprocs[:k])
        assert sorted(int(r["rank"]) for r in results(log)) == list(range(first, first + nprocs[k]))
        path = "ranks computed locally" if len(set(nprocs)) == 1 else "ranks assigned through the store"
        text = log.read_text()
        assert path in text
        # INFO says what happens: where the store is, who joined, the workers' world; no statistics
        assert f"node 127.0.1.{k + 1} is node rank {k}" in text and f"round 0: {nodes} node(s) joined" in text
        ranks = f"{first}-{first + nprocs[k] - 1}" if nprocs[k] > 1 else str(first)
        assert f"{nprocs[k]} worker(s) started, global rank(s) {ranks} of {world}" in text
        assert ("this node hosts the job's store" in text) == (k == 0) and "served:" not in text


@pytest.mark.parametrize("nprocs", [(2, 2), (2, 2, 2), (1, 2, 2)])
def test_elastic_nodes(tmp_path, nprocs):
    """As the static test: ranks computed locally only when every member runs as many
    workers (the closer of the round says so)."""
    nodes = len(nprocs)
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(nodes)]
    procs = []
    for k in range(nodes):
        procs.append(tierrun("--nnodes", f"2:{nodes}", "--nproc_per_node", nprocs[k],
                             "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "el",
                             "--rdzv_conf", "last_call_timeout=3", "--local_addr", f"127.0.1.{k + 1}",
                             SCRIPTS / "collectives.py", log=logs[k], env={"TIERRUN_LOG_LEVEL": "INFO"}))
    assert finish(procs) == [0] * nodes, logs[-1].read_text()[-3000:]
    world = sum(nprocs)
    check_world(results(*logs), world, world * (world + 1) // 2)
    path = "ranks computed locally" if len(set(nprocs)) == 1 else "ranks assigned through the store"
    assert all(path in log.read_text() for log in logs)


def test_torch_npu_run_flags_verbatim(tmp_path):
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = [
        tierrun("--rdzv_backend=parallel", "--master_addr=127.0.1.1", f"--master_port={port}",
                "--nnodes=2", f"--node_rank={k}", "--nproc_per_node=2",
                "--enable_tiered_parallel_tcpstore=true", f"--local_addr=127.0.1.{k + 1}",
                SCRIPTS / "collectives.py", log=logs[k])
        for k in range(2)
    ]
    assert finish(procs) == [0, 0], logs[0].read_text()[-3000:]
    check_world(results(*logs), 4, 10)


def test_failing_worker_restarts_then_fails_clearly(tmp_path):
    log = tmp_path / "out.log"
    p = tierrun("--standalone", "--nproc_per_node", 2, "--max_restarts", 2, SCRIPTS / "fail.py", log=log)
    code = finish([p])[0]
    text = log.read_text()
    assert code != 0
    restarts = sorted({r["restart"] for r in results(log, tag="ATTEMPT")})
    assert restarts == ["0", "1", "2"]
    assert "fail.py FAILED" in text or "FAILED" in text
    assert "exitcode  : 3" in text and "rank      : 1" in text


def test_elastic_scale_up_admits_a_late_node(tmp_path):
    """With no restarts to spare, a membership change must not cost one (``scale_up_out_of_phase``)."""
    common = ("--nnodes", "2:3", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{free_port()}",
              "--rdzv_id", "up", "--rdzv_conf", "last_call_timeout=1", "--max_restarts", 0)
    check_world(scale_up_out_of_phase(tmp_path, *common), 3, 6)


def test_elastic_two_late_nodes_at_once_into_one_free_place(tmp_path):
    """2:3 nodes, two running, two arriving together (which alone make the minimum):
    the running members, restarting together, are waited for, so one round of 3 forms
    and the fourth node is a spare; not rounds of 2 that take turns (a review's case)."""
    port = free_port()
    common = ("--nnodes", "2:3", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{port}",
              "--rdzv_id", "two", "--rdzv_conf", "last_call_timeout=1", "--max_restarts", 0)
    logs = [tmp_path / f"node{k}.log" for k in range(4)]
    start = lambda k, interval: tierrun(*common, "--monitor_interval", interval, "--local_addr", f"127.0.1.{k + 1}",
                                        SCRIPTS / "elastic_worker.py", "--want", 3, log=logs[k])
    procs = [start(0, "0.1"), start(1, "2")]
    deadline = time.time() + 60
    while len(results(*logs[:2], tag="ROUND")) < 2 and time.time() < deadline:
        time.sleep(0.2)
    procs += [start(2, "0.5"), start(3, "1")]
    assert finish(procs) == [0, 0, 0, 0], logs[0].read_text()[-3000:]
    check_world(results(*logs), 3, 6)
    rounds = results(*logs, tag="ROUND")
    assert [r["world"] for r in rounds].count("2") == 2, rounds  # (the first round only)


def test_elastic_scale_down_after_an_agent_is_killed(tmp_path):
    port = free_port()
    common = ("--nnodes", "2:3", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{port}",
              "--rdzv_id", "down", "--rdzv_conf", "last_call_timeout=1", "--max_restarts", 3,
              "--monitor_interval", "0.5")
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    procs = [tierrun(*common, "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "elastic_worker.py",
                     "--want", 2, log=logs[k]) for k in range(3)]
    deadline = time.time() + 60
    while len(results(*logs, tag="ROUND")) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert {r["world"] for r in results(*logs, tag="ROUND")} == {"3"}
    kill_tree(procs[2].pid)
    assert finish(procs[:2]) == [0, 0], logs[0].read_text()[-3000:]
    check_world(results(*logs[:2]), 2, 3)


def test_nodes_past_the_maximum_wait_as_spares_and_take_a_dead_nodes_place(tmp_path):
    """--nnodes 1:2 and four nodes: the two past the maximum wait as spares (as torch's
    c10d backend does) without restarting the running members; when a member dies, a
    spare takes its place; the other spare, never needed, ends well with the job."""
    port = free_port()
    common = ("--nnodes", "1:2", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{port}",
              "--rdzv_id", "spare", "--rdzv_conf", "last_call_timeout=1", "--max_restarts", 3,
              "--monitor_interval", "0.5")
    logs = [tmp_path / f"node{k}.log" for k in range(4)]

    def node(k: int, seconds: float):
        return tierrun(*common, "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "steady_worker.py",
                       "--seconds", seconds, log=logs[k])

    def wait_for(what, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while not what():
            assert time.time() < deadline, [log.read_text()[-2000:] for log in logs if log.exists()]
            time.sleep(0.2)

    procs = [node(0, 12), node(1, 12)]
    wait_for(lambda: len(results(*logs[:2], tag="UP")) == 2)
    procs.append(node(2, 12))
    wait_for(lambda: "waits as a spare" in logs[2].read_text())
    time.sleep(2)  # (a spare that made the members restart would show here)
    assert len(results(*logs[:2], tag="UP")) == 2
    kill_tree(procs[1].pid)
    wait_for(lambda: any(r["world"] == "2" for r in results(logs[2], tag="UP")))
    procs.append(node(3, 12))
    assert finish([procs[0], procs[2], procs[3]]) == [0, 0, 0], logs[3].read_text()[-3000:]
    assert sorted(r["world"] for r in results(logs[0], logs[2])) == ["2", "2"]  # the RESULT lines
    assert not results(logs[3])
    assert "waited as a spare and was not needed" in logs[3].read_text()


def test_static_timeout_names_the_missing_nodes(tmp_path):
    log = tmp_path / "node0.log"
    p = tierrun("--nnodes", 3, "--nproc_per_node", 1, "--rdzv_backend", "parallel",
                "--master_addr", "127.0.1.1", "--master_port", free_port(), "--node_rank", 0,
                "--rdzv_conf", "timeout=3", SCRIPTS / "collectives.py", log=log)
    assert finish([p], timeout=90)[0] != 0
    text = log.read_text()
    assert "1 of 3 nodes arrived; missing node ranks: 1, 2" in text


@pytest.mark.parametrize("counts", [(2, 3), (3, 2)])
def test_static_nodes_started_with_different_node_counts_stop_naming_them(tmp_path, counts):
    """A copied command line with another --nnodes: the second node to arrive finds the
    counts disagree in its arrival's ADD and stops naming both (with the host at 3 and
    the other at 2, the other once started a job of 2 while the host waited for 3); the
    host's progress finds them too. Within seconds (torchrun and torch_npu_run wait
    forever; tierrun said "2/2 nodes; none missing")."""
    port, logs = free_port(), [tmp_path / f"node{k}.log" for k in range(2)]
    started = time.monotonic()
    procs = [tierrun("--nnodes", counts[k], "--nproc_per_node", 1, "--rdzv_backend", "parallel",
                     "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", k,
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k]) for k in range(2)]
    codes = finish(procs, timeout=90)
    texts = [log.read_text() for log in logs]
    assert codes == [1, 1] and time.monotonic() - started < 60, (codes, texts[0][-2000:], texts[1][-2000:])
    errors = [[line for line in text.splitlines() if line.startswith("tierrun: error:")] for text in texts]
    assert all(len(e) == 1 for e in errors) and not any("RESULT" in text for text in texts), errors
    named = [e[0] for e in errors if "the nodes were started with different --nnodes" in e[0]]
    # whoever arrives second finds it in its arrival's ADD, and the host's progress too; a
    # first arrival that is not the host may only learn that the store host left
    assert named and all(f"node rank 0 (127.0.1.1) with {counts[0]}" in e and f"node rank 1 (127.0.1.2) with {counts[1]}"
                         in e and e.endswith("Give every node the same --nnodes (or PET_NNODES) and restart the job.")
                         for e in named), errors
    assert all(e[0] in named or "lost the job's store host" in e[0] for e in errors), errors


def test_a_node_started_with_a_larger_node_count_does_not_join_the_job_and_says_why(tmp_path):
    """Node ranks 0 and 1 with --nnodes 2, node rank 2 with --nnodes 3, started together:
    node rank 2 never starts a worker (it once joined the job of 2, started one, and
    died with it saying the store host was lost), and the node that finds the counts
    disagree in its arrival's ADD names the nodes."""
    port, logs = free_port(), [tmp_path / f"node{k}.log" for k in range(3)]
    procs = [tierrun("--nnodes", 3 if k == 2 else 2, "--nproc_per_node", 1, "--rdzv_backend", "parallel",
                     "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", k,
                     "--rdzv_conf", "timeout=20" if k == 2 else "timeout=60",
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k]) for k in range(3)]
    codes = finish(procs, timeout=120)
    texts = [log.read_text() for log in logs]
    assert codes[2] == 1 and "RESULT" not in texts[2], texts[2][-2000:]
    # whoever arrived after a node of the other count names them (in some arrival orders
    # node rank 2 arrives first, and then learns only that the store host left)
    named = [text for text in texts if "the nodes were started with different --nnodes" in text]
    assert named and all("node rank 2 (127.0.1.3) with 3" in text for text in named), texts
    assert any("node rank 0 (127.0.1.1) with 2" in text or "node rank 1 (127.0.1.2) with 2" in text for text in named)


def _static_node(port: int, logs: list, nodes: int = 3, timeline=None):
    def node(k: int, rank: int):
        extra = ("--timeline", timeline) if timeline is not None and rank == 0 else ()
        return tierrun("--nnodes", nodes, "--nproc_per_node", 1, "--rdzv_backend", "parallel",
                       "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", rank, *extra,
                       "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k])
    return node


def _wait_for_text(logs: list, text: str, timeout: float = 90) -> int:
    """The index of the first log that shows ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for k, log in enumerate(logs):
            if log.exists() and text in log.read_text():
                return k
        time.sleep(0.2)
    raise AssertionError(f"no log says {text!r}")


def test_of_two_nodes_started_with_one_node_rank_one_stops_saying_so_and_the_job_runs(tmp_path):
    """A copied command line: two live nodes with --node_rank 1. The later one takes the
    rank (as a spare replacing a lost node would); once the round forms the other stops,
    naming both, before it starts any worker, and the job runs with ranks 0-2 once."""
    logs = [tmp_path / f"node{k}.log" for k in range(4)]
    node = _static_node(free_port(), logs, timeline=tmp_path / "timeline.json")
    procs = [node(0, 0), node(1, 1), node(2, 1)]
    try:
        taker = _wait_for_text(logs[1:3], "takes its place") + 1
        stopped = 3 - taker
        procs.append(node(3, 2))
        assert finish(procs) == [0] + [1 if k == stopped else 0 for k in (1, 2)] + [0], \
            "".join(log.read_text()[-2000:] for log in logs)
        text = logs[stopped].read_text()
        assert (f"node 127.0.1.{stopped + 1} held node rank 1 of rendezvous 'none' until node "
                f"127.0.1.{taker + 1} was started with the same rank") in text, text[-3000:]
        assert "Traceback" not in text and not results(logs[stopped])
        check_world(results(logs[0], logs[taker], logs[3]), 3, 6)
        members = [n["addr"] for n in json.loads((tmp_path / "timeline.json").read_text())["nodes"]]
        assert sorted(members) == ["127.0.1.1", f"127.0.1.{taker + 1}", "127.0.1.4"]  # (not the one that stopped)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)


def test_a_spare_takes_the_place_of_a_node_lost_before_the_job_formed(tmp_path):
    """Node rank 1 dies while the job forms (it was counted); a spare started with its
    rank takes its place, and the job runs with the spare."""
    logs = [tmp_path / f"node{k}.log" for k in range(4)]
    node = _static_node(free_port(), logs)
    host, lost = node(0, 0), node(1, 1)
    procs = [host, lost]
    try:
        _wait_for_text([logs[0]], "missing: node rank 2", timeout=120)  # (node rank 1 arrived)
        kill_tree(lost.pid)
        procs += [node(2, 1), node(3, 2)]
        assert finish([host, *procs[2:]]) == [0, 0, 0], "".join(log.read_text()[-2000:] for log in logs)
        assert "node 127.0.1.3 takes its place" in logs[2].read_text()
        check_world(results(logs[0], logs[2], logs[3]), 3, 6)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)


def test_elastic_timeout_says_how_many_arrived(tmp_path):
    log = tmp_path / "node0.log"
    p = tierrun("--nnodes", "2:3", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{free_port()}",
                "--local_addr", "127.0.1.1", "--rdzv_conf", "join_timeout=3",
                SCRIPTS / "collectives.py", log=log)
    assert finish([p], timeout=90)[0] != 0
    text = log.read_text()
    assert "1 node(s) arrived (127.0.1.1), at least 2 needed" in text


def served_by_store_host(log, by: str = "store host"):
    """What the agent logged its store host (or its node proxy: ``by="node proxy"``)
    served, when it stopped."""
    import json
    import re

    m = re.search(by + r" served: (\{.*\})", log.read_text())
    assert m, log.read_text()[-3000:]
    return json.loads(m.group(1))


@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_tiered_three_nodes_node0_sees_only_links(tmp_path, mode):
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    env = {"TIERRUN_TOKEN": "tiered-test-token", "TIERRUN_LOG_LEVEL": "DEBUG"}
    procs = []
    for k in range(3):
        if mode == "static":
            flags = ("--nnodes", 3, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                     "--master_port", port, "--node_rank", k, "--enable_tiered_parallel_tcpstore", "true")
        else:
            flags = ("--nnodes", "2:3", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "tiered",
                     "--rdzv_conf", "last_call_timeout=3", "--tiered")
        procs.append(tierrun(*flags, "--nproc_per_node", 2, "--local_addr", f"127.0.1.{k + 1}",
                             SCRIPTS / "collectives.py", log=logs[k], env=env))
    assert finish(procs) == [0, 0, 0], logs[0].read_text()[-3000:]
    check_world(results(*logs), 6, 21)
    for log in logs:  # workers talk to their own node's proxy on loopback
        assert {r["master"].split(":")[0] for r in results(log)} == {"127.0.0.1"}
    served = served_by_store_host(logs[0])
    # one link per other node; node 0's agent and 2 workers on its own node front-end (in
    # the store process, on the core: docs/architecture.md), none on the public port
    assert served["links_accepted"] == 2
    assert served["clients_accepted"] == 0
    assert served["node_frontend"]["clients_accepted"] >= 3
    assert served_by_store_host(logs[0], "node proxy") == served["node_frontend"]


def test_tiered_without_token_derives_one_and_warns(tmp_path):
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = [tierrun("--nnodes", 2, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                     "--master_port", port, "--node_rank", k, "--tiered", "--nproc_per_node", 1,
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k],
                     env={"TIERRUN_TOKEN": ""}) for k in range(2)]
    assert finish(procs) == [0, 0], logs[0].read_text()[-3000:]
    for k, log in enumerate(logs):  # what it protects, and what to do for a secret
        text = log.read_text()
        assert f"node 127.0.1.{k + 1}: no job token (TIERRUN_TOKEN_FILE or TIERRUN_TOKEN)" in text, text[-3000:]
        assert ("derived from the job id 'none' and the port of the store endpoint 127.0.1.1:" in text
                and "guards against accidents" in text and "not against attackers" in text)
        assert "For a secret, give every node the same one in the file TIERRUN_TOKEN_FILE names" in text
    check_world(results(*logs), 2, 3)


def test_a_job_of_up_to_64_nodes_is_tiered_in_a_tree_without_a_flag(tmp_path):
    """torchrun's flags only (c10d, --nnodes 2:64, no secret): the job's size chooses
    tiered wire-up in a tree of fanout 8 (``launcher.tiering``), here run by the 3 nodes
    that came: the workers talk to their node's proxy, the store host sees one link per
    other node and no torch client, and the nodes say what was chosen, at INFO."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    procs = [tierrun("--nnodes", "2:64", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.1.1:{port}",
                     "--rdzv_id", "auto", "--rdzv_conf", "last_call_timeout=3", "--nproc_per_node", 2,
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "collectives.py", log=logs[k],
                     env={"TIERRUN_TOKEN": "", "TIERRUN_LOG_LEVEL": "DEBUG"}) for k in range(3)]
    assert finish(procs) == [0, 0, 0], logs[0].read_text()[-3000:]
    check_world(results(*logs), 6, 21)
    for k, log in enumerate(logs):
        text = log.read_text()
        assert {r["master"].split(":")[0] for r in results(log)} == {"127.0.0.1"}
        assert (f"INFO node 127.0.1.{k + 1}: tiered wire-up in a tree of fanout 8, chosen for --nnodes 2:64"
                in text), text[-3000:]
        assert f"INFO node 127.0.1.{k + 1}: no job token" in text  # (a flat store authenticates nothing)
        assert not [line for line in text.splitlines() if "WARNING" in line and "job token" in line]
    served = served_by_store_host(logs[0])
    assert served["links_accepted"] == 2 and served["clients_accepted"] == 0


@pytest.mark.parametrize("case", ["flat host", "tiered host", "flat host, tree"])
def test_a_node_whose_store_layout_differs_from_the_store_hosts_stops_in_one_line(tmp_path, case):
    """The nodes of one job decide their store layout alone. When they differ -- a 64-node
    job whose store host alone was given --store-workers 2 (a store-host flag: it keeps
    the store flat) while the others tier by size, or the other way round, or a node of
    a tree whose store host was told --no-tiered -- the node that differs stops at once
    in one line saying what differs and what to write: not "refused the link" with no
    word of what to do, nor a minute of torch's C++ stack traces ending in "cannot reach
    the job's store"."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    if case == "flat host, tree":  # node rank 2's parent in the tree is node rank 1
        common = ("--nnodes", 3, "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1", "--master_port", port)
        flags = [(*common, "--node_rank", 0, "--no-tiered"), (*common, "--node_rank", 2, "--store-fanout", 2)]
    else:
        common = ("--nnodes", "2:64", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "mixed")
        flat = (*common, "--store-workers", 2)
        flags = [flat, common] if case == "flat host" else [common, flat]
    procs = [tierrun(*flags[k], "--nproc_per_node", 1, "--local_addr", f"127.0.1.{k + 1}",
                     SCRIPTS / "collectives.py", log=logs[k], env={"TIERRUN_TOKEN": ""}) for k in (0, 1)]
    try:
        started = time.monotonic()
        assert finish(procs[1:], timeout=90) == [1], logs[1].read_text()[-3000:]
        assert time.monotonic() - started < 30
        # the store host says it too (its store refused the other layout's connection)
        said = "the job's store refused a " + ("node link" if case.startswith("flat") else "torch-protocol client")
        while said not in logs[0].read_text() and time.monotonic() < started + 30:
            time.sleep(0.1)
        assert said in logs[0].read_text(), logs[0].read_text()[-3000:]
    finally:
        kill_tree(procs[0].pid)
        procs[0].wait()
    text = logs[1].read_text()
    assert "TCPStore.cpp" not in text and "Traceback" not in text, text[-3000:]
    last = text.splitlines()[-1]
    host = "a flat store (it takes no node links), but this node is tiered" if case.startswith("flat") else \
        "tiered wire-up (its port takes node links only), but this node's store is flat"
    assert last.startswith(f"tierrun: error: node 127.0.1.2: the job's store host 127.0.1.1:{port} runs {host}"), last
    assert "Give every node the same --nnodes, --tiered or --no-tiered, --store-fanout and --store-workers" in last


def test_the_store_host_says_why_it_refused_a_torch_client_of_a_tiered_job(tmp_path):
    """A tiered job's store port takes node links only. A worker whose script connects a
    TCPStore of its own to --master_addr/--rdzv_endpoint fails in torch's words ("Ping
    failed, invalid value returned from server"), and the store process's line saying
    why went nowhere: the store host's agent now says it, once per address, with what to
    do; so does a flat store host that a tiered node tried to link to."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = [tierrun("--nnodes", "2:64", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "own",
                     "--rdzv_conf", "last_call_timeout=2", "--nproc_per_node", 1, "--max_restarts", 0,
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "own_store_client.py", "127.0.1.1", port,
                     log=logs[k], env={"TIERRUN_TOKEN": ""}) for k in range(2)]
    assert 0 not in finish(procs)
    assert {r["store"] for r in results(*logs)} == {"failed"}
    said = [line for line in logs[0].read_text().splitlines()
            if "the job's store refused a torch-protocol client from 127.0." in line]
    assert len(said) == 1, logs[0].read_text()[-3000:]  # (torch's client retries: said once)
    assert said[0].startswith("[tierrun] WARNING node 127.0.1.1: ")
    assert ("$MASTER_ADDR:$MASTER_PORT" in said[0] and "--rdzv_conf store_public_clients=true" in said[0]
            and "--no-tiered" in said[0])


def test_torchruns_default_flags_honour_the_node_rank(tmp_path):
    """torchrun's multi-node command with no --rdzv_backend (its default, static):
    node ranks as given, whichever node starts first. Node rank 1 starts first here."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = []
    for k in (1, 0):
        procs.append(tierrun("--nnodes", 2, "--node_rank", k, "--nproc_per_node", 1, "--master_addr", "127.0.1.1",
                             "--master_port", port, "--local_addr", f"127.0.1.{k + 1}",
                             SCRIPTS / "collectives.py", log=logs[k]))
        time.sleep(1.0)
    assert finish(procs) == [0, 0], logs[0].read_text()[-3000:]
    for k in (0, 1):
        (row,) = results(logs[k])
        assert (row["group_rank"], row["rank"], row["world"]) == (str(k), str(k), "2"), logs[k].read_text()[-2000:]
        assert "node_rank is only used for static" not in logs[k].read_text()


def test_a_one_node_job_whose_store_port_is_taken_fails_at_once_and_never_joins_it(tmp_path):
    """torchrun fails with EADDRINUSE; tierrun's elastic backend would join whatever store
    listens there (torch's c10d rule for agents of one job on one machine): a second
    one-node job on the same --master_port waited as a spare and exited 0 without running."""
    port = free_port()
    slow = tmp_path / "slow.py"
    slow.write_text("import time, torch.distributed as dist\ndist.init_process_group('gloo')\ntime.sleep(20)\n"
                    "dist.destroy_process_group()\n")
    first = tierrun("--nnodes", "1", "--master_port", port, "--nproc_per_node", "1", slow, log=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None:
            with socket.socket() as probe:  # (the first job's store listens: the port is taken)
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        started = time.monotonic()
        second = tierrun("--nnodes", "1", "--master_port", port, "--nproc_per_node", "1", SCRIPTS / "ddp_toy.py",
                         log=tmp_path / "second.log")
        assert finish([second], timeout=60) == [1]
        assert time.monotonic() - started < 30
        said = (tmp_path / "second.log").read_text()
        assert (f"could not start the job's store on port {port} (port {port} is taken). Pick a free port with "
                "--master_port or --rdzv_endpoint HOST:PORT: a job of one node hosts its store itself") in said, said
        assert not results(tmp_path / "second.log")
    finally:
        assert finish([first]) == [0], (tmp_path / "first.log").read_text()[-3000:]
