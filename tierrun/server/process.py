"""Start a tierrun store in a child process, from Python.

    with StoreProcess(port=0) as store:
        client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from .control import (
    CloseNamespace, Command, Listening, NamespaceListening, OpenNamespace, SendStats, Stats, TakingLinks,
)
from .control import format_command, parse_event


class StoreStartError(RuntimeError):
    pass


#: A node proxy the launcher starts stops when its agent wrote nothing on its control
#: pipe for this long (seconds: its agent is frozen or hung), so the first hop above it
#: runs the node's will (``hub.wills``): a tiered static job's liveness is its links'.
AGENT_SILENCE = 5.0

class StoreProcess:
    """A ``tierrun store`` (or, with ``command="proxy"``, ``tierrun proxy``) child process.

    ``start()`` blocks until the store accepts connections (or raises
    :class:`StoreStartError` with the child's output); ``port`` is then the bound port,
    also when 0 was asked for. ``stop()`` sends SIGTERM and waits.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int = 0,
        unix: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        controlled: bool = False,
        command: str = "store",
        node_frontend_unix: str | None = None,
        token: bytes | None = None,
        on_line: Callable[[str], None] | None = None,
        agent_silence: float = 0.0,
    ) -> None:
        """``node_frontend_unix``: a store that is also its host's node front-end
        (``--node-frontend``), listening on this Unix socket too; see :class:`HostedFrontEnd`.
        ``token``: the job token, handed to the process through a pipe (``--token-fd``),
        never through its environment or command line; without it the process reads
        ``$TIERRUN_TOKEN`` / ``$TIERRUN_TOKEN_FILE`` from ``env``. ``on_line``: called
        with each line of its output (its log), from the thread that reads it.
        ``agent_silence`` (needs ``controlled``): this agent writes a blank control line
        every third of it, and the process stops if none comes for that long (the agent
        is frozen or hung; ``--agent-silence``)."""
        self.command_name = command
        self.token = token
        self.on_line = on_line
        self.host = host
        self.requested_port = port
        self.unix = unix
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.env = env
        self.controlled = controlled
        self.agent_silence = agent_silence
        self._namespaces: dict[str, int] = {}
        self.node_frontend_unix = node_frontend_unix
        #: Where the node front-end (``node_frontend_unix`` given) takes its host's clients.
        self.node_port: int | None = None
        self._node_namespaces: dict[str, int] = {}
        self._stats: list[dict] = []
        self._pump_thread: threading.Thread | None = None
        self._changed = threading.Condition()
        self.port: int | None = None
        #: Where a proxy started with ``--link-listen`` takes other front-ends' links.
        self.link_port: int | None = None
        self.proc: subprocess.Popen[str] | None = None
        self._output: list[str] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "tierrun", self.command_name, "--port", str(self.requested_port)]
        if self.host:
            cmd += ["--host", self.host]
        if self.unix:
            cmd += ["--unix", self.unix]
        if self.controlled:
            cmd.append("--control-stdin")
            if self.agent_silence:
                cmd += ["--agent-silence", f"{self.agent_silence:g}"]
        if self.node_frontend_unix:
            cmd += ["--node-frontend", "--node-frontend-unix", self.node_frontend_unix]
        return cmd + self.extra_args

    def start(self) -> int:
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        command, pass_fds = self.command(), ()
        if self.token is not None:
            read_end, write_end = os.pipe()  # (both close-on-exec; pass_fds opens one to the child)
            command, pass_fds = [*command, "--token-fd", str(read_end)], (read_end,)
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE if self.controlled else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                pass_fds=pass_fds,
                # (controlled: its agent stops it, and it stops when the agent is gone; a
                # signal to the agent's process group, Ctrl-C, must not end it before the
                # agent has told the other nodes, through it, that this node leaves)
                start_new_session=self.controlled,
            )
        finally:
            if self.token is not None:
                os.close(read_end)
                self._hand_over_token(write_end)
        ready = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, args=(ready,), daemon=True)
        self._pump_thread.start()
        if self.controlled and self.agent_silence:
            threading.Thread(target=self._keep_alive, args=(self.proc,), daemon=True).start()
        if (not ready.wait(self.start_timeout) or self.port is None
                or (self.node_frontend_unix is not None and self.node_port is None)):
            self.stop()
            raise StoreStartError(
                f"tierrun {self.command_name} did not start:\n" + "".join(self._output[-20:])
            )
        return self.port

    def _keep_alive(self, proc: subprocess.Popen) -> None:
        """A blank control line every third of ``agent_silence`` while ``proc`` runs."""
        while proc.poll() is None:
            time.sleep(self.agent_silence / 3)
            try:
                with self._changed:
                    assert proc.stdin is not None
                    proc.stdin.write("\n")
                    proc.stdin.flush()
            except (OSError, ValueError):  # (it exited; or stopped: its pipe closed)
                return

    def _hand_over_token(self, write_end: int) -> None:
        """Write the token into the pipe the child reads it from, and close it. Blocks
        until the child has read it when it exceeds the pipe's buffer; a child that died
        before reading it (a broken pipe) is reported by ``start``."""
        try:
            rest = memoryview(self.token or b"") if self.proc is not None else memoryview(b"")
            while rest:
                rest = rest[os.write(write_end, rest):]
        except BrokenPipeError:
            pass
        finally:
            os.close(write_end)

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._output.append(line)
            del self._output[:-200]
            if self.on_line is not None:
                self.on_line(line)
            parsed = parse_event(line)
            if parsed is None:
                continue
            event = parsed[1]
            if isinstance(event, Listening) and event.port is not None:
                if event.node:  # (before the store's own line: start() returns with both known)
                    self.node_port = event.port
                elif self.port is None:
                    self.port = event.port
                    ready.set()
            elif isinstance(event, TakingLinks) and event.port is not None:
                self.link_port = event.port
            elif isinstance(event, NamespaceListening):
                with self._changed:
                    (self._node_namespaces if event.node else self._namespaces)[event.name] = event.port
                    self._changed.notify_all()
            elif isinstance(event, Stats) and not event.node:
                with self._changed:
                    self._stats.append(event.counters)
                    self._changed.notify_all()
        ready.set()
        with self._changed:
            self._changed.notify_all()

    def open_namespace(self, name: str, timeout: float = 30.0, node: bool = False) -> int:
        """Open a listener whose clients see only keys under ``name/``; return its port.
        ``node``: on the node front-end (its clients' requests go through its link).

        Idempotent. Needs ``controlled=True``. Blocks up to ``timeout``; raises
        :class:`StoreStartError` if the store does not answer (it died), ``ValueError``
        for a name that is empty or holds whitespace (``control``).
        """
        assert self.controlled and self.proc is not None and self.proc.stdin is not None
        names = self._node_namespaces if node else self._namespaces
        with self._changed:
            if name not in names:
                self._command(OpenNamespace(name, node))
                self._changed.wait_for(
                    lambda: name in names or self.proc.poll() is not None, timeout
                )
            if name not in names:
                raise StoreStartError(f"the store did not open namespace {name}:\n{self.output}")
            return names[name]

    def close_namespace(self, name: str, node: bool = False) -> None:
        """Stop listening for namespace ``name`` (its round is over; its clients keep
        their connections until they close). Needs ``controlled=True``; returns at once
        (the process closes it when it reads the command); unknown names: nothing."""
        assert self.controlled and self.proc is not None and self.proc.stdin is not None
        names = self._node_namespaces if node else self._namespaces
        with self._changed:
            if names.pop(name, None) is not None and self.proc.poll() is None:
                try:
                    self._command(CloseNamespace(name, node))
                except OSError:
                    pass  # (the process is gone: so is its listener)

    def stats(self, timeout: float = 10.0) -> dict:
        """The process's counters (needs ``controlled=True``). Blocks up to ``timeout``;
        raises ``StoreStartError`` if they do not come, or the process has exited (also
        when it did so just before the request: its pipe is closed)."""
        assert self.controlled and self.proc is not None and self.proc.stdin is not None
        with self._changed:
            seen = len(self._stats)
            try:
                self._command(SendStats())
            except OSError:
                raise StoreStartError(f"the {self.command_name} process exited ({self.proc.poll()}): "
                                      "no stats") from None
            if not self._changed.wait_for(lambda: len(self._stats) > seen, timeout):
                raise StoreStartError(f"no stats from the {self.command_name} process")
            return self._stats[-1]

    def _command(self, command: Command) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(format_command(command) + "\n")
        self.proc.stdin.flush()

    def exited(self) -> int | None:
        """The exit status once the process has ended, else None. O(1)."""
        assert self.proc is not None
        return self.proc.poll()

    def last_error(self) -> str | None:
        """The last ERROR line it logged, without its prefix."""
        for line in reversed(self._output):
            if "] ERROR " in line:
                return line.split("] ERROR ", 1)[1].strip()
        return None

    @property
    def output(self) -> str:
        return "".join(self._output)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout)
        return self.proc.returncode

    @property
    def last_stats(self) -> dict | None:
        """The counters it printed last (at exit it prints its final ones)."""
        return self._stats[-1] if self._stats else None

    def __enter__(self) -> StoreProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HostedFrontEnd:
    """The node front-end of the store host, run by its store process
    (``StoreProcess(node_frontend_unix=...)``): where the host's agent and workers
    connect, as they connect to a ``tierrun proxy`` on other nodes. It serves them from
    the core in that process (no link, no process of its own to wake), and lives and
    dies with the store."""

    link_port = None  # (it takes no other front-end's links)

    def __init__(self, store: StoreProcess) -> None:
        assert store.node_frontend_unix is not None
        self.store = store
        self.unix = store.node_frontend_unix

    @property
    def port(self) -> int | None:
        return self.store.node_port

    def open_namespace(self, name: str, timeout: float = 30.0) -> int:
        return self.store.open_namespace(name, timeout, node=True)

    def close_namespace(self, name: str) -> None:
        self.store.close_namespace(name, node=True)

    @property
    def last_stats(self) -> dict | None:
        stats = self.store.last_stats
        return None if stats is None else stats.get("node_frontend")
