"""The root store: the core, its front-end on the public port (or, with ``workers`` > 1,
a pool of front-end processes sharing it), and the links of node front-ends (which
arrive on the same port and are told apart by their first byte). With ``node_frontend``
it also runs the store host's own node front-end, linked to the core in-process
(``local_link``): the store host's agent and workers then cost no other process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..core import StoreCore
from ..frontend import Upstream
from ..frontend.namespace import NamespacedUpstream
from ..link.config import LinkConfig
from .frontend_pool import FrontEndPool
from ..link.reply_gate import break_watches
from .link_server import LinkServer, core_upstreams
from .local_link import link_in_process
from .service import Service, ServiceConfig

RootConfig = ServiceConfig


async def serve_root(
    config: ServiceConfig,
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    token: bytes | None = None,
    link_config: LinkConfig | None = None,
    node_frontend: ServiceConfig | None = None,
) -> None:
    """Serve until ``stop`` is set, or until SIGINT/SIGTERM when ``stop`` is None.

    ``on_listening`` gets one line per event (``listening on tcp [::]:29500``, answers
    to control commands; the node front-end's start with ``node front-end``). Links are
    accepted only when ``token`` is given; ``node_frontend`` (where this host's agent and
    workers connect) needs one. Raises ``OSError`` if a bind fails.
    """
    core = StoreCore()
    links = LinkServer(core_upstreams(core), token, link_config, drop_watches=core.drop_watches_of)
    core.on_watches_broken = break_watches

    def make_upstream(namespace: str) -> Upstream:
        return NamespacedUpstream(core, namespace.encode() + b"/") if namespace else core

    def stats() -> dict:
        st = links.stats
        return {"keys": core.num_keys, "operations": core.operations, "waiters": core.num_waiters,
                "links": st.links,
                "links_accepted": st.links_accepted, "link_resumes": st.link_resumes,
                "sessions_expired": st.sessions_expired, "link_batches": st.batches,
                "link_operations": st.operations, "watches": core.num_watches,
                "watches_evicted": core.watches_evicted,
                "invalidation_rounds": links.gate.rounds, "invalidations_lapsed": links.gate.lapsed}

    announce = on_listening or (lambda line: None)
    node = None
    if node_frontend is not None:
        if token is None:
            raise ValueError("a node front-end links to the core: it needs the job token")
        link = await link_in_process(links, token, lambda reason: None, link_config)
        node = Service(node_frontend, link.view, lambda: link.stats.as_dict(),
                       lambda line: announce("node front-end " + line))
    pool = FrontEndPool(config.workers, links, config.frontend) if config.workers > 1 else None
    service = Service(
        config, make_upstream, stats, announce,
        link_acceptor=links.take, pool=pool, gate=links.gate, node=node,
    )
    try:
        await service.serve(stop)
    finally:
        if node is not None:  # (its goodbye reaches the core a loop turn later)
            link.close()
            await asyncio.sleep(0)
        links.close()
