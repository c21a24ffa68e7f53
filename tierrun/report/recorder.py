"""An agent's record of its own node, built from torch's elastic agent events.

torch's agent emits an event when a rendezvous ends (with its duration), when each
worker starts, and, when the agent's run ends, one per worker with its final state,
exit code and error file. :class:`AgentRecorder` is a ``logging.Handler`` installed as
the agent's event destination: it turns those events into a :class:`NodeRecord` and
publishes it to the job's board, so the agent itself is torch's, unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable

from torch.distributed.elastic.events import Event, EventSource

from ..client import StoreClientError
from .board import FINAL_STATES, Attempt, Failure, JobBoard, LostNode, NodeRecord
from .exits import ExitClock

log = logging.getLogger("tierrun.report")

#: Seconds within which two losses of one address are one death (its agent's next
#: life there, rejoined and lost again, is another).
SAME_DEATH = 30.0

class AgentRecorder(logging.Handler):
    """``board()`` gives the board once the job's store is up (None before); events are
    forwarded to ``forward`` (the user's ``--event_log_handler``) unchanged.

    Publishing blocks the agent for one store round trip; if the store does not answer,
    the recorder stops publishing (the record stays complete locally) rather than delay
    the agent again.
    """

    def __init__(self, addr: str, pid: int, board: Callable[[], JobBoard | None],
                 forward: logging.Handler | None = None, local_workers: int | None = None) -> None:
        super().__init__(logging.INFO)
        self.node = NodeRecord(node=f"{addr}:{pid}", addr=addr, started=process_start_time())
        self._board = board
        self.forward = forward
        self._board_down = False
        #: when each worker process ended (torch's agent notices at its monitor interval)
        self.exits = ExitClock()
        #: workers per round on this node, to say once they have all started (None: unknown)
        self.local_workers = local_workers
        self._started: list[int] = []  # global ranks started in the current attempt

    @property
    def attempt(self) -> Attempt | None:
        return self.node.attempts[-1] if self.node.attempts else None

    def emit(self, record: logging.LogRecord) -> None:
        if self.forward is not None:
            self.forward.handle(record)
        try:
            self.on_event(Event.deserialize(record.getMessage()), time.time())
        except Exception:  # never let reporting break the agent
            log.debug("could not record an agent event", exc_info=True)

    def on_event(self, event: Event, now: float) -> None:
        md = event.metadata
        state = str(md.get("state"))
        restarts = int(md.get("agent_restarts") or 0)
        if event.source == EventSource.AGENT and state == "RENDEZVOUS":
            if self.attempt is not None and self.attempt.state == "RUNNING":
                self.attempt.state, self.attempt.ended = "RESTARTED", now - md["duration_ms"] / 1000
            self.node.attempts.append(Attempt(number=restarts,
                                                 rendezvous=(now - md["duration_ms"] / 1000, now)))
            self._started = []
        elif event.source == EventSource.WORKER and self.attempt is not None:
            extra = json.loads(str(md.get("metadata") or "{}"))
            if state == "START":
                self.attempt.workers_started = now
                self.attempt.workers += 1
                self.attempt.group_rank = int(md["group_rank"])
                self.attempt.world_size = int(extra.get("group_world_size", -1))
                if str(md.get("worker_id") or "").isdigit():  # torch's local agent: the pid
                    self.exits.watch(int(md["worker_id"]))
                self._say_started(int(md["global_rank"]), _first(extra.get("role_world_size")))
            elif state in FINAL_STATES:
                self._end(state, md, extra, now)
            else:
                return
        else:
            return
        self.publish()

    def _end(self, state: str, md: dict, extra: dict, now: float) -> None:
        attempt = self.attempt
        assert attempt is not None
        attempt.ended = attempt.ended or now
        attempt.workers_ended += 1
        if state == "FAILED" or attempt.state != "FAILED":
            attempt.state = state
        if state != "FAILED":
            return
        exitcode = _first(extra.get("exit_code"))
        pid = _first(extra.get("worker_pid"))
        exited = self.exits.exited_at(int(pid)) if isinstance(pid, int) else None
        message, tb, when = _error_details(md.get("raw_error"), exitcode, now, exited)
        attempt.failures.append(Failure(
            global_rank=int(md["global_rank"]), local_rank=int(_first(extra.get("local_rank")) or 0),
            exitcode=exitcode, time=when, message=message, traceback=tb, exited=exited,
        ))

    def _say_started(self, global_rank: int, world: int | None) -> None:
        """Once every worker of this node has started: one INFO line with their ranks."""
        self._started.append(global_rank)
        if self.local_workers is None or len(self._started) != self.local_workers:
            return
        ranks = sorted(self._started)
        if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
            span = f"{ranks[0]}-{ranks[-1]}"
        else:
            span = ", ".join(map(str, ranks))
        attempt = self.attempt
        assert attempt is not None
        log.info("node %s (node rank %d): %d worker(s) started, global rank(s) %s of %s",
                 self.node.addr, attempt.group_rank, len(ranks), span, world if world is not None else "?")

    def node_lost(self, addr: str, silent_since: float) -> None:
        """This agent's watcher saw the member at ``addr`` stop beating (``silent_since``,
        Unix seconds): recorded, for the failure report to name it. Called from a thread
        of the rendezvous handler's (``lost_hooks``); one store round trip."""
        if all(n.addr != addr or abs(n.silent_since - silent_since) > SAME_DEATH for n in self.node.lost):
            self.node.lost.append(LostNode(addr, silent_since, time.time(), self.node.addr))
            self.publish()

    def publish(self) -> None:
        if self._board_down:
            return
        board = self._board()
        if board is None:
            return
        try:
            board.publish(self.node)
        except (OSError, StoreClientError) as e:
            self._board_down = True
            log.info("cannot publish this node's record to the job's store (%s); keeping it local", e)


def process_start_time() -> float:
    """When this process started (Unix seconds), so "agent start" includes Python's and
    torch's import time. From /proc on Linux; now, elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _first(value):
    """torch wraps some metadata values in 1-tuples (JSON lists)."""
    return value[0] if isinstance(value, (list, tuple)) else value


# What torch's agent reports for a worker that left no error file (a signal, a crash).
NO_ERROR_FILE = {"message": "<NONE>"}


def _error_details(raw_error, exitcode: int | None, now: float,
                   exited: float | None = None) -> tuple[str, str, float]:
    """(message, traceback, time) from a worker's error file, or from its exit code.

    The time is when the failure happened, as precisely as known: the raise time
    tierrun's worker wrapper writes, else the process's exit (``exited``, from the
    :class:`ExitClock`), else the error file's whole-second timestamp (torch's
    ``@record``), else ``now`` (when the agent reported it)."""
    data = json.loads(raw_error) if isinstance(raw_error, str) else raw_error
    # (torch adds "errorTraits" to its shared no-file record: compare the message only)
    if data and data.get("message") != NO_ERROR_FILE["message"]:
        msg = data.get("message", data)
        if isinstance(msg, dict):
            info = msg.get("extraInfo", {})
            when = float(info.get("tierrun_time") or exited or info.get("timestamp") or now)
            return str(msg.get("message", "")), str(info.get("py_callstack", "")), when
        return str(msg), "", exited or now
    when = exited or now
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}", "", when
        except ValueError:
            return f"killed by signal {-exitcode}", "", when
    return f"exited with code {exitcode}", "", when
