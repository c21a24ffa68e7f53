"""Steady state: what NCCL's heartbeat monitor costs node 0 once a job runs.

ProcessGroupNCCL's heartbeat monitor CHECKs one dump key about once a second on every
rank, for the whole job. This runs bench/wireup.py's start-up simulation twice per
set-up, with ``--heartbeats`` LOW and HIGH beats per rank, and reports what the extra
HIGH - LOW seconds of beating cost node 0, per second: requests it parsed and CPU
seconds, against torch's server flat, in the same run. Medians of --repeat runs;
writes docs/bench/heartbeat.json and its section of docs/benchmarks.md.

--agents tierrun: tierrun's set-ups also run what tierrun's agents of a static job send
while the job runs (wireup.py --agents tierrun): each node's liveness beat, an ADD once
a second on the wall clock's whole seconds, and the first 3 nodes' MULTI_GET of every
node's counter; torch's set-up is torchrun's static job, which has no liveness (its
server sees only the ranks' CHECKs). Writes heartbeat_tierrun_agents.
"""

from __future__ import annotations

import argparse
import statistics
import types

import wireup
from report import raise_fd_limit, write_json, write_section

SETUPS = ("torch", "tiered", "tree")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="512x8", help="KxP")
    p.add_argument("--low", type=int, default=2, help="heartbeats per rank in the short run")
    p.add_argument("--high", type=int, default=12, help="heartbeats per rank in the long run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--agents", choices=("torch", "tierrun"), default="torch",
                   help="agent traffic of tierrun's set-ups (see wireup.py --agents)")
    args = p.parse_args()
    raise_fd_limit()
    k, pp = map(int, args.size.split("x"))
    seconds = args.high - args.low
    per_second: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for i in range(args.repeat):
        for setup in SETUPS:
            got = {}
            for beats in (args.low, args.high):
                sim = types.SimpleNamespace(procs=2, traffic="nccl", heartbeats=beats, fanout=8, agents=args.agents)
                got[beats] = wireup.measure(setup, k, pp, sim)
            r = {m: (got[args.high][m] - got[args.low][m]) / seconds for m in ("requests", "frames", "cpu_s")}
            per_second[setup].append(r)
            print(f"run {i + 1} {setup}: {r}", flush=True)
    med = {s: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for s, rs in per_second.items()}
    torch = med["torch"]
    agents = ("" if args.agents == "torch" else "; tierrun's set-ups: tierrun's agents too (each node's liveness "
              "ADD once a second, the first 3 nodes' MULTI_GET of every counter), torch's: torchrun's static job")
    lines = [f"{args.size}, each rank CHECKing the dump key once a second{agents}; per second of beating "
             f"(runs with {args.high} and {args.low} beats per rank, the difference over {seconds} s), "
             f"medians of {args.repeat} runs.", "",
             "| set-up | node-0 requests / s | node-0 frames / s | node-0 CPU ms / s | CPU: torch / set-up |",
             "|---|---:|---:|---:|---:|"]
    for setup, m in med.items():
        ratio = "—" if setup == "torch" else (f"{torch['cpu_s'] / m['cpu_s']:.0f}x" if m["cpu_s"] > 0 else "no cost measured")
        lines.append(f"| {setup} | {m['requests']:,.0f} | {m['frames']:,.0f} | {1000 * m['cpu_s']:.1f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    name = "heartbeat" if args.agents == "torch" else "heartbeat_tierrun_agents"
    write_json(name, {"args": vars(args), "per_second": per_second})
    write_section(name, table)


if __name__ == "__main__":
    main()
