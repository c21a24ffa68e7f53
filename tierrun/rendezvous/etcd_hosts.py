"""Which node of a ``tierrun-etcd`` round hosts its store: the rank-0 node, chosen by
each node's ``is_host`` and why a node may not host (told so, or its store could not
start), as every node's arrival descriptor in etcd records them; and how a node makes
a round's store (:class:`RoundStores`): hosts it, or joins the host's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from ..link.config import LinkConfig
from ..settings import Settings
from .conf import conf_int, public_clients_from, store_workers_from, token_from
from .etcd_client import KeyValue
from .job_store import JobStore

#: ``is_host`` -> the order in which nodes are chosen to host a round's store
HOST_PREFERENCE = {True: 0, None: 1, False: 2}
#: the setting a node that cannot start a round's store is told to change
PORT_SETTING = "--rdzv_conf store_port=N (0, the default: any free port)"


def descriptor(node_id: str, addr: str, prev_rank: int, prev_round: int, pid: int,
               is_host: bool | None, no_host: str | None) -> bytes:
    """A node's arrival in a round: ``no_host`` says why it may not host (None: it may)."""
    return json.dumps({"id": node_id, "addr": addr, "prev_rank": prev_rank, "prev_round": prev_round,
                       "pid": pid, "host": HOST_PREFERENCE[is_host], "no_host": no_host}).encode()


def in_rank_order(kvs: Sequence[KeyValue], max_nodes: int) -> list[dict]:
    """The first ``max_nodes`` arrivals in rank order. Rank 0 hosts the store: nodes
    that must host first, those that may not last; then by rank in the previous round,
    then by arrival (etcd's create revision)."""
    arrivals = (dict(json.loads(kv.value), rev=kv.create_revision) for kv in kvs)
    return sorted(arrivals, key=lambda a: (a.get("host", 1), a["prev_rank"] if a["prev_rank"] >= 0 else 1 << 30,
                                           a["rev"]))[:max_nodes]


def may_not_host(arrivals: list[dict]) -> list[tuple[str, str]]:
    """(address, why) of each of ``arrivals`` that may not host the round's store."""
    return [(a["addr"], a.get("no_host") or "may not host") for a in arrivals
            if a.get("host", 1) == HOST_PREFERENCE[False]]


def none_may_host(no_host: list[tuple[str, str]]) -> str:
    """Says that none of the nodes of a round may host its store, and why each may not."""
    return (f"none of the {len(no_host)} nodes that joined may host the store (" +
            "; ".join(f"{addr}: {why}" for addr, why in no_host) + ")")


#: What a node says that gave up on a round's store host.
JOINED_HINT = ("check that the round's store host (the node named above) is running and that its port is open "
               "(--rdzv_conf store_port), or give it more time (--rdzv_conf join_timeout=SECONDS).")


@dataclass(frozen=True)
class RoundStores:
    """How this node makes the store of a round: hosts it on ``port`` (rank 0), or
    joins the rank-0 node's. Every store operation may take ``timeout`` (torch's c10d
    ``read_timeout``: a minute, or the join timeout if longer)."""

    node: str
    token: bytes | None
    link_config: LinkConfig
    port: int
    workers: int
    public_clients: bool
    timeout: timedelta

    @staticmethod
    def from_config(config: dict, settings: Settings, node: str, join_timeout: float) -> RoundStores:
        """``--rdzv_conf store_port=N`` (0: any free port), ``store_workers``,
        ``store_public_clients``, ``tiered``. Raises ``ValueError`` for a wrong one."""
        return RoundStores(node, token_from(config, settings), settings.link,
                           conf_int(config, "store_port", 0), store_workers_from(config),
                           public_clients_from(config), timedelta(seconds=max(join_timeout, 60)))

    def hosted(self) -> JobStore:
        """A store this node hosts: it fails (``start``) if it cannot start, never joins
        another on its port."""
        return JobStore(self.node, self.port, hosting=True, timeout=self.timeout, token=self.token,
                        store_workers=self.workers, host_fallback="never", port_setting=PORT_SETTING,
                        link_config=self.link_config, node=self.node, public_clients=self.public_clients)

    def joined(self, host: str, port: int) -> JobStore:
        """The store ``host:port`` hosts, as a client (a proxy of its own when tiered)."""
        return JobStore(host, port, hosting=False, timeout=self.timeout, token=self.token,
                        link_config=self.link_config, node=self.node, unreachable_hint=JOINED_HINT)
