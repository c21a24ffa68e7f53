"""The root store: the core, its front-end on the public port (or, with ``workers`` > 1,
a pool of front-end processes sharing it), and the links of node front-ends (which
arrive on the same port and are told apart by their first byte). With ``node_frontend``
it also runs the store host's own node front-end: a front-end on the core, as the
public port's, on listeners of the host's own (loopback, a Unix socket): the store
host's agent and workers then cost no other process, and their requests no link."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Callable

from ..core import StoreCore
from ..frontend import Upstream
from ..frontend.namespace import NamespacedUpstream
from ..link.config import LinkConfig
from ..hub.link_server import LinkServer
from ..hub.lookup_datagrams import LookupDatagrams
from ..hub.paced_udp import PacedDatagramEndpoint
from ..hub.reply_gate import break_watches
from ..hub.session import core_upstreams
from .control import Event
from .frontend_pool import FrontEndPool
from .service import Service, ServiceConfig

RootConfig = ServiceConfig


async def serve_root(
    config: ServiceConfig,
    on_listening: Callable[[Event], None] | None = None,
    stop: asyncio.Event | None = None,
    token: bytes | None = None,
    link_config: LinkConfig | None = None,
    node_frontend: ServiceConfig | None = None,
) -> None:
    """Serve until ``stop`` is set, or until SIGINT/SIGTERM when ``stop`` is None.

    ``on_listening`` gets every event (``control.Listening`` once per listener, the
    answers to control commands; the node front-end's with ``node`` set). Links are
    accepted only when ``token`` is given; ``node_frontend`` (where this host's agent and
    workers connect) needs one. Raises ``OSError`` if a bind fails.
    """
    core = StoreCore(config.frontend.limits)
    links = LinkServer(core_upstreams(core), token, link_config, drop_watches=core.drop_watches_of,
                       limits=config.frontend.limits, max_connections=config.frontend.max_connections)
    core.on_watches_broken = break_watches

    def make_upstream(namespace: str) -> Upstream:
        return NamespacedUpstream(core, namespace.encode() + b"/") if namespace else core

    def stats() -> dict:
        st = links.stats
        budget = core.budget
        return {"keys": core.num_keys, "operations": core.operations, "waiters": core.num_waiters,
                "store_bytes": budget.bytes, "store_entries": budget.entries, "budget_refused": budget.refused,
                "scans": core.pacer.scans, "scans_refused": core.pacer.refused,
                "links": st.links,
                "links_accepted": st.links_accepted, "lookups": st.lookups, "link_resumes": st.link_resumes,
                "sessions_expired": st.sessions_expired, "link_batches": st.batches,
                "link_operations": st.operations, "wills_held": links.wills.held,
                "wills_executed": links.wills.executed, "watches": core.num_watches,
                "watches_evicted": core.watches_evicted,
                "invalidation_rounds": links.gate.rounds, "invalidations_lapsed": links.gate.lapsed}

    announce = on_listening or (lambda event: None)
    node = None
    if node_frontend is not None:
        # (on the core like the public port's clients, with no link in between: an
        # in-process link cost node 0 ~15% more CPU at 512x8, measured with bench/wireup.py,
        # and merging the requests of one node's workers saves the core little)
        node = Service(node_frontend, make_upstream, dict,
                       lambda event: announce(dataclasses.replace(event, node=True)), gate=links.gate)
    pool = FrontEndPool(config.workers, links, config.frontend, config.links_only) if config.workers > 1 else None

    def count_lookup() -> None:
        links.stats.lookups += 1

    def datagrams(sock: socket.socket) -> PacedDatagramEndpoint:
        assert token is not None
        lookups = LookupDatagrams(token, core, config.frontend.limits.max_key_bytes, count_lookup)
        return PacedDatagramEndpoint(sock, lookups, links.config.lookup_pace)

    service = Service(
        config, make_upstream, stats, announce,
        link_acceptor=links.take, pool=pool, gate=links.gate, node=node,
        datagrams=datagrams if token else None,
    )
    try:
        await service.serve(stop)
    finally:
        links.close()
