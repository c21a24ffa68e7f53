"""``tierrun``: elastic rendezvous (min:max nodes) in O(1) store operations per node.

torch's c10d backend keeps the whole rendezvous state in one pickled blob that every
agent updates with compare-and-swap loops and polls every second: O(N) bytes per
operation, O(N²) traffic. Here each round ``r`` lives in a few keys and every agent
does a fixed number of operations:

    ADD    r/joined 1          -> my arrival index i (atomic, no retry loop)
    SET    r/node/<i>          -> my descriptor
    (i == max)                 -> close now;  (i == min) -> close after the last call
    WAIT   r/closed            -> pushed by the store, no polling
    GET    r/closed            -> n members: arrivals 1..n; i > n waits for round r+1
    WAIT + MULTI_GET r/rank/<i>, r/identical, r/worker_port
                               -> my rank; whether every member runs as many workers
                                  (then torch's agent computes global ranks itself,
                                  instead of three store requests per node); where my
                                  workers connect

Closing is one COMPARE_SET of ``r/closed`` from empty to the member count: whoever
wins decides, the others' attempts change nothing. The winner (the closer) reads the n
descriptors once and publishes every member's rank in one MULTI_SET, so each member
reads O(1) keys and bytes, and the store does O(n) work per round, not O(n²). (If the
closer dies in that instant, the members' wait ends with the join timeout.) Nodes that arrive after the close
join round r+1 at once, and running agents restart to admit them (below), unless round
r runs with the maximum of nodes: then they wait as spares (``spare``).
Ranks are stable: members sort by their rank in their previous round, then by arrival.

Liveness (``liveness.py``): while round r runs, every member beats a counter and the
first ranks watch them all; a silent one is marked dead and ``r/changed`` set,
which every member WAITs on, so all agents restart their workers, even workers stuck in
a collective. Running agents also learn of nodes waiting for round r+1 through
``r/changed`` (its first arrival sets it), and stop their workers together
(``restart_together``: else the first to stop fails the others' workers, which costs
them a restart). When round r+1 re-forms, its last call ends as soon as every member
of round r is back or dead: recovering from a dead node takes ``heartbeat_timeout``
seconds (``--rdzv_conf heartbeat_timeout=3,heartbeat_interval=1``), not the last call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta

from torch.distributed import DistError, PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..client import StoreClient, StoreClientError
from ..report.progress import Arrivals
from ..settings import Settings
from . import liveness, restart_together, spare
from .conf import conf_bool, conf_float, public_clients_from, store_workers_from, token_from
from .elastic_tree import TreeRounds
from .job_store import JobStore
from .sockets import hosts_store, link_address, on_this_machine
from .tree import store_fanout_from
from .messages import ALONE_HINT, closed_while_waiting, join_timeout_message, unreachable_hint

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_PORT = 29400
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
_JOB_CLOSED = "job-closed"


class ElasticRendezvousHandler(TreeRounds):
    """Elastic rendezvous on tierrun's store (with ``--store-fanout``, each round's tree
    of node proxies: ``elastic_tree``).

    ``next_rendezvous`` blocks until a round closes with this node as a member; raises
    ``RendezvousTimeoutError`` if fewer than ``min_nodes`` arrive within
    ``join_timeout`` (the message lists who arrived), ``RendezvousClosedError`` once the
    job has been closed (finished, or failed for good).
    """

    def __init__(self, job: JobStore, run_id: str, min_nodes: int, max_nodes: int,
                 join_timeout: float, last_call_timeout: float, local_addr: str | None,
                 config: dict) -> None:
        super().__init__(job, run_id, local_addr, config)
        self._min, self._max = min_nodes, max_nodes
        self._join_timeout = join_timeout
        self._spares_waiting = 0  # (seen when this node closed the job)
        self._last_call = last_call_timeout
        self._base = f"tierrun/{run_id}"
        self._round = -1  # last round this node was a member of
        self._index = -1  # its arrival index in that round
        self._rank = -1
        self._members = 0  # nodes in that round
        self._waiting_seen: set[int] = set()  # rounds r whose membership changed

    # -- keys -------------------------------------------------------------------------

    def _k(self, r: int, name: str) -> str:
        return f"{self._base}/{r}/{name}"

    # -- RendezvousHandler ------------------------------------------------------------

    def get_backend(self) -> str:
        return "tierrun"

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except DistError:  # (torch's client: a lost store is said in one line, not a stack trace)
            self.blame_lost_store()
            raise

    def _next_rendezvous(self) -> RendezvousInfo:
        # (the proxy's death also fails this node's workers, and torch's agent restarts
        # failed workers, calling this, without asking num_nodes_waiting first)
        self.replace_dead_proxy()
        if self._fanout:  # (torch's agent has stopped this node's workers)
            self._go_flat()
        store = self.connect()
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous '{self.run_id}' is closed: the job has ended")
        r = max(self._round + 1, int(store.add(f"{self._base}/round", 0)))
        deadline = time.monotonic() + self._join_timeout
        while True:
            if r > 0 and self._round != r - 1 and self._running_full(store, r - 1):  # (not a member coming back)
                self._wait_as_spare(store, r - 1)
                deadline = time.monotonic() + self._join_timeout
            with self._progress(f"rendezvous '{self.run_id}' round {r}", lambda c, r=r: self._arrivals(c, r)):
                joined = self._join(store, r, deadline)
            if joined is not None:
                break
            r += 1  # arrived after the close: wait in the next round
        index, rank, n, endpoint, identical, layout = joined
        self._use_local_rank_assignment(identical)
        with self._lock:
            self._round = r
            self._index = index
            self._rank = rank
            self._members = n
        self._watch_members(r, index, rank, n)
        if layout is not None:
            self._take_place(r, rank, n, layout)
        if endpoint is None:  # tiered: on this node's proxy, once it is the round's
            endpoint = self.job.worker_endpoint(f"{self.run_id}/workers/{r}")
            store = self.job.client()
        self._log_round(r, rank, n)
        return RendezvousInfo(
            PrefixStore(self._k(r, "agents"), store),
            rank,
            n,
            RendezvousStoreInfo(*endpoint),
        )

    def _join(self, store, r: int, deadline: float):
        """Join round r. None if it closed without us; else (arrival index, rank, members,
        worker endpoint (None: tiered, opened once the node's proxy is the round's),
        whether every member runs as many workers, the round's ``tree`` key or None)."""
        index = int(store.add(self._k(r, "joined"), 1))
        me = {"addr": self.node_addr, "prev_rank": self._rank, "prev_round": self._round,
              "prev_index": self._index, "pid": os.getpid(), "workers": self._local_world_size,
              "host": self.job.root is not None, "fanout": self._fanout}
        store.set(self._k(r, f"node/{index}"), json.dumps(me))
        if r > 0 and (index == 1 or self._round == r - 1):  # the running members restart (a member
            store.compare_set(self._k(r - 1, "changed"), "", "joined")  # back: round r-1 is over, spares join)
        if r > 0 and self._round == r - 1:  # (back on its own, maybe: restart_together)
            self._together.back(r - 1, store, lambda name: self._k(r - 1, name), self._members)
        store.append(self._k(r, "arrivals"), f"{self.node_addr}\n")
        endpoint = None
        if not self.job.tiered:  # flat: the host publishes it
            endpoint = self.job.worker_endpoint(f"{self.run_id}/workers/{r}")
            if endpoint is not None:
                store.set(self._k(r, "worker_port"), str(endpoint[1]))
        if index == self._max:
            self._close(store, r, self._max)
        elif index == self._min:
            threading.Thread(target=self._last_call_then_close, args=(store.clone(), r), daemon=True).start()
        try:  # (one WAIT on tierrun's client: torch's prints C++ warnings when one times out)
            self._wait_quietly([self._k(r, "closed")], deadline - time.monotonic(), self.check_store_host)
        except TimeoutError as e:
            raise RendezvousTimeoutError(self._timeout_message(store, r)) from e
        except (OSError, StoreClientError) as e:
            self.check_store_host()
            raise RendezvousConnectionError(
                f"node {self.node_addr} lost its connection to the job's store while waiting for round {r} "
                f"of rendezvous '{self.run_id}' to close ({type(e).__name__}: {e})") from e
        closed = store.get(self._k(r, "closed")).decode()
        if closed == _JOB_CLOSED:
            raise RendezvousClosedError(closed_while_waiting(self.run_id, self.node_addr, r))
        n = int(closed)
        if index > n:
            log.info("round %d of '%s' closed with %d nodes before node %s arrived; waiting for the next",
                     r, self.run_id, n, self.node_addr)
            return None
        keys = [self._k(r, f"rank/{index}"), self._k(r, "identical")]
        if not self.job.tiered:
            keys.append(self._k(r, "worker_port"))
        elif self._fanout:
            keys.append(self._k(r, "tree"))
        store.wait(keys, self.job.timeout)
        values = store.multi_get(keys)
        if not self.job.tiered:
            endpoint = (self.job.host, int(values[2]))
        layout = values[2].decode() if self.job.tiered and self._fanout else None
        return index, int(values[0]), n, endpoint, values[1] == b"1", layout

    def _running_full(self, store, r: int) -> bool:
        """Whether round r (closed) runs with the maximum of nodes and none left or died."""
        return (store.multi_get([self._k(r, "closed")])[0] == str(self._max).encode()
                and not store.check([self._k(r, "changed")]))

    def _wait_as_spare(self, store, r: int) -> None:
        """Wait until round r changes (see ``spare``), with no arrival index (a spare that
        dies holds no place); counted, so the store host waits for spares before it stops."""
        store.add(f"{self._base}/spares", 1)
        spare.wait(self.node_addr, self.run_id, r, self._max, lambda t: self._changed_within(r, t), self.is_closed)
        store.add(f"{self._base}/spares", -1)

    def _changed_within(self, r: int, timeout: float) -> bool:
        """Whether round r changes (a member leaves or dies) within ``timeout`` seconds."""
        try:
            self._wait_quietly([self._k(r, "changed")], timeout, self.check_store_host)
            return True
        except TimeoutError:
            return False
        except (OSError, StoreClientError) as e:
            self.check_store_host()
            raise RendezvousConnectionError(
                f"node {self.node_addr} lost its connection to the job's store while waiting as a spare "
                f"of rendezvous '{self.run_id}' ({type(e).__name__}: {e})") from e

    def _arrivals(self, client: StoreClient, r: int) -> Arrivals:
        """From ``r/arrivals``, not the descriptors: the store's MULTI_GET waits for
        missing keys, and an arrival dead between its ADD and its SET would hang it."""
        key = ("/" + self._k(r, "arrivals")).encode()
        joined = client.get(key).decode().splitlines() if client.check([key]) else []
        return Arrivals(joined, self._min, self._max, None)

    def _close(self, store, r: int, n: int) -> None:
        if store.compare_set(self._k(r, "closed"), "", str(n)) == str(n).encode():
            self._assign_ranks(store, r, n)
            # advance the open round (only the closer of r does this, once)
            store.compare_set(f"{self._base}/round", str(r) if r else "", str(r + 1))

    def _assign_ranks(self, store, r: int, n: int) -> None:
        """The closer's one O(n) step: rank of members 1..n, stable across rounds (by the
        rank a node had in its previous round, then by arrival), and whether they all run
        as many workers (then torch's agents compute global ranks without the store), in
        one MULTI_SET."""
        keys = [self._k(r, f"node/{j}") for j in range(1, n + 1)]
        store.wait(keys, self.job.timeout)
        members = json.loads(b"[" + b",".join(store.multi_get(keys)) + b"]")  # one parse
        order = sorted(range(n), key=lambda j: (members[j]["prev_rank"] if members[j]["prev_rank"] >= 0 else 1 << 30, j))
        keys = [self._k(r, f"rank/{j + 1}") for j in order]  # index -> rank
        keys += [self._k(r, f"member/{rank}") for rank in range(n)]  # rank -> index
        keys += [self._k(r, f"beat/{j}") for j in range(1, n + 1)]  # heartbeats start at 0
        # dead markers exist from the start: torch's client WAITs for every key it MULTI_GETs
        keys += [self._k(r, f"dead/{j}") for j in range(1, n + 1)]
        values = [str(rank) for rank in range(n)] + [str(j + 1) for j in order] + ["0"] * n + [""] * n
        workers = {m.get("workers") for m in members}
        keys.append(self._k(r, "identical"))
        values.append("1" if len(workers) == 1 and None not in workers else "0")
        keys.append(self._k(r, "tree"))
        values.append(self._round_tree(r, members, order))
        store.multi_set(keys, values)

    def _round_tree(self, r: int, members: list[dict], order: list[int]) -> str:
        """The round's ``tree`` key, "F,HOST_RANK": the fanout of its tree of node proxies
        (0: none, unless every member runs with one; the smallest if they differ) and the
        rank of the member hosting the store (-1: none)."""
        fanouts = [m.get("fanout", 0) for m in members]
        fanout = min(fanouts)
        if len(set(fanouts)) > 1:
            log.warning("rendezvous '%s' round %d: the members' --store-fanout differ (%s); the round's tree %s. "
                        "Give every node the same --store-fanout.", self.run_id, r,
                        ", ".join(f"{m['addr']}: {f}" for m, f in zip(members, fanouts)),
                        f"has fanout {fanout}" if fanout else "is flat")
        host = next((rank for rank, j in enumerate(order) if members[j].get("host")), -1)
        return f"{fanout},{host}"

    def _last_call_then_close(self, store, r: int) -> None:
        """Close round r when the last call ends, or sooner: as soon as every member of
        round r-1 has either joined r or is dead (marked by its watcher, or its heartbeat
        still for ``heartbeat_timeout``). A re-rendezvous after a failure then takes
        seconds, not the last call. One MULTI_GET of O(n) keys per poll, on one node. Ends
        at once when round r closed without it (it filled up): the node's proxy moves to
        the round's tree then, and a request on the old connection would fail."""
        try:
            previous = self._previous_members(store, r)
            joined = previous and store.multi_get([self._k(r - 1, "changed")])[0] == b"joined"
            deadline = time.monotonic() + (restart_together.last_call_limit(self._last_call, self._monitor_interval)
                                           if joined else self._last_call)  # (see restart_together)
            still = liveness.Stillness(self._beat_timeout)
            while time.monotonic() < deadline:
                if store.check([self._k(r, "closed")]):
                    return
                if previous and self._all_accounted_for(store, r, previous, still):
                    log.info("round %d of '%s': every live member of round %d is back; closing "
                             "before the last call", r, self.run_id, r - 1)
                    break
                time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
            n = min(int(store.add(self._k(r, "joined"), 0)), self._max)
            self._close(store, r, n)
        except Exception:  # the store went away: the job is ending
            log.debug("last call of round %d not completed", r, exc_info=True)

    def _previous_members(self, store, r: int) -> int:
        if r == 0:
            return 0
        closed = store.multi_get([self._k(r - 1, "closed")])[0]
        return int(closed) if closed.isdigit() else 0

    def _all_accounted_for(self, store, r: int, previous: int, still: liveness.Stillness) -> bool:
        joined = min(int(store.add(self._k(r, "joined"), 0)), self._max)
        if joined < self._min:
            return False
        back = set()
        for raw in store.multi_get([self._k(r, f"node/{j}") for j in range(1, joined + 1)]):
            if raw:
                d = json.loads(raw)
                if d.get("prev_round") == r - 1:
                    back.add(d["prev_index"])
        members = range(1, previous + 1)
        values = store.multi_get([self._k(r - 1, f"beat/{j}") for j in members] +
                                 [self._k(r - 1, f"dead/{j}") for j in members])
        now = time.monotonic()
        still.sample(dict(zip(members, values[:previous])), now)
        dead = {j for j, mark in zip(members, values[previous:]) if mark} | still.still(now)
        return all(j in back or j in dead for j in members)

    def _timeout_message(self, store, r: int) -> str:
        try:
            n = int(store.add(self._k(r, "joined"), 0))
            keys = [self._k(r, f"node/{j}") for j in range(1, n + 1)]
            arrived = [json.loads(v)["addr"] for v in store.multi_get(keys)] if n else []
        except Exception:
            arrived = ["(unknown: the store did not answer)"]
        return join_timeout_message(self.run_id, self.node_addr, self._join_timeout, arrived, self._min, self._max)

    def _rewatch(self) -> None:
        """Restart the current round's watch on this node's current proxy (it moved)."""
        with self._lock:
            r, index, rank, n = self._round, self._index, self._rank, self._members
        if r >= 0 and self._heartbeat is not None:
            self._watch_members(r, index, rank, n)

    def _round_changed(self, r: int) -> bool:
        with self._lock:
            return r in self._waiting_seen

    def _watch_members(self, r: int, index: int, rank: int, n: int) -> None:
        """While round r runs: wait for ``r/changed`` (a node joined round r+1, or a member
        died or left), and beat; the first ranks watch every member (``liveness``)."""

        def changed(_: StoreClient) -> None:
            with self._lock:
                self._waiting_seen.add(r)

        watched = liveness.watched_by(rank, index, range(1, n + 1))  # members: arrivals 1..n
        self._watch_round(lambda name: ("/" + self._k(r, name)).encode(), "changed", changed,
                          index, watched, lambda dead: self._declare_dead(r, dead))

    def _declare_dead(self, r: int, index: int) -> None:
        """Called by the heartbeat thread: member ``index`` of round r went silent. Not
        if it is marked gone already (it left, saying why, or another watcher declared it),
        nor once a node joined the next round (``changed`` says so): round r's members
        stop beating in it to re-form, they are not dead. (A round that changed for a
        death still declares a second one: a rack lost at once.)"""
        with StoreClient(self.job.agent_address, timeout=10) as store:
            raw, gone, over = store.multi_get([("/" + self._k(r, f"node/{index}")).encode(),
                                               ("/" + self._k(r, f"dead/{index}")).encode(),
                                               ("/" + self._k(r, "changed")).encode()], wait=False)
            if gone or over == b"joined":
                return
            addr = json.loads(raw)["addr"] if raw else f"arrival {index}"
            self._note_dead(addr)
            log.warning("rendezvous '%s' round %d: node %s has not answered for %.0f s; "
                        "re-forming the job without it", self.run_id, r, addr, self._beat_timeout)
            store.multi_set([("/" + self._k(r, f"dead/{index}")).encode(), ("/" + self._k(r, "changed")).encode()],
                            [addr.encode(), f"dead {addr}".encode()])

    def _announce_leaving(self, reason: str) -> None:
        """Mark this member of the current round gone, as a dead one is: the others
        restart their workers and re-form without it now, not after the heartbeat timeout."""
        with self._lock:
            r, index = self._round, self._index
        self._stop_watching()
        if r < 0:
            return
        log.warning("rendezvous '%s' round %d: node %s is leaving (%s)", self.run_id, r, self.node_addr, reason)
        with StoreClient(self.job.agent_address, timeout=10) as store:
            store.multi_set([("/" + self._k(r, name)).encode() for name in (f"dead/{index}", "changed", "all_seen")],
                            [self.node_addr.encode(), f"left {self.node_addr}: {reason}".encode(), b"1"])

    def _agents_store(self) -> tuple[str, int] | None:
        return (self._k(self._round, "agents"), self._members) if self._round >= 0 else None

    def num_nodes_waiting(self) -> int:
        """Raises ``RendezvousConnectionError`` once the store host is lost. A node whose
        proxy died gets a new one and answers 1: it restarts its workers and rejoins. So
        does a node whose parent in the store tree was lost, with a proxy linked to the
        store host (its workers' requests on the lost path fail)."""
        if self.replace_dead_proxy():
            return 1
        if self._parent_lost():  # (its heartbeat went through that parent: link it at once)
            self._go_flat()
            return 1
        self.check_store_host()
        with self._lock:
            if self._round not in self._waiting_seen:
                return 0
            r = self._round
        self._restart_together(r, lambda name: self._k(r, name), self._members)
        try:  # nodes waiting, or 1 when a member died: either way, restart to re-form
            return max(int(self.job.client().add(self._k(self._round + 1, "joined"), 0)), 1)
        except Exception:
            self.check_store_host()
            return 1

    def is_closed(self) -> bool:
        return bool(self.job.client().check([f"{self._base}/closed"]))

    def set_closed(self) -> None:
        store = self.job.client()
        store.set(f"{self._base}/closed", "1")
        self._spares_waiting = int(store.add(f"{self._base}/spares", 0))
        # release nodes waiting for the next round
        r = int(store.add(f"{self._base}/round", 0))
        for rr in {r, self._round + 1}:
            store.compare_set(self._k(rr, "closed"), "", _JOB_CLOSED)

    def shutdown(self) -> bool:
        self._run_shutdown_hooks()
        self._stop_watching(leaving=True)
        if self._round >= 0:  # (a node that never joined, e.g. could not start its store, ends nothing)
            try:
                self.set_closed()
            except Exception:
                log.debug("closing rendezvous '%s' failed (store gone)", self.run_id, exc_info=True)
        if self.job.hosting:  # let the other agents, and spares (which look every spare.POLL), see it closed
            time.sleep(0.5 + (spare.POLL if self._spares_waiting else 0.0))
        self.job.stop()
        return True


def create_handler(params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    """``--rdzv_conf is_host=true|false`` as torch's c10d backend reads it: given, it
    decides whether this node hosts the store (and a host that cannot start it fails);
    else this node hosts if the endpoint names it, and becomes a client of the endpoint
    if its store cannot start there (another agent on this machine hosts it). A job of
    one node whose endpoint is on this machine (whatever ``--local_addr`` says) hosts
    its store and fails if it cannot start it (a second job on the same port must not
    join the first as a spare and exit 0)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    join_timeout = conf_float(params.config, "join_timeout", DEFAULT_JOIN_TIMEOUT)
    last_call = conf_float(params.config, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT)
    # (every store operation may take a minute, as torch's c10d read_timeout; reaching
    # the store host, join_timeout: a node nobody hosts the store for gives up then)
    timeout = timedelta(seconds=max(join_timeout, 60))
    is_host = conf_bool(params, "is_host")
    # (in a tree, any member may relay others in some round: every proxy takes links)
    link_addr = link_address(params.local_addr, host, port) if store_fanout_from(params.config) else None
    hosting = hosts_store(host, params.local_addr) if is_host is None else is_host
    # (a job of one node on this machine hosts its store, and never joins one found on its port)
    alone = is_host is None and params.max_nodes == 1 and (hosting or on_this_machine(host))
    job = JobStore(host, port, hosting=hosting or alone,
                   timeout=timeout, connect_timeout=join_timeout, unreachable_hint=unreachable_hint(host, is_host),
                   token=token_from(params.config, settings),
                   store_workers=store_workers_from(params.config), link_config=settings.link,
                   public_clients=public_clients_from(params.config),
                   host_fallback="any" if is_host is None and not alone else "never", node=params.local_addr,
                   link_addr=link_addr, host_hint=ALONE_HINT if alone else None)
    return ElasticRendezvousHandler(job, params.run_id, params.min_nodes, params.max_nodes,
                                    join_timeout, last_call, params.local_addr, params.config)
