"""The differential oracle with a small store budget (``--max-store-bytes``): torch's
server has no budget, so here tierrun's store alone is the reference, and every
tiered target (a proxy, a proxy under a relay, clients spread over every level) must
answer the same histories byte for byte as it does: refuse the same writes, close the
same clients at the same steps, and run none of the requests a closed client
pipelined after its refused write (``tier.writes``, AFTER entries, UNORDERED answers).

Sequential histories (oracle/history.py) whose values are often hundreds of bytes
against a budget of a few kilobytes: about every other history passes it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from oracle import sequential
from oracle.driver import Oracle
from oracle.history import CI, History, generate
from oracle.regressions import KNOWN
from oracle.targets import Targets

from tierrun.protocol import Op

BUDGET = 3000  # bytes of keys and values
SEEDS = range(100)
PROFILE = replace(CI, medium=0.35, heavy=0.0, burst=0.7, avoid=frozenset(KNOWN))
WRITES = {Op.SET, Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH, Op.COMPARE_SET, Op.ADD}


@pytest.fixture(scope="module")
def oracle():
    saved = sequential.DEADLINE
    sequential.DEADLINE = 1.5
    with Oracle(Targets(extra_env={"TIERRUN_MAX_STORE_BYTES": str(BUDGET)})) as o:
        yield o
    sequential.DEADLINE = saved


def _refusals(history: History, ref: sequential.Trace) -> int:
    """Steps at which the store alone closed the acting client after a write of its burst."""
    n = 0
    for (client, burst), step in zip(history.steps, ref.steps):
        closed = step.seen.get(client, ((), False))[1]
        if closed and step.sent and any(r[0] in WRITES for r in step.sent):
            n += 1
    return n


def test_budget_histories_through_every_tier_as_on_the_store_alone(oracle):
    flat = next(t for t in oracle.targets.tierrun if t.name == "flat")
    tiers = [t for t in oracle.targets.tierrun if t.name != "flat"]
    t0 = time.monotonic()
    found, refusals = [], 0
    for seed in SEEDS:
        history = generate(seed, PROFILE)
        for _ in range(3):
            ref = sequential.run(history, flat)
            oracle._after(flat, history)
            if not ref.error:
                break
        assert not ref.error, ref.error
        refusals += _refusals(history, ref)
        for target in tiers:
            mismatch = oracle.run_on(history, target, ref)
            if mismatch is not None:  # (confirmed: once more, the reference too)
                ref2 = sequential.run(history, flat)
                oracle._after(flat, history)
                mismatch = oracle.run_on(history, target, ref2)
            if mismatch is not None:
                found.append(mismatch)
    print(f"{len(SEEDS)} budget histories, {refusals} refusals on the store alone, {time.monotonic() - t0:.1f} s")
    assert refusals >= len(SEEDS) // 4  # (the budget is passed: the comparison is not vacuous)
    assert not found, "\n\n".join(f"{m}\n{m.history.source()}" for m in found)
