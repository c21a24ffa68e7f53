"""What a node's agent says of its store proxy's link: the proxy process logs to its
own output, which nobody reads while it runs, so a node whose link to the store host
dropped would say nothing until the link's grace period ran out (15 s) and the job
failed. The agent repeats the two lines a person waits for: the link lost (and until
when the proxy retries), and the link back; a link that keeps dropping and coming back
says so at most ``BURST`` times a minute, then how many lines it left out."""

from __future__ import annotations

import logging

from ..logs import FloodLog

log = logging.getLogger("tierrun.rendezvous")

#: How the proxy's lines begin and what they say (``tier.connection.reconnect``).
_PREFIX = "[tierrun proxy] WARNING "
_SAID = ("; reconnecting (for up to ", "link to the store host resumed after ")
#: Lines repeated per minute, at most (a flapping link: two a flap).
BURST = 10


class ProxyNotices:
    """Called with each line of the node proxy's output (``StoreProcess(on_line=...)``),
    from its reader thread. O(len(line))."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._log = FloodLog(log, f"{node}: its store proxy's link lines", burst=BURST, window=60.0)

    def __call__(self, line: str) -> None:
        if line.startswith(_PREFIX) and any(said in line for said in _SAID):
            self._log.warning("%s: its store proxy: %s", self.node, line[len(_PREFIX):].rstrip())
