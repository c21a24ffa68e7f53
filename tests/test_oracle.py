"""The differential oracle (tests/oracle/): torch 2.13's own TCPStore server against
tierrun flat, tiered (a real ``tierrun proxy``), a two-level tree (proxy -> proxy ->
store) and clients spread over every level, on raw-protocol histories.

- every minimized difference found so far (oracle/regressions.py): the cases of
  KNOWN_BUGS are strict xfails on the targets where they show, a hand-over: fix
  tierrun, remove the entry, and they must pass; those of KNOWN_DEVIATIONS must differ
  from torch exactly as decided (``Case.deviates``);
- a bounded seeded budget of random sequential histories (answers byte for byte as
  torch's) and concurrent ones (linearizable), drawn away from the known patterns.

The servers are started once for the module and emptied between histories.
``bench/fuzz.py --minutes N`` runs the same with random seeds for longer.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from oracle import concurrent, sequential
from oracle.driver import Oracle
from oracle.history import CI, generate
from oracle.regressions import ALL, CASES, CONCURRENT, KNOWN, KNOWN_BUGS
from oracle.sequential import Trace

#: The seeded budget (the whole module stays well within two minutes on 2 cores).
SEQUENTIAL_SEEDS = range(60)
CONCURRENT_SEEDS = range(150)


@pytest.fixture(scope="module")
def oracle():
    saved = sequential.DEADLINE
    sequential.DEADLINE = 1.5  # (tierrun answers in milliseconds; a known bug's silence costs this)
    with Oracle() as o:
        yield o
    sequential.DEADLINE = saved


HEAVY = os.environ.get("ORACLE_HEAVY") == "1"


def _params(cases):
    out = []
    for case in cases:
        for target in ALL:
            marks = []
            if getattr(case, "heavy", False) and not HEAVY:
                marks.append(pytest.mark.skip(reason="moves hundreds of megabytes: ORACLE_HEAVY=1 runs it"))
            if case.bug in KNOWN_BUGS and target in case.fails_on:
                marks.append(pytest.mark.xfail(strict=True, reason=f"{case.bug}: {KNOWN_BUGS[case.bug]}"))
            out.append(pytest.param(case, target, marks=marks, id=f"{case.name}-{target}"))
    return out


@pytest.mark.parametrize("case,target", _params(CASES))
def test_regression(oracle, case, target):
    deviates = case.deviates if target in case.fails_on else None
    for _ in range(case.runs):
        mismatch = oracle.mismatch_of(case.history, target)
        if deviates is None:
            assert mismatch is None, f"{case.note}\n{mismatch}\n{case.history.source()}"
        else:  # (a decided deviation: exactly it, and nothing before it)
            assert mismatch is not None and (mismatch.step, mismatch.got) == deviates, \
                f"{case.bug}: {KNOWN[case.bug]}\n{mismatch or 'no difference'}\n{case.history.source()}"


@pytest.mark.parametrize("case,target", _params(CONCURRENT))
def test_concurrent_regression(oracle, case, target):
    t = next(t for t in oracle.targets.tierrun if t.name == target)
    for _ in range(case.runs):
        outcome = concurrent.run(case.history, t, deadline=1.0)
        oracle._after(t, case.history)
        assert concurrent.check(outcome), f"{case.note}\n{outcome.describe()}"


def test_seeded_sequential_histories(oracle):
    """Random histories (seeded), every opcode and edge the generator knows, minus the
    patterns of known bugs: every target answers byte for byte as torch's server."""
    profile = replace(CI, avoid=frozenset(KNOWN))
    t0 = time.monotonic()
    found = []
    for seed in SEQUENTIAL_SEEDS:
        found += oracle.check(generate(seed, profile))
    st = oracle.stats
    print(f"{st.histories} sequential histories, {st.operations} requests each target, "
          f"{time.monotonic() - t0:.1f} s, ops {dict(st.ops)}")
    assert not found, "\n\n".join(f"{m}\n{m.history.source()}" for m in found)
    # the generator reaches every opcode (and raw bytes) within the budget
    assert len(st.ops) >= 19, sorted(st.ops)


def test_seeded_concurrent_histories(oracle):
    """Clients pipelining at once: torch's answers satisfy the model (else the model is
    wrong), every target's are linearizable."""
    t0 = time.monotonic()
    failed = []
    for seed in CONCURRENT_SEEDS:
        failed += oracle.check_concurrent(concurrent.generate(seed, frozenset(KNOWN)))
    st = oracle.stats
    print(f"{st.c_histories} concurrent histories, {st.c_operations} requests per target, "
          f"{time.monotonic() - t0:.1f} s")
    assert st.model_failures == 0
    assert not failed, "\n\n".join(o.describe() for o in failed)


def test_the_comparison_is_not_vacuous(oracle):
    """A reference that differs in one byte, or in a closed connection, is a mismatch;
    torch's server against itself is none."""
    h = generate(7, CI)
    ref = oracle.reference(h)
    assert sequential.compare(h, ref, oracle.reference(h)) is None
    step = next(i for i, s in enumerate(ref.steps) if any(t for t, _ in s.seen.values()))
    seen = dict(ref.steps[step].seen)
    j = next(j for j, (t, _) in seen.items() if t)
    tokens, closed = seen[j]
    index, answer = tokens[0]
    seen[j] = (((index, answer + b"?"),) + tokens[1:], closed)
    doctored = Trace(ref.target, ref.steps[:step] + [replace(ref.steps[step], seen=seen)] + ref.steps[step + 1:],
                     ref.final, ref.alive)
    assert sequential.compare(h, doctored, ref) is not None
    seen[j] = (tokens, not closed)
    doctored.steps[step] = replace(ref.steps[step], seen=seen)
    assert sequential.compare(h, doctored, ref) is not None
