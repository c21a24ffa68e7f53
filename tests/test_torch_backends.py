"""torch's own rendezvous backends still work through tierrun when asked for by name:
``torch-c10d``, ``torch-static`` (torch's c10d and static, whose names tierrun maps
to its own backends otherwise), ``etcd`` and ``etcd-v2`` (on a real etcd server)."""

import pytest

from etcd_server import EtcdServer
from launch import SCRIPTS, finish, free_port, results, tierrun


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd-data").start()
    yield server
    server.stop()


def run_two_nodes(tmp_path, backend: str, *flags) -> list[str]:
    """2 simulated nodes x 2 workers; returns the agents' logs after checking the job."""
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = [
        tierrun("--nnodes", 2, "--nproc_per_node", 2, "--rdzv_backend", backend,
                "--local_addr", f"127.0.1.{k + 1}", *[f.format(k=k) for f in flags],
                SCRIPTS / "collectives.py", log=logs[k], env={"LOGLEVEL": "INFO"})
        for k in range(2)
    ]
    assert finish(procs) == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    rows = results(*logs)
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2, 3], rows
    assert all(int(r["world"]) == 4 and int(r["sum"]) == 10 for r in rows), rows
    return [log.read_text() for log in logs]


def used_backend(log: str) -> str:
    """The backend torch's launcher was given, from its 'launch configs' log."""
    for line in log.splitlines():
        if " rdzv_backend " in line:
            return line.rsplit(":", 1)[1].strip()
    raise AssertionError("no launch config in the log:\n" + log[-2000:])


def test_torch_c10d(tmp_path):
    logs = run_two_nodes(tmp_path, "torch-c10d", "--rdzv_endpoint", f"127.0.1.1:{free_port()}",
                         "--rdzv_id", "tc")
    assert [used_backend(log) for log in logs] == ["c10d", "c10d"]


def test_torch_static(tmp_path):
    logs = run_two_nodes(tmp_path, "torch-static", "--master_addr", "127.0.1.1",
                         "--master_port", str(free_port()), "--node_rank", "{k}")
    assert [used_backend(log) for log in logs] == ["static", "static"]


def test_c10d_means_tierrun(tmp_path):
    logs = run_two_nodes(tmp_path, "c10d", "--rdzv_endpoint", f"127.0.1.1:{free_port()}",
                         "--rdzv_id", "tt")
    assert [used_backend(log) for log in logs] == ["tierrun", "tierrun"]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_etcd(tmp_path, etcd, backend):
    logs = run_two_nodes(tmp_path, backend, "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", backend)
    assert [used_backend(log) for log in logs] == [backend, backend]
