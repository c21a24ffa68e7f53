"""Opening a front-end's link to the store host (or to another front-end)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..link.config import LinkConfig
from .connection import open_connection
from .plan import PlanLimits
from .upstream import LinkUpstream


async def connect_link(host: str, port: int, token: bytes, on_lost: Callable[[str], None],
                       timeout: float = 60.0, config: LinkConfig | None = None,
                       limits: PlanLimits | None = None, source: str | None = None) -> LinkUpstream:
    """Connect (from the local address ``source``, if given) and open a session,
    retrying while the store host is not up yet (backoff 0.1 s to 2 s). Raises
    LinkError (refused, wrong token, version) or TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    link = LinkUpstream(token, on_lost, config, (host, port), limits)
    link.source = source
    delay = 0.1
    while True:
        try:
            await open_connection(link, max(deadline - loop.time(), 1.0))
            return link
        except (OSError, asyncio.TimeoutError) as e:
            if loop.time() + delay > deadline:
                raise TimeoutError(f"cannot connect to the store host {host}:{port} within {timeout:g} s: {e}. Is "
                                   "it running, and its port open to this node?") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
