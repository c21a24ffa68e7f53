"""Runs histories on torch's server and on every tierrun target, keeps the servers
clean between histories (restarting what died), and counts what it did."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from . import sequential
from .history import History
from .sequential import Mismatch, Trace
from .targets import Target, Targets


@dataclass
class Stats:
    histories: int = 0
    operations: int = 0  # requests sent to torch's server (each also sent to every target)
    runs: Counter = field(default_factory=Counter)  # target -> histories run
    target_operations: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)  # opcode name -> requests (torch's run)
    mismatches: Counter = field(default_factory=Counter)  # target -> confirmed mismatches
    flaky: Counter = field(default_factory=Counter)  # target -> mismatches not seen again
    restarts: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    # concurrent histories
    c_histories: int = 0
    c_operations: int = 0  # requests per run (each run on torch's server and every target)
    c_runs: Counter = field(default_factory=Counter)
    c_failures: Counter = field(default_factory=Counter)  # target -> not linearizable / unanswered
    c_flaky: Counter = field(default_factory=Counter)  # unanswered in time, answered when run again
    model_failures: int = 0  # torch's own server judged not linearizable: the model is wrong
    c_ops_on_tierrun: int = 0
    c_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"histories": self.histories, "operations": self.operations, "runs": dict(self.runs),
                "target_operations": dict(self.target_operations), "ops": dict(self.ops),
                "mismatches": dict(self.mismatches), "flaky": dict(self.flaky),
                "restarts": dict(self.restarts), "seconds": round(self.seconds, 1),
                "concurrent_histories": self.c_histories, "concurrent_operations": self.c_operations,
                "concurrent_runs": dict(self.c_runs), "concurrent_failures": dict(self.c_failures),
                "concurrent_slow_not_seen_again": dict(self.c_flaky),
                "model_failures": self.model_failures, "concurrent_seconds": round(self.c_seconds, 1),
                "operations_tried_on_tierrun": self.operations_tried}

    @property
    def operations_tried(self) -> int:
        """Requests sent to tierrun, every target counted (the issue's figure)."""
        return sum(self.target_operations.values()) + self.c_ops_on_tierrun


class Oracle:
    def __init__(self, targets: Targets | None = None, names=None) -> None:
        self.targets = targets or Targets(**({"names": names} if names else {}))
        self.stats = Stats()
        #: What the tierrun cluster ran since it last started, ("sequential" or
        #: "concurrent", seed): a failure that depends on a proxy's state (its watches,
        #: the keys it has seen) replays from it.
        self.since_restart: list[tuple[str, int | None]] = []
        self._generation = self.targets.cluster.restarts

    def close(self) -> None:
        self.targets.stop()

    def __enter__(self) -> Oracle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _after(self, target: Target, history: History) -> None:
        """Empty the store (or restart what died or cannot be emptied)."""
        if not target.healthy() or not target.clean(history.queue_keys()):
            self.stats.restarts[target.name] += 1
            target.restart()
            if not target.clean(history.queue_keys()):
                raise RuntimeError(f"{target.name} cannot be emptied after a restart")

    def reference(self, history: History) -> Trace:
        torch = self.targets.torch
        for _ in range(3):
            ref = sequential.run(history, torch)
            self._after(torch, history)
            if not ref.error:
                return ref
        raise RuntimeError(f"torch's server did not run the history: {ref.error}")

    def run_on(self, history: History, target: Target, ref: Trace) -> Mismatch | None:
        got = sequential.run(history, target, ref)
        self._after(target, history)
        return sequential.compare(history, ref, got)

    def _note(self, kind: str, seed) -> None:
        if self.targets.cluster.restarts != self._generation:
            self._generation = self.targets.cluster.restarts
            self.since_restart = []
        self.since_restart.append((kind, seed))

    def check(self, history: History, targets=None, confirm: bool = True) -> list[Mismatch]:
        """Run one history everywhere; the confirmed mismatches (a mismatch is run again,
        torch's run too, and counted only if it repeats)."""
        t0 = time.monotonic()
        self._note("sequential", history.seed)
        ref = self.reference(history)
        st = self.stats
        st.histories += 1
        sent = [r for s in ref.steps if s.sent for r in s.sent]
        st.operations += len(sent)
        from .wire import op_name

        st.ops.update(op_name(r) for r in sent)
        out = []
        for target in targets or self.targets.tierrun:
            st.runs[target.name] += 1
            st.target_operations[target.name] += len(sent)
            m = self.run_on(history, target, ref)
            if m is not None and confirm:
                again = self.run_on(history, target, self.reference(history))
                if again is None:
                    st.flaky[target.name] += 1
                    m = None
            if m is not None:
                st.mismatches[target.name] += 1
                out.append(m)
        st.seconds += time.monotonic() - t0
        return out

    def check_concurrent(self, history, targets=None) -> list:
        """Run one concurrent history on torch's server (its answers must satisfy the
        model: else the model is wrong, counted apart) and on every target; the
        outcomes that are not linearizable (or lost a request, or closed a client)."""
        from . import concurrent

        t0 = time.monotonic()
        self._note("concurrent", history.seed)
        st = self.stats
        st.c_histories += 1
        st.c_operations += history.operations
        ref = concurrent.run(history, self.targets.torch)
        self._after(self.targets.torch, history)
        if not concurrent.check(ref):
            st.model_failures += 1
        out = []
        for target in targets or self.targets.tierrun:
            st.c_runs[target.name] += 1
            st.c_ops_on_tierrun += history.operations
            got = concurrent.run(history, target)
            self._after(target, history)
            if not concurrent.check(got) and got.slow:  # (only slow? once more, with time to spare)
                again = concurrent.run(history, target, deadline=10.0)
                self._after(target, history)
                if concurrent.check(again):
                    st.c_flaky[target.name] += 1
                    continue
            if not concurrent.check(got):
                st.c_failures[target.name] += 1
                out.append(got)
        st.c_seconds += time.monotonic() - t0
        return out

    def mismatch_of(self, history: History, target_name: str) -> Mismatch | None:
        """One run on one target (for minimizing): its mismatch, or None."""
        target = next(t for t in self.targets.tierrun if t.name == target_name)
        return self.run_on(history, target, self.reference(history))
