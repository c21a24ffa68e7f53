"""What a node's agent says of its store proxy's link: the proxy process logs to its
own output, which nobody reads while it runs, so a node whose link to the store host
dropped would say nothing until the link's grace period ran out (15 s) and the job
failed. The agent repeats the two lines a person waits for: the link lost (and until
when the proxy retries), and the link back."""

from __future__ import annotations

import logging

log = logging.getLogger("tierrun.rendezvous")

#: How the proxy's lines begin and what they say (``tier.connection.reconnect``).
_PREFIX = "[tierrun proxy] WARNING "
_SAID = ("; reconnecting (for up to ", "link to the store host resumed after ")


class ProxyNotices:
    """Called with each line of the node proxy's output (``StoreProcess(on_line=...)``),
    from its reader thread. O(len(line))."""

    def __init__(self, node: str) -> None:
        self.node = node

    def __call__(self, line: str) -> None:
        if line.startswith(_PREFIX) and any(said in line for said in _SAID):
            log.warning("%s: its store proxy: %s", self.node, line[len(_PREFIX):].rstrip())
