"""``parallel`` (and ``static``): a fixed number of nodes, each given its node rank.

torch_npu_run's behaviour on tierrun's store: node rank 0 hosts the store, every agent
announces itself with one SET and waits once for all the others (O(1) operations per
node), and the workers of each round get their own key namespace.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..client import StoreClient
from ..report.progress import Arrivals
from .handler_base import StoreRendezvousHandler
from .job_store import JobStore, token_from

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_TIMEOUT = 600


class ParallelRendezvousHandler(StoreRendezvousHandler):
    """Static rendezvous: ``world_size`` nodes, this one is ``rank``.

    ``next_rendezvous`` blocks until every node has arrived, and raises
    ``RendezvousTimeoutError`` naming the missing node ranks after ``timeout``.
    """

    def __init__(self, store: JobStore, rank: int, world_size: int, run_id: str,
                 timeout: timedelta, local_addr: str | None, config: dict) -> None:
        super().__init__(store, run_id, local_addr, config)
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self._round = -1

    def get_backend(self) -> str:
        return "parallel"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        self._round += 1
        self.job.start()
        store = self.job.client()
        base = self._base(self._round)
        store.set(f"{base}/node/{self._rank}", json.dumps({"addr": self.node_addr}))
        store.append(f"{base}/arrivals", f"{self._rank} {self.node_addr}\n")
        endpoint = self.job.worker_endpoint(f"{self.run_id}/workers/{self._round}")
        keys = [f"{base}/node/{r}" for r in range(self._world_size)]
        if not self.job.tiered:  # the host publishes the one worker port of the round
            if endpoint is not None:
                store.set(f"{base}/worker_port", str(endpoint[1]))
            keys.append(f"{base}/worker_port")
        try:
            with self._progress(f"rendezvous '{self.run_id}'", lambda c: self._arrivals(c, base)):
                store.wait(keys, self._timeout)
        except Exception as e:
            raise RendezvousTimeoutError(self._missing_message(store, base)) from e
        if endpoint is None:
            endpoint = (self.job.host, int(store.get(f"{base}/worker_port")))
        return RendezvousInfo(
            PrefixStore(f"{base}/agents", store),
            self._rank,
            self._world_size,
            RendezvousStoreInfo(*endpoint),
        )

    def _base(self, r: int) -> str:
        return f"tierrun/{self.run_id}/static/{r}"

    def _arrivals(self, client: StoreClient, base: str) -> Arrivals:
        """From ``arrivals`` (one GET), since MULTI_GET of the descriptors would wait for
        the missing ones, the very nodes to name."""
        key = f"/{base}/arrivals".encode()
        lines = client.get(key).decode().splitlines() if client.check([key]) else []
        arrived = dict(line.split(" ", 1) for line in lines)
        missing = [f"node rank {r}" for r in range(self._world_size) if str(r) not in arrived]
        return Arrivals(list(arrived.values()), self._world_size, self._world_size, missing)

    def _missing_message(self, store, base: str) -> str:
        missing = [r for r in range(self._world_size) if not store.check([f"{base}/node/{r}"])]
        arrived = self._world_size - len(missing)
        return (
            f"rendezvous '{self.run_id}' timed out after {self._timeout.total_seconds():.0f} s "
            f"on node rank {self._rank} ({self.node_addr}): {arrived} of {self._world_size} "
            f"nodes arrived; missing node ranks: {', '.join(map(str, missing)) or 'none'}. "
            "Start tierrun on the missing nodes with the same --master_addr/--master_port, "
            "or raise the timeout with --rdzv_conf timeout=SECONDS."
        )

    def _agents_store(self) -> tuple[str, int] | None:
        if self._round < 0:
            return None
        return f"{self._base(self._round)}/agents", self._world_size

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        """Always 0 (the job is static). Raises ``RendezvousConnectionError`` once the
        store host is lost."""
        self.check_store_host()
        return 0

    def shutdown(self) -> bool:
        self._run_shutdown_hooks()
        self.job.stop()
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    if params.min_nodes != params.max_nodes:
        raise ValueError(
            f"the parallel rendezvous needs a fixed number of nodes, got "
            f"--nnodes {params.min_nodes}:{params.max_nodes}: write --nnodes "
            f"{params.max_nodes}, or use --rdzv_backend tierrun for an elastic job"
        )
    rank = int(params.config.get("rank", 0))
    if not 0 <= rank < params.max_nodes:
        raise ValueError(
            f"--node_rank {rank} is outside 0..{params.max_nodes - 1} for --nnodes {params.max_nodes}"
        )
    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    if port < 0:
        raise ValueError(f"no port in '{params.endpoint}': add --master_port PORT")
    timeout = timedelta(seconds=int(params.config.get("timeout", DEFAULT_TIMEOUT)))
    store = JobStore(host, port, hosting=rank == 0, timeout=timeout, token=token_from(params.config))
    return ParallelRendezvousHandler(store, rank, params.max_nodes, params.run_id, timeout,
                                     params.local_addr, params.config)
