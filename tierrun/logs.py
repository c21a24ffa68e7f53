"""Log lines a flood could multiply: one per connection closed or refused.

A store logs a line for every connection it closes for bad input and every connection
it refuses, which is what an operator needs for one bad client, and what a flood of
connections (a port scanner, a client reconnecting in a loop) would turn into
thousands of lines a second: disks filled, the one useful line lost. So each such
kind of line has a budget: the first ``burst`` lines of a ``window`` are logged, the
rest counted, and the first line of the next window says how many were left out.
O(1) per line; no timer (a count left out is told with the next line of its kind).
"""

from __future__ import annotations

import logging
import time
from time import monotonic


class FloodLog:
    """Warnings of one kind (``what``, e.g. "connections closed"), at most ``burst`` per
    ``window`` seconds."""

    __slots__ = ("_log", "_what", "_burst", "_window", "_since", "_logged", "_left_out", "_first_left_out")

    def __init__(self, log: logging.Logger, what: str, burst: int = 20, window: float = 10.0) -> None:
        self._log = log
        self._what = what
        self._burst = burst
        self._window = window
        self._since = -window  # (monotonic) when the current window began
        self._logged = 0
        self._left_out = 0
        self._first_left_out = 0.0  # (wall clock) when the first line left out of this window came

    def warning(self, msg: str, *args: object) -> None:
        now = monotonic()
        if now - self._since >= self._window:
            if self._left_out:
                self._log.warning("%s: %s more not logged since %s (at most %d lines per %g s)", self._what,
                                  f"{self._left_out:,}", time.strftime("%H:%M:%S", time.localtime(self._first_left_out)),
                                  self._burst, self._window)
            self._since, self._logged, self._left_out = now, 0, 0
        if self._logged < self._burst:
            self._logged += 1
            self._log.warning(msg, *args)
        else:
            if not self._left_out:
                self._first_left_out = time.time()
            self._left_out += 1
