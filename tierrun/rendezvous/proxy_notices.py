"""What a node's agent says of its store proxy's link: the proxy process logs to its
own output, which nobody reads while it runs, so a node whose link to the store host
dropped would say nothing until the link's grace period ran out (15 s) and the job
failed. The agent repeats the two lines a person waits for: the link lost (and until
when the proxy retries), and the link back.

A link that keeps dropping and coming back would repeat two lines a flap: past
``BURST`` lines a minute, a line is repeated only once what it says has held for
``SETTLE`` seconds (a drop that lasts, or the link back for good), with the count of
the lines left out; so the last line the agent shows always says where the link is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from time import monotonic

from ..tier.connect import SILENT_LISTENER
from .refusals import LimitRefusals

log = logging.getLogger("tierrun.rendezvous")

#: How the proxy's lines begin and what they say (``tier.connection.reconnect``).
_PREFIX = "[tierrun proxy] WARNING "
_LOST, _BACK = "; reconnecting (for up to ", "link to the store host resumed after "
#: Lines repeated at once per ``WINDOW`` seconds, at most (a flapping link: two a flap).
BURST = 10
WINDOW = 60.0
#: Past the burst, how long (seconds) a line's news must hold before it is repeated.
SETTLE = 2.0


class ProxyNotices:
    """Called with each line of the node proxy's output (``StoreProcess(on_line=...)``),
    from its reader thread; past the burst, a timer thread says what held. O(len(line))."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._window_began = -WINDOW  # (monotonic)
        self._told = 0  # lines repeated in this window
        self._shown_lost: bool | None = None  # what the last line repeated said (lost: True)
        self._latest: tuple[bool, str] | None = None  # the latest line left out, and what it says
        self._left_out = 0
        self._left_out_since = 0.0  # (wall clock) the first of them
        self._timer: threading.Timer | None = None

    def __call__(self, line: str) -> None:
        if not line.startswith(_PREFIX) or not (_LOST in line or _BACK in line):
            return
        lost = _LOST in line
        text = line[len(_PREFIX):].rstrip()
        with self._lock:
            now = monotonic()
            if now - self._window_began >= WINDOW:
                self._window_began, self._told = now, 0
            if self._told < BURST and self._latest is None:
                self._told += 1
                self._say(lost, text)
                return
            if not self._left_out:
                self._left_out_since = time.time()
            self._left_out += 1
            self._latest = (lost, text)
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(SETTLE, self._settled, (self._latest,))
            self._timer.daemon = True
            self._timer.start()

    def _settled(self, latest: tuple[bool, str]) -> None:
        """``latest`` held for ``SETTLE`` seconds: repeat it if it changes what was shown."""
        with self._lock:
            if self._latest is not latest:
                return  # (a later line's timer says what holds)
            self._timer = None
            self._latest = None
            lost, text = latest
            left_out = self._left_out - (lost != self._shown_lost)  # (the one repeated now is not left out)
            self._left_out = 0
            since = time.strftime("%H:%M:%S", time.localtime(self._left_out_since))
            if lost == self._shown_lost:
                if left_out:
                    log.warning("%s: its store proxy's link dropped and came back %d more times since %s", self.node,
                                left_out // 2 or 1, since)
                return
            self._say(lost, text + (f" ({left_out} link lines left out since {since})" if left_out else ""))

    def _say(self, lost: bool, text: str) -> None:
        self._shown_lost = lost
        log.warning("%s: its store proxy: %s", self.node, text)


def store_host_lines(node: str, on_silent: Callable[[], None]) -> Callable[[str], None]:
    """What reads the output of a node's proxy linked to the store host: its link's
    losses and returns repeated (:class:`ProxyNotices`), so are its refusals past its
    limit of connections (``refusals.LimitRefusals``), and ``on_silent()`` called when
    the store host's port took the link and never answered (the agent's waiting notices
    then say so, not "is that node up?")."""
    notices = ProxyNotices(node)
    refusals = LimitRefusals(node, "its store proxy")

    def on_line(line: str) -> None:
        if SILENT_LISTENER in line:
            on_silent()
        notices(line)
        refusals(line)

    return on_line
