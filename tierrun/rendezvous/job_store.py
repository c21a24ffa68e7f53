"""The job's store, seen from one agent: host it (in a child process) or connect to it."""

from __future__ import annotations

import errno
import logging
import socket
from datetime import timedelta

from torch.distributed import TCPStore

from ..server import StoreProcess, StoreStartError

log = logging.getLogger("tierrun.rendezvous")


class JobStore:
    """One store per job serves the agents and, through per-round namespaces, the workers.

    ``hosting`` agents start the root store on ``port`` (every address, dual-stack),
    supervise it (it exits when this process does) and stop it in :meth:`stop`.
    :meth:`connect` blocks until the store answers or ``timeout`` expires, and raises
    ``RuntimeError`` naming the address when it does not.
    """

    def __init__(self, host: str, port: int, hosting: bool, timeout: timedelta) -> None:
        self.host = host
        self.port = port
        self.hosting = hosting
        self.timeout = timeout
        self.process: StoreProcess | None = None
        self._client: TCPStore | None = None

    def start_if_hosting(self) -> bool:
        """Start the root store if this agent hosts it. False if the port was taken
        (another agent on this machine hosts it); raises on any other failure."""
        if not self.hosting or self.process is not None:
            return self.hosting
        proc = StoreProcess(host=None, port=self.port, controlled=True)
        try:
            self.port = proc.start()
        except StoreStartError as e:
            if _port_in_use(self.port) and self.port != 0:
                log.info("port %d is taken; connecting to the store there instead", self.port)
                self.hosting = False
                return False
            raise RuntimeError(
                f"could not start the job's store on port {self.port}: {e}. "
                "Pick a free port with --master_port or --rdzv_endpoint HOST:PORT."
            ) from e
        self.process = proc
        log.info("hosting the job's store on port %d (pid %d)", self.port, proc.pid)
        return True

    def client(self) -> TCPStore:
        if self._client is None:
            try:
                self._client = TCPStore(
                    self.host, self.port, is_master=False, timeout=self.timeout,
                    wait_for_workers=False,
                )
            except Exception as e:
                raise RuntimeError(
                    f"cannot reach the job's store at {self.host}:{self.port} "
                    f"within {self.timeout.total_seconds():.0f} s ({type(e).__name__}). "
                    "Check that the store host (node rank 0 / the --rdzv_endpoint host) "
                    "is running and that the port is open."
                ) from e
        return self._client

    def open_worker_namespace(self, name: str) -> int:
        """The port of a listener whose clients see only keys under ``name/``."""
        assert self.process is not None, "only the hosting agent opens namespaces"
        return self.process.open_namespace(name)

    def stop(self) -> None:
        self._client = None
        if self.process is not None:
            self.process.stop()
            self.process = None


def _port_in_use(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", port))
        return False
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()
