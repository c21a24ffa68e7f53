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
    silent: list[str] = []  # (the last attempt's connection was taken and never answered)
    said: list[bool] = []

    def on_silent() -> None:
        silent.append(f"the store host {host}:{port} {SILENT_LISTENER} within {SILENT_AFTER:g} s")
        if not said:
            said.append(True)
            log.warning("%s; still waiting (for up to %.0f s)", silent[-1], max(deadline - loop.time(), 0))

    while True:
        silent.clear()
        try:
            await open_connection(link, max(deadline - loop.time(), 1.0), on_silent)
            return link
        except (OSError, asyncio.TimeoutError) as e:
            if loop.time() + delay > deadline:
                why = f"{silent[0]} (something holds that port, or the store host is frozen)" if silent else (
                    f"{e}. Is it running, and its port open to this node?")
                raise TimeoutError(f"cannot connect to the store host {host}:{port} within {timeout:g} s: {why}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
