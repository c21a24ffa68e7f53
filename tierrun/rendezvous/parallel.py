"""``parallel`` (and ``static``): a fixed number of nodes, each given its node rank.

torch_npu_run's behaviour on tierrun's store: node rank 0 hosts the store, every agent
announces itself (its record, claimed as ``node_claim`` says, and an ADD to the round's
arrival count; the last to arrive sets one key) and waits once, on that key, for all the others (O(1) operations
and bytes per node), and the workers of each round get their own key namespace.

A static job cannot go on without any of its nodes, so it should stop at once, and say
why, when one is lost: flat, the members beat and the first ranks watch them all (see
``liveness``); tiered, each node's link is its beat, and the first hop above its proxy
holds its will (``liveness.LinkWill``). A node silent for the heartbeat timeout, or
that leaves on a signal, sets the round's ``failed`` key, and every agent, holding a
WAIT on it, stops its workers and exits with the reason instead of waiting in a
collective or in the next round's rendezvous for a node that will not come.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..client import StoreClient, StoreClientError
from ..protocol import Op
from ..report.progress import Arrivals
from ..settings import Settings
from . import liveness
from .conf import public_clients_from, store_workers_from, token_from
from .handler_base import JobStoppedError, StoreRendezvousHandler
from .job_store import JobStore
from .node_claim import Claim, DuplicateNodeRankError, NodeRecord, Rank, check_confirmed, claim, confirmed_record
from .sockets import link_address
from .tree import TreePlace, store_fanout_from

log = logging.getLogger("tierrun.rendezvous")

T = TypeVar("T")

DEFAULT_TIMEOUT = 600
#: A node's arrival adds 1 + its --nnodes times this to the count (see ``_arrive``): the
#: count stays below it, and the sum of the nodes' --nnodes times it below 2**63, for
#: jobs of up to 2**21 nodes.
ARRIVAL_UNIT = 1 << 21
#: How a will's reason ends (a tiered job: ``liveness.LinkWill``), and what it names.
WILL_SAYS = " (its link to the store went silent, or its agent is gone)"
SILENT_NODE = re.compile(r"node rank \d+ \((.*)\) has not answered for ")


class ParallelRendezvousHandler(StoreRendezvousHandler):
    """Static rendezvous: ``world_size`` nodes, this one is ``rank``.

    ``next_rendezvous`` blocks until every node has arrived, and raises
    ``RendezvousTimeoutError`` naming the missing node ranks after ``timeout``, and
    ``DuplicateNodeRankError`` on a node that may not hold its node rank (``node_claim``).
    """

    def __init__(self, store: JobStore, rank: int, world_size: int, run_id: str,
                 timeout: timedelta, local_addr: str | None, config: dict) -> None:
        super().__init__(store, run_id, local_addr, config)
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self._round = -1
        self._failure: str | None = None  # why the job cannot go on
        self._mismatch: str | None = None  # nodes started with another --nnodes, once found (see _arrive)

    def get_backend(self) -> str:
        return "parallel"

    def next_rendezvous(self) -> RendezvousInfo:
        self._raise_if_failed()
        self._round += 1
        store = self.connect()
        base = self._base(self._round)
        key = f"{base}/node/{self._rank}"
        mine = NodeRecord.fresh(self.node_addr, self._local_world_size)
        rank = Rank(self._rank, self._world_size, self.run_id)
        how = self._refused_if(lambda: claim(store, key, mine, rank))
        if how is Claim.TAKEN_OVER:
            log.warning("rendezvous '%s': node rank %d was held by another node; node %s takes its place (that "
                        "node is gone, or was started with the same node rank: then it stops)",
                        self.run_id, self._rank, self.node_addr)
        self.job.advertise_relay()  # (only the rank's holder tells its children where to link)
        endpoint = self.job.worker_endpoint(f"{self.run_id}/workers/{self._round}")
        keys = [f"{base}/all_arrived"]
        if not self.job.tiered:  # the host publishes the one worker port of the round
            if endpoint is not None:
                store.set(f"{base}/worker_port", str(endpoint[1]))
            keys.append(f"{base}/worker_port")
        workers_key = self._workers_key(base)
        # (the rest of the round on one connection of tierrun's client, which pipelines:
        # a round trip to announce, one to wait, one to confirm, where torch's client took
        # six; in a tree each waits for every level's hold on its way to node 0)
        try:
            with StoreClient(self.job.agent_address, timeout=self.job.timeout.total_seconds()) as client:
                self._announce(client, store, base, workers_key, counted=how is Claim.NEW)
                with self._progress(f"rendezvous '{self.run_id}'", lambda c: self._arrivals(c, base)):
                    self._wait_for_all(client, store, keys, base)
                # (the count is complete once all arrived: no WAIT before its GET)
                answers = client.pipeline(
                    (Op.COMPARE_SET, f"/{key}".encode(), mine.encode(), confirmed_record(mine)),
                    *([(Op.GET, f"/{workers_key}".encode())] if workers_key is not None else []))
        except (OSError, StoreClientError) as e:
            raise self._lost_store(e, "in its rendezvous") from e
        self._refused_if(lambda: check_confirmed(answers[0], mine, rank))
        if how is Claim.TAKEN_OVER:
            self.job.advertise_relay(again=True)
        # (an empty count: the rank's earlier holder did not count itself there, as when it ran
        # under TORCH_ELASTIC_WORKER_IDENTICAL and this agent does not; then not identical)
        self._choose_rank_assignment(int(answers[1] or 0) if workers_key is not None else None, self._world_size)
        if endpoint is None:
            endpoint = (self.job.host, int(store.get(f"{base}/worker_port")))
        self._watch_nodes(base)
        self._log_round(self._round, self._rank, self._world_size)
        return RendezvousInfo(
            PrefixStore(f"{base}/agents", store),
            self._rank,
            self._world_size,
            RendezvousStoreInfo(*endpoint),
        )

    def _refused_if(self, step: Callable[[], T]) -> T:
        """Run a step of ``node_claim``; if it raises DuplicateNodeRankError, this node
        was never a member of the job (it reports nothing, see ``refused``)."""
        try:
            return step()
        except DuplicateNodeRankError:
            self.refused = True
            raise

    def _announce(self, client: StoreClient, store, base: str, workers_key: str | None, counted: bool) -> None:
        """List this node among round ``base``'s arrivals and, if ``counted`` (it created
        its rank's record: see ``node_claim``), count it among the nodes with its number
        of workers and among the arrived, in one round trip; the node that completes the
        count sets ``all_arrived``, the one key every node waits for. Listed before it is
        counted: the store host's progress, which reads the list once the count is
        complete, then names every node (a restarted agent's second line is the same
        entry, a node that took a rank over names itself). Raises ``RendezvousError`` if
        the nodes disagree on --nnodes (:meth:`_arrived`; ``store``, torch's client,
        reads their list)."""
        line = f"{self._rank} {self.node_addr} {self._world_size}\n".encode()
        reqs: list[tuple] = [(Op.APPEND, f"/{base}/arrivals".encode(), line)]
        if counted:
            if workers_key is not None:
                reqs.append((Op.ADD, f"/{workers_key}".encode(), 1))
            reqs.append((Op.ADD, f"/{base}/arrived".encode(), self.arrival))
        answers = client.pipeline(*reqs)
        if counted and self._arrived(answers[-1], store, base):
            client.set(f"/{base}/all_arrived".encode(), b"1")

    @property
    def arrival(self) -> int:
        """What this node's arrival adds to the count: 1, and its --nnodes in the high bits."""
        return 1 + self._world_size * ARRIVAL_UNIT

    def _arrived(self, total: int, store, base: str) -> bool:
        """Whether this node, whose arrival brought the count to ``total``, is the last.
        Counting, not waiting for all N record keys: N WAITs of N keys each cost the store
        host O(N²) (at 512 nodes, more than all the rest of the start-up). Each node adds
        its ``--nnodes`` too, in the count's high bits, so the nodes' counts agree or a
        node finds they do not (one node started with another ``--nnodes``) in the same
        ADD: it then stops, naming them (read from the arrivals with ``store``), and the
        count never completes."""
        count, nodes = total % ARRIVAL_UNIT, total // ARRIVAL_UNIT
        if nodes != count * self._world_size:
            self._note_mismatch(store.get(f"{base}/arrivals").decode().splitlines())
            raise RendezvousError(self._mismatch or f"rendezvous '{self.run_id}': the nodes were started with "
                                  "different --nnodes. Give every node the same --nnodes and restart the job.")
        return count == self._world_size

    def _wait_for_all(self, client: StoreClient, store, keys: list[str], base: str) -> None:
        """WAIT on ``client`` for ``keys`` (every node arrived), checking every second,
        without a store request, whether a node was lost in the previous round (its
        watchers set ``failed``) or this node lost the store: either ends the wait at
        once. One WAIT per node (see ``_wait_quietly``). Raises ``RendezvousTimeoutError``
        naming the missing node ranks (read with ``store``), ``JobStoppedError`` or
        ``RendezvousConnectionError``."""
        try:
            self._wait_quietly(keys, self._timeout.total_seconds(),
                               lambda: (self.check_store_host(), self._raise_if_failed(), self._raise_if_mismatched()),
                               client)
        except TimeoutError as e:
            raise RendezvousTimeoutError(self._missing_message(store, base)) from e
        except (OSError, StoreClientError) as e:
            raise self._lost_store(e, "while waiting for the other nodes") from e

    def _lost_store(self, e: Exception, doing: str) -> Exception:
        """What to raise when this node's connection to the store broke ``doing``
        something: why the job stopped, if it did (raised here), else
        ``RendezvousConnectionError``."""
        self.check_store_host()
        self._raise_if_failed()
        return RendezvousConnectionError(
            f"node rank {self._rank} ({self.node_addr}) lost its connection to "
            f"{self.job.upstream_name} {doing} ({e}). The store host "
            "stops when its own wait for the nodes times out (its log names the missing node ranks) "
            "or it fails: check its log, then restart the job."
        )

    def _watch_nodes(self, base: str) -> None:
        """While the round runs: wait for ``failed``; and beat (the first ranks also watch
        every node), or in a tiered job leave this node's will with its link's first hop
        (``liveness.LinkWill``): the store host then reads no beat at all."""

        def failed(client: StoreClient) -> None:
            reason = client.get(f"/{base}/failed".encode()).decode()
            with self._lock:
                self._failure = reason
            # (recorded by the first ranks, as the watchers of beats did: not by every node at once)
            if self._rank < liveness.WATCHERS and reason.endswith(WILL_SAYS) and (found := SILENT_NODE.match(reason)):
                self._note_dead_by_will(found.group(1), silence)

        watched = liveness.watched_by(self._rank, self._rank, range(self._world_size))
        # (a healthy link may be silent for two of its heartbeats, one riding with a batch:
        # the will waits one more than the timeout, so a proxy may stall ~2 s, as a beat could)
        silence = self._beat_timeout + self.job.link_config.heartbeat_interval
        will = f"node rank {self._rank} ({self.node_addr}) has not answered for {silence:.0f} s{WILL_SAYS}"
        try:
            self._watch_round(lambda name: f"/{base}/{name}".encode(), "failed", failed, self._rank,
                              watched, lambda dead: self._declare_dead(base, dead), will=(silence, will.encode()))
        except (OSError, StoreClientError) as e:
            raise self._lost_store(e, "leaving its will with its store proxy") from e

    def _declare_dead(self, base: str, rank: int) -> None:
        """Called by the heartbeat thread: node ``rank`` went silent. Not once the round
        failed (a node that left stops beating: it is not dead, and the job stops anyway)."""
        with self._lock:
            if self._failure is not None:
                return
        with StoreClient(self.job.agent_address, timeout=10) as store:
            addr = NodeRecord.decode(store.get(f"/{base}/node/{rank}".encode())).addr
            self._note_dead(addr)
            reason = f"node rank {rank} ({addr}) has not answered for {self._beat_timeout:.0f} s"
            log.warning("rendezvous '%s': %s; stopping the job", self.run_id, reason)
            store.compare_set(f"/{base}/failed".encode(), b"", reason.encode())  # (the first reason stays)

    def _announce_leaving(self, reason: str) -> None:
        self._stop_watching()
        if self._round < 0:
            return
        with StoreClient(self.job.agent_address, timeout=10) as store:
            store.set(f"/{self._base(self._round)}/failed".encode(),
                      f"node rank {self._rank} ({self.node_addr}) left: {reason}".encode())

    def _raise_if_failed(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise JobStoppedError(
                f"node rank {self._rank} ({self.node_addr}): {failure}. A static job "
                "(--rdzv_backend parallel or static) cannot go on without every node, so this "
                "node's workers were stopped. Restart the job, or run it elastic "
                "(--nnodes MIN:MAX) to re-form without a lost node."
            )

    def _base(self, r: int) -> str:
        return f"tierrun/{self.run_id}/static/{r}"

    def _arrivals(self, client: StoreClient, base: str) -> Arrivals:
        """From ``arrivals`` (one GET), since MULTI_GET of the descriptors would wait for
        the missing ones, the very nodes to name."""
        key = f"/{base}/arrivals".encode()
        lines = client.get(key).decode().splitlines() if client.check([key]) else []
        self._note_mismatch(lines)
        arrived = dict(line.split(" ", 2)[:2] for line in lines)
        missing = [f"node rank {r}" for r in range(self._world_size) if str(r) not in arrived]
        return Arrivals(list(arrived.values()), self._world_size, self._world_size, missing)

    def _note_mismatch(self, lines: list[str]) -> None:
        """Note the nodes of the arrival ``lines`` ("rank address nnodes", every line: a
        node restarted with the right count leaves its first line) started with another
        node count than this one: their counts never complete, so the nodes would wait
        out the timeout (torch_npu_run's and torchrun's wait forever)."""
        mine = str(self._world_size)
        others = sorted({f"node rank {fields[0]} ({fields[1]}) with {fields[2]}"
                         for fields in (line.split(" ", 2) for line in lines) if len(fields) == 3 and fields[2] != mine})
        if others:
            with self._lock:
                self._mismatch = (
                    f"rendezvous '{self.run_id}': the nodes were started with different --nnodes: node rank "
                    f"{self._rank} ({self.node_addr}) with {self._world_size}, {', '.join(others)}. Give every "
                    "node the same --nnodes (or PET_NNODES) and restart the job.")

    def _raise_if_mismatched(self) -> None:
        with self._lock:
            mismatch = self._mismatch
        if mismatch is not None:
            raise RendezvousError(mismatch)

    def _missing_message(self, store, base: str) -> str:
        missing = [r for r in range(self._world_size) if not store.check([f"{base}/node/{r}"])]
        arrived = self._world_size - len(missing)
        if store.check([f"{base}/arrivals"]):  # (a node with another --nnodes: whoever is missing, say that)
            self._note_mismatch(store.get(f"{base}/arrivals").decode().splitlines())
        if self._mismatch is not None:
            return self._mismatch
        if not missing:  # (a rank's first node died between its claim and its count: see node_claim)
            return (
                f"rendezvous '{self.run_id}' timed out after {self._timeout.total_seconds():.0f} s on node rank "
                f"{self._rank} ({self.node_addr}): every node rank has a node, but the count of arrivals is short: "
                "a node was lost while it joined (between claiming its rank and counting itself), and the node "
                "that took its place is not counted again. Restart the job."
            )
        return (
            f"rendezvous '{self.run_id}' timed out after {self._timeout.total_seconds():.0f} s "
            f"on node rank {self._rank} ({self.node_addr}): {arrived} of {self._world_size} "
            f"nodes arrived; missing node ranks: {', '.join(map(str, missing)) or 'none'}. "
            "Start tierrun on the missing nodes with the same --master_addr/--master_port (if they were "
            "started, their own logs say why they stopped before arriving), or raise the timeout with "
            "--rdzv_conf timeout=SECONDS."
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
        store host is lost, ``JobStoppedError`` once another node is."""
        self.check_store_host()
        self._raise_if_failed()
        return 0

    def shutdown(self) -> bool:
        self._run_shutdown_hooks()
        self._stop_watching(leaving=True)
        self.job.stop()
        return True


def create_handler(params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    if params.min_nodes != params.max_nodes:  # (as torch_npu_run's parallel and torchrun's static: MAX nodes)
        log.warning("node %s: --rdzv_backend parallel is not elastic: --nnodes %d:%d runs %d nodes; for an elastic "
                    "job use --rdzv_backend tierrun", params.local_addr or socket.gethostname(), params.min_nodes,
                    params.max_nodes, params.max_nodes)
    if "rank" not in params.config and params.max_nodes > 1:
        raise ValueError(
            "the parallel rendezvous needs this node's rank: torch's torchrun passes "
            "--node-rank only to its static backend, so add --rdzv-conf rank=K (0 on the "
            "store host), or launch with tierrun, which passes --node_rank itself"
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
    fanout = store_fanout_from(params.config)
    tree = None
    if fanout:
        tree = TreePlace(rank, params.max_nodes, fanout, link_address(params.local_addr, host, port), params.run_id)
    # (node rank 0 is told to host: if the port is taken, it fails rather than joining
    # whatever listens there, another job's store maybe)
    store = JobStore(host, port, hosting=rank == 0, timeout=timeout, token=token_from(params.config, settings),
                     store_workers=store_workers_from(params.config), tree=tree, link_config=settings.link,
                     node=params.local_addr,
                     host_fallback="never", public_clients=public_clients_from(params.config),
                     host_hint=" (node rank 0 hosts a parallel job's store, and never joins a store it did "
                     "not start: another job's, maybe), or, if this job's node rank 0 runs already there, give "
                     "this node its own --node_rank.")
    return ParallelRendezvousHandler(store, rank, params.max_nodes, params.run_id, timeout,
                                     params.local_addr, params.config)
