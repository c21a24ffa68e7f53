"""Secrets never reach a training worker: neither the job token nor the etcd password is
in any worker's environment (as the worker sees it, nor in ``/proc/<pid>/environ``), nor
in the store processes' (they get the token through a pipe); under tierrun's launcher and
under torch's own torchrun alike."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from launch import SCRIPTS, descendants, finish, free_port, kill_tree, results, tierrun
from tierrun.server import StoreProcess, StoreStartError

TOKEN = "tok-5f3a9c1e-never-in-a-worker"
PASSWORD = "pw-81d0c2-never-in-a-worker"
SECRET_ENV = {"TIERRUN_TOKEN": TOKEN, "TIERRUN_ETCD_PASSWORD": PASSWORD}


def environ_of(pid: int) -> bytes:
    """``/proc/<pid>/environ``: the environment the process was started with."""
    return Path(f"/proc/{pid}/environ").read_bytes()


def cmdline_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def wait_for_rows(logs: list[Path], count: int, procs: list[subprocess.Popen], timeout: float = 90) -> list[dict]:
    """The ``ENV`` lines of ``count`` workers, once printed (they then wait for release)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = results(*logs, tag="ENV")
        if len(rows) >= count:
            return rows
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError("\n".join(log.read_text()[-3000:] for log in logs))
        time.sleep(0.1)


def check_no_secret(procs: list[subprocess.Popen], rows: list[dict], secrets: tuple[str, ...]) -> list[str]:
    """Every worker's and store process's /proc environ holds none of ``secrets``;
    returns the command lines of the store processes seen."""
    workers = {int(r["pid"]) for r in rows}
    store_processes = []
    for p in procs:
        for pid in descendants(p.pid):
            try:
                environ, cmdline = environ_of(pid), cmdline_of(pid)
            except OSError:
                continue  # (ended meanwhile)
            if pid in workers or " -m tierrun " in cmdline:
                for secret in secrets:
                    assert secret.encode() not in environ, f"{secret} in the environment of {cmdline}"
                    assert secret not in cmdline, cmdline
            if " -m tierrun store" in cmdline or " -m tierrun proxy" in cmdline:
                store_processes.append(cmdline)
    assert workers <= {pid for p in procs for pid in descendants(p.pid)}
    return store_processes


def test_no_worker_or_store_process_inherits_a_secret(tmp_path):
    """2 nodes, tiered, TIERRUN_TOKEN and TIERRUN_ETCD_PASSWORD in every agent's
    environment: no worker sees either (os.environ, /proc/<pid>/environ), nor does any
    store process (the store and the proxy read the token from a pipe)."""
    port, release = free_port(), tmp_path / "release"
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    env = {**SECRET_ENV, "ENV_WORKER_RELEASE": str(release)}
    procs = [tierrun("--nnodes", 2, "--node_rank", k, "--nproc_per_node", 1, "--rdzv_backend", "parallel",
                     "--master_addr", "127.0.1.1", "--master_port", port, "--tiered",
                     "--local_addr", f"127.0.1.{k + 1}", SCRIPTS / "env_worker.py", log=logs[k], env=env)
             for k in range(2)]
    try:
        rows = wait_for_rows(logs, 2, procs)
        stores = check_no_secret(procs, rows, (TOKEN, PASSWORD))
        assert any(" store " in c and "--token-fd" in c for c in stores), stores  # node 0's store
        assert any(" proxy " in c and "--token-fd" in c for c in stores), stores  # node 1's proxy
    finally:
        release.touch()
    assert finish(procs, timeout=60) == [0, 0], logs[0].read_text()[-3000:]
    rows = results(*logs, tag="ENV")
    assert sorted(int(r["rank"]) for r in rows) == [0, 1] and all(r["sum"] == "3" for r in rows)
    for r in rows:  # as the worker itself sees its environment
        names = r["names"].split(",")
        assert "TIERRUN_TOKEN" not in names and "TIERRUN_ETCD_PASSWORD" not in names, names
        assert "MASTER_ADDR" in names and "RANK" in names


def test_torchrun_workers_inherit_no_secret(tmp_path):
    """Under torch's own torchrun (tierrun's backend, tiered), the handler takes the
    secrets out of torchrun's environment before torch starts a worker."""
    release = tmp_path / "release"
    log = tmp_path / "torchrun.log"
    env = dict(os.environ, **SECRET_ENV, ENV_WORKER_RELEASE=str(release), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    code = ("import sys, tierrun.torchrun_plugin as p; p.register(); "
            "from torch.distributed.run import main; sys.exit(main())")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "tierrun",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "secrets",
             "--rdzv-conf", "tiered=1,is_host=true", str(SCRIPTS / "env_worker.py")],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rows = wait_for_rows([log], 2, [proc])
        check_no_secret([proc], rows, (TOKEN, PASSWORD))
    finally:
        release.touch()
    assert finish([proc], timeout=60) == [0], log.read_text()[-3000:]


def test_store_processes_take_the_token_from_a_pipe():
    """StoreProcess(token=...) hands the token over a pipe (--token-fd): it is in neither
    the environment nor the command line; any bytes will do; a proxy with another token
    is refused."""
    token = b"\x00binary token\xff\n"
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    with StoreProcess(port=0, controlled=True, env=env, token=token) as root:
        with StoreProcess(command="proxy", host="127.0.0.1", port=0, controlled=True, env=env, token=token,
                          extra_args=["--upstream", f"127.0.0.1:{root.port}"]) as proxy:
            for p in (root, proxy):
                assert b"binary token" not in environ_of(p.pid)
                assert "--token-fd" in cmdline_of(p.pid) and "binary" not in cmdline_of(p.pid)
            assert root.stats()["links"] == 1
        bad = StoreProcess(command="proxy", host="127.0.0.1", port=0, env=env, token=token[:-1],
                           extra_args=["--upstream", f"127.0.0.1:{root.port}", "--connect-timeout", "5"])
        try:
            bad.start()
            raise AssertionError("a proxy with another token linked")
        except StoreStartError as e:
            assert "wrong job token" in str(e)
