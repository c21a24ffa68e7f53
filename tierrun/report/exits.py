"""When each worker process ended, to the millisecond.

torch's agent learns that a worker exited only at its next monitor interval (0.1 s by
default, often set to seconds), and stamps every failure of a group with the moment it
reports them. A worker that exits or is killed without a Python exception (``sys.exit``,
the OOM killer's SIGKILL, a SIGSEGV) leaves no error file with a time of its own, so the
failure report would place it after the peers whose collectives failed *because* it
died. :class:`ExitClock` notes the exit itself: one thread per watched process, blocked
on a Linux pidfd, which becomes readable when the process ends. A pidfd does not reap
the process: torch's agent still collects its exit status as before.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time

log = logging.getLogger("tierrun.report")


class ExitClock:
    """``watch(pid)`` returns at once; ``exited_at(pid)`` is the Unix time at which that
    process ended, or None while it runs, if it was never watched, or where pidfds are
    missing (Linux < 5.3, other systems: the agent's own time of notice stands).
    Thread-safe."""

    def __init__(self) -> None:
        self._times: dict[int, float] = {}
        self._watched: set[int] = set()
        self._lock = threading.Lock()

    def watch(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:  # gone already (then reaped), or no pidfds here
            log.debug("cannot watch process %d for its exit: %s", pid, e)
            return
        with self._lock:
            self._watched.add(pid)
        threading.Thread(target=self._wait, args=(pid, fd), name=f"tierrun-exit-{pid}", daemon=True).start()

    def _wait(self, pid: int, fd: int) -> None:
        try:
            select.select([fd], [], [])
            now = time.time()
            with self._lock:
                self._times[pid] = now
        except OSError as e:
            log.debug("lost the exit of process %d: %s", pid, e)
            with self._lock:
                self._watched.discard(pid)
        finally:
            os.close(fd)

    def exited_at(self, pid: int | None, wait: float = 0.5) -> float | None:
        """When ``pid`` ended. Waits up to ``wait`` seconds for its watching thread to
        note it (called once the agent has seen the process end, so the thread is
        about to, if it has not)."""
        with self._lock:
            if pid not in self._watched:
                return None
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                when = self._times.get(pid)
            if when is not None or time.monotonic() >= deadline:
                return when
            time.sleep(0.005)
