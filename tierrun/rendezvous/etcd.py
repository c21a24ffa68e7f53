"""``tierrun-etcd``: elastic rendezvous on etcd, so the job survives the loss of any node.

Membership lives in etcd (a replicated, existing consensus service); the workers' data
store is still tierrun's, hosted by the node that is rank 0 of the round and started
afresh on a new host when that node is lost. Round ``r`` of job ``J`` is a few keys
under ``/tierrun/J/r/<r>/``; every agent does O(1) requests per round:

    TXN  if sig/closed absent: PUT joined/<me> (my lease); COUNT joined/   -> arrival i
         (else the round closed: try r+1)
    (i >= max) -> close now;  (i == min) -> close after the last call
    WATCH sig/ until sig/closed          -> the ranked members (one key, O(n) bytes)
    rank 0:  host a store, PUT sig/store -> where it is;  others: WATCH sig/ until sig/store

Closing is one TXN: create ``sig/closed`` with the members in rank order (stable: by
their rank in their previous round, then by arrival), and advance ``/tierrun/J/round``.
Whoever creates it decides; a node that joined too late sees it is not listed and
waits for round r+1, whose first arrival sets ``sig/changed`` of round r, unless round
r runs with the maximum of nodes: then it waits as a spare (``spare``).

Liveness is etcd's: each agent's keys hang on its lease (TTL ``heartbeat_timeout``,
10 s, kept alive every ``heartbeat_interval``, 1 s; a killed store host is noticed
sooner, when its connections close). While round r runs, every member watches the
``joined`` key of the member of the next rank, in a ring; when that key vanishes (the
lease expired: the node died; or it left) the watcher creates ``sig/changed``, which
every member watches, so every agent restarts its workers and re-forms, even when
those workers are stuck in a collective with the dead node or its store. Nothing of
round r is read in round r+1: every key, the agents' store prefix and the workers'
store namespace carry the round.

If etcd is unreachable for a while (restarted, a partition), running workers go on
(their store is tierrun's); agents retry, and etcd renews leases when it is back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
import uuid

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ..settings import Settings
from .elastic import DEFAULT_JOIN_TIMEOUT, DEFAULT_LAST_CALL_TIMEOUT
from .etcd_client import Etcd, EtcdAuthError, EtcdOptions, EtcdUnavailable, KeyValue, absent, count, put
from .etcd_watch import keep_alive, when_gone, when_set
from .handler_base import StoreRendezvousHandler
from .conf import conf_bool, conf_float
from .job_store import JobStore
from .etcd_hosts import RoundStores, descriptor, in_rank_order, may_not_host, none_may_host
from . import restart_together, spare
from .messages import closed_while_waiting, join_timeout_message

log = logging.getLogger("tierrun.rendezvous")

_JOB_CLOSED = b"job-closed"
#: how long one watch request waits before the waiter re-reads and re-checks
_WATCH_SLICE = 5.0
#: seconds a silent node keeps its membership (its lease's TTL): ``heartbeat_timeout``
DEFAULT_LEASE_TTL = 10.0


class EtcdRendezvousHandler(StoreRendezvousHandler):
    """Elastic rendezvous on etcd, with the round's store on its rank-0 node.

    ``next_rendezvous`` blocks until a round closes with this node as a member and its
    store is up; raises ``RendezvousTimeoutError`` if fewer than ``min_nodes`` arrive
    within ``join_timeout``, ``RendezvousClosedError`` once the job is closed, and
    ``RendezvousConnectionError`` naming the endpoints when etcd cannot be reached.
    ``num_nodes_waiting`` never raises: while etcd is away, running workers go on.
    """

    def __init__(self, options: EtcdOptions, run_id: str, min_nodes: int, max_nodes: int,
                 join_timeout: float, last_call_timeout: float, local_addr: str | None,
                 config: dict, settings: Settings, is_host: bool | None = None) -> None:
        super().__init__(None, run_id, local_addr, config)
        self._is_host = is_host  # (see create_handler)
        #: why this node may not host a round's store (None: it may)
        self._no_host = "--rdzv_conf is_host=false" if is_host is False else None
        self._no_host_said: set[int] = set()  # rounds whose closer said none may host
        self.options = options
        self._etcd = Etcd(options)
        self._min, self._max = min_nodes, max_nodes
        self._join_timeout, self._last_call = join_timeout, last_call_timeout
        self._stores = RoundStores.from_config(config, settings, self.node_addr, join_timeout)
        self._base = f"/tierrun/{run_id}"
        self._id = uuid.uuid4().hex
        self._lease = 0
        # a lease outlives a few late renewals: etcd answers keep-alives late under load
        self._beat_timeout = conf_float(config, "heartbeat_timeout", DEFAULT_LEASE_TTL)
        self._lease_ttl = max(2, math.ceil(self._beat_timeout))
        self._lease_lost = False
        self._keepalive_stop = threading.Event()
        self._round, self._rank, self._members = -1, -1, 0  # last round this node was a member of, its rank, size
        self._host_id = ""  # the id of that round's store host
        self._changed: dict[int, bytes] = {}  # rounds whose membership changed: why
        self._lost_reported: set[int] = set()  # rounds whose store host this node marked lost
        self._round_stop = threading.Event()  # ends the current round's watch threads

    # -- keys -------------------------------------------------------------------------

    def _k(self, r: int, name: str) -> bytes:
        return f"{self._base}/r/{r}/{name}".encode()

    # -- RendezvousHandler ------------------------------------------------------------

    def get_backend(self) -> str:
        return "tierrun-etcd"

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except EtcdUnavailable as e:
            raise RendezvousConnectionError(
                f"node {self.node_addr} cannot reach etcd at {', '.join(self.options.endpoints)}: {e}. "
                "Check that etcd is running there and that --rdzv_endpoint lists its client URLs "
                "(comma-separated; TLS: --rdzv_conf protocol=https,cacert=...,cert=...,key=...)."
            ) from e
        except EtcdAuthError as e:
            raise RendezvousConnectionError(
                f"node {self.node_addr}: {e}. Check --rdzv_conf username= and the password in "
                "TIERRUN_ETCD_PASSWORD."
            ) from e

    def _next_rendezvous(self) -> RendezvousInfo:
        # (the store host's loss also fails this node's workers, and torch's agent
        # restarts failed workers, calling this, without asking num_nodes_waiting first)
        self._store_lost()
        self._stop_round_watch()
        self._ensure_lease()
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous '{self.run_id}' is closed: the job has ended")
        opened, _ = self._etcd.get(f"{self._base}/round".encode())
        r = max(self._round + 1, int(opened.value) if opened else 0)
        deadline = time.monotonic() + self._join_timeout
        while True:
            if r > 0 and self._round != r - 1 and self._running_full(r - 1):  # (not a member coming back)
                spare.wait(self.node_addr, self.run_id, r - 1, self._max,  # (no arrival meanwhile)
                           lambda t: self._wait_signals(r - 1, ("changed",), time.monotonic() + t) is not None,
                           self.is_closed)
                deadline = time.monotonic() + self._join_timeout
            members = self._join(r, deadline)
            if members is not None:
                ids, addrs = members
                rank = ids.index(self._id)
                endpoint = self._round_store(r, rank, addrs[0])
                if endpoint is not None:
                    break
                log.info("round %d of '%s' changed before its store was up; re-forming", r, self.run_id)
            r += 1
        n = len(ids)
        with self._lock:
            self._round, self._rank, self._members = r, rank, n
            self._host_id = ids[0]
        self._round_stop = threading.Event()
        threading.Thread(target=self._watch_changed, args=(r, self._round_stop), daemon=True).start()
        if n > 1:  # the ring: watch the member of the next rank
            watched = (rank + 1) % n
            threading.Thread(target=self._watch_member, args=(r, ids[watched], addrs[watched], self._round_stop),
                             daemon=True).start()
        log.info("rendezvous '%s' round %d: node %s is rank %d of %d (store on %s:%d)",
                 self.run_id, r, self.node_addr, rank, n, self.job.host, self.job.port)
        return RendezvousInfo(PrefixStore(f"tierrun/{self.run_id}/{r}/agents", self.job.client()),
                              rank, n, RendezvousStoreInfo(*endpoint))

    def _join(self, r: int, deadline: float) -> tuple[list[str], list[str]] | None:
        """Join round r; the members' ids and addresses in rank order once it closes with
        this node, None if it closed without it."""
        me = descriptor(self._id, self.node_addr, self._rank, self._round, os.getpid(), self._is_host, self._no_host)
        joined, responses, revision = self._etcd.txn(
            [absent(self._k(r, "sig/closed"))],
            [put(self._k(r, f"joined/{self._id}"), me, self._lease), count(self._k(r, "joined/"))],
        )
        if not joined:
            return None
        index = int(responses[1].get("count", 0))
        if r > 0 and (index == 1 or self._round == r - 1):  # the running members restart to admit the
            self._etcd.create(self._k(r - 1, "sig/changed"), b"joined")  # waiting nodes (a member back: spares)
        if index >= self._max:
            self._close(self._etcd, r)
        elif index == self._min:
            threading.Thread(target=self._last_call_then_close, args=(r,), daemon=True).start()
        joined_at = time.monotonic()
        while True:
            signals = self._wait_signals(r, ("closed",), deadline)
            if signals is not None:
                break
            if self._lease_lost:  # renewals were late: join again with a new lease
                self._ensure_lease()
                self._etcd.txn([absent(self._k(r, "sig/closed"))], [put(self._k(r, f"joined/{self._id}"), me, self._lease)])
            # the closer may have died: past the last call any waiting member closes
            if time.monotonic() - joined_at > self._last_call + 2 * self._beat_timeout:
                self._close(self._etcd, r)
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(self._timeout_message(r))
        closed = signals["closed"]
        if closed == _JOB_CLOSED:
            raise RendezvousClosedError(closed_while_waiting(self.run_id, self.node_addr, r))
        members = json.loads(closed)
        if self._id not in members["ids"]:
            log.info("round %d of '%s' closed with %d nodes before node %s arrived; waiting for the next",
                     r, self.run_id, len(members["ids"]), self.node_addr)
            return None
        return members["ids"], members["addrs"]

    def _running_full(self, r: int) -> bool:
        """Whether round r (closed) runs with the maximum of nodes and none left or died."""
        return len(self._members_of(self._etcd, r)) == self._max and not self._etcd.get(self._k(r, "sig/changed"))[0]

    def _wait_signals(self, r: int, names: tuple[str, ...], deadline: float) -> dict[str, bytes] | None:
        """Round r's signals (``sig/*``) once one of ``names`` is set; None after one
        watch slice without it (so callers can check their own conditions)."""
        prefix = self._k(r, "sig/")
        kvs, revision = self._etcd.range(prefix)
        signals = {kv.key[len(prefix):].decode(): kv.value for kv in kvs}
        if any(name in signals for name in names):
            return signals
        slice_ = min(_WATCH_SLICE, max(deadline - time.monotonic(), 0.01))
        self._etcd.watch(prefix, revision + 1, slice_, prefix=True)
        return None

    def _close(self, etcd: Etcd, r: int) -> bool:
        """Close round r with the live arrivals (at most max), if at least min; one TXN."""
        kvs, _ = etcd.range(self._k(r, "joined/"))
        if len(kvs) < self._min:
            return False
        arrivals = in_rank_order(kvs, self._max)
        if len(no_host := may_not_host(arrivals)) == len(arrivals):
            if r not in self._no_host_said:  # (once: the last call retries every 0.5 s)
                self._no_host_said.add(r)
                log.warning("round %d of '%s': %s; waiting for one that may", r, self.run_id, none_may_host(no_host))
            return False
        members = json.dumps({"ids": [a["id"] for a in arrivals],
                              "addrs": [a["addr"] for a in arrivals]}).encode()
        closed, _, _ = etcd.txn([absent(self._k(r, "sig/closed"))],
                                [put(self._k(r, "sig/closed"), members),
                                 put(f"{self._base}/round".encode(), str(r + 1).encode())])
        if closed:
            log.info("round %d of '%s' closed with %d nodes", r, self.run_id, len(arrivals))
        return closed

    def _last_call_then_close(self, r: int) -> None:
        """Close round r when the last call ends, or as soon as every live member of
        round r-1 has joined (a re-form after a failure then takes seconds). Three range
        reads per poll, on one node."""
        etcd = self._etcd.clone()
        try:
            previous = self._members_of(etcd, r - 1) if r > 0 else set()
            joined = previous and getattr(etcd.get(self._k(r - 1, "sig/changed"))[0], "value", None) == b"joined"
            deadline = time.monotonic() + (restart_together.last_call_limit(self._last_call, self._monitor_interval)
                                           if joined else self._last_call)  # (see restart_together)
            while time.monotonic() < deadline:
                if previous and self._previous_all_back(etcd, r, previous):
                    log.info("round %d of '%s': every live member of round %d is back; closing "
                             "before the last call", r, self.run_id, r - 1)
                    break
                time.sleep(0.25)
            while not self._close(etcd, r):  # below min again: wait until enough are back
                closed, _ = etcd.get(self._k(r, "sig/closed"))
                if closed is not None:
                    return
                time.sleep(0.5)
        except Exception:  # etcd unreachable: waiting members close after the last call
            log.debug("last call of round %d not completed", r, exc_info=True)
        finally:
            etcd.close()

    def _members_of(self, etcd: Etcd, r: int) -> set[str]:
        closed, _ = etcd.get(self._k(r, "sig/closed"))
        return set() if closed is None or closed.value == _JOB_CLOSED else set(json.loads(closed.value)["ids"])

    def _ids(self, etcd: Etcd, r: int, name: str) -> set[str]:
        """The node ids under round r's ``name/`` (the last part of each key)."""
        kvs, _ = etcd.range(self._k(r, f"{name}/"))
        return {kv.key.rsplit(b"/", 1)[1].decode() for kv in kvs}

    def _previous_all_back(self, etcd: Etcd, r: int, previous: set[str]) -> bool:
        """Every member of round r-1 that is still alive (its key not expired, not
        marked lost) has joined round r, and round r has at least min nodes."""
        back = self._ids(etcd, r, "joined")
        if len(back) < self._min:
            return False
        alive = (self._ids(etcd, r - 1, "joined") & previous) - self._ids(etcd, r - 1, "lost")
        return alive <= back

    def _timeout_message(self, r: int) -> str:
        try:
            kvs, _ = self._etcd.range(self._k(r, "joined/"))
            arrivals = [json.loads(kv.value) for kv in kvs]
        except EtcdUnavailable:
            arrivals = [{"addr": "(unknown: etcd did not answer)"}]
        return join_timeout_message(self.run_id, self.node_addr, self._join_timeout, [a["addr"] for a in arrivals],
                                    self._min, self._max, may_not_host(arrivals))

    # -- the round's store -------------------------------------------------------------

    def _round_store(self, r: int, rank: int, host_addr: str) -> tuple[str, int] | None:
        """Rank 0 hosts the round's store (its own from the previous round if it still
        runs, else a fresh one) and publishes where; the others connect to it. Returns
        where this node's workers connect, or None if the round changed before its
        store was up (its host died): the caller re-forms."""
        namespace = f"{self.run_id}/workers/{r}"
        if rank == 0:
            job = self.job
            if job is None or not job.hosting or job.lost() is not None:
                try:
                    self._use_store(self._stores.hosted())
                except RendezvousConnectionError as e:
                    # the others re-form (without this node if it must host: it fails)
                    self._etcd.create(self._k(r, "sig/changed"), f"store host {self.node_addr} failed".encode())
                    if self._is_host:
                        told = f"node {self.node_addr} (--rdzv_conf is_host=true): "
                        raise RendezvousConnectionError(told + str(e).removeprefix(f"node {self.node_addr}: ")) from e
                    log.warning("node %s cannot host the store of round %d (%s); re-forming with "
                                "another node as the store host", self.node_addr, r, e)
                    self._is_host = False  # as torch's c10d does: a client from now on
                    self._no_host = f"its store could not start on store_port {self._stores.port}"
                    return None
            endpoint = self.job.worker_endpoint(namespace)
            assert endpoint is not None
            # flat, the other nodes' workers connect to this namespace listener too
            where = {"host": self.node_addr, "port": self.job.port, "worker_port": endpoint[1]}
            self._etcd.put(self._k(r, "sig/store"), json.dumps(where).encode(), self._lease)
            return endpoint
        store_deadline = time.monotonic() + self._stores.timeout.total_seconds()
        while (signals := self._wait_signals(r, ("store", "changed"), store_deadline)) is None:
            if time.monotonic() >= store_deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous '{self.run_id}' round {r}: the rank-0 node {host_addr} did not "
                    f"start the round's store within {self._stores.timeout.total_seconds():.0f} s")
        if "store" not in signals:
            return None
        where = json.loads(signals["store"])
        job = self.job
        if job is None or (job.host, job.port) != (where["host"], where["port"]) or job.lost() is not None:
            self._use_store(self._stores.joined(where["host"], where["port"]))
        return self.job.worker_endpoint(namespace) or (where["host"], where["worker_port"])

    def _use_store(self, job: JobStore) -> None:
        if self.job is not None:
            self.job.stop()
        self.job = None
        job.start()
        job.client()
        self.job = job

    # -- while a round runs ------------------------------------------------------------

    def _ensure_lease(self) -> None:
        if self._lease and not self._lease_lost:
            return
        self._keepalive_stop.set()
        self._lease = self._etcd.grant(self._lease_ttl)
        self._lease_lost = False
        self._keepalive_stop = threading.Event()
        threading.Thread(target=keep_alive, args=(self._etcd, self._lease, self._beat_interval, self._keepalive_stop,
                                                  self._lease_expired, self.node_addr),
                         name="tierrun-etcd-lease", daemon=True).start()

    def _lease_expired(self) -> None:
        with self._lock:
            self._lease_lost = True

    def _watch_changed(self, r: int, stop: threading.Event) -> None:
        def changed(kv: KeyValue) -> None:
            with self._lock:
                self._changed[r] = kv.value
            log.info("round %d of '%s' changed: %s", r, self.run_id, kv.value.decode())

        when_set(self._etcd, self._k(r, "sig/changed"), stop, _WATCH_SLICE, changed)

    def _watch_member(self, r: int, member: str, addr: str, stop: threading.Event) -> None:
        """Mark round r changed once ``member``'s key is gone (its lease ended), so the
        others stop their workers. Quietly if it closed the job first (a node ends it
        so, having finished or failed: the others then find it closed)."""
        def gone(etcd: Etcd) -> None:
            if etcd.get(f"{self._base}/closed".encode())[0] is None:
                log.warning("rendezvous '%s' round %d: node %s is gone (its etcd lease ended); re-forming the job "
                            "without it", self.run_id, r, addr)
            etcd.create(self._k(r, "sig/changed"), f"dead {addr}".encode())

        when_gone(self._etcd, self._k(r, f"joined/{member}"), stop, _WATCH_SLICE, gone)

    def _stop_round_watch(self) -> None:
        self._round_stop.set()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round, or 1 when a member died or left, this node's
        lease expired or it lost the round's store: any of these re-forms the job.
        Never raises; one count request only after a change."""
        with self._lock:
            r = self._round
            changed = r in self._changed or self._lease_lost
            why = self._changed.get(r)
        if self._store_lost():
            return 1
        if not changed:
            return 0
        if why is not None:  # (a member back on its own does not count in: its round's store may be what it lost)
            self._restart_together(r, lambda name: f"tierrun/{self.run_id}/{r}/{name}", self._members, why)
        try:
            return max(self._etcd.count(self._k(r + 1, "joined/")), 1)
        except EtcdUnavailable:
            return 1

    def _store_lost(self) -> bool:
        """Whether this node has lost its round's store; if so, mark the round's store
        host lost, so the next round's last call does not wait for it until its lease
        ends (if it is alive after all, it re-joins: one more re-form). Best effort,
        once per round: two create-only requests."""
        if self.job is None or (lost := self.job.lost()) is None:
            return False
        with self._lock:
            r = self._round
        if r in self._lost_reported:
            return True
        self._lost_reported.add(r)
        log.warning("node %s lost round %d's store on %s (%s); re-forming", self.node_addr, r, self.job.host, lost)
        with contextlib.suppress(EtcdUnavailable):
            self._etcd.create(self._k(r, f"lost/{self._host_id}"), lost.encode())
            self._etcd.create(self._k(r, "sig/changed"), f"store host {self.job.host} lost".encode())
        return True

    def _announce_leaving(self, reason: str) -> None:
        """Tell the others at once (``sig/changed``) and drop this node's keys (revoke
        its lease), rather than let them wait for the lease to expire."""
        with self._lock:
            r = self._round
        self._stop_round_watch()
        self._keepalive_stop.set()
        if r >= 0:
            log.warning("rendezvous '%s' round %d: node %s is leaving (%s)", self.run_id, r, self.node_addr, reason)
            self._etcd.create(self._k(r, "sig/changed"), f"left {self.node_addr}: {reason}".encode())
        if self._lease:
            self._etcd.revoke(self._lease)
            self._lease = 0

    def _agents_store(self) -> tuple[str, int] | None:
        if self._round < 0 or self.job is None:
            return None
        return f"tierrun/{self.run_id}/{self._round}/agents", self._members

    def is_closed(self) -> bool:
        kv, _ = self._etcd.get(f"{self._base}/closed".encode())
        return kv is not None

    def set_closed(self) -> None:
        self._etcd.put(f"{self._base}/closed".encode(), b"1")
        opened, _ = self._etcd.get(f"{self._base}/round".encode())
        for r in {int(opened.value) if opened else 0, self._round + 1}:  # release waiting nodes
            self._etcd.create(self._k(r, "sig/closed"), _JOB_CLOSED)

    def shutdown(self) -> bool:
        self._run_shutdown_hooks()
        self._stop_round_watch()
        try:  # (a node that never joined a round, e.g. timed out, ends nothing: others may go on)
            if self._round >= 0:
                self.set_closed()
        except EtcdUnavailable:
            log.warning("could not mark rendezvous '%s' closed: etcd unreachable", self.run_id)
        if self.job is not None:
            if self.job.hosting:
                time.sleep(0.5)  # let the other agents finish with the store
            self.job.stop()
        self._keepalive_stop.set()
        if self._lease:
            with contextlib.suppress(EtcdUnavailable):  # (else the lease expires on its own)
                self._etcd.revoke(self._lease)
            self._lease = 0
        self._etcd.close()
        return True


def create_handler(params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    """``--rdzv_conf is_host=true|false``: the endpoint is etcd's, and the store moves
    to each round's rank 0, so ``is_host`` says which nodes may be that rank: true, this
    node hosts every round it is in (and fails if its store cannot start there); false,
    never; unset, it may, and if its store cannot start (``store_port`` taken) the round
    re-forms with another host and this node stays a client, as torch's c10d does."""
    options = EtcdOptions.parse(params.endpoint, params.config, settings.etcd_password)
    return EtcdRendezvousHandler(
        options, params.run_id, params.min_nodes, params.max_nodes,
        conf_float(params.config, "join_timeout", DEFAULT_JOIN_TIMEOUT),
        conf_float(params.config, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT),
        params.local_addr, params.config, settings, is_host=conf_bool(params, "is_host"),
    )
