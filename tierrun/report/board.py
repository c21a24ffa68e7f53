"""The job's board: every agent's record, kept in the job's store.

Keys, under ``tierrun/<run_id>/report/``:

    nodes          APPEND "<node id>\\n" once per agent
    node/<id>      SET the agent's whole record (JSON, a few hundred bytes per attempt)

Publishing is O(1) operations per update; reading everyone's is one GET and one
MULTI_GET, O(nodes) bytes, done only by the agent that reports.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from dataclasses import asdict, dataclass, field

from ..client import StoreClient

log = logging.getLogger("tierrun.report")


@dataclass
class Failure:
    """One worker that failed: ``exitcode`` is negative for a signal."""

    global_rank: int
    local_rank: int
    exitcode: int | None
    time: float  # when it failed, as precisely as known (see recorder._error_details)
    message: str
    traceback: str = ""
    exited: float | None = None  # when the process ended, if this agent saw it

    @property
    def stopped_by_agent(self) -> bool:
        """SIGTERM and no error file: usually the agent stopping the rest of a failed
        group. torch stamps every failure of one group with the same time, so this is
        what tells the rank that failed first from the ones stopped because of it."""
        return self.exitcode == -signal.SIGTERM and not self.traceback


FINAL_STATES = ("SUCCEEDED", "FAILED", "TERMINATED")


@dataclass
class Attempt:
    """One round of an agent's workers; times are Unix seconds (``time.time()``)."""

    number: int  # restarts used before it
    group_rank: int = -1
    world_size: int = -1
    rendezvous: tuple[float, float] | None = None
    workers_started: float | None = None
    ended: float | None = None
    state: str = "RUNNING"  # then SUCCEEDED, FAILED, or TERMINATED (stopped by the agent)
    failures: list[Failure] = field(default_factory=list)
    workers: int = 0  # this node's workers started in this round
    workers_ended: int = 0  # of which torch's agent has reported the final state

    def has_ended(self) -> bool:
        """Whether every worker of this round has its final state recorded: torch's
        agent reports them one by one, and the record is published after each."""
        return self.state in FINAL_STATES and self.workers_ended >= self.workers


@dataclass
class LostNode:
    """A member whose heartbeat this agent's watcher saw stop (a dead node leaves no
    record of its own): ``silent_since``, about when it was last heard from (the
    declaration less the heartbeat timeout and one interval: it died after, within
    about two intervals); ``declared``, when the watcher gave up on it (Unix seconds)."""

    addr: str
    silent_since: float
    declared: float
    by: str  # the watcher's address


@dataclass
class NodeRecord:
    """An agent's view of its own node, from its start to now."""

    node: str  # unique per agent: "<address>:<pid>"
    addr: str
    started: float
    attempts: list[Attempt] = field(default_factory=list)
    lost: list[LostNode] = field(default_factory=list)  # members its watcher saw die

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes | str) -> NodeRecord:
        d = json.loads(raw)
        attempts = []
        for a in d.pop("attempts"):
            failures = [Failure(**f) for f in a.pop("failures")]
            if a["rendezvous"] is not None:
                a["rendezvous"] = tuple(a["rendezvous"])
            attempts.append(Attempt(**a, failures=failures))
        lost = [LostNode(**n) for n in d.pop("lost", ())]
        return NodeRecord(**d, attempts=attempts, lost=lost)


class JobBoard:
    """Publish this agent's record; read every agent's.

    Uses its own connection to the job's store (``address``: the store host, or this
    node's proxy when tiered), opened on first use. Methods block for one round trip
    and raise ``OSError`` or ``StoreClientError`` when the store is gone. Thread-safe.
    """

    def __init__(self, address: tuple[str, int] | str, run_id: str, timeout: float = 10.0) -> None:
        self._address = address
        self._base = f"/tierrun/{run_id}/report"
        self._timeout = timeout
        self._client: StoreClient | None = None
        self._announced: set[str] = set()
        self._lock = threading.Lock()

    def _store(self) -> StoreClient:
        if self._client is None:
            self._client = StoreClient(self._address, timeout=self._timeout)
        return self._client

    def publish(self, record: NodeRecord) -> None:
        with self._lock:
            store = self._store()
            # the record first: a reader that sees the id in "nodes" finds the record
            store.set(f"{self._base}/node/{record.node}".encode(), record.to_json().encode())
            if record.node not in self._announced:
                store.append(f"{self._base}/nodes".encode(), f"{record.node}\n".encode())
                self._announced.add(record.node)

    def read_all(self) -> list[NodeRecord]:
        with self._lock:
            store = self._store()
            nodes_key = f"{self._base}/nodes".encode()
            if not store.check([nodes_key]):
                return []
            nodes = store.get(nodes_key).decode().split()
            raw = store.multi_get([f"{self._base}/node/{n}".encode() for n in nodes])
        return [NodeRecord.from_json(r) for r in raw]

    def move_to(self, address: tuple[str, int] | str) -> None:
        """Use ``address`` from now on (this node's store proxy was replaced: its tree
        parent changed, or it died); what was published stays published."""
        with self._lock:
            if address != self._address:
                if self._client is not None:
                    self._client.close()
                    self._client = None
                self._address = address

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
