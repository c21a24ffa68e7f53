"""The node proxy: a front-end whose upstream is a link to the store host.

Workers and the agent of a node connect here (loopback TCP, or a Unix socket);
VALIDATE and PING are answered here, everything else leaves in batches over one
authenticated link. A link that drops is resumed (see ``LinkUpstream``); if the store
host is not back within the grace period the proxy exits (status 3), closing its
clients' connections, and its agent reports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from ..tier import PlanLimits, connect_link
from ..frontend.listen import ListenError, describe, tcp_listen_socket
from ..link.config import LinkConfig
from ..tier.pace import BatchPace
from ..hub.link_server import LinkServer
from ..hub.reply_gate import break_watches
from .control import Event, TakingLinks
from .service import Service, ServiceConfig

log = logging.getLogger("tierrun.proxy")

#: The proxy's exit status when its link to the upstream is lost past the grace period
#: (any other non-zero status, or a signal, is the proxy's own failure).
LINK_LOST = 3


async def serve_proxy(
    config: ServiceConfig,
    upstream_host: str,
    upstream_port: int,
    token: bytes,
    on_listening: Callable[[Event], None] | None = None,
    connect_timeout: float = 60.0,
    link_config: LinkConfig | None = None,
    link_listen: tuple[str, int] | None = None,
    link_source: str | None = None,
) -> int:
    """Serve until the link is lost past its grace period (returns ``LINK_LOST``) or until stopped
    (0). With ``link_listen`` (host, port), other front-ends may link to this one there
    (a deeper tree): their sessions are served like the core serves links, their
    requests forwarded over this proxy's own link, merged with its local clients'."""
    stop = asyncio.Event()
    lost: list[str] = []
    announce = on_listening or (lambda event: None)

    def on_lost(reason: str) -> None:
        if not lost:
            lost.append(reason)
            log.error("%s", reason)
        stop.set()

    own = config.frontend.limits  # (merges hold no more than one request may)
    link = await connect_link(upstream_host, upstream_port, token, on_lost, connect_timeout, link_config,
                              PlanLimits.of(own), source=link_source)
    # refuse here what the store host would refuse (a request past its limits fails
    # its client alone either way, but here it costs the link nothing)
    limits = own if link.upstream_limits is None else own.within(link.upstream_limits)
    if limits != own:
        log.info("the store host's limits on one request are tighter than this proxy's; using %s", limits)
        config = dataclasses.replace(config, frontend=dataclasses.replace(config.frontend, limits=limits))
    links: LinkServer | None = None
    if link_listen is not None:
        link.on_watches_broken = break_watches
        if link.config.relay_pace > 0:
            link.pace = BatchPace(link.config.relay_pace)
        links = LinkServer(lambda ns: link.view(ns.decode()), token, link_config, lease=link.lease_left, limits=limits,
                           max_connections=config.frontend.max_connections,
                           largest_value=link.upstream_largest_value or None)
        try:
            sock = tcp_listen_socket(*link_listen, config.backlog)
        except ListenError as e:
            raise ListenError(e, f"{e.where} (--link-listen)", "port in --link-listen") from None
        await asyncio.get_running_loop().create_server(
            lambda: links.accept(sniffed=False), sock=sock, backlog=config.backlog)
        where = describe(sock)
        announce(TakingLinks(where))

    def stats() -> dict:
        silence = link.silence()  # (-1: no connection, the link is reconnecting)
        counters = {**link.stats.as_dict(), "upstream_silence_s": -1.0 if silence is None else round(silence, 3)}
        if links is not None:
            st = links.stats
            counters.update(links=st.links, links_accepted=st.links_accepted, lookups=st.lookups, link_resumes=st.link_resumes,
                            link_batches=st.batches, link_operations=st.operations,
                            wills_held=links.wills.held, wills_executed=links.wills.executed)
        return counters

    service = Service(config, link.view, stats, announce)
    try:
        await service.serve(stop)
    finally:
        if links is not None:  # (a lost path to the store ends the subtree's at once, with why)
            links.close(f"the relay, the proxy at {where}, lost its own link: {lost[0]}" if lost else None)
        link.close()
    return LINK_LOST if lost else 0
