"""The differential oracle, run long: random seeds of sequential histories (every target
must answer byte for byte as torch 2.13's own TCPStore server) and concurrent ones
(every target's answers linearizable), against tierrun flat, tiered (a real proxy), a
two-level tree and clients spread over every level. See tests/oracle/.

    python bench/fuzz.py --minutes 30            # patterns of KNOWN bugs left out
    python bench/fuzz.py --minutes 30 --all      # the known patterns too

Each new mismatch is minimized (--minimize N: the first N of each target) and printed as
a history to paste into tests/oracle/regressions.py. Writes the run's figures and its
mismatches to docs/bench/fuzz.json (raw) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))  # (the tree under test, also for the servers' processes)

from oracle import concurrent  # noqa: E402
from oracle.driver import Oracle  # noqa: E402
from oracle.history import FUZZ, generate  # noqa: E402
from oracle.minimize import kind, minimize_concurrent, minimize_mismatch  # noqa: E402
from oracle.regressions import KNOWN  # noqa: E402
from report import write_json, write_section  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    p.add_argument("--all", action="store_true", help="draw the patterns of KNOWN bugs and deviations too")
    p.add_argument("--concurrent-share", type=float, default=0.5,
                   help="share of the time spent on concurrent histories")
    p.add_argument("--minimize", type=int, default=3, help="mismatches minimized per target (0: none)")
    p.add_argument("--minimize-concurrent", action="store_true",
                   help="minimize concurrent failures too (slow: each try is several runs, and most "
                   "depend on timing or on a proxy's state, see --replay)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    p.add_argument("--replay", metavar="FUZZ_JSON:N", default=None,
                   help="run again what the cluster ran before mismatch N of a fuzz.json, in order "
                   "(a failure that depends on a proxy's state), up to and including it; --minutes "
                   "bounds the attempts")
    args = p.parse_args()
    if args.replay:
        return replay(args)
    seed0 = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 40)
    avoid = frozenset() if args.all else frozenset(KNOWN)
    profile = replace(FUZZ, avoid=avoid)
    found: list[dict] = []
    minimized: dict[str, int] = {}
    deadline = time.monotonic() + 60 * args.minutes
    t0 = time.monotonic()
    seq_time = conc_time = 0.0
    n = 0
    with Oracle() as oracle:
        while time.monotonic() < deadline:
            seed = seed0 + n
            n += 1
            # spend the time in the asked shares (concurrent histories are ~10x cheaper)
            if conc_time < args.concurrent_share * (seq_time + conc_time + 1e-9):
                t = time.monotonic()
                failed = oracle.check_concurrent(concurrent.generate(seed, avoid))
                conc_time += time.monotonic() - t
                for outcome in failed:
                    entry = {"kind": "concurrent", "seed": seed, "target": outcome.target,
                             "problem": outcome.problem or "not linearizable", "outcome": outcome.describe(),
                             "cluster_ran": _compact(oracle.since_restart)}
                    if args.minimize_concurrent and minimized.get(outcome.target, 0) < args.minimize:
                        minimized[outcome.target] = minimized.get(outcome.target, 0) + 1
                        entry["minimized"] = repr(_minimize_concurrent(oracle, seed, avoid, outcome.target))
                    found.append(entry)
                    print(f"concurrent seed {seed}: {outcome.describe()}\n", flush=True)
            else:
                t = time.monotonic()
                history = generate(seed, profile)
                mismatches = oracle.check(history)
                seq_time += time.monotonic() - t
                for m in mismatches:
                    entry = {"kind": "sequential", "seed": seed, "target": m.target, "what": kind(m),
                             "mismatch": str(m), "history": m.history.source(),
                             "cluster_ran": _compact(oracle.since_restart)}
                    if minimized.get(m.target, 0) < args.minimize:
                        minimized[m.target] = minimized.get(m.target, 0) + 1
                        small = minimize_mismatch(oracle, m, max_tries=80)
                        entry["minimized"] = small.source()
                        entry["minimized_mismatch"] = str(oracle.mismatch_of(small, m.target))
                    found.append(entry)
                    print(f"sequential seed {seed}: {m}\n{entry.get('minimized', '')}\n", flush=True)
            if n % 100 == 0:
                st = oracle.stats
                print(f"{time.monotonic() - t0:.0f} s: {st.histories} sequential, {st.c_histories} concurrent "
                      f"histories, {st.operations_tried} operations on tierrun, {len(found)} mismatches",
                      flush=True)
        stats = oracle.stats.as_dict()
    elapsed = time.monotonic() - t0
    print(stats)
    result = {"args": vars(args), "first_seed": seed0, "seeds": n, "avoided": sorted(avoid),
              "seconds": round(elapsed, 1), "stats": stats, "mismatches": found}
    if not args.no_write:
        write_json("fuzz", result)
        write_section("fuzz", _section(result))
    return 1 if found else 0


def _compact(ran: list) -> dict:
    """What the cluster ran, ("sequential" | "concurrent", seed) each with the seed after
    the one before: the first seed and one letter per history."""
    seeds = [seed for _, seed in ran]
    assert seeds == list(range(seeds[0], seeds[0] + len(seeds))) if seeds else True
    return {"first_seed": seeds[0] if seeds else None, "kinds": "".join(kind_[0] for kind_, _ in ran)}


def _expand(compact: dict) -> list:
    return [("sequential" if k == "s" else "concurrent", compact["first_seed"] + i)
            for i, k in enumerate(compact["kinds"])]


def replay(args) -> int:
    import json

    path, _, n = args.replay.rpartition(":")
    r = json.loads(Path(path).read_text())
    entry = r["mismatches"][int(n)]
    avoid = frozenset(r["avoided"])
    profile = replace(FUZZ, avoid=avoid)
    deadline = time.monotonic() + 60 * args.minutes
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        with Oracle() as oracle:
            for kind_, seed in _expand(entry["cluster_ran"]):
                if kind_ == "concurrent":
                    bad = oracle.check_concurrent(concurrent.generate(seed, avoid))
                    bad = [o.describe() for o in bad]
                else:
                    bad = [str(m) for m in oracle.check(generate(seed, profile))]
                if bad:
                    print(f"attempt {attempt}: {kind_} seed {seed}:\n" + "\n".join(bad), flush=True)
                    if seed == entry["seed"]:
                        return 1
        print(f"attempt {attempt}: not reproduced", flush=True)
    return 0


def _minimize_concurrent(oracle, seed: int, avoid, target_name: str):
    target = next(t for t in oracle.targets.tierrun if t.name == target_name)

    def failing(h) -> bool:
        for _ in range(10):
            outcome = concurrent.run(h, target, deadline=1.0)
            oracle._after(target, h)
            if not concurrent.check(outcome):
                return True
        return False

    return minimize_concurrent(concurrent.generate(seed, avoid), failing, max_tries=60)


def _section(r: dict) -> str:
    st = r["stats"]
    targets = sorted(st["runs"])
    lines = [
        f"`python bench/fuzz.py --minutes {r['args']['minutes']:g}`"
        + (" --all" if r["args"]["all"] else "") + f": {r['seconds'] / 60:.1f} min, seeds "
        f"{r['first_seed']}..{r['first_seed'] + r['seeds'] - 1}, on {os.cpu_count()} cores. "
        f"**{st['operations_tried_on_tierrun']:,} operations** sent to tierrun (each request counted once per "
        f"target it ran on), the same to torch's server; **{len(r['mismatches'])} mismatches**.",
        "",
        "| | " + " | ".join(targets) + " |",
        "|---|" + "---:|" * len(targets),
        "| sequential histories | " + " | ".join(f"{st['runs'].get(t, 0):,}" for t in targets) + " |",
        "| their requests | " + " | ".join(f"{st['target_operations'].get(t, 0):,}" for t in targets) + " |",
        "| mismatches (confirmed by a second run) | "
        + " | ".join(str(st["mismatches"].get(t, 0)) for t in targets) + " |",
        "| mismatches not seen again (timing) | " + " | ".join(str(st["flaky"].get(t, 0)) for t in targets) + " |",
        "| concurrent histories | " + " | ".join(f"{st['concurrent_runs'].get(t, 0):,}" for t in targets) + " |",
        "| not linearizable / unanswered | "
        + " | ".join(str(st["concurrent_failures"].get(t, 0)) for t in targets) + " |",
        "| restarts (a process died or a front-end stopped answering) | "
        + " | ".join(str(st["restarts"].get(t, 0)) for t in targets) + " |",
        "",
        f"torch's server: {st['histories']:,} sequential histories ({st['operations']:,} requests), "
        f"{st['concurrent_histories']:,} concurrent ones ({st['concurrent_operations']:,} requests), whose answers "
        f"the linearizability model rejected {st['model_failures']} times (a model error if not 0). Requests "
        "per opcode in the sequential histories: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(st["ops"].items(), key=lambda kv: -kv[1])) + ".",
    ]
    if r["avoided"]:
        lines += ["", "Left out (patterns of known bugs and deviations, tests/oracle/regressions.py): "
                  + ", ".join(f"`{a}`" for a in r["avoided"]) + "."]
    if r["mismatches"]:
        lines += ["", "Mismatches (raw in docs/bench/fuzz.json):", ""]
        for m in r["mismatches"][:20]:
            what = (m.get("mismatch") or m.get("problem")).splitlines()[0].removeprefix(f"{m['target']}: ")
            lines.append(f"- {m['kind']} seed {m['seed']}, {m['target']}: {what[:160]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
