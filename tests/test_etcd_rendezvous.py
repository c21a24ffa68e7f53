"""The ``tierrun-etcd`` rendezvous on a real etcd server (Debian's etcd-server): the
round's store on its rank-0 node and re-hosted when that node is lost, elastic
membership, etcd unreachable at start, etcd restarted mid-job."""

import re
import signal
import threading
import time

import base64

import pytest
import requests
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError, RendezvousConnectionError, RendezvousParameters,
)

from etcd_server import Certificates, EtcdServer
from launch import SCRIPTS, finish, free_port, kill_tree, results, scale_up_out_of_phase, tierrun
from tierrun.rendezvous.etcd import create_handler
from tierrun.rendezvous.etcd_client import EtcdOptions
from tierrun.rendezvous.spare import SpareNotNeededError
from tierrun.settings import Settings

COMMON = ("--rdzv_backend", "tierrun-etcd", "--nproc_per_node", 1, "--max_restarts", 3,
          "--monitor_interval", "0.5")


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd-data").start()
    yield server
    server.stop()


def test_endpoint_lists_schemes_and_tls_options_are_parsed():
    o = EtcdOptions.parse("10.0.0.1, 10.0.0.2:2380,https://[::1]:2400", {})
    assert o.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2380", "https://[::1]:2400")
    o = EtcdOptions.parse("e1:2379", {"cacert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem"})
    assert o.endpoints == ("https://e1:2379",) and (o.cacert, o.cert, o.key) == ("/ca.pem", "/c.pem", "/k.pem")
    with pytest.raises(ValueError, match="cert= and key= go together"):
        EtcdOptions.parse("e1", {"cert": "/c.pem"})
    with pytest.raises(ValueError, match="TIERRUN_ETCD_PASSWORD"):
        EtcdOptions.parse("e1", {"username": "u"})
    with pytest.raises(ValueError, match="protocol=ftp"):
        EtcdOptions.parse("e1", {"protocol": "ftp"})
    assert EtcdOptions.parse("e1", {"username": "u"}, password="p").password == "p"


def _handler(etcd, run_id, addr, nnodes=(2, 4), endpoint=None, **conf):
    config = {"last_call_timeout": "1", "progress": "off", **conf}
    return create_handler(RendezvousParameters("tierrun-etcd", endpoint or etcd.endpoint, run_id, *nnodes,
                                               local_addr=addr, **config), Settings.from_env())


def _rendezvous_all(handlers):
    infos = [None] * len(handlers)

    def run(i):
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return infos


def test_rounds_stable_ranks_waiting_nodes_and_closing(etcd):
    """min 2, max 4: three nodes form round 0 after the last call, the rank-0 node
    hosts the store; a fourth is a waiting node the others see; round 1 keeps their
    ranks and store host; closing the job releases a fifth node, which waits as a spare
    (the round runs with the maximum)."""
    first = [_handler(etcd, "rounds", f"127.0.1.{k}") for k in (1, 2, 3)]
    infos = _rendezvous_all(first)
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    host = next(h for h, i in zip(first, infos) if i.rank == 0)
    assert host.job.hosting and all(not h.job.hosting for h in first if h is not host)
    assert {(h.job.host, h.job.port) for h in first} == {(host.job.host, host.job.port)}
    infos[0].store.set("k", "v")  # the agents' store of the round works
    assert infos[1].store.get("k") == b"v"

    late = _handler(etcd, "rounds", "127.0.1.4")
    late_info = []
    t = threading.Thread(target=lambda: late_info.append(late.next_rendezvous()))
    t.start()
    deadline = time.monotonic() + 20
    seen = []  # (each agent asks on its own: the first to see a join waits until all have)
    for h in first:
        threading.Thread(target=lambda h=h: seen.append(_sees_waiting(h, deadline)), daemon=True).start()
    while len(seen) < len(first) and time.monotonic() < deadline + 1:
        time.sleep(0.1)
    assert seen == [True] * len(first), "the running nodes never saw the waiting one"
    again = _rendezvous_all(first)
    t.join(30)
    assert [i.rank for i in again] == [i.rank for i in infos]  # stable
    assert late_info[0].rank == 3 and {i.world_size for i in again} == {4}
    assert host.job.hosting and late.job.port == host.job.port  # same store host

    waiting = _handler(etcd, "rounds", "127.0.1.5", nnodes=(2, 4))
    errors = []

    def wait_in_vain():
        try:
            waiting.next_rendezvous()
        except RendezvousClosedError as e:
            errors.append(e)

    w = threading.Thread(target=wait_in_vain)
    w.start()
    time.sleep(1)
    for h in [*first, late]:
        h.shutdown()
    w.join(30)
    assert errors and isinstance(errors[0], SpareNotNeededError) and "was not needed" in str(errors[0])
    waiting.shutdown()


def test_a_restart_after_losing_the_store_host_does_not_wait_for_its_lease(etcd):
    """The store host dies (its store closes; its etcd lease, 10 s, lives on). torch's
    agent restarts the survivors' failed workers by calling next_rendezvous without
    asking num_nodes_waiting first: next_rendezvous itself marks the host lost, so the
    next round closes as soon as both survivors are back, not after the lease or the
    20 s last call."""
    handlers = [_handler(etcd, "host-lost", f"127.0.1.{k}", nnodes=(2, 3), last_call_timeout="20")
                for k in (1, 2, 3)]
    infos = _rendezvous_all(handlers)
    host = next(h for h, i in zip(handlers, infos) if i.rank == 0)
    survivors = [h for h in handlers if h is not host]
    host._stop_round_watch()
    host._keepalive_stop.set()  # dead: no renewals, no revoke, its store's sockets close
    host.job.stop()
    deadline = time.monotonic() + 10
    while any(h.job.lost() is None for h in survivors):
        assert time.monotonic() < deadline, "the survivors never saw the store close"
        time.sleep(0.05)
    t0 = time.monotonic()
    again = _rendezvous_all(survivors)
    assert sorted(i.rank for i in again) == [0, 1] and {i.world_size for i in again} == {2}
    assert time.monotonic() - t0 < 6, "the re-form waited for the dead host's lease"
    for h in survivors:
        h.shutdown()


def test_too_few_nodes_time_out_naming_who_arrived(etcd):
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    lone = _handler(etcd, "too-few", "127.0.1.1", nnodes=(2, 2), join_timeout="2")
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"1 node\(s\) arrived \(127.0.1.1\), at least 2 needed"):
        lone.next_rendezvous()
    assert time.monotonic() - t0 < 10
    lone.shutdown()


def test_etcd_unreachable_at_start_is_a_clear_error(tmp_path):
    ports = free_port(), free_port()
    log = tmp_path / "node.log"
    proc = tierrun(*COMMON, "--nnodes", "1:2", "--rdzv_endpoint", f"127.0.0.1:{ports[0]},127.0.0.2:{ports[1]}",
                   "--rdzv_id", "nobody", "--local_addr", "127.0.1.1", SCRIPTS / "sleep_worker.py", log=log)
    t0 = time.monotonic()
    assert finish([proc], timeout=60) == [1], log.read_text()[-3000:]
    assert time.monotonic() - t0 < 30
    text = log.read_text()
    assert (f"tierrun: error: node 127.0.1.1 cannot reach etcd at http://127.0.0.1:{ports[0]}, "
            f"http://127.0.0.2:{ports[1]}") in text, text[-3000:]
    assert "connection refused" in text


def _three_nodes(tmp_path, etcd, run_id, *extra):
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    procs = [tierrun(*COMMON, *extra, "--nnodes", "2:3", "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", run_id,
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "heartbeat_worker.py", "--want", 2,
                     log=logs[k], env={"TIERRUN_LOG_LEVEL": "INFO"}) for k in range(3)]
    deadline = time.time() + 90
    while len(results(*logs, tag="UP")) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert {r["world"] for r in results(*logs, tag="UP")} == {"3"}, logs[0].read_text()[-3000:]
    return procs, logs


def test_scale_up_with_no_restart_to_spare(tmp_path, etcd):
    """As with the tierrun backend: a late node admitted with --max_restarts 0 (``scale_up_out_of_phase``)."""
    common = ("--rdzv_backend", "tierrun-etcd", "--nproc_per_node", 1, "--max_restarts", 0, "--nnodes", "2:3",
              "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", "up", "--rdzv_conf", "last_call_timeout=1")
    rows = scale_up_out_of_phase(tmp_path, *common)
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2] and {r["sum"] for r in rows} == {"6"}
    # a node that finished (it closes the job, then revokes its lease) is not taken for a dead one
    texts = [(tmp_path / f"node{k}.log").read_text() for k in range(3)]
    assert not any("is gone (its etcd lease ended)" in text for text in texts), texts


def test_a_member_whose_workers_fail_ends_the_job_for_the_others(tmp_path, etcd):
    """Node A's worker fails with no restart left: its agent closes the job, then revokes
    its lease. Node B, whose workers run on, stops within seconds saying the job ended
    (not after its workers' collective timeout), and does not take A for dead."""
    flag, logs = tmp_path / "fail", [tmp_path / f"node{k}.log" for k in range(2)]
    node = lambda k, *script: tierrun(
        "--rdzv_backend", "tierrun-etcd", "--nproc_per_node", 1, "--max_restarts", 0, "--nnodes", "1:2",
        "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", "fails", "--rdzv_conf", "last_call_timeout=2",
        "--local_addr", f"127.0.1.{k + 1}", *script, log=logs[k])
    procs = [node(0, SCRIPTS / "fail_when_told.py", "--fail-file", flag), node(1, SCRIPTS / "sleep_worker.py")]
    deadline = time.time() + 60
    while sum("UP rank" in log.read_text() for log in logs if log.exists()) < 2 and time.time() < deadline:
        time.sleep(0.2)
    flag.touch()
    told = time.monotonic()
    assert finish(procs, timeout=60) == [1, 1], logs[1].read_text()[-3000:]
    assert time.monotonic() - told < 30
    text = logs[1].read_text()
    assert "tierrun: error: rendezvous 'fails' is closed: the job has ended" in text, text[-3000:]
    assert "is gone (its etcd lease ended)" not in text, text[-3000:]


def _store_host(log) -> str:
    return re.findall(r"store on ([\d.]+):\d+\)", log.read_text())[-1]


@pytest.mark.parametrize("fault", ["killed-flat", "frozen-tiered"])
def test_losing_the_store_host_node_the_others_reform_on_a_new_store(tmp_path, etcd, fault):
    """kill -9 (its sockets close) or SIGSTOP (silent: only its etcd lease tells) the node
    that hosts the round's store, node 0 of the job; the other two pick a new host,
    start a fresh store there and finish with the right ranks and sums."""
    # frozen: only the lease tells, so a short one; killed: the default (10 s) lease,
    # but the survivors see the store's connections close and do not wait for it
    extra = ("--tiered", "--rdzv_conf", "heartbeat_timeout=3") if fault.endswith("tiered") else ()
    procs, logs = _three_nodes(tmp_path, etcd, fault, *extra)
    host = _store_host(logs[0])
    victim = int(host.rsplit(".", 1)[1]) - 1
    survivors = [k for k in range(3) if k != victim]
    t_fault = time.time()
    kill_tree(procs[victim].pid, signal.SIGKILL if fault.startswith("killed") else signal.SIGSTOP)
    try:
        codes = finish([procs[k] for k in survivors], timeout=120)
    finally:
        kill_tree(procs[victim].pid, signal.SIGKILL)
    assert codes == [0, 0], logs[survivors[0]].read_text()[-3000:]
    rows = results(*(logs[k] for k in survivors))
    assert sorted(int(r["rank"]) for r in rows) == [0, 1] and {r["sum"] for r in rows} == {"2"}
    new_hosts = {_store_host(logs[k]) for k in survivors}
    assert len(new_hosts) == 1 and host not in new_hosts
    up = [float(r["t"]) for r in results(*(logs[k] for k in survivors), tag="UP") if r["world"] == "2"]
    # killed: faster than the 10 s lease (2.4 s here); frozen: the 3 s lease, then re-form
    assert len(up) == 2 and max(up) - t_fault < (9 if fault.startswith("killed") else 20), (up, t_fault)


def test_etcd_restarted_mid_job_the_job_goes_on(tmp_path, etcd):
    """etcd killed and back after longer than a lease TTL: the workers (whose store is
    tierrun's) never notice, no node is declared dead, no restart."""
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = [tierrun(*COMMON, "--nnodes", "2", "--rdzv_conf", "heartbeat_timeout=3",
                     "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", "restart",
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "steady_worker.py", "--seconds", 15,
                     log=logs[k]) for k in range(2)]
    deadline = time.time() + 60
    while len(results(*logs, tag="UP")) < 2 and time.time() < deadline:
        time.sleep(0.2)
    etcd.stop(kill=True)
    time.sleep(5)  # > the 3 s lease TTL
    etcd.start()
    assert finish(procs, timeout=90) == [0, 0], logs[0].read_text()[-3000:]
    rows = results(*logs)
    assert sorted(int(r["rank"]) for r in rows) == [0, 1]
    assert {r["restart"] for r in rows} == {"0"} and {r["sum"] for r in rows} == {"3"}
    assert "cannot reach etcd" in logs[0].read_text() + logs[1].read_text()


def _pair_rendezvous(etcd, run_id, **conf):
    pair = [_handler(etcd, run_id, f"127.0.1.{k}", nnodes=(2, 2), **conf) for k in (1, 2)]
    try:
        infos = _rendezvous_all(pair)
        assert sorted(i.rank for i in infos) == [0, 1]
    finally:
        for h in pair:
            h.shutdown()


def test_tls_options_are_passed_through(tmp_path):
    """etcd serving https only and requiring client certificates: the rendezvous works
    with cacert/cert/key, and without the client certificate fails naming the endpoint."""
    certs = Certificates(tmp_path / "certs")
    server = EtcdServer(tmp_path / "etcd-data", tls=certs).start()
    try:
        _pair_rendezvous(server, "tls", cacert=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key))
        lone = _handler(server, "tls-no-cert", "127.0.1.1", nnodes=(1, 1), cacert=str(certs.ca))
        with pytest.raises(RendezvousConnectionError, match=f"cannot reach etcd at https://127.0.0.1:{server.port}"):
            lone.next_rendezvous()
    finally:
        server.stop()


def test_etcd_authentication_with_a_password_from_the_environment(tmp_path, etcd, monkeypatch):
    url = f"http://{etcd.endpoint}/v3"
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    for path, body in [("/auth/user/add", {"name": "root", "password": "rootpw"}),
                       ("/auth/role/add", {"name": "root"}),
                       ("/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/auth/user/add", {"name": "trainer", "password": "s3cret"}),
                       ("/auth/role/add", {"name": "jobs"}),
                       ("/auth/role/grant", {"name": "jobs", "perm": {"permType": "READWRITE",
                                             "key": b64("/tierrun/"), "range_end": b64("/tierrun0")}}),
                       ("/auth/user/grant", {"user": "trainer", "role": "jobs"}),
                       ("/auth/enable", {})]:
        reply = requests.post(url + path, json=body, timeout=5)
        assert reply.status_code == 200, (path, reply.text)
    monkeypatch.setenv("TIERRUN_ETCD_PASSWORD", "s3cret")
    _pair_rendezvous(etcd, "auth", username="trainer")
    monkeypatch.setenv("TIERRUN_ETCD_PASSWORD", "wrong")
    with pytest.raises(RendezvousConnectionError, match="refused user 'trainer': .*authentication failed"):
        _handler(etcd, "auth-wrong", "127.0.1.1", nnodes=(1, 1), username="trainer").next_rendezvous()


def _sees_waiting(handler, deadline: float) -> bool:
    while handler.num_nodes_waiting() == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
