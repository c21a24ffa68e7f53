"""A key namespace: an upstream that prefixes every key of its clients.

The launcher gives each rendezvous round its own namespace, so that workers of a
later round can never read what workers of an earlier round wrote (a stale Gloo
address, a stale NCCL unique id), although one store serves the whole job.
"""

from __future__ import annotations

from ..core import StoreCore, Waiter
from ..core.watch_state import WATCH_READ
from ..protocol import Op, Request
from ..protocol.replies import encode_i64, encode_key_list

_ONE_KEY = frozenset(
    {Op.SET, Op.COMPARE_SET, Op.GET, Op.ADD, Op.DELETE_KEY, Op.APPEND,
     Op.QUEUE_PUSH, Op.QUEUE_POP, Op.QUEUE_LEN, Op.BARRIER}
)
_KEY_TUPLE = frozenset({Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET})


class NamespacedUpstream:
    """Wraps the core: clients see only the keys under ``prefix``, without the prefix.

    Cost per request: one concatenation per key. GETNUMKEYS and LIST_KEYS scan the
    whole key space (O(keys in the store), paced by the core's ``ScanPacer``, and a
    LIST_KEYS answer's size checked before it is built); torch uses neither on its
    start-up path.
    """

    def __init__(self, core: StoreCore, prefix: bytes) -> None:
        self._core = core
        self._prefix = prefix

    def execute(self, req: Request, waiter: Waiter) -> bytes | None:
        op = req[0]
        p = self._prefix
        if op in _ONE_KEY:
            req = (op, p + req[1], *req[2:])
        elif op in _KEY_TUPLE:
            req = (op, tuple(p + k for k in req[1]), *req[2:])
        elif op == Op.LIST_KEYS or op == Op.GETNUMKEYS:
            return self._scan(op, waiter)
        return self._core.execute(req, waiter)

    def _scan(self, op: int, scanner: Waiter) -> bytes:
        """LIST_KEYS or GETNUMKEYS of the namespace. Raises BudgetExceeded (a
        StoreError) while scans have had their share of the store's time, or for a
        LIST_KEYS whose answer would pass the store's limit (counted before anything
        is copied). O(keys in the store)."""
        core, p = self._core, self._prefix
        keys = core.keys()
        started = core.pacer.start(len(keys), scanner)
        try:
            mine = [k for k in keys if k.startswith(p)]
            if op == Op.GETNUMKEYS:
                return encode_i64(len(mine))
            n = len(p)
            core.budget.reply(8 + sum(8 + len(k) - n for k in mine))
            return encode_key_list([k[n:] for k in mine])
        finally:
            core.pacer.done(started, scanner)

    def execute_watching(self, req: Request, waiter: Waiter, watcher: object, how: int = WATCH_READ) -> bytes | None:
        op = req[0]
        p = self._prefix
        req = (op, p + req[1]) if op == Op.GET else (op, tuple(p + k for k in req[1]))
        return self._core.execute_watching(req, waiter, watcher, how)

    def forget(self, waiter: Waiter) -> None:
        self._core.forget(waiter)
