"""One launch's reporting: record this agent's events, share them through the job's
store, and at the end print the failure report and write the timeline.

torch's agent is used unchanged: its event stream goes to :class:`AgentRecorder`
(installed as an event destination, forwarding to the user's ``--event_log_handler``),
and tierrun's rendezvous handlers call :meth:`before_shutdown` while the store is still
up, so the agent that hosts it can read everyone's records before it stops.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

from torch.distributed.elastic import events
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ..rendezvous.handler_base import StoreRendezvousHandler
from ..client import StoreClientError
from ..report import timeline
from ..report.board import JobBoard, NodeRecord
from ..report.failure import FailedRank, FailureReport
from ..report.recorder import AgentRecorder

log = logging.getLogger("tierrun")

EVENT_DESTINATION = "tierrun"
#: seconds an agent that reports waits for another node's final record (from the start,
#: then from the last one that came), before it reports without the rest
REPORT_GRACE = 5.0
#: seconds it waits at most: the nodes' failures may cascade (a peer's collective fails
#: when a failed worker's process ends, which takes seconds on a loaded machine)
REPORT_LIMIT = 30.0
#: seconds the store host keeps the store up after a failure, for the others' reports
LINGER = 1.0
#: seconds after this node declared a member dead that it stops waiting for its record:
#: a dead agent publishes nothing more, but one that was only stalled (or cut off behind
#: a relay that stalled) may still publish, the root cause maybe
DEAD_GRACE = 2.0


class JobReporting:
    """Attach with :meth:`install` before the agent starts; :meth:`report_failure` after
    it raised. Nothing here blocks the agent for more than one store round trip."""

    def __init__(self, run_id: str, local_addr: str | None, timeline_path: Path | None,
                 local_workers: int | None = None) -> None:
        self.run_id = run_id
        self.timeline_path = timeline_path
        self.handler: StoreRendezvousHandler | None = None
        self._board: JobBoard | None = None
        self._others: list[NodeRecord] = []
        self.recorder = AgentRecorder(local_addr or socket.gethostname(), os.getpid(), self.board,
                                      local_workers=local_workers)

    def install(self, user_event_handler: str) -> str:
        """Become the agent's event destination; returns its name for LaunchConfig.

        torch looks destinations up by name in ``events.handlers._log_handlers`` (its
        only registry); the user's own destination still gets every event."""
        if user_event_handler != "null":
            self.recorder.forward = event_handlers.get_logging_handler(user_event_handler)
        event_handlers._log_handlers[EVENT_DESTINATION] = self.recorder
        # torch gives the destination's logger the level $LOGLEVEL; events are INFO, and
        # the report needs them whatever the console's level
        events._get_or_create_logger(EVENT_DESTINATION).setLevel(logging.INFO)
        return EVENT_DESTINATION

    def handler_created(self, handler) -> None:
        if isinstance(handler, StoreRendezvousHandler):
            self.handler = handler
            self.recorder.node.addr = handler.node_addr
            handler.shutdown_hooks.append(self.before_shutdown)
            handler.lost_hooks.append(self.recorder.node_lost)

    def board(self) -> JobBoard | None:
        """The job's board of records; None while this node never reached the job's store
        (it could not start, or was never found: whatever holds its port is no store), and
        for a node refused a place in the job (never a member: torch's agent still reports
        its rendezvous attempt, which must not reach the board)."""
        if self.handler is not None and self.handler.refused:
            return None
        if self.handler is not None and self.handler.job is not None and self.handler.job.reached:
            if self._board is None:
                self._board = JobBoard(self.handler.job.agent_address, self.run_id, timeout=5.0)
            elif self.handler.job.proxy is not None:  # (replaced since, maybe; not stopped)
                self._board.move_to(self.handler.job.agent_address)
        return self._board

    def before_shutdown(self) -> None:
        """Read every agent's record while the store is up; the host writes the timeline.

        The store host waits (up to ``REPORT_GRACE`` s) until every member of the last
        round has published how it ended or is dead (see ``_read_when_all_ended``), and if
        the job failed keeps the store up ``LINGER`` s more so the others can read the
        failures too."""
        board = self.board()
        if board is None or self.handler is None:
            return
        self.recorder.publish()
        mine = self.recorder.attempt
        hosting = self.handler.job.hosting
        try:
            if mine is not None and mine.state == "FAILED":
                self.handler.leave_exit_barrier()
            if hosting or (mine is not None and mine.state == "FAILED"):
                # (a node that failed waits for the others' records too: the rank whose
                # death failed its workers' collectives may be reported a moment later)
                self._read_when_all_ended(board, mine.world_size if mine else -1, self.handler.declared_dead)
        except (OSError, StoreClientError) as e:  # the store host already stopped: report what this node saw
            log.info("could not read the other nodes' records (%s); the report shows what it read", e)
        if hosting and any(a.state == "FAILED" for r in self._others for a in r.attempts[-1:]):
            time.sleep(LINGER)
        board.close()
        if self.timeline_path is not None and hosting:
            timeline.write(self.timeline_path, timeline.build(self.run_id, self._others))
            print(f"[tierrun] wire-up timeline written to {self.timeline_path}", file=sys.stderr, flush=True)
        elif self.timeline_path is not None:
            print(f"[tierrun] --timeline: the store host's agent ({self.handler.job.host}) writes the job's "
                  f"timeline, with every node's record; this node writes none", file=sys.stderr, flush=True)

    def _read_when_all_ended(self, board: JobBoard, members: int,
                             declared_dead: Callable[[], dict[str, float]]) -> None:
        """Read every record into ``_others`` until ``members`` agents have ended: this
        one (it is shutting down: its workers may have been stopped with no final state,
        when another node stopped the job), those that have published how their round
        ended (every worker's final state), and those this node declared dead
        (``declared_dead()``: address -> when) ``DEAD_GRACE`` seconds ago or more; or
        until no other has ended for ``REPORT_GRACE`` seconds, or ``REPORT_LIMIT``
        seconds have passed. Raises like the board; what was read before stays in
        ``_others``."""
        me = self.recorder.node.node
        start = time.monotonic()
        deadline, seen = start + REPORT_GRACE, -1
        while True:
            self._others = board.read_all()
            ended_at = [r.addr for r in self._others
                        if r.node != me and r.attempts and r.attempts[-1].has_ended()]
            now = time.monotonic()
            gone = {addr for addr, when in declared_dead().items() if now - when >= DEAD_GRACE}
            ended = 1 + len(ended_at) + len(gone.difference(ended_at))
            if ended > seen:  # another node ended: wait for the rest from now
                seen, deadline = ended, min(now + REPORT_GRACE, start + REPORT_LIMIT)
            if ended >= members or now > deadline:
                return
            time.sleep(0.1)

    def report_failure(self, log_dir: str | None) -> FailureReport:
        """Print the failure report on stderr and write it as JSON in ``log_dir``."""
        report = FailureReport.build(self.run_id, self.recorder.node, self._others)
        print(report.render(), file=sys.stderr, flush=True)
        if log_dir:
            name = self.recorder.node.node.replace(":", "_")
            path = Path(log_dir) / f"tierrun_failure_{name}.json"
            try:
                report.write_json(path)
                print(f"[tierrun] failure report written to {path}", file=sys.stderr, flush=True)
            except OSError as e:
                log.warning("could not write the failure report to %s: %s", path, e)
        return report

    @staticmethod
    def torch_failures_in_report_order(report: FailureReport, failures: dict) -> dict:
        """This node's failures (torch's ``ChildFailedError.failures``, by global rank) in
        the report's order, their whole-second timestamps made non-decreasing in it:
        torch's own summary then names as its "Root Cause" the failure the report puts
        first on this node, not a peer whose collective failed because that rank died
        (torch times an exit without an error file by when its agent noticed it)."""
        when = {fr.failure.global_rank: fr.failure.time for fr in report.failed if fr.node == report.reporter}
        order = [r for r in when if r in failures] + [r for r in failures if r not in when]
        aligned: dict = {}
        floor = 0
        for rank in order:
            failure = failures[rank]
            floor = max(int(when.get(rank, failure.timestamp)), floor)
            failure.timestamp = floor  # (the first keeps its own second: the floor starts at 0)
            aligned[rank] = failure
        return aligned


class JobFailedError(ChildFailedError):
    """torch's ``ChildFailedError`` for this node's failed workers (what ``@record`` and
    tools expect), whose summary names as its "Root Cause" the job's first failure from
    tierrun's report when that is on another node: torch's own would name one of this
    node's workers, which failed only because that rank did. This node's failures are
    then all listed under "Failures"."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure], report: FailureReport) -> None:
        first = report.first
        self.first_elsewhere: FailedRank | None = first if first is not None and first.node != report.reporter else None
        super().__init__(name, failures)

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        first = self.first_elsewhere
        if first is None:
            return super().format_msg(boarder_delim, section_delim)
        title = f"{self.name} FAILED"
        blocks = [self._format_failure(i, rank, f) for i, (rank, f) in enumerate(self.failures.items())]
        f = first.failure
        when = datetime.fromtimestamp(int(f.time)).isoformat(sep="_")
        signal_name = f" ({signal.Signals(-f.exitcode).name})" if f.exitcode is not None and -f.exitcode in _SIGNALS else ""
        root = "\n".join([
            f"[{len(blocks)}]:",
            f"  time      : {when}",
            f"  host      : {first.addr} (node rank {first.group_rank}; this node's failures followed it)",
            f"  rank      : {f.global_rank} (local_rank: {f.local_rank})",
            f"  exitcode  : {f.exitcode}{signal_name}",
            f"  error_file: {'on node ' + first.addr if f.traceback else '<N/A>'}",
            f"  traceback : {f.message}",
        ])
        width = min(max([len(title)] + [w for _, w in blocks] + [len(line) for line in root.splitlines()]), 60)
        return "\n".join(["", boarder_delim * width, title, section_delim * width, "Failures:",
                          *[fmt for fmt, _ in blocks], section_delim * width,
                          "Root Cause (first observed failure):", root, boarder_delim * width])


_SIGNALS = {s.value for s in signal.Signals}
