"""Jobs in which no node hosts the store end after the join timeout, in one line that
says what happened, on which node and what to do: real ``tierrun`` processes, 2
simulated nodes. ``tierrun`` with ``--rdzv_conf is_host=false`` on every node (flat and
tiered); ``tierrun-etcd`` where one node is told is_host=false and the other's
``store_port`` is taken."""

import re
import socket
import time

import pytest

from etcd_server import EtcdServer
from launch import SCRIPTS, finish, free_port, tierrun

#: what torch's C++ code prints: its log lines ("[W1126 03:30:00.123 socket.cpp:...]"),
#: and the stack traces of its exceptions
CPP_NOISE = re.compile(r"^\[?[WE]\d{4} |frame #\d+|Exception raised from", re.MULTILINE)


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("tierrun: error:")]


@pytest.mark.parametrize("tiered", [False, True])
def test_nobody_hosts_the_store_each_node_gives_up_after_join_timeout(tmp_path, tiered):
    port, join = free_port(), 8
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    extra, env = (["--tiered"], {"TIERRUN_TOKEN": "no-host"}) if tiered else ([], {})
    started = time.monotonic()
    procs = [tierrun("--nnodes", 2, "--nproc_per_node", 1, "--rdzv_backend", "tierrun",
                     "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "no-host",
                     "--rdzv_conf", f"is_host=false,join_timeout={join}", "--local_addr", f"127.0.1.{k + 1}",
                     *extra, SCRIPTS / "sleep_worker.py", log=logs[k], env=env) for k in range(2)]
    codes = finish(procs, timeout=150)
    elapsed = time.monotonic() - started
    texts = [log.read_text() for log in logs]
    assert codes == [1, 1], texts[0][-3000:]
    # join_timeout, plus each agent's start (Python, torch) on a loaded machine; before,
    # every node waited max(join_timeout, 60) s per store connection attempt, ~3.5 min
    assert join <= elapsed < join + 25, (elapsed, texts[0][-3000:])
    for k, text in enumerate(texts):
        assert _errors(text) == [
            f"tierrun: error: node 127.0.1.{k + 1}: no store at 127.0.1.1:{port} after {join} s; this node "
            "does not host it (--rdzv_conf is_host=false). One node must host the store: set is_host=true on "
            "the endpoint's node, or leave is_host unset so the endpoint's host is inferred."], text[-3000:]
        assert not CPP_NOISE.search(text) and "Traceback" not in text, text[-3000:]
        # the notice while it waits names the same deadline
        assert f"still waiting for the job's store host 127.0.1.1:{port} after 5 s (giving up after {join} s)" in text


def test_tierrun_etcd_when_no_node_may_host_the_store_says_why_and_names_store_port(tmp_path):
    """Node 127.0.1.1 is told is_host=false; 127.0.1.2 may host, but its store_port is
    taken: round 0 picks it, its store cannot start, the round re-forms with both as
    clients, and no round can close. Each node ends after join_timeout naming why the
    nodes it sees may not host, and the setting to change: store_port (not --master_port). The
    first to give up does not close the job on the other (it was never a member of a
    round): both say they timed out, not "was closed while node ... waited"."""
    server = EtcdServer(tmp_path / "etcd-data").start()
    taken = socket.socket()
    taken.bind(("0.0.0.0", free_port()))
    taken.listen()
    busy = taken.getsockname()[1]
    join = 10
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    confs = ["is_host=false", f"store_port={busy}"]
    try:
        procs = [tierrun("--nnodes", 2, "--nproc_per_node", 1, "--rdzv_backend", "tierrun-etcd",
                         "--rdzv_endpoint", server.endpoint, "--rdzv_id", "no-etcd-host",
                         "--rdzv_conf", f"{confs[k]},join_timeout={join},last_call_timeout=1",
                         "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "sleep_worker.py", log=logs[k])
                 for k in range(2)]
        codes = finish(procs, timeout=150)
    finally:
        taken.close()
        server.stop()
    texts = [log.read_text() for log in logs]
    assert codes == [1, 1], texts[1][-3000:]
    why = ["127.0.1.1: --rdzv_conf is_host=false", f"127.0.1.2: its store could not start on store_port {busy}"]
    errors = [_errors(text) for text in texts]
    for k, text in enumerate(texts):
        assert len(errors[k]) == 1, text[-3000:]
        said = errors[k][0]
        assert said.startswith(f"tierrun: error: rendezvous 'no-etcd-host' timed out after {join} s on node "
                               f"127.0.1.{k + 1}: "), said
        assert "but none of them may host the round's store (" in said and why[k] in said, said
        assert said.endswith("One node must host it: on one node leave --rdzv_conf is_host unset (or set "
                             "is_host=true), with a free --rdzv_conf store_port (0, the default, takes any "
                             "free port)."), said
        assert "more missing" not in text and "--master_port" not in text, text[-3000:]
    # the first to give up names both nodes and why; the other may find it gone by then
    # (it left: its lease revoked), and names what it still sees
    assert any("2 node(s) arrived (" in e[0] and "enough for --nnodes 2:2" in e[0] and all(w in e[0] for w in why)
               for e in errors), errors
    # the node whose store could not start said so when it happened, naming the setting
    assert (f"could not start the job's store on port {busy} (port {busy} is taken). Pick a "
            "free port with --rdzv_conf store_port=N (0, the default: any free port)") in texts[1], texts[1][-3000:]


@pytest.mark.parametrize("backend, conf", [("parallel", "timeout=3"), ("tierrun", "join_timeout=3")])
def test_a_store_port_that_accepts_but_never_answers_ends_the_node_in_its_timeout(tmp_path, backend, conf):
    """Something holds the store port and accepts connections but answers nothing (a
    frozen store host, another program): torch's client would wait past any timeout
    (it did: a flat node still waited after 55 s of a 5 s timeout, then printed C++
    stack traces once the listener went away). The node gives up within its timeout,
    in one line that names the node and what to check."""
    log = tmp_path / "node.log"
    with socket.socket() as silent:
        silent.bind(("127.0.1.1", 0))
        silent.listen(64)  # (accepts into the backlog, never reads, never answers)
        port = silent.getsockname()[1]
        started = time.monotonic()
        rank = ["--node_rank", 1, "--master_addr", "127.0.1.1", "--master_port", port] if backend == "parallel" \
            else ["--rdzv_endpoint", f"127.0.1.1:{port}"]
        p = tierrun("--nnodes", 2, "--nproc_per_node", 1, "--rdzv_backend", backend, *rank,
                    "--rdzv_conf", conf, "--local_addr", "127.0.1.2", SCRIPTS / "sleep_worker.py", log=log)
        codes = finish([p], timeout=60)
    elapsed = time.monotonic() - started
    text = log.read_text()
    assert codes == [1] and elapsed < 3 + 25, (codes, elapsed, text[-3000:])
    assert _errors(text) == [
        f"tierrun: error: node 127.0.1.2: something at 127.0.1.1:{port} accepts connections but did not answer "
        "as a store within 3 s: the store host may be overloaded or frozen (stopped, swapping), or another program "
        "holds that port. Check node rank 0 / the --rdzv_endpoint host, and that nothing else listens on the store "
        "port."
    ], text[-3000:]
    assert not CPP_NOISE.search(text) and "Traceback" not in text, text[-3000:]


def test_a_tiered_node_at_a_store_port_that_never_answers_says_so_while_it_waits(tmp_path):
    """As above, tiered: the node's proxy links to the port, which takes the connection
    and never answers the link handshake. The proxy says so after 2 s and the agent's
    waiting notices and final line name a silent listener (they asked "is that node
    up?", which sent a person to check a node that was up)."""
    log = tmp_path / "node.log"
    with socket.socket() as silent:
        silent.bind(("127.0.1.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        p = tierrun("--nnodes", 2, "--nproc_per_node", 1, "--rdzv_backend", "parallel", "--node_rank", 1,
                    "--master_addr", "127.0.1.1", "--master_port", port, "--tiered", "--rdzv_conf",
                    "timeout=8,progress_interval=2", "--local_addr", "127.0.1.2", SCRIPTS / "sleep_worker.py",
                    log=log, env={"TIERRUN_TOKEN": "silent"})
        codes = finish([p], timeout=60)
    text = log.read_text()
    assert codes == [1], text[-3000:]
    waiting = [line for line in text.splitlines() if f"still waiting for the job's store host 127.0.1.1:{port}" in line]
    assert waiting and "Something there accepts connections but does not answer as a store" in waiting[-1], \
        text[-3000:]
    assert _errors(text) == [
        f"tierrun: error: node 127.0.1.2: no store at 127.0.1.1:{port} after 8 s; something there accepts "
        "connections but does not answer as a store: the store host may be overloaded or frozen (stopped, swapping), "
        "or another program holds that port. Check node rank 0 / the --rdzv_endpoint host, and that nothing else "
        "listens on the store port."], text[-3000:]
    assert not CPP_NOISE.search(text) and "Traceback" not in text, text[-3000:]


def test_node_0_whose_store_port_is_taken_says_so_at_once(tmp_path):
    """Node rank 0 of a static job cannot start the store: another program holds the
    port. It says so in one line, without first trying to publish its record to that
    program for the report (it waited 10 s on it: two 5 s timeouts)."""
    log = tmp_path / "node0.log"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        p = tierrun("--nnodes", 2, "--node_rank", 0, "--master_addr", "127.0.1.1", "--master_port", port,
                    "--local_addr", "127.0.1.1", "--nproc_per_node", 1, SCRIPTS / "sleep_worker.py", log=log)
        codes = finish([p], timeout=60)
    elapsed, text = time.monotonic() - started, log.read_text()
    assert codes == [1] and _errors(text) == [
        f"tierrun: error: node 127.0.1.1: could not start the job's store on port {port} (port {port} is taken). "
        "Pick a free port with --master_port or --rdzv_endpoint HOST:PORT (node rank 0 hosts a parallel job's "
        "store, and never joins a store it did not start: another job's, maybe), or, if this job's node rank 0 "
        "runs already there, give this node its own --node_rank."], text[-3000:]
    assert "cannot publish this node's record" not in text and elapsed < 9, (elapsed, text[-3000:])


def test_the_endpoint_node_whose_port_another_program_holds_says_so_while_it_waits(tmp_path):
    """The endpoint is this machine's, but another program listens on its port and never
    answers: the node cannot host the store there and waits for it as a client (another
    agent of the job on this machine might host it). It says every progress interval
    that it still waits, and that something there takes connections without answering,
    not only once join_timeout is over (it said nothing for 600 s by default)."""
    log = tmp_path / "node.log"
    with socket.socket() as silent:
        silent.bind(("0.0.0.0", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        p = tierrun("--nnodes", "1:2", "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.0.1:{port}",
                    "--rdzv_id", "held", "--rdzv_conf", "join_timeout=8,progress_interval=2",
                    SCRIPTS / "sleep_worker.py", log=log)
        codes = finish([p], timeout=60)
    text = log.read_text()
    assert codes == [1], text[-3000:]
    waiting = [line for line in text.splitlines() if f"still waiting for the job's store host 127.0.0.1:{port}" in line]
    assert waiting and all("Something there accepts connections but does not answer as a store" in line
                           for line in waiting[1:]), text[-3000:]
    assert len(_errors(text)) == 1 and "accepts connections but did not answer as a store within 8 s" in text, \
        text[-3000:]


def test_a_store_host_name_that_does_not_resolve_is_named(tmp_path):
    log = tmp_path / "node.log"
    p = tierrun("--nnodes", 2, "--node_rank", 1, "--nproc_per_node", 1, "--master_addr", "nosuchhost.invalid",
                "--master_port", free_port(), "--rdzv_conf", "timeout=6,progress_interval=2",
                "--local_addr", "127.0.1.2", SCRIPTS / "sleep_worker.py", log=log)
    codes = finish([p], timeout=60)
    text = log.read_text()
    assert codes == [1], text[-3000:]
    assert ("still waiting for the job's store host nosuchhost.invalid" in text
            and "The name nosuchhost.invalid does not resolve from this node" in text), text[-3000:]
    [error] = _errors(text)
    assert error.endswith("the name nosuchhost.invalid does not resolve from this node: check its spelling, and "
                          "that this node's DNS (or /etc/hosts) knows it."), error
    assert not CPP_NOISE.search(text) and "Traceback" not in text, text[-3000:]
