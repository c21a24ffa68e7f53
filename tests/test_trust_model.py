"""Who may reach what: a tiered job's store host takes only links on its public port;
Unix-socket clients of another user are refused; ``--unix PATH`` never deletes what is
not its socket; round listeners close with their round; node rank 0 of a ``parallel``
job fails clearly when its port is taken. Real store processes, adversarial clients on
raw sockets, and an unrelated client that keeps being served."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from launch import free_port
from tierrun.client import StoreClient
from tierrun.frontend.listen import tcp_listen_socket
from tierrun.rendezvous import parallel
from tierrun.rendezvous.job_store import JobStore
from tierrun.server import StoreProcess, StoreStartError
from tierrun.settings import Settings

TOKEN = {"TIERRUN_TOKEN": "trust-model"}


def wait_for(predicate, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def refused(connect, timeout: float = 2.0) -> bool:
    """Whether a torch-protocol client made by ``connect()`` is closed by the server."""
    try:
        c = connect()
        c.ping()
        c.add(b"k", 1)
    except (OSError, RuntimeError):
        return True
    return False


def test_a_tiered_store_host_takes_only_links_on_its_public_port():
    """What the launcher starts on a tiered job's store host: a torch client on the
    public port (anyone who can reach it: read, write, delete every key) is refused with
    a log line; the store host's own node front-end serves its clients, and other nodes'
    proxies link. ``store_public_clients=true`` lets torch clients in again."""
    env = dict(os.environ, **TOKEN)
    job = JobStore("127.0.0.1", free_port(), hosting=True, timeout=timedelta(seconds=20), token="trust-model")
    try:
        job.start()
        assert refused(lambda: StoreClient(("127.0.0.1", job.port)))
        wait_for(lambda: "a torch-protocol client, refused: this tiered job's store host takes only node links"
                 in job.root.output, 5)
        local = StoreClient(job.client_address)  # the store host's own node front-end
        node = StoreProcess(command="proxy", host="127.0.0.1", port=0, env=env,
                            extra_args=["--upstream", f"127.0.0.1:{job.port}"])
        with node:
            assert StoreClient(("127.0.0.1", node.port)).add(b"k", 1) == 1 and local.add(b"k", 1) == 2
        assert job.root.stats()["clients_open"] == 0
    finally:
        job.stop()
    assert JobStore("h", 1, hosting=True, timeout=timedelta(seconds=1), token="t")._store_args() == ["--links-only"]
    assert JobStore("h", 1, hosting=True, timeout=timedelta(seconds=1), token="t",
                    public_clients=True)._store_args() == []


def _connect_as(uid: int, address: str) -> str:
    """Connect to the Unix socket ``address`` from a child process running as ``uid``
    (forked: the interpreter may not be readable by that user); what it saw: "closed"
    (by the server) or "open" (still open after 0.5 s)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: plain system calls only, then _exit)
        try:
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.connect("\0" + address[1:])
            s.settimeout(0.5)
            try:
                seen = b"closed" if s.recv(1) == b"" else b"open"
            except socket.timeout:
                seen = b"open"
            except ConnectionResetError:
                seen = b"closed"
            os.write(write, seen)
        finally:
            os._exit(0)
    os.close(write)
    seen = os.read(read, 16).decode()
    os.close(read)
    os.waitpid(pid, 0)
    return seen


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
@pytest.mark.parametrize("where", ["proxy", "node front-end"])
def test_unix_clients_of_another_user_are_refused(where):
    """A node's Unix socket (abstract: no file permissions) serves the agent's user and
    root only (SO_PEERCRED): uid 65534 is refused with a log line, root is served."""
    name = f"@tierrun-trust-{os.getpid()}-{where[0]}"
    env = dict(os.environ, **TOKEN)
    with StoreProcess(port=0, host="127.0.0.1", controlled=True, env=env,
                      node_frontend_unix=name if where != "proxy" else None) as root:
        node = None
        if where == "proxy":
            node = StoreProcess(command="proxy", host="127.0.0.1", port=0, unix=name, env=env,
                                extra_args=["--upstream", f"127.0.0.1:{root.port}"])
            node.start()
        try:
            served = node or root
            assert _connect_as(65534, name) == "closed"
            wait_for(lambda: "runs as uid 65534; only uid(s) 0 may use this store's Unix socket" in served.output, 5)
            assert _connect_as(0, name) == "open"
            assert StoreClient(name).add(b"k", 1) == 1
        finally:
            if node is not None:
                node.stop()


def test_unix_path_never_deletes_what_is_not_its_socket(tmp_path):
    """``--unix PATH``: a regular file there is left alone (the store fails, saying so),
    a live socket of another store is not taken over, a socket left by a dead process is
    replaced, and the store removes its socket when it stops."""
    path = tmp_path / "store.sock"
    path.write_text("precious")
    with pytest.raises(StoreStartError, match="exists and is not a socket"):
        StoreProcess(port=0, host="127.0.0.1", unix=str(path), start_timeout=10).start()
    assert path.read_text() == "precious"
    path.unlink()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # (closed without unlinking: what a killed process leaves)
    stale.close()
    with StoreProcess(port=0, host="127.0.0.1", unix=str(path)) as first:
        with pytest.raises(StoreStartError, match="another process listens on it"):
            StoreProcess(port=0, host="127.0.0.1", unix=str(path), start_timeout=10).start()
        assert StoreClient(str(path)).add(b"k", 1) == 1  # still the first store's
        assert first.exited() is None
    assert not path.exists()


def test_a_socket_a_store_process_cannot_listen_on_is_named_in_its_error(tmp_path):
    """A new user's mistakes about where to listen: the one line names the socket and
    the flag to change, not the store host (a proxy said 'cannot link to the store
    host ...: Address already in use' for its own --port taken, and 'No such file or
    directory' for a --unix path in a missing directory, which `tierrun store` blamed
    on '*:0' and --port)."""
    taken = tcp_listen_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    missing = str(tmp_path / "no" / "such" / "dir" / "store.sock")
    try:
        with StoreProcess(port=0, host="127.0.0.1", env=dict(os.environ, **TOKEN)) as root:
            upstream = ["--upstream", f"127.0.0.1:{root.port}"]
            for command, kwargs, extra, expected in [
                ("store", dict(port=port), [], f"cannot listen on 127.0.0.1:{port}: Address already in use. "
                 "Pick another --port"),
                ("store", dict(port=0, unix=missing), [], f"cannot listen on the Unix socket {missing}: No such file"),
                ("proxy", dict(port=port), upstream, f"cannot listen on 127.0.0.1:{port}: Address already in use. "
                 "Pick another --port"),
                ("proxy", dict(port=0, unix=missing), upstream, f"cannot listen on the Unix socket {missing}: No such"),
                ("proxy", dict(port=0), [*upstream, "--link-listen", f"127.0.0.1:{port}"],
                 f"cannot listen on 127.0.0.1:{port} (--link-listen): Address already in use"),
            ]:
                with pytest.raises(StoreStartError) as e:
                    StoreProcess(command=command, host="127.0.0.1", env=dict(os.environ, **TOKEN),
                                 extra_args=extra, start_timeout=20, **kwargs).start()
                assert expected in str(e.value) and "link to the store host" not in str(e.value), (command, kwargs)
            assert root.exited() is None
    finally:
        taken.close()


def test_a_proxy_that_cannot_reach_its_store_host_says_so_once():
    """`tierrun proxy --upstream HOST` (no port) was answered 'invalid literal for int()';
    an unreachable store host was named twice ('cannot link to the store host X: cannot
    connect to the store host X: ...')."""
    import subprocess
    import sys

    env = dict(os.environ, **TOKEN)
    run = lambda *argv: subprocess.run([sys.executable, "-m", "tierrun", "proxy", "--port", "0", *argv],  # noqa: E731
                                       env=env, capture_output=True, text=True, timeout=60)
    no_port = run("--upstream", "127.0.1.9")
    assert no_port.returncode == 2 and "--upstream 127.0.1.9: write HOST:PORT" in no_port.stderr, no_port.stderr
    port = free_port()
    down = run("--upstream", f"127.0.1.9:{port}", "--connect-timeout", "1")
    assert down.returncode == 1 and down.stderr.count("127.0.1.9") == 1, down.stderr
    assert f"cannot connect to the store host 127.0.1.9:{port} within 1 s" in down.stderr
    assert "Connection refused. Is it running, and its port open to this node?" in down.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_round_listeners_close_with_their_round(workers):
    """A new round's namespace listener closes the previous round's: its port takes
    no more connections; the clients it had keep theirs until they close. With
    --workers 2 the front-end processes close theirs too."""
    job = JobStore("127.0.0.1", free_port(), hosting=True, timeout=timedelta(seconds=20),
                   store_workers=workers)
    try:
        job.start()
        _, first = job.worker_endpoint("job/workers/0")
        old = StoreClient(("127.0.0.1", first))
        assert old.add(b"r", 1) == 1
        assert job.worker_endpoint("job/workers/0")[1] == first  # (the same round: the same one)
        _, second = job.worker_endpoint("job/workers/1")
        wait_for(lambda: refused(lambda: StoreClient(("127.0.0.1", first), timeout=2)), 10)
        assert old.add(b"r", 1) == 2  # (its connection stays)
        assert StoreClient(("127.0.0.1", second)).add(b"r", 1) == 1
    finally:
        job.stop()


def test_parallel_node0_fails_clearly_when_its_port_is_taken():
    """Node rank 0 of a ``parallel`` job is told to host: with its port taken (another
    job's store, say) it stops in one line, instead of joining whatever listens there
    and mixing that job's keys with its own."""
    taken = tcp_listen_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    other_job = StoreProcess(port=port, host="127.0.0.1")  # (a store on the port, another job's)
    taken.close()
    with other_job:
        params = RendezvousParameters("parallel", f"127.0.0.1:{port}", "job", 2, 2, rank="0", timeout="10")
        handler = parallel.create_handler(params, Settings.from_env())
        try:
            with pytest.raises(RendezvousConnectionError) as e:
                handler.next_rendezvous()
        finally:
            handler.shutdown()
        message = str(e.value)
        assert f"could not start the job's store on port {port} (port {port} is taken)" in message
        assert "never joins a store it did not start" in message and "\n" not in message
        assert other_job.exited() is None and StoreClient(("127.0.0.1", port)).num_keys() == 0


def test_accepted_tcp_connections_probe_silent_peers():
    """A client whose host vanished without closing (half-open) is found out by TCP
    keepalive, set on the listening socket and inherited by every connection."""
    listener = tcp_listen_socket("127.0.0.1", 0)
    listener.setblocking(True)
    with socket.create_connection(listener.getsockname()[:2]):
        conn, _ = listener.accept()
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        conn.close()
    listener.close()
