"""The store host's front-end processes, seen from the core process (``--workers N``).

The core process keeps the state and the node links; ``N`` child processes (see
``frontend_process``) parse the torch clients, each on its own SO_REUSEPORT socket of
every public port, so the kernel spreads new connections over them and parsing runs on
several cores. Each is linked to the core like a node proxy, so its clients' requests
reach the core in coalesced batches; links of nodes that land on one are handed over,
connection and all, and end here.

A process that dies (killed, crashed, frozen past the link heartbeat timeout, counted
from its first frame: a Python start-up may take seconds on a loaded machine) is
replaced at once; its clients lose their connections (torch's client does not reconnect), its link
session ends with it, and everything else carries on: nodes' links and the other
processes' clients are not affected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..frontend import FrontEndConfig
from ..frontend.contracts import TORCH_CLIENT_REFUSED
from ..hub.link_connection import PROCESS_START_ALLOWANCE
from ..hub.link_server import LinkServer
from ..settings import frontend_process_env
from .frontend_process import HAND_OFF, HAND_OFF_UNREAD, LISTEN, MAX_MESSAGE, STATS, UNLISTEN
from .options import frontend_arguments

log = logging.getLogger("tierrun.store")

#: A process that dies sooner than this after starting is restarted after this delay.
RESTART_BACKOFF = 1.0
#: How long to wait for a process's counters.
STATS_TIMEOUT = 2.0


class FrontEndStartError(RuntimeError):
    """A front-end process never linked to the core as the store started."""


@dataclass
class Listener:
    """A listening address every front-end process serves."""

    namespace: str
    #: A socket for one more process: a new SO_REUSEPORT socket on the same port, or
    #: the one shared socket (a Unix socket: no SO_REUSEPORT there).
    make: Callable[[], socket.socket]
    shared: bool = False


class _Process:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: socket.socket | None = None
        self.stats: asyncio.Future[dict] | None = None
        #: Set once its link opened its session (True) or closed before (False).
        self.linked: asyncio.Future[bool] | None = None


class FrontEndPool:
    """``start`` returns once every process has its sockets and its link to the core is
    open; it raises FrontEndStartError if a process closed its link first (a broken install: its
    output says why). ``close`` stops them all."""

    def __init__(self, count: int, links: LinkServer, config: FrontEndConfig, links_only: bool = False) -> None:
        """``links_only``: the processes refuse torch-protocol clients on the public port."""
        self.links = links
        self.args = frontend_arguments(config, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        if links_only:
            self.args.append("--links-only")
        self.listeners: list[Listener] = []
        self.restarts = 0
        self._processes = [_Process(i) for i in range(count)]
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    async def start(self, listeners: list[Listener]) -> None:
        self.listeners = list(listeners)
        started = [asyncio.get_running_loop().create_future() for _ in self._processes]
        self._tasks = [asyncio.ensure_future(self._supervise(p, f))
                       for p, f in zip(self._processes, started)]
        await asyncio.gather(*started)

    def listen(self, listener: Listener) -> None:
        """Every running process (and every one started later) serves ``listener`` too."""
        self.listeners.append(listener)
        for p in self._processes:
            if p.channel is not None:
                self._send_listener(p, listener)

    def unlisten(self, namespace: str) -> None:
        """Every process stops listening for ``namespace`` (its round is over), and
        processes started later do not serve it."""
        self.listeners = [listener for listener in self.listeners if listener.namespace != namespace]
        for p in self._processes:
            if p.channel is not None:
                try:
                    p.channel.send(UNLISTEN + namespace.encode())
                except OSError:
                    pass  # (it is gone; its replacement will not serve it)

    async def _supervise(self, p: _Process, started: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            since = loop.time()
            try:
                await self._spawn(p)
            except Exception as e:
                if not started.done():
                    started.set_exception(e)
                    return
                log.error("could not restart store front-end process %d: %s", p.index, e)
            else:
                assert p.proc is not None and p.linked is not None
                linked = await p.linked
                if not started.done():
                    if not linked:
                        started.set_exception(FrontEndStartError(await self._never_linked(p)))
                        return
                    started.set_result(None)
                status = await p.proc.wait()
                self._forget(p)
                if self._closing:
                    return
                self.restarts += 1
                log.warning("store front-end process %d (pid %d) exited with status %d; its "
                            "clients lost their connections; starting a new one",
                            p.index, p.proc.pid, status)
            if loop.time() - since < RESTART_BACKOFF:
                await asyncio.sleep(RESTART_BACKOFF)

    async def _spawn(self, p: _Process) -> None:
        loop = asyncio.get_running_loop()
        channel, child_channel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        link, child_link = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = secrets.token_bytes(32)
        try:
            p.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tierrun", "store-frontend",
                "--channel-fd", str(child_channel.fileno()), "--link-fd", str(child_link.fileno()),
                *self.args,
                pass_fds=(child_channel.fileno(), child_link.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                env=frontend_process_env(token),
            )
        except BaseException:
            for s in (channel, link):
                s.close()
            raise
        finally:
            child_channel.close()
            child_link.close()
        peer = f"store front-end process {p.index} (pid {p.proc.pid})"
        _, conn = await loop.connect_accepted_socket(
            lambda: self.links.accept(peer, token=token, resumable=False, sniffed=False), sock=link)
        p.linked = linked = loop.create_future()

        def settle(opened: bool) -> None:
            if not linked.done():
                linked.set_result(opened)

        conn.on_open = lambda: settle(True)
        conn.on_lost = lambda proc=p.proc: (settle(False), self._link_lost(proc, peer))
        channel.setblocking(False)
        p.channel = channel
        loop.add_reader(channel.fileno(), self._on_channel, p)
        for listener in self.listeners:
            self._send_listener(p, listener)

    async def _never_linked(self, p: _Process) -> str:
        """Why process ``p``, whose link closed before it opened, never served: it exited
        (its own output says why), or it sent nothing in time (killed here)."""
        assert p.proc is not None
        if p.proc.returncode is None:
            try:
                await asyncio.wait_for(p.proc.wait(), 1.0)  # (its link closed as it exited?)
            except asyncio.TimeoutError:
                p.proc.kill()
                await p.proc.wait()
                allowance = PROCESS_START_ALLOWANCE + self.links.config.heartbeat_timeout
                return (f"store front-end process {p.index} (pid {p.proc.pid}) did not link to the store's core "
                        f"within {allowance:g} s of starting (a Python process that hangs as it starts: "
                        "check the machine's load and the Python environment); it was stopped")
        return (f"store front-end process {p.index} (pid {p.proc.pid}) exited with status {p.proc.returncode} "
                "before it linked to the store's core: its output above says why")

    def _link_lost(self, proc: asyncio.subprocess.Process, peer: str) -> None:
        """Its link closed (it exited, or was silent past the link heartbeat timeout):
        make sure it is gone, so that it stops taking connections it cannot serve."""
        if proc.returncode is None:
            if not self._closing:
                log.warning("%s: its link to the core closed (it died, or froze past the link heartbeat timeout); stopping it", peer)
            proc.kill()

    def _send_listener(self, p: _Process, listener: Listener) -> None:
        assert p.channel is not None
        sock = listener.make()
        try:
            socket.send_fds(p.channel, [LISTEN + listener.namespace.encode()], [sock.fileno()])
        finally:
            if not listener.shared:
                sock.close()  # the process has it now

    def _on_channel(self, p: _Process) -> None:
        assert p.channel is not None
        try:
            msg, fds, _, _ = socket.recv_fds(p.channel, MAX_MESSAGE, 1)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        if not msg:  # the process is gone; _supervise sees it exit
            self._forget(p)
            return
        kind, body = msg[:1], msg[1:]
        if (kind == HAND_OFF or kind == HAND_OFF_UNREAD) and fds:  # (unread: of a links-only port)
            asyncio.ensure_future(self._adopt_link(socket.socket(fileno=fds[0]), None if kind == HAND_OFF_UNREAD else body))
        elif kind == STATS and p.stats is not None and not p.stats.done():
            p.stats.set_result(json.loads(body))
        else:
            for fd in fds:
                os.close(fd)

    async def _adopt_link(self, sock: socket.socket, initial: bytes | None) -> None:
        try:
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            sock.close()  # gone already
            return
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: self.links.accept(
            peer, initial or b"", sniffed=initial is not None, not_a_link=TORCH_CLIENT_REFUSED), sock=sock)

    def _forget(self, p: _Process) -> None:
        if p.channel is not None:
            asyncio.get_running_loop().remove_reader(p.channel.fileno())
            p.channel.close()
            p.channel = None
        if p.stats is not None and not p.stats.done():
            p.stats.set_result({})

    async def stats(self) -> dict:
        """The processes' counters, summed. Blocks up to ``STATS_TIMEOUT``; a process
        that does not answer in time counts as nothing."""
        loop = asyncio.get_running_loop()
        waiting = []
        for p in self._processes:
            if p.channel is not None:
                p.stats = loop.create_future()
                p.channel.send(STATS)
                waiting.append(p.stats)
        total: dict = {"store_frontend_processes": len(self._processes),
                       "store_frontend_restarts": self.restarts}
        per_process = []
        if waiting:
            await asyncio.wait(waiting, timeout=STATS_TIMEOUT)
            for f in waiting:
                counters = f.result() if f.done() else {}
                per_process.append(counters.get("clients_accepted", 0))
                for key, value in counters.items():
                    total[key] = total.get(key, 0) + value
        total["clients_per_process"] = per_process
        return total

    async def close(self) -> None:
        """Stop every process (closing its channel tells it to), killing any that has
        not exited after 5 s."""
        self._closing = True
        for p in self._processes:
            self._forget(p)
        procs = [p.proc for p in self._processes if p.proc is not None and p.proc.returncode is None]
        if procs:
            done, pending = await asyncio.wait([asyncio.ensure_future(q.wait()) for q in procs], timeout=5)
            for q in procs:
                if q.returncode is None:
                    q.kill()
            for t in pending:
                await t
        for t in self._tasks:
            t.cancel()
