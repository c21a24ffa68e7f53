"""The failure report: which rank failed first, where, why, and how long each phase took.

Built from every agent's record on the job's board (when the store was still there to
read) and this agent's own record; printed on stderr and written as JSON for tools.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .board import Attempt, Failure, NodeRecord

TAIL_LINES = 12


@dataclass
class FailedRank:
    node: str
    addr: str
    group_rank: int
    failure: Failure


@dataclass
class FailureReport:
    run_id: str
    reporter: str  # the node writing the report
    first: FailedRank | None  # earliest failure seen anywhere in the job
    failed: list[FailedRank]  # every failure seen, earliest first; workers the agent
    # stopped (SIGTERM, no error file) after a failure come after every other failure
    restarts: int  # restarts this node used
    phases: dict[str, float]  # seconds per phase of this node's last attempt
    nodes_seen: int  # how many agents' records the report was built from

    @staticmethod
    def build(run_id: str, mine: NodeRecord, others: list[NodeRecord]) -> FailureReport:
        records = {r.node: r for r in others}
        records[mine.node] = mine  # this agent's own view is the freshest
        failed = sorted(
            (FailedRank(r.node, r.addr, a.group_rank, f)
             for r in records.values() for a in r.attempts for f in a.failures),
            key=lambda fr: (fr.failure.stopped_by_agent, fr.failure.time),
        )
        last = mine.attempts[-1] if mine.attempts else None
        return FailureReport(
            run_id=run_id, reporter=mine.node, first=failed[0] if failed else None,
            failed=failed, restarts=last.number if last else 0,
            phases=phases(mine.started, last), nodes_seen=len(records),
        )

    def render(self) -> str:
        lines = [f"tierrun: job '{self.run_id}' failed (report from {self.reporter})"]
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
            others = self.failed[1:]
            if others:
                lines.append(f"  {len(others)} later failure(s): " + ", ".join(
                    f"rank {fr.failure.global_rank} on {fr.addr} (+{fr.failure.time - f.time:.1f} s)"
                    for fr in others[:8]) + (" ..." if len(others) > 8 else ""))
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
