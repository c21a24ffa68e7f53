"""How often a relay's batches leave for its upstream. No I/O, no clock: calls take ``now``.

A relay (a front-end that takes other front-ends' links) carries its subtree's requests.
When they trickle in, as they do while a big job's nodes arrive over a second or more,
each would leave in a frame of its own, and a frame costs the process that reads it far
more than the entries it carries (a wake-up, a read, a MAC, an answer frame back). So
while its batches keep leaving, a relay sends at most one per ``gap`` seconds, and what
arrives meanwhile leaves together. A batch after a quiet spell (``gap`` since the last
one) leaves at once: an idle link adds no latency.

Bounds: the upstream reads at most ``1 / gap`` batches a second from each relay, however
large its subtree; a request waits at most ``gap`` at each relay on its way up (answers
coming down are not paced). O(1) per call.
"""

from __future__ import annotations


class BatchPace:
    """When the next batch may leave."""

    __slots__ = ("gap", "_last")

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self._last = float("-inf")

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until a batch may leave (0.0: at once)."""
        return max(0.0, self._last + self.gap - now)

    def sent(self, now: float) -> None:
        """A batch left at ``now``."""
        self._last = now
