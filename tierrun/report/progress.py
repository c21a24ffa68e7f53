"""Live rendezvous progress on the store host: nodes joined / expected, elapsed time,
and, once ``interval`` seconds have passed, the nodes still missing. On the other
nodes, while they cannot reach the store yet: what they wait for, and for how long.

A tqdm bar when stderr is a terminal; plain lines every ``interval`` seconds when it is
not (CI, Slurm logs), so a log shows who was missing without a bar's control codes.
Runs in its own thread with its own store connection; each poll is two requests.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..client import StoreClient

log = logging.getLogger("tierrun.report")

MODES = ("auto", "bar", "log", "off")
MAX_NAMES = 10


@dataclass
class Arrivals:
    joined: list[str]  # names of the nodes that arrived
    needed: int  # nodes the round needs before it can close
    expected: int  # nodes the round takes at most
    missing: list[str] | None  # names of the nodes still missing, when they are known


def arrivals_line(a: Arrivals) -> str:
    if a.missing is not None:
        if not a.missing:
            return "none missing"
        shown = ", ".join(a.missing[:MAX_NAMES])
        more = f" and {len(a.missing) - MAX_NAMES} more" if len(a.missing) > MAX_NAMES else ""
        return f"missing: {shown}{more}"
    short = a.needed - len(a.joined)
    if short > 0:
        return f"waiting for at least {short} more node(s); joined: {', '.join(a.joined[-MAX_NAMES:]) or 'none'}"
    return f"{len(a.joined)} joined, taking up to {a.expected} until the last call ends"


class RendezvousProgress:
    """``start()`` returns at once; ``stop()`` ends the display (blocks up to one poll)."""

    def __init__(self, title: str, address: tuple[str, int] | str, poll: Callable[[StoreClient], Arrivals],
                 mode: str = "auto", interval: float = 5.0) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode
        self._title = title
        self._address = address
        self._poll = poll
        self._interval = interval
        self._done = threading.Event()
        self._completed = True
        self._thread = threading.Thread(target=self._run, name="tierrun-progress", daemon=True)

    def start(self) -> RendezvousProgress:
        if self.mode != "off":
            self._thread.start()
        return self

    def stop(self, completed: bool = True) -> None:
        """``completed``: the round formed (the display ends saying how many joined);
        else it failed, and says so itself."""
        self._completed = completed
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        start = time.monotonic()
        try:
            with StoreClient(self._address, timeout=10) as store:
                if self.mode == "bar":
                    self._bar(store, start)
                else:
                    self._lines(store, start)
        except Exception:  # the store went away: the rendezvous reports that itself
            log.debug("rendezvous progress stopped", exc_info=True)

    def _lines(self, store: StoreClient, start: float) -> None:
        printed = False
        while not self._done.wait(self._interval):
            a = self._poll(store)
            _say(f"{self._title}: {len(a.joined)}/{a.expected} nodes after "
                 f"{time.monotonic() - start:.0f} s; {arrivals_line(a)}")
            printed = True
        if printed and self._completed:
            a = self._poll(store)
            n = len(a.joined)
            _say(f"{self._title}: {n} node{'' if n == 1 else 's'} joined in {time.monotonic() - start:.1f} s")

    def _bar(self, store: StoreClient, start: float) -> None:
        from tqdm import tqdm

        a = self._poll(store)
        with tqdm(total=a.expected, desc=self._title, unit="node", file=sys.stderr, delay=1.0, **_screen(),
                  bar_format="{desc}: {n}/{total} nodes |{bar}| {elapsed}{postfix}") as bar:
            while True:
                bar.n = len(a.joined)
                if time.monotonic() - start >= self._interval:
                    bar.set_postfix_str(arrivals_line(a), refresh=False)
                bar.refresh()
                finished = self._done.wait(0.5)
                a = self._poll(store)
                if finished:
                    bar.n = len(a.joined)
                    bar.set_postfix_str("all joined" if self._completed else arrivals_line(a), refresh=False)
                    bar.refresh()
                    break


class StillWaiting:
    """Says every ``interval`` seconds that this node is still waiting for ``what()``
    (a description read at each line, as it may change), with ``hint()`` (what to check;
    by default whether that node is up and reachable), except while ``quiet()``, until
    ``stop()``; once it has said so, ``stop()`` says how long it took. Its own thread;
    no store traffic. ``start()`` returns at once."""

    def __init__(self, node: str, what: Callable[[], str], timeout: float, interval: float = 5.0,
                 hint: Callable[[], str | None] = lambda: None, quiet: Callable[[], bool] = lambda: False) -> None:
        self._node = node
        self._what = what
        self._hint = hint  # (what to check, if known better than whether the node is up: read at each line)
        self._quiet = quiet  # (nothing to say for now: read at each line)
        self._timeout = timeout
        self._interval = interval
        self._done = threading.Event()
        self._said = False
        self._thread = threading.Thread(target=self._run, name="tierrun-still-waiting", daemon=True)
        self._start = time.monotonic()

    def start(self) -> StillWaiting:
        self._thread.start()
        return self

    def stop(self, reached: bool) -> None:
        """``reached``: the wait ended because the store answered (else it failed)."""
        self._done.set()
        self._thread.join(timeout=5)
        if self._said and reached:
            _say(f"node {self._node}: reached {self._what()} after {time.monotonic() - self._start:.0f} s")

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            if self._quiet():
                continue
            _say(f"node {self._node}: still waiting for {self._what()} after "
                 f"{time.monotonic() - self._start:.0f} s (giving up after {self._timeout:.0f} s). "
                 + (self._hint() or "Is that node up, and its port reachable from this one?"))
            self._said = True


def _screen() -> dict[str, int]:
    """The terminal's size, with a default where it reports 0 (a fresh pty, some
    containers): tqdm prints nothing on a screen of 0 rows."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        return {"ncols": 100, "nrows": 24}
    return {"ncols": size.columns or 100, "nrows": size.lines or 24}


def _say(line: str) -> None:
    print(f"[tierrun] {line}", file=sys.stderr, flush=True)
