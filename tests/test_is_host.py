"""``--rdzv_conf is_host`` as torch's c10d backend reads it, in tierrun's elastic
backends driven as torch's agent drives them (each handler starts real store processes):
an inferred host whose store cannot start becomes a client; an explicit one fails in
one line. ``tierrun-etcd``: ``is_host`` chooses which nodes may host a round's store.
(Explicit hosting on a node the endpoint does not name, with real agents under torch's
own torchrun: ``test_torchrun_plugin.py``.)"""

import socket
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError, RendezvousParameters

from etcd_server import EtcdServer
from launch import SCRIPTS, finish, free_port, tierrun
from test_no_store_host import CPP_NOISE
from tierrun import rendezvous
from tierrun.rendezvous import elastic, etcd as etcd_backend, sockets
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
        assert str(e.value).startswith(f"node {socket.gethostname()}: could not start the job's store on port "
                                       f"{port} (port {port} is taken)"), str(e.value)
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


@pytest.mark.parametrize("backend", ["tierrun", "tierrun-etcd"])
def test_is_host_takes_torchs_spellings_and_names_a_wrong_one(backend):
    """``is_host`` is read as torch's ``get_as_bool`` reads it (1/0, true/false, yes/no,
    any case); another value fails naming the node, the setting and what to write, as a
    ``RendezvousError`` (one line from the tierrun command) and a ``ValueError`` (what
    torch's backends raise for it)."""
    endpoint = "127.0.1.1:29400" if backend == "tierrun" else "127.0.1.1:2379"  # (nothing is contacted)

    def create(value: str):
        return rendezvous.create(backend, RendezvousParameters(
            backend, endpoint, "spell", 2, 2, local_addr="127.0.1.2", is_host=value), Settings.from_env())

    for value, told in [("1", True), ("True", True), ("yes", True), ("Y", True),
                        ("0", False), ("FALSE", False), ("no", False)]:
        handler = create(value)
        if backend == "tierrun":  # the endpoint names another node: only is_host makes this one host
            assert handler.job.hosting is told, value
        else:
            assert handler._is_host is told, value
    with pytest.raises(RendezvousError) as e:
        create("maybe")
    assert isinstance(e.value, ValueError)
    assert str(e.value) == (
        f"node 127.0.1.2: --rdzv_backend {backend}: --rdzv_conf is_host=maybe is not a boolean: write "
        "is_host=true or is_host=false (torch's spellings: 1/true/t/yes/y or 0/false/f/no/n)")


def test_a_wrong_rdzv_conf_value_ends_the_tierrun_command_in_one_line(tmp_path):
    """Real ``tierrun`` processes: a value that is not a boolean or a number ends the
    command with exit code 1 and one line, no traceback (before: torch's traceback of a
    ValueError that named no node, and for join_timeout=abc not the setting either)."""
    for conf, said in [("is_host=maybe", "--rdzv_conf is_host=maybe is not a boolean: write is_host=true or "
                                          "is_host=false (torch's spellings: 1/true/t/yes/y or 0/false/f/no/n)"),
                       ("join_timeout=abc", "--rdzv_conf join_timeout=abc is not a number: write join_timeout=SECONDS")]:
        out = subprocess.run(
            [sys.executable, "-m", "tierrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_endpoint",
             "127.0.1.1:29400", "--rdzv_id", "wrong", "--rdzv_conf", conf, "--local_addr", "127.0.1.2",
             str(SCRIPTS / "sleep_worker.py")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-3000:]
        assert out.stderr.splitlines() == [f"tierrun: error: node 127.0.1.2: --rdzv_backend tierrun: {said}"], \
            out.stderr[-3000:]


def test_two_nodes_told_to_host(tmp_path):
    """``is_host=true`` on two nodes of one machine, the endpoint's first: the second's
    store cannot take the port, and it fails at once in one line naming itself and the
    port; the first waits for the missing node until join_timeout and ends in one line,
    with no C++ warnings from torch's client and no "joined" summary of a round that
    did not form (before: two "waitForInput ... timed out" warnings, then "1 nodes
    joined in 4.0 s", then the timeout)."""
    # (join: the second node must reach its store's start before the first gives up,
    # or it finds the port free again and hosts a job of its own, rightly; under a
    # loaded test run its agent takes up to ~7 s to get there, torch's import mostly)
    port, join = free_port(), 20
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    args = ("--nnodes", 2, "--nproc_per_node", 1, "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "two",
            "--rdzv_conf", f"is_host=true,join_timeout={join}", "--progress", "log", "--progress_interval", 1)
    first = tierrun(*args, "--local_addr", "127.0.1.1", SCRIPTS / "sleep_worker.py", log=logs[0])
    deadline = time.monotonic() + 60
    while not _listening("127.0.1.1", port):  # the first hosts the store
        assert time.monotonic() < deadline and first.poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.1)
    second = tierrun(*args, "--local_addr", "127.0.1.2", SCRIPTS / "sleep_worker.py", log=logs[1])
    second_code = finish([second], timeout=120)
    first_waited = first.poll() is None
    assert (second_code, finish([first], timeout=120)) == ([1], [1])
    assert first_waited, "the second node did not fail before the first's join_timeout: " + logs[1].read_text()[-3000:]
    host, other = (log.read_text() for log in logs)
    assert [line for line in other.splitlines() if "error" in line.lower()] == [
        f"tierrun: error: node 127.0.1.2: could not start the job's store on port {port} (port {port} is "
        "taken). Pick a free port with --master_port or --rdzv_endpoint HOST:PORT, or let another node host "
        "it (--rdzv_conf is_host=false here)."], other[-3000:]
    assert [line for line in host.splitlines() if line.startswith("tierrun: error:")] == [
        f"tierrun: error: rendezvous 'two' timed out after {join} s on node 127.0.1.1: 1 node(s) arrived "
        "(127.0.1.1), at least 2 needed (--nnodes 2:2); 1 more missing. Start tierrun on the missing nodes "
        "with the same --rdzv_endpoint and --rdzv_id, lower --nnodes, or raise --rdzv_conf "
        "join_timeout=SECONDS."], host[-3000:]
    assert "1/2 nodes after 1 s; waiting for at least 1 more node(s); joined: 127.0.1.1" in host, host[-3000:]
    assert " joined in " not in host and "Traceback" not in host, host[-3000:]
    for text in (host, other):
        assert not CPP_NOISE.search(text), text[-3000:]


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 1).close()
        return True
    except OSError:
        return False


def test_an_inferred_host_is_found_through_its_addresses(monkeypatch):
    """Without is_host, as torch's c10d infers it: the endpoint names this node if it is
    the node's --local_addr or resolves to it (a host name whose address is the
    node's), or, not a loopback name, if it names this machine; a loopback endpoint
    names only the simulated node whose address it is."""
    names = {"node0.cluster": {"10.0.0.1"}, "svc.cluster": {"10.0.9.9"}, "sim0": {"127.0.1.1"},
             "localhost": {"127.0.0.1", "::1"}}
    monkeypatch.setattr(sockets, "_addresses", lambda name: names.get(name, {name}))
    monkeypatch.setattr(sockets, "_matches_machine_hostname", lambda host: host in ("node0.cluster", "10.0.0.1"))
    assert sockets.hosts_store("node0.cluster", "10.0.0.1")  # resolves to the node's address
    assert sockets.hosts_store("node0.cluster", "192.168.0.1")  # this machine, another interface
    assert not sockets.hosts_store("svc.cluster", "10.0.0.1")  # a Service: is_host=true is for that
    assert sockets.hosts_store("sim0", "127.0.1.1") and not sockets.hosts_store("sim0", "127.0.1.2")
    assert not sockets.hosts_store("localhost", "127.0.1.2") and sockets.hosts_store("localhost", "127.0.0.1")
    assert sockets.hosts_store("127.0.1.1", "127.0.1.1") and not sockets.hosts_store("127.0.1.1", "127.0.1.2")


@pytest.mark.parametrize("endpoint, local_addr, hosts", [
    ("127.0.0.1:29400", None, True), ("127.0.0.1:29400", "127.0.1.3", True), ("localhost:29400", "127.0.1.3", True),
    ("127.0.1.3:29400", "127.0.1.3", True)])
def test_a_job_of_one_node_on_this_machine_hosts_its_store_and_never_joins_another(endpoint, local_addr, hosts):
    """Whatever --local_addr makes the node (a simulated one's loopback address, say), a
    one-node job whose endpoint is on this machine hosts the store, and one whose port is
    taken fails instead of joining what listens there (another job: it would wait as its
    spare and exit 0 without running)."""
    handler = elastic.create_handler(RendezvousParameters("tierrun", endpoint, "alone", 1, 1, local_addr=local_addr),
                                     Settings.from_env())
    assert (handler.job.hosting, handler.job.host_fallback) == (hosts, "never")
    two = elastic.create_handler(RendezvousParameters("tierrun", endpoint, "two", 1, 2, local_addr=local_addr),
                                 Settings.from_env())
    assert two.job.host_fallback == "any"  # (torch's c10d rule: another agent of the job on this machine)
