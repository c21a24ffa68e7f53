"""The failure report: which rank failed first, where, why, and how long each phase took.

Built from every agent's record on the job's board (when the store was still there to
read) and this agent's own record; printed on stderr and written as JSON for tools.

The root cause is the earliest failure in time across the job: a worker's, or a node's
whose heartbeat stopped (a dead node leaves no record of its own; its watcher records
it, with when it was last heard from), with two kinds of worker failure set aside as
consequences: a worker that failed *in a collective or in the
store* (Gloo's "Connection closed by peer", NCCL's errors, torch's ``DistError``s) when
another worker failed some other way no later than ``CONSEQUENCE_WINDOW`` seconds
after it, or when a node was last heard from no later than that (its peer's death is
what broke the collective: the peer's exit, timed by the
agent's :class:`~tierrun.report.exits.ExitClock`, and the collective's error race by
milliseconds), and a worker its own agent stopped (SIGTERM, no error file) after
another failed.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .board import Attempt, Failure, LostNode, NodeRecord

TAIL_LINES = 12
#: seconds by which the death that broke a collective may be timed after its failure
CONSEQUENCE_WINDOW = 2.0
#: errors of a worker whose collective (or store) lost a peer, rather than of its own
_COLLECTIVE = re.compile(
    r"^\w*(DistBackendError|DistNetworkError|DistStoreError|DistError)\b|connection closed by peer|"
    r"connection reset by peer|broken pipe|gloo/transport|\bnccl\b|\bhccl\b|"
    r"remote process exited|communicator was aborted|collective operation timeout",
    re.IGNORECASE)


def in_collective(failure: Failure) -> bool:
    """Whether ``failure`` is a worker's collective or store call failing (from its error
    message and the last line of its traceback), not a failure of its own."""
    last = failure.traceback.strip().splitlines()[-1:] or [""]
    return bool(_COLLECTIVE.search(failure.message) or _COLLECTIVE.search(last[0]))


@dataclass
class FailedRank:
    node: str
    addr: str
    group_rank: int
    failure: Failure
    #: failed because another rank did (see the module's docstring)
    consequence: bool = False


@dataclass
class FailureReport:
    run_id: str
    reporter: str  # the node writing the report
    first: FailedRank | None  # the root cause: earliest failure in the job, not a consequence
    failed: list[FailedRank]  # every failure seen: others by time, then consequences by
    # time, then workers their agent stopped (SIGTERM, no error file)
    restarts: int  # restarts this node used
    phases: dict[str, float]  # seconds per phase of this node's last attempt
    nodes_seen: int  # how many agents' records the report was built from
    lost: list[LostNode]  # nodes whose heartbeat stopped, the earliest first

    @staticmethod
    def build(run_id: str, mine: NodeRecord, others: list[NodeRecord]) -> FailureReport:
        records = {r.node: r for r in others}
        records[mine.node] = mine  # this agent's own view is the freshest
        every = [FailedRank(r.node, r.addr, a.group_rank, f)
                 for r in records.values() for a in r.attempts for f in a.failures]
        lost: dict[str, LostNode] = {}
        for n in sorted((n for r in records.values() for n in r.lost), key=lambda n: n.silent_since):
            lost.setdefault(n.addr, n)  # (each watcher's view of one death: the earliest)
        causes = [fr.failure.time for fr in every
                  if not fr.failure.stopped_by_agent and not in_collective(fr.failure)]
        causes += [n.silent_since for n in lost.values()]
        for fr in every:
            f = fr.failure
            fr.consequence = f.stopped_by_agent or (
                in_collective(f) and any(t <= f.time + CONSEQUENCE_WINDOW for t in causes))
        failed = sorted(every, key=lambda fr: (fr.failure.stopped_by_agent, fr.consequence, fr.failure.time))
        last = mine.attempts[-1] if mine.attempts else None
        return FailureReport(
            run_id=run_id, reporter=mine.node, first=failed[0] if failed else None,
            failed=failed, restarts=last.number if last else 0,
            phases=phases(mine.started, last), nodes_seen=len(records), lost=list(lost.values()),
        )

    @property
    def lost_first(self) -> LostNode | None:
        """The node whose heartbeat stopped first, when no worker failed on its own before
        (then it is the root cause: its death broke the others' collectives)."""
        if not self.lost:
            return None
        n = self.lost[0]
        first = self.first
        return n if first is None or first.consequence or n.silent_since <= first.failure.time else None

    def render(self) -> str:
        addr, _, pid = self.reporter.rpartition(":")  # ("<address>:<pid>": the pid is no port)
        lines = [f"tierrun: job '{self.run_id}' failed (report from node {addr}, agent pid {pid})"]
        lost = self.lost_first
        if lost is not None:
            lines.append(f"  first failure: node {lost.addr} stopped answering at about {_clock(lost.silent_since)} "
                         f"(its heartbeat: declared lost by node {lost.by} at {_clock(lost.declared)}); a dead node "
                         "leaves no record of its workers: look at that machine (killed, out of memory, "
                         "rebooted, cut off?)")
            lines += [f"  node {n.addr} also stopped answering at about {_clock(n.silent_since)}"
                      for n in self.lost[1:]]
        if self.first is None and lost is None:
            lines.append("  no worker failure was recorded: the agent itself failed (see the error above)")
        elif self.first is not None:
            f = self.first.failure
            if lost is None:
                lines.append(
                    f"  first failure: rank {f.global_rank} (local rank {f.local_rank}) on node "
                    f"{self.first.addr} (node rank {self.first.group_rank}) at {_clock(f.time)}: {f.message}"
                )
                tail = f.traceback.strip().splitlines()[-TAIL_LINES:]
                lines += [f"    | {t}" for t in tail]
            rest = self.failed[1:] if lost is None else self.failed
            t0 = f.time if lost is None else lost.silent_since
            groups = (
                ("later failure(s)", [fr for fr in rest if not fr.consequence]),
                ("failure(s) in collectives after it (consequences)",
                 [fr for fr in rest if fr.consequence and not fr.failure.stopped_by_agent]),
                ("worker(s) stopped by their agent", [fr for fr in rest if fr.failure.stopped_by_agent]),
            )
            for title, group in groups:
                if group:
                    lines.append(f"  {len(group)} {title}: " + ", ".join(
                        f"rank {fr.failure.global_rank} on {fr.addr} ({fr.failure.time - t0:+.2f} s)"
                        for fr in group[:8]) + (" ..." if len(group) > 8 else ""))
        if lost is None and self.lost:
            lines.append("  node(s) that stopped answering after it: " + ", ".join(
                f"{n.addr} at about {_clock(n.silent_since)}" for n in self.lost))
        lines.append(f"  restarts used on this node: {self.restarts}")
        if self.phases:
            lines.append("  this node's phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()))
        lines.append(f"  built from the records of {self.nodes_seen} node(s)")
        return "\n".join(lines)

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def phases(started: float, attempt: Attempt | None) -> dict[str, float]:
    """Seconds spent per phase: start-up of the agent, rendezvous, worker start, run."""
    if attempt is None or attempt.rendezvous is None:
        return {}
    r0, r1 = attempt.rendezvous
    out = {"agent start": r0 - started, "rendezvous": r1 - r0} if attempt.number == 0 else {"rendezvous": r1 - r0}
    if attempt.workers_started is not None:
        out["worker start"] = attempt.workers_started - r1
        if attempt.ended is not None:
            out["run"] = attempt.ended - attempt.workers_started
    return out
