"""The node proxy: a front-end whose upstream is a link to the store host.

Workers and the agent of a node connect here (loopback TCP, or a Unix socket);
VALIDATE and PING are answered here, everything else leaves in batches over one
authenticated link. A link that drops is resumed (see ``LinkUpstream``); if the store
host is not back within the grace period the proxy exits (status 3), closing its
clients' connections, and its agent reports it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..frontend.link_upstream import connect_link
from ..link.config import LinkConfig
from .service import Service, ServiceConfig

log = logging.getLogger("tierrun.proxy")


async def serve_proxy(
    config: ServiceConfig,
    upstream_host: str,
    upstream_port: int,
    token: bytes,
    on_listening: Callable[[str], None] | None = None,
    connect_timeout: float = 60.0,
    link_config: LinkConfig | None = None,
) -> int:
    stop = asyncio.Event()
    lost: list[str] = []

    def on_lost(reason: str) -> None:
        if not lost:
            lost.append(reason)
            log.error("%s", reason)
        stop.set()

    link = await connect_link(upstream_host, upstream_port, token, on_lost, connect_timeout, link_config)
    service = Service(config, link.view, link.stats.as_dict, on_listening or (lambda line: None))
    try:
        await service.serve(stop)
    finally:
        link.close()
    return 3 if lost else 0
