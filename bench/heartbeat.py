"""Steady state: what NCCL's heartbeat monitor costs node 0 once a job runs.

ProcessGroupNCCL's heartbeat monitor CHECKs one dump key about once a second on every
rank, for the whole job. This runs bench/wireup.py's start-up simulation twice per
set-up, with ``--heartbeats`` LOW and HIGH beats per rank, and reports what the extra
HIGH - LOW seconds of beating cost node 0, per second: requests it parsed and CPU
seconds, and the busiest node's CPU seconds (in the tree a relay, a real proxy
process), against torch's server flat, in the same run. The two runs of a round start
alike (every node at once, the same seed), so their difference is the beating. Medians
of --repeat runs; writes docs/bench/heartbeat.json and its section of docs/benchmarks.md
(unless --no-write).

--agents tierrun: tierrun's set-ups also run what tierrun's agents of a static job send
while the job runs (wireup.py --agents tierrun), and tierrun's flat store is measured
too: flat, each node's liveness beat, a SET of its count once a second on the wall
clock's whole seconds (every 16th an ADD), and the first 3 nodes' MULTI_GET of every
node's counter; tiered and tree, nothing (each node's will waits at its link's first
hop: ``tierrun/hub/wills.py``); torch's set-up is torchrun's static job, which has no
liveness (its server sees only the ranks' CHECKs). Writes heartbeat_tierrun_agents.

--idle: what idle connections cost node 0 a second, nothing else running: torch's server
with every agent's and rank's connection open (K x (P + 1): torch's protocol has no
liveness, so they cost it nothing), tierrun's store with one link per node (tiered) and
with 8 (tree). What a link costs is its heartbeat: an ACK a second and its PONG. Writes
heartbeat_idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
import types

import wireup
from report import DOCS, raise_fd_limit, write_json, write_section
from servers import process_cpu_seconds, start_torch

from tierrun.server import StoreProcess

SETUPS = ("torch", "tiered", "tree")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="512x8", help="KxP")
    p.add_argument("--low", type=int, default=2, help="heartbeats per rank in the short run")
    p.add_argument("--high", type=int, default=12, help="heartbeats per rank in the long run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--agents", choices=("torch", "tierrun"), default="torch",
                   help="agent traffic of tierrun's set-ups (see wireup.py --agents)")
    p.add_argument("--idle", action="store_true", help="measure idle connections instead (see above)")
    p.add_argument("--idle-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--report-only", action="store_true",
                   help="no run: the table of --agents again from its JSON under docs/bench/")
    p.add_argument("--no-write", action="store_true", help="print only: write nothing under docs/")
    args = p.parse_args()
    raise_fd_limit()
    if args.idle_child:
        idle_child(args.idle_child[0], int(args.idle_child[1]), int(args.idle_child[2]))
        return
    if args.report_only:
        name = "heartbeat" if args.agents == "torch" else "heartbeat_tierrun_agents"
        stored = json.loads((DOCS / "bench" / f"{name}.json").read_text())
        a = stored["args"]
        write_section(name, report(stored["per_second"], a["size"], a["agents"], a["low"], a["high"], a["repeat"]))
        return
    k, pp = map(int, args.size.split("x"))
    if args.idle:
        idle(k, pp, args)
        return
    seconds = args.high - args.low
    # (with tierrun's agents, its flat store too: the one set-up whose agents still beat)
    setups = SETUPS if args.agents == "torch" else ("torch", "tierrun-flat", *SETUPS[1:])
    per_second: dict[str, list[dict]] = {s: [] for s in setups}
    for i in range(args.repeat):
        for setup in setups:
            got = {}
            for beats in (args.low, args.high):
                sim = types.SimpleNamespace(procs=2, traffic="nccl", heartbeats=beats, fanout=8, agents=args.agents)
                got[beats] = wireup.measure(setup, k, pp, 0.0, f"heartbeat-{i}", sim)
            r = {m: (got[args.high][m] - got[args.low][m]) / seconds
                 for m in ("requests", "frames", "node0_cpu_s", "busiest_cpu_s")}
            per_second[setup].append(r)
            print(f"run {i + 1} {setup}: {r}", flush=True)
    name = "heartbeat" if args.agents == "torch" else "heartbeat_tierrun_agents"
    table = report(per_second, args.size, args.agents, args.low, args.high, args.repeat)
    print(table)
    if not args.no_write:
        write_json(name, {"args": vars(args), "per_second": per_second})
        write_section(name, table)


def report(per_second: dict[str, list[dict]], size: str, agents_of: str, low: int, high: int, repeat: int) -> str:
    """The table of the medians of ``per_second`` (set-up -> each run's differences)."""
    med = {s: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for s, rs in per_second.items()}
    torch = med["torch"]
    agents = ("; the tree: tierrun's agents (a tree needs tierrun's parallel backend), whose liveness is their "
              "links' (wills at the first hop: nothing at node 0)" if agents_of == "torch" else
              "; tierrun's set-ups: tierrun's agents too (flat: each node's liveness beat once a second, the first 3 "
              "nodes' MULTI_GET of every counter; tiered and tree: their wills, at the first hop), torch's: "
              "torchrun's static job")
    lines = [f"{size}, each rank CHECKing the dump key once a second{agents}; per second of beating "
             f"(runs with {high} and {low} beats per rank, the difference over {high - low} s), "
             f"medians of {repeat} runs. Busiest: node 0 or a relay (tree), whichever spent more.", "",
             "| set-up | node-0 requests / s | node-0 frames / s | node-0 CPU ms / s | busiest CPU ms / s "
             "| CPU: torch / busiest |",
             "|---|---:|---:|---:|---:|---:|"]

    def ratio(m: dict) -> str:
        if m["busiest_cpu_s"] <= 0:
            return "no cost measured"
        r = torch["node0_cpu_s"] / m["busiest_cpu_s"]
        return f"{r:.1f}x" if r < 10 else f"{r:.0f}x"

    for setup, m in med.items():
        lines.append(f"| {setup} | {m['requests']:,.0f} | {m['frames']:,.0f} | {1000 * m['node0_cpu_s']:.1f} "
                     f"| {1000 * m['busiest_cpu_s']:.1f} | {'—' if setup == 'torch' else ratio(m)} |")
    return "\n".join(lines)


IDLE_SECONDS = 6.0


def idle_child(kind: str, port: int, count: int) -> None:
    """Open ``count`` connections to node 0 (``torch``: torch clients, handshake done;
    ``link``: front-end links, each opened at a random moment of a second, as nodes
    start at different moments) and keep them open, idle, until stdin closes."""
    from tierrun.tier import connect_link
    from tierrun.server.eventloop import run

    async def main() -> None:
        if kind == "torch":
            conns = [await wireup.connect("127.0.0.1", port) for _ in range(count)]
        else:
            token = os.environ["TIERRUN_TOKEN"].encode()

            async def node() -> object:
                await asyncio.sleep(random.random())
                return await connect_link("127.0.0.1", port, token, lambda reason: os._exit(1))

            conns = await asyncio.gather(*(node() for _ in range(count)))
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        del conns

    run(main())


def idle_cost(kind: str, count: int) -> float:
    """Node 0's CPU seconds per second with ``count`` idle connections (two client
    processes), over IDLE_SECONDS, after a second's settling."""
    env = dict(os.environ, TIERRUN_TOKEN=secrets.token_hex(16))
    if kind == "torch":
        server = start_torch()
        port, pid, stop = server.port, server.pid, server.stop
    else:
        store = StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env)
        port, pid, stop = store.start(), store.pid, store.stop
    children = [subprocess.Popen([sys.executable, __file__, "--idle-child", kind, str(port), str(n)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                for n in (count // 2, count - count // 2)]
    try:
        for c in children:
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError(f"idle {kind} x {count}: a client process did not start")
        time.sleep(1.0)
        cpu0 = process_cpu_seconds(pid)
        time.sleep(IDLE_SECONDS)
        return (process_cpu_seconds(pid) - cpu0) / IDLE_SECONDS
    finally:
        for c in children:
            c.kill()
            c.wait()
        stop()


def idle(k: int, pp: int, args) -> None:
    setups = {"torch": ("torch", k * (pp + 1)), "tiered": ("link", k), "tree": ("link", 8)}
    runs: dict[str, list[float]] = {s: [] for s in setups}
    for i in range(args.repeat):
        for setup, (kind, count) in setups.items():
            runs[setup].append(idle_cost(kind, count))
            print(f"run {i + 1} {setup} ({count} connections): {1000 * runs[setup][-1]:.2f} ms/s", flush=True)
    lines = [f"{args.size}, every connection open and idle for {IDLE_SECONDS:g} s; node-0 CPU per second, "
             f"medians of {args.repeat} runs.", "",
             "| set-up | node-0 connections | node-0 CPU ms / s |", "|---|---:|---:|"]
    for setup, (kind, count) in setups.items():
        lines.append(f"| {setup} | {count:,} | {1000 * statistics.median(runs[setup]):.2f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_json("heartbeat_idle", {"args": vars(args), "cpu_s_per_s": runs})
        write_section("heartbeat_idle", table)


if __name__ == "__main__":
    main()
