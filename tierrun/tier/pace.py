"""How often a relay's batches leave for its upstream. No I/O, no clock: calls take ``now``.

A relay (a front-end that takes other front-ends' links) carries its subtree's requests.
When they trickle in from many clients, as they do while a big job's nodes arrive over
a second or more, each would leave in a frame of its own, and a frame costs the process
that reads it far more than the entries it carries (a wake-up, a read, a MAC, an answer
frame back). So while the relay is *busy*, a relay sends at most one batch per ``gap``
seconds, and what arrives meanwhile leaves together.

Busy: requests from at least two issuers within ``gap`` seconds of each other, the
latest within the last ``gap``. An issuer is a local client or a front-end below (all
of a front-end's clients travel under its one link client, and it sends its next batch
once the previous is answered: to the relay it looks like one client). A lone client
that sends one request at a time (each waits for the answer to the one before: nothing
could join its batches) is never paced, nor is a lone front-end below, nor a batch
after a quiet spell of ``gap``: only concurrent traffic waits, where it can merge.

Bounds: while busy, the upstream reads at most ``1 / gap`` batches a second from the
relay, however large its subtree; a request waits for its batch to leave at most
``gap`` at each relay, and may also wait behind the batch ahead of it at the proxies
below (each sends its next batch once the previous is answered): up to about twice
``gap`` in a tree whose relays are busy at once (measured). O(1) per call.
"""

from __future__ import annotations

from typing import Any


class BatchPace:
    """When the next batch may leave."""

    __slots__ = ("gap", "_last", "_issuer", "_issuer_at", "_others_at")

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self._last = float("-inf")  # when the last batch left
        self._issuer: Any = None  # who sent the last request ...
        self._issuer_at = float("-inf")  # ... when
        self._others_at = float("-inf")  # when two issuers last sent requests within a gap

    def request(self, issuer: Any, now: float) -> None:
        """A request from ``issuer`` joined the batch."""
        if issuer is not self._issuer:
            if now - self._issuer_at < self.gap:
                self._others_at = now
            self._issuer = issuer
        self._issuer_at = now

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until a batch may leave (0.0: at once)."""
        if now - self._others_at >= self.gap:
            return 0.0  # (not busy: one issuer, or a quiet spell)
        return max(0.0, self._last + self.gap - now)

    def sent(self, now: float) -> None:
        """A batch left at ``now``."""
        self._last = now
