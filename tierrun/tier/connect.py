"""Opening a front-end's link to the store host (or to another front-end)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..link.config import LinkConfig
from .connection import SILENT_AFTER, open_connection
from .plan import PlanLimits
from .upstream import LinkUpstream

log = logging.getLogger("tierrun.frontend")

#: How a proxy's line says that the store host took its connection and never answered
#: (a node's agent reads the proxy's output for it: ``rendezvous.job_store``).
SILENT_LISTENER = "accepts connections but has not answered the link handshake"


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
    silent = said = False  # (this attempt's connection was taken and never answered; said once)

    def on_silent() -> None:
        nonlocal silent, said
        silent = True
        if not said:
            said = True
            log.warning("the store host %s:%d %s within %g s; still waiting (for up to %.0f s)", host, port,
                        SILENT_LISTENER, SILENT_AFTER, max(deadline - loop.time(), 0))

    while True:
        silent = False
        try:
            await open_connection(link, max(deadline - loop.time(), 1.0), on_silent)
            return link
        except (OSError, asyncio.TimeoutError) as e:
            if loop.time() + delay > deadline:
                why = (f"it {SILENT_LISTENER} within {SILENT_AFTER:g} s (something holds that port, or the "
                       "store host is overloaded or frozen)" if silent
                       else f"{e}. Is it running, and its port open to this node?")
                raise TimeoutError(
                    f"cannot connect to the store host {host}:{port} within {timeout:g} s: {why}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
