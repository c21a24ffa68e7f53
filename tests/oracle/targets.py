"""The servers a history runs against, started once and reused across histories.

- ``torch``: torch's own TCPStore server (the libuv backend, torch's default) in a
  subprocess, so that a crash there is contained.
- tierrun: one ``tierrun store`` S, a ``tierrun proxy`` P1 linked to it, a proxy P2
  linked to it that takes links, and a proxy P3 linked to P2. The targets are views of
  them: ``flat`` (clients on S), ``tiered`` (on P1), ``tree`` (on P3, two levels below
  S) and ``mixed`` (each client on the front-end its history names: S, P1, P2 or P3).
  They share S: histories run one at a time and the store is emptied between them.

Every target is emptied between histories through an admin connection straight to the
store (S, or torch's server), and restarted when one of its processes died.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from tierrun.protocol import Op
from tierrun.server import StoreProcess

from .wire import ReplyReader, encode, handshake

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "oracle-token"
HOST = "127.0.0.1"

_TORCH_SERVER = """
import sys, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                  timeout=datetime.timedelta(seconds=3600), wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, TIERRUN_TOKEN=TOKEN)
    # the tree under test (this checkout), for the store and proxy processes too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def unread_by_server(server_port: int, client_port: int) -> int:
    """Bytes the server's end of a loopback connection has received but its process
    has not read yet (the rx_queue of /proc/net/tcp and tcp6); 0 if none or gone."""
    want = (f"{server_port:04X}", f"{client_port:04X}")
    for table in ("/proc/net/tcp6", "/proc/net/tcp"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, remote, queues = fields[1], fields[2], fields[4]
                    if (local.rsplit(":", 1)[1], remote.rsplit(":", 1)[1]) == want:
                        return int(queues.split(":")[1], 16)
        except OSError:
            continue
    return 0


class ClosedError(Exception):
    pass


class Conn:
    """One raw client connection: VALIDATE + PING sent at connect, then requests as
    bytes; every byte received goes through a :class:`ReplyReader`."""

    def __init__(self, port: int, nonce: int = 0x0A11CE) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = ReplyReader()
        self.closed = False
        self.sock.sendall(handshake(nonce))
        data = b""
        while len(data) < 4:
            chunk = self.sock.recv(4 - len(data))
            if not chunk:
                raise ClosedError("closed during the handshake")
            data += chunk
        if struct.unpack("<I", data)[0] != nonce:
            raise ClosedError(f"handshake answered {data!r}")
        self.sock.setblocking(False)
        self.port = port
        self.local_port = self.sock.getsockname()[1]

    def consumed(self, timeout: float = 30.0) -> None:
        """Wait until the server's process has read everything sent so far (a long
        request arrives in many reads: the server may answer a probe on another
        connection before it has read the end of it)."""
        deadline = time.monotonic() + timeout
        while not self.closed and unread_by_server(self.port, self.local_port) and time.monotonic() < deadline:
            time.sleep(0.002)
            self.pump()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, reqs) -> None:
        """Write the requests at once (pipelined). A connection the server closed is
        noted, not raised."""
        data = b"".join(encode(r) for r in reqs)
        for r in reqs:
            self.reader.sending(r)
        if self.closed:
            return
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
                view = view[n:]
            except BlockingIOError:
                # the server is not reading: read what it sent meanwhile, then go on
                r, w, _ = select.select([self.sock], [self.sock], [], 10)
                if r:
                    self.pump()
                    if self.closed:
                        return
                if not r and not w:
                    raise TimeoutError("the server took no bytes for 10 s")
            except (BrokenPipeError, ConnectionResetError):
                # the server closed with our bytes unread (a reset): what it answered
                # before is still in our receive buffer; read it, as the server sent it
                self._drain()
                return

    def pump(self) -> bool:
        """Read whatever has arrived; True if anything did (or the connection closed)."""
        if self.closed:
            return False
        got = False
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                return got
            except (ConnectionResetError, ConnectionAbortedError):
                self._close()
                return True
            if not data:
                self._close()
                return True
            self.reader.feed(data)
            got = True

    def _drain(self) -> None:
        """Read what is left to read, then close (the connection is reset or ended)."""
        self.sock.setblocking(True)
        self.sock.settimeout(1.0)
        try:
            while data := self.sock.recv(1 << 20):
                self.reader.feed(data)
        except OSError:
            pass
        self._close()

    def _close(self) -> None:
        self.closed = True
        self.reader.closed = True
        self.sock.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def call(self, req: tuple, timeout: float = 10.0) -> bytes:
        """Send one request and wait for its answer (admin and probe connections)."""
        n = len(self.reader.tokens)
        self.send([req])
        deadline = time.monotonic() + timeout
        while len(self.reader.tokens) == n:
            if self.closed:
                raise ClosedError(f"closed while waiting for {req[0]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to {req!r} in {timeout} s")
            select.select([self.sock], [], [], left)
            self.pump()
        return self.reader.tokens[-1][1]


class Target:
    """Where a history's clients connect (``entries``, one per front-end) and how to
    empty the store afterwards."""

    name: str
    entries: list[int]

    def alive(self) -> bool:
        raise NotImplementedError

    def healthy(self) -> bool:
        """Every process of the target's servers is up (more than ``alive``)."""
        return self.alive()

    def admin(self) -> Conn:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError

    def describe_death(self) -> str:
        return ""

    def probe(self, entry: int) -> Conn:
        """A connection on front-end ``entry`` whose answered request shows that what
        reached that front-end before it has been through the store."""
        c = self._probes.get(entry)
        if c is None or c.closed:
            c = self._probes[entry] = Conn(self.entries[entry], nonce=0xBEEF)
        return c

    def drop_probes(self) -> None:
        for c in self._probes.values():
            c.close()
        self._probes = {}

    def clean(self, queue_keys=()) -> bool:
        """Empty the store: delete every key, pop every queue the history used. False if
        it could not (the store is gone or answers nonsense): restart then."""
        try:
            a = self.admin()
            listing = a.call((Op.LIST_KEYS,))
            count = struct.unpack_from("<q", listing)[0]
            pos, keys = 8, []
            for _ in range(count):
                n = struct.unpack_from("<Q", listing, pos)[0]
                keys.append(listing[pos + 8:pos + 8 + n])
                pos += 8 + n
            for k in keys:
                a.call((Op.DELETE_KEY, k))
            for q in queue_keys:
                n = struct.unpack("<q", a.call((Op.QUEUE_LEN, q)))[0]
                for _ in range(n):
                    a.call((Op.QUEUE_POP, q))
            return struct.unpack("<q", a.call((Op.GETNUMKEYS,)))[0] == 0
        except (OSError, ClosedError, TimeoutError):
            return False


class TorchTarget(Target):
    name = "torch"

    def __init__(self) -> None:
        self._probes: dict[int, Conn] = {}
        self._admin: Conn | None = None
        self.proc: subprocess.Popen | None = None
        self.restarts = -1
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _TORCH_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.entries = [int(self.proc.stdout.readline())]
        self.restarts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe_death(self) -> str:
        return "" if self.alive() else f"torch's server exited with {self.proc.returncode}"

    def admin(self) -> Conn:
        if self._admin is None or self._admin.closed:
            self._admin = Conn(self.entries[0], nonce=0xAD)
        return self._admin

    def stop(self) -> None:
        self.drop_probes()
        if self._admin:
            self._admin.close()
            self._admin = None
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


class TierrunCluster:
    """S, P1 -> S, P2 -> S (takes links), P3 -> P2: every tierrun target's processes."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.extra_env = extra_env or {}
        self.procs: dict[str, StoreProcess] = {}
        self._admin: Conn | None = None
        self._checkers: dict[str, Conn] = {}
        self.restarts = -1
        self.start()

    def start(self) -> None:
        env = {**_env(), **self.extra_env}
        s = StoreProcess(host=HOST, port=0, controlled=True, env=env)
        s.start()
        self.procs = {"S": s}
        try:
            self.procs["P1"] = self._proxy(s.port, env)
            self.procs["P2"] = self._proxy(s.port, env, takes_links=True)
            self.procs["P3"] = self._proxy(self.procs["P2"].link_port, env)
        except Exception:
            self.stop()
            raise
        self.restarts += 1

    @staticmethod
    def _proxy(port: int, env: dict, takes_links: bool = False) -> StoreProcess:
        extra = ["--upstream", f"{HOST}:{port}", "--connect-timeout", "10"]
        if takes_links:
            extra += ["--link-listen", f"{HOST}:0"]
        p = StoreProcess(host=HOST, port=0, command="proxy", controlled=True, env=env, extra_args=extra)
        p.start()
        return p

    def port(self, name: str) -> int:
        return self.procs[name].port

    def alive(self, names=None) -> bool:
        return all(p.exited() is None for n, p in self.procs.items() if names is None or n in names)

    def deaths(self, names=None) -> str:
        out = []
        for name, p in self.procs.items():
            if (names is None or name in names) and p.exited() is not None:
                out.append(f"{name} exited with {p.exited()}: {p.last_error() or p.output[-300:].strip()}")
        return "; ".join(out)

    def admin(self) -> Conn:
        if self._admin is None or self._admin.closed:
            self._admin = Conn(self.port("S"), nonce=0xAD)
        return self._admin

    def checker(self, name: str) -> Conn:
        """A connection to one front-end, for health checks."""
        c = self._checkers.get(name)
        if c is None or c.closed:
            c = self._checkers[name] = Conn(self.port(name), nonce=0xC0)
        return c

    def stop(self) -> None:
        for c in self._checkers.values():
            c.close()
        self._checkers = {}
        if self._admin:
            self._admin.close()
            self._admin = None
        for p in reversed(list(self.procs.values())):
            p.stop()

    def restart(self) -> None:
        self.stop()
        self.start()


#: Which of the cluster's front-ends each tierrun target's clients use.
LAYOUTS = {"flat": ["S"], "tiered": ["P1"], "tree": ["P3"], "mixed": ["S", "P1", "P2", "P3"]}
#: The processes each target's answers go through.
PATHS = {"flat": ["S"], "tiered": ["S", "P1"], "tree": ["S", "P2", "P3"], "mixed": ["S", "P1", "P2", "P3"]}


class TierrunTarget(Target):
    def __init__(self, cluster: TierrunCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self._probes = {}
        self._generation = cluster.restarts

    @property
    def entries(self) -> list[int]:
        if self._generation != self.cluster.restarts:
            self.drop_probes()
            self._generation = self.cluster.restarts
        return [self.cluster.port(n) for n in LAYOUTS[self.name]]

    def alive(self) -> bool:
        """The processes on this target's path are up (another target's proxy may have
        died: the driver restarts the cluster for the next history anyway)."""
        return self.cluster.alive(PATHS[self.name])

    def describe_death(self) -> str:
        return self.cluster.deaths(PATHS[self.name])

    def healthy(self) -> bool:
        """Every process is up and every front-end answers (a proxy may be wedged)."""
        if not self.cluster.alive():
            return False
        try:
            for name in self.cluster.procs:
                self.cluster.checker(name).call((Op.GETNUMKEYS,), timeout=3)
        except (OSError, ClosedError, TimeoutError):
            return False
        return True

    def admin(self) -> Conn:
        return self.cluster.admin()

    def restart(self) -> None:
        self.drop_probes()
        self.cluster.restart()


class Targets:
    """torch's server and the tierrun targets, started once."""

    def __init__(self, names=("flat", "tiered", "tree", "mixed"), extra_env=None) -> None:
        self.torch = TorchTarget()
        self.cluster = TierrunCluster(extra_env)
        self.tierrun = [TierrunTarget(self.cluster, n) for n in names]

    def stop(self) -> None:
        for t in self.tierrun:
            t.drop_probes()
        self.torch.stop()
        self.cluster.stop()

    def __enter__(self) -> Targets:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
