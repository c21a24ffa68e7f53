"""What the store host's agent says when its store refuses a node's connection for a
reason a person must fix: a torch-protocol client on a tiered job's links-only port (a
script connecting to --master_addr itself, a tool, a node that runs a flat store), a
node's link on a flat job's store (a node that is tiered), or a link with another job
token (a node given another secret, or another job's node). The store process logs
every refusal to its own output, which nobody reads while it runs; the agent says it,
once per source address and kind (torch's client retries twice a second until its
timeout; a front-end, its link), and, every 30 s at most, that it refuses connections
past its limit (its open files)."""

from __future__ import annotations

import logging
import threading
from time import monotonic

from ..frontend.contracts import TORCH_CLIENT_REFUSED
from ..link.auth import WRONG_TOKEN
from ..link.session import NO_LINKS

log = logging.getLogger("tierrun.rendezvous")

#: How a store process's log line of a closed connection begins (``LinkServerConnection``).
CLOSING = "] WARNING closing link from "
#: Addresses said at most (a scan of the store port from many must not flood the log).
MAX_ADDRESSES = 64
#: How a store process's log line of a connection refused past its limit begins
#: (``FrontEnd.admit``), and what it says after the peer.
REFUSING = "] WARNING refusing connection from "
#: Seconds between two repeats of a store's refusals past its limit.
LIMIT_REPEAT = 30.0


class LimitRefusals:
    """Called with each line of a store process's output: says, at most every
    ``LIMIT_REPEAT`` seconds, that it refuses connections past its limit of
    connections (its open files, or --max-connections), which would otherwise be said
    only in its own output, which nobody reads while it runs: the agents and workers
    refused fail to connect, and the job waits. ``what``: the store, as the line names
    it. O(1) a line."""

    def __init__(self, node: str, what: str) -> None:
        self.node = node
        self.what = what
        self._lock = threading.Lock()
        self._said_at: float | None = None

    def __call__(self, line: str) -> None:
        if REFUSING not in line:
            return
        now = monotonic()
        with self._lock:
            if self._said_at is not None and now - self._said_at < LIMIT_REPEAT:
                return
            self._said_at = now
        rest = line.split(REFUSING, 1)[1].partition(": ")[2].rstrip()  # (N open (the limit: ...); M refused so far)
        log.warning("%s: %s refuses connections: %s. The agents and workers refused cannot reach the store.",
                    self.node, self.what, rest)


class Refusals:
    """Called with each line of the store process's output (``StoreProcess(on_line=...)``),
    from its reader thread; says each refusal of the other layout, or of another job
    token, once per address. ``node``: this node, as messages name it; ``port``: the
    store's public port. O(1) a line."""

    def __init__(self, node: str, port: int) -> None:
        self.node = node
        self.port = port
        self._said: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._limit = LimitRefusals(node, "the job's store")

    def __call__(self, line: str) -> None:
        if CLOSING not in line:
            self._limit(line)
            return
        peer, _, reason = line.split(CLOSING, 1)[1].partition(": ")
        if reason.startswith(TORCH_CLIENT_REFUSED[:40]):
            kind = "torch"
        elif NO_LINKS in reason:
            kind = "layout"
        elif reason.startswith(WRONG_TOKEN):
            kind = "token"
        else:
            return
        address = peer.rpartition(":")[0] or peer
        address = address.removeprefix("::ffff:") if "." in address else address  # (IPv4, on a dual-stack port)
        with self._lock:
            if (address, kind) in self._said or len(self._said) > MAX_ADDRESSES:
                return
            self._said.add((address, kind))
            if len(self._said) > MAX_ADDRESSES:
                log.warning("%s: the job's store refused connections from over %d addresses; not said again",
                            self.node, MAX_ADDRESSES)
                return
        log.warning("%s", self.message(address, kind))

    def message(self, address: str, kind: str) -> str:
        if kind == "torch":
            return (f"{self.node}: the job's store refused a torch-protocol client from {address}: a tiered job's "
                    f"store port ({self.port}) takes node links only. Either a node there runs a flat store (give "
                    "every node the same flags and tierrun version), or a script or tool there connects to "
                    "--master_addr or --rdzv_endpoint itself: workers reach the store at $MASTER_ADDR:$MASTER_PORT "
                    "as tierrun sets them (their node's proxy); to let such clients in, launch with --rdzv_conf "
                    "store_public_clients=true (or --no-tiered). Said once per address.")
        if kind == "token":
            return (f"{self.node}: the job's store refused a node link from {address}: its job token is not this "
                    "job's. Give every node of the job the same secret (TIERRUN_TOKEN_FILE or TIERRUN_TOKEN), or, "
                    "without one, the same --rdzv_id and store port (the derived token); a node of another job "
                    "there should use another port. Said once per address.")
        return (f"{self.node}: the job's store refused a node link from {address}: this node runs a flat store, "
                "that node is tiered. Give every node the same --nnodes, --tiered or --no-tiered, --store-fanout "
                "and --store-workers (with none of them, a job of 32 nodes or more is tiered), and the same "
                "tierrun version.")
