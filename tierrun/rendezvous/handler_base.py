"""What tierrun's rendezvous handlers share: the job's store, the node's name, live
progress on the store host, and hooks that run before the store goes away."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

from torch.distributed import PrefixStore
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError, RendezvousError, RendezvousHandler,
)
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from ..client import StoreClient
from ..report.progress import MODES, Arrivals, RendezvousProgress
from .job_store import JobStore

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_PROGRESS_INTERVAL = 5.0


class JobStoppedError(RendezvousError):
    """A node of a static job left or died: the others cannot go on without it."""


class StoreRendezvousHandler(RendezvousHandler):
    """Base of ``parallel`` and ``tierrun``. ``--rdzv_conf progress=auto|bar|log|off``
    and ``progress_interval=SECONDS`` set the store host's progress display."""

    def __init__(self, job: JobStore, run_id: str, local_addr: str | None, config: dict) -> None:
        self.job = job
        self.run_id = run_id
        self.node_addr = local_addr or socket.gethostname()
        self.shutdown_hooks: list[Callable[[], None]] = []
        mode = str(config.get("progress", "auto"))
        if mode not in MODES:
            raise ValueError(f"--rdzv_conf progress={mode}: write one of {', '.join(MODES)}")
        self._progress_mode = mode
        self._progress_interval = float(config.get("progress_interval", DEFAULT_PROGRESS_INTERVAL))

    def get_run_id(self) -> str:
        return self.run_id

    @contextlib.contextmanager
    def _progress(self, title: str, poll: Callable[[StoreClient], Arrivals]) -> Iterator[None]:
        """Show the round's progress while the body runs, on the store host only."""
        if not self.job.hosting or self._progress_mode == "off":
            yield
            return
        progress = RendezvousProgress(title, self.job.client_address, poll,
                                      self._progress_mode, self._progress_interval).start()
        try:
            yield
        finally:
            progress.stop()

    def check_store_host(self) -> None:
        """Raise ``RendezvousConnectionError`` if this node has lost the job's store. O(1),
        no store operation (see ``JobStore.lost``); torch's agent calls
        ``num_nodes_waiting`` every monitor interval, which calls this, and stops the
        node's workers when it raises."""
        reason = self.job.lost()
        if reason is not None:
            raise RendezvousConnectionError(
                f"node {self.node_addr} lost the job's store host {self.job.host}:{self.job.port}: "
                f"{reason}. The job cannot go on without its store; this node's workers were "
                "stopped. Restart the job when the store host (the --rdzv_endpoint or "
                "--master_addr node) is up again."
            )

    def leave(self, reason: str) -> None:
        """This agent is going away (a signal; torch's agent has stopped its workers):
        tell the other nodes at once rather than let the heartbeats find out, and check in
        to the exit barrier so nobody waits there for this node. Best effort: errors are
        logged, never raised."""
        try:
            self._announce_leaving(reason)
            self.leave_exit_barrier()
        except Exception as e:
            log.warning("node %s could not tell the others it is leaving: %s", self.node_addr, e)

    def _announce_leaving(self, reason: str) -> None:
        raise NotImplementedError

    def _agents_store(self) -> tuple[str, int] | None:
        """The current round's agent-store prefix and node count; None before a round."""
        raise NotImplementedError

    def leave_exit_barrier(self) -> None:
        """Check this node in to torch's exit barrier of the current round, for an agent
        whose workers failed for good. torch's agent checks in only after success, so
        without this the other agents (the store host among them) would wait out the
        whole exit-barrier timeout (300 s) for a node that has already given up. One ADD
        (and one SET if this node is the last): the barrier still waits for the rest."""
        current = self._agents_store()
        if current is None:
            return
        prefix, n = current
        _barrier_nonblocking(store=PrefixStore(prefix, self.job.client()), world_size=n,
                             key_prefix=_TERMINAL_STATE_SYNC_ID)

    def _run_shutdown_hooks(self) -> None:
        for hook in self.shutdown_hooks:
            try:
                hook()
            except Exception as e:
                log.warning("a report step before shutdown failed: %s", e)
                log.debug("report step", exc_info=True)
