"""A store process short of file descriptors says so and keeps serving: it raises its
own limit, and past it refuses connections (closed at once, the limit named), where
``accept`` failed with EMFILE and libuv closed the waiting connections without a word
(a client saw its connection closed, nobody saw why)."""

import os
import re
import resource
import socket
import subprocess
import sys
import time

import pytest

from tierrun.client import StoreClient
from tierrun.server import open_files

from launch import free_port


@pytest.mark.parametrize("asked, soft, keep, cap", [
    (65536, 1024, 30, 994),
    (100, 1024, 30, 100),
    (65536, 20, 30, 1),  # (a limit below what the process keeps: 1 at least)
])
def test_connections_stay_below_the_open_files_limit(asked, soft, keep, cap):
    assert open_files.connection_cap(asked, soft, keep) == cap
    assert open_files.kept(10) == 10 + open_files.RESERVE


def _run(code: str, limits: tuple[int, int]) -> str:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)

    return subprocess.run([sys.executable, "-c", code], preexec_fn=preexec, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_a_store_process_raises_its_soft_limit_to_its_hard_one():
    code = "from tierrun.server import open_files; import resource; " \
           "print(open_files.raise_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    assert _run(code, (256, 512)).split() == ["512", "512"]
    assert _run(code, (300, 300)).split() == ["300", "300"]


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:  # (reset)
        return True


def test_a_store_out_of_descriptors_refuses_the_excess_and_keeps_serving():
    """``tierrun store`` with 128 open files at most (hard limit too): 200 connections
    arrive. The excess is closed at once with a line naming the limit; a client
    connected before is served throughout; once the crowd leaves, a new client is
    served (the listener is still open)."""
    port = free_port()

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    proc = subprocess.Popen([sys.executable, "-m", "tierrun", "store", "--host", "127.0.1.1", "--port", str(port)],
                            preexec_fn=preexec, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    crowd: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                first = StoreClient(("127.0.1.1", port), timeout=10)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the store did not start"
                time.sleep(0.1)
        assert first.add(b"count", 1) == 1
        for _ in range(200):
            crowd.append(socket.create_connection(("127.0.1.1", port), timeout=10))
        time.sleep(1.0)
        closed = sum(_closed_by_peer(s) for s in crowd)  # (the refused ones)
        assert 200 - (128 - open_files.RESERVE) <= closed < 200 - 64, closed
        assert first.add(b"count", 1) == 2  # (served while the store is full)
        for s in crowd:
            s.close()
        crowd.clear()
        time.sleep(1.0)
        with StoreClient(("127.0.1.1", port), timeout=10) as later:  # (still listening)
            assert later.add(b"count", 1) == 3
        first.close()
    finally:
        for s in crowd:
            s.close()
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert proc.returncode in (0, -15), err
    assert re.search(r"the limit: this process may open 128 files and keeps \d\d for itself; raise the hard "
                     r"open-files limit, ulimit -Hn, to take more\); \d+ refused so far", err), err


def test_the_launcher_says_early_when_the_store_host_could_not_take_a_flat_job():
    """A flat job of up to 40 nodes x 8 workers (360 connections at its store host) on
    nodes that may open 256 files: the node that hosts the store says so before the job
    forms, with what to do, instead of the job failing later on refused connections
    (the others, which never host it, say nothing). Tiered, the same job needs 49
    connections: nothing is said."""
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    def launch(*layout: str, rank: int = 0) -> str:
        return subprocess.run(
            [sys.executable, "-m", "tierrun", "--nnodes", "40", "--nproc_per_node", "8", *layout,
             "--rdzv_backend", "parallel", "--node_rank", str(rank), "--master_addr", "127.0.1.1", "--master_port",
             str(free_port()), "--local_addr", f"127.0.1.{rank + 1}", "--rdzv_conf", "timeout=2", "-m", "this"],
            preexec_fn=preexec, capture_output=True, text=True, timeout=120, env={**os.environ, "TIERRUN_TOKEN": "t"},
        ).stderr

    flat = launch("--no-tiered")
    assert ("node 127.0.1.1: a flat job of up to 40 nodes x 8 workers brings about 360 connections to its store "
            "host, but a store process here may open at most 256 files (the hard limit, ulimit -Hn) and takes at "
            "most 236 connections: past that, connections are refused and the job cannot form. Raise the hard "
            "limit of open files (guide: System limits). Or run tiered (--tiered, or --store-fanout 8), which "
            "needs one connection per node.") in flat, flat
    tiered = launch("--tiered")
    assert "brings about" not in tiered, tiered
    other = launch("--no-tiered", rank=1)  # (a node that never hosts the store says nothing)
    assert "brings about" not in other, other


def test_a_job_whose_store_refuses_connections_past_its_limit_says_so(tmp_path):
    """A store at its limit of connections (40 open files here) refuses the excess in
    its own output, which nobody reads: the node's agent says it (once, naming the
    limit), or the job would wait with nothing said (a worker retrying its connection
    for 30 minutes)."""
    script = tmp_path / "crowd.py"
    script.write_text("import os, socket, time\nheld = []\nfor _ in range(40):\n    try:\n"
                      "        held.append(socket.create_connection((os.environ['MASTER_ADDR'], "
                      "int(os.environ['MASTER_PORT'])), timeout=5))\n    except OSError:\n        pass\n"
                      "time.sleep(2)\n")

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    out = subprocess.run([sys.executable, "-m", "tierrun", "--standalone", "--nproc_per_node", "1", str(script)],
                         preexec_fn=preexec, capture_output=True, text=True, timeout=120)
    said = [line for line in out.stderr.splitlines() if "the job's store refuses connections" in line]
    assert len(said) == 1, out.stderr[-3000:]
    assert re.search(r"\d+ connections open \(the limit: this process may open 40 files and keeps \d+ for itself; "
                     r"raise the hard open-files limit, ulimit -Hn, to take more\); \d+ refused so far", said[0]), said


def test_front_ends_of_one_process_share_its_limit():
    """A store host's public port and its node front-end (where node 0's agent and
    workers connect) live in one process: they share its open files, so one budget,
    not one each (80 + 80 connections at 128 files ran it out of descriptors, and the
    excess was dropped without a line)."""
    port, unix = free_port(), f"@tierrun-test-{os.getpid()}-fds"

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    proc = subprocess.Popen([sys.executable, "-m", "tierrun", "store", "--host", "127.0.1.1", "--port", str(port),
                             "--node-frontend", "--node-frontend-unix", unix], preexec_fn=preexec,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TIERRUN_TOKEN": "fds"})
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                StoreClient(unix, timeout=10).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the store did not start"
                time.sleep(0.1)
        for _ in range(80):
            held.append(socket.create_connection(("127.0.1.1", port), timeout=10))
        for _ in range(80):
            s = socket.socket(socket.AF_UNIX)
            s.connect("\0" + unix[1:])
            held.append(s)
        time.sleep(1.0)
        still_open = sum(not _closed_by_peer(s) for s in held)
        assert still_open <= 128 - open_files.RESERVE, still_open
    finally:
        for s in held:
            s.close()
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "refusing connection from" in err and "refused so far" in err, err
