"""The failure report: which rank failed first, where, why, and how long each phase took.

Built from every agent's record on the job's board (when the store was still there to
read) and this agent's own record; printed on stderr and written as JSON for tools.

The root cause is the earliest failure in time across the job, with two kinds of
failure set aside as consequences: a worker that failed *in a collective or in the
store* (Gloo's "Connection closed by peer", NCCL's errors, torch's ``DistError``s) when
another worker failed some other way no later than ``CONSEQUENCE_WINDOW`` seconds
after it (its peer's death is what broke the collective: the peer's exit, timed by the
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

from .board import Attempt, Failure, NodeRecord

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

    @staticmethod
    def build(run_id: str, mine: NodeRecord, others: list[NodeRecord]) -> FailureReport:
        records = {r.node: r for r in others}
        records[mine.node] = mine  # this agent's own view is the freshest
        every = [FailedRank(r.node, r.addr, a.group_rank, f)
                 for r in records.values() for a in r.attempts for f in a.failures]
        causes = [fr.failure.time for fr in every
                  if not fr.failure.stopped_by_agent and not in_collective(fr.failure)]
        for fr in every:
            f = fr.failure
            fr.consequence = f.stopped_by_agent or (
                in_collective(f) and any(t <= f.time + CONSEQUENCE_WINDOW for t in causes))
        failed = sorted(every, key=lambda fr: (fr.failure.stopped_by_agent, fr.consequence, fr.failure.time))
        last = mine.attempts[-1] if mine.attempts else None
        return FailureReport(
            run_id=run_id, reporter=mine.node, first=failed[0] if failed else None,
            failed=failed, restarts=last.number if last else 0,
            phases=phases(mine.started, last), nodes_seen=len(records),
        )

    def render(self) -> str:
        addr, _, pid = self.reporter.rpartition(":")  # ("<address>:<pid>": the pid is no port)
        lines = [f"tierrun: job '{self.run_id}' failed (report from node {addr}, agent pid {pid})"]
        if self.first is None:
            lines.append("  no worker failure was recorded: the agent itself failed (see the error above)")
        else:
            f = self.first.failure
            when = time.strftime("%H:%M:%S", time.localtime(f.time)) + f".{int(f.time % 1 * 1000):03d}"
            lines.append(
                f"  first failure: rank {f.global_rank} (local rank {f.local_rank}) on node "
                f"{self.first.addr} (node rank {self.first.group_rank}) at {when}: {f.message}"
            )
            tail = f.traceback.strip().splitlines()[-TAIL_LINES:]
            lines += [f"    | {t}" for t in tail]
            rest = self.failed[1:]
            groups = (
                ("later failure(s)", [fr for fr in rest if not fr.consequence]),
                ("failure(s) in collectives after it (consequences)",
                 [fr for fr in rest if fr.consequence and not fr.failure.stopped_by_agent]),
                ("worker(s) stopped by their agent", [fr for fr in rest if fr.failure.stopped_by_agent]),
            )
            for title, group in groups:
                if group:
                    lines.append(f"  {len(group)} {title}: " + ", ".join(
                        f"rank {fr.failure.global_rank} on {fr.addr} ({fr.failure.time - f.time:+.2f} s)"
                        for fr in group[:8]) + (" ..." if len(group) > 8 else ""))
        lines.append(f"  restarts used on this node: {self.restarts}")
        if self.phases:
            lines.append("  this node's phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items()))
        lines.append(f"  built from the records of {self.nodes_seen} node(s)")
        return "\n".join(lines)

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))


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
