"""Wire-up benchmark: what the store host (node 0) and the busiest node pay to start a
job of K nodes x P ranks, with nodes arriving spread in time.

A simulated cluster (``wireup_sim.py``) replays a start-up's store traffic against
these set-ups, in the same run, each with the traffic of agents that can run it:

  torch         torch's TCPStore server (libuv), flat; torch's agents (static
                rendezvous and rank assignment): every agent and rank connects to it
  tierrun-flat  tierrun's store, flat; --agents (default tierrun: the parallel backend)
  tiered        tierrun's store with a node front-end per simulated node (the proxy's
                own components, FrontEnd + LinkUpstream, inside the simulator
                processes); --agents as above
  tree          tiered, front-ends stacked in the launcher's tree (--store-fanout F,
                rendezvous.tree.TreePlace), tierrun's parallel agents (the elastic
                backend's per-round trees are not simulated): every relay (a node whose front-end takes
                children's links) is a real ``tierrun proxy`` process, measured from
                /proc; leaves stay in the simulator processes
  tree-proxies  the tree with every node but node 0 a real ``tierrun proxy`` process
                (up to --max-proxies nodes)
  tree-10ms     (not run by default) tree, every front-end keeping its batch open 10 ms
  tree-paced    (not run by default) tree, its relays paced (--relay-pace P, default 0.05:
                while busy, a relay sends at most a batch per P seconds; tierrun/tier/pace.py;
                several values: a set-up each, labelled "tree-paced P s")

Arrivals (--skew S, default 1 s): each node starts at a moment drawn uniformly over
[0, S]; its ranks start 0.1-0.3 s (uniform) after its agent's rendezvous completes, as
worker spawn spreads them; seeded (--seed, then per round), the same for every set-up
of a round. By default every set-up also runs in lockstep (every node at once, ranks
at once after the rendezvous: --skew 0), reported on secondary lines labelled
"lockstep"; --no-lockstep skips them.

Per agent (one per node), torch's agents: connect, VALIDATE+PING, ADD init/, SET
role_info/<node>; node 0's agent WAITs for and MULTI_GETs every role_info, MULTI_SETs
every node's assigned ranks; every agent WAITs and GETs its assignment, starts its P
ranks, and at the end joins the exit barrier (ADD, the last one SETs last_member, WAIT).
tierrun's agents (the parallel backend): COMPARE_SET its node record, then in one write
APPEND to the arrivals, ADD to the count of nodes with P workers and to the arrival
count (the last SETs all_arrived), WAIT for all_arrived, then in one write confirm its
record (COMPARE_SET) and GET the count; while the ranks run, a standing WAIT on the
round's failed key and its liveness: tiered (every set-up with front-ends), its will,
left with its link's first hop (a SET and a GET at its proxy's will namespace, revoked
the same way after the exit barrier; node 0 leaves none), flat the heartbeat (ADD its
beat counter at once, then SET its next count on every whole second of the wall clock;
nodes 0-2 also MULTI_GET every other node's half a second later); then the same exit
barrier. In a tree, a node with a
parent first reads where its parent takes links with a LOOKUP at the store host (a UDP
datagram and its answer, as ``tier.lookup`` sends it first), and a relay's agent SETs
that address.
Per rank, --traffic nccl (default): connect, VALIDATE+PING, ADD init/; NCCL's unique-id
broadcast; a barrier; then --heartbeats CHECKs one second apart. --traffic gloo:
Gloo's full-mesh address exchange instead (O(W^2) requests; small K only).

Measured per set-up (CPU from /proc's schedstat): node 0 (the store process, which is
node 0's own front-end too in the tiered set-ups); the busiest measured node (node 0
or a relay / proxy process); the total of every server-side process measured (torch's
server; tierrun's store process and its proxy processes: the simulators' in-process
leaf front-ends are not measured); the wall time from the common start to every rank
done (it includes the skew window). Real proxy processes are started (level by level)
before the common start, and every process's CPU counts from that start: their own
link handshakes (at most F per upstream) are not counted, the parent lookups' (one
datagram to node 0 per node with a parent, at the node's start) are; node 0's
CPU while the proxies start is kept in the JSON (node0_cpu_proxies_start_s). Medians of --repeat rounds. Writes
docs/bench/wireup.json, docs/bench/wireup.png and the table section of
docs/benchmarks.md, unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from report import DOCS, raise_fd_limit, write_json, write_section
from servers import process_cpu_seconds, start_torch
from wireup_report import crossover, report, wakeup_floor_us
from wireup_sim import RUN_ID, Plan, node_address, sim_child

from tierrun.link.frames import WILL_NAMESPACE
from tierrun.rendezvous.tree import TreePlace
from tierrun.server import StoreProcess

SETUPS = ("torch", "tierrun-flat", "tiered", "tree", "tree-proxies", "tree-10ms", "tree-paced")
DEFAULT_SETUPS = ("torch", "tierrun-flat", "tiered", "tree", "tree-proxies")
DEFAULT_SIZES = ["64x8", "128x8", "256x8", "512x8", "1024x8"]
CROSSOVER_SETUPS = ("torch", "tierrun-flat", "tiered", "tree")
CROSSOVER_SIZES = ("4x8", "8x8", "16x8", "32x8", "64x8", "128x8")
#: The set-ups with node front-ends, and those stacked in a tree.
TIERED = ("tiered", "tree", "tree-proxies", "tree-10ms", "tree-paced")
TREES = ("tree", "tree-proxies", "tree-10ms", "tree-paced")


def agents_of(setup: str, args: argparse.Namespace) -> str:
    """Whose agents' traffic a set-up replays: torch's server runs torch's; a tree needs
    tierrun's parallel backend; the flat and tiered tierrun set-ups take --agents."""
    if setup == "torch":
        return "torch"
    return "tierrun" if setup in TREES else args.agents


def depth(place: TreePlace) -> int:
    """How many proxies lie between node ``place.rank`` and the store host (0: linked to it)."""
    d, n = 0, place.parent
    while n is not None:
        d, n = d + 1, TreePlace(n, place.nodes, place.fanout, "", RUN_ID).parent
    return d


def start_proxies(nodes: list[int], k: int, fanout: int, port: int, env: dict, token: bytes
                  ) -> dict[int, StoreProcess]:
    """A ``tierrun proxy`` process per node of ``nodes``, as ``JobStore.start`` starts
    them (a relay also takes links on its node's address), each listening on its node's
    address; level by level (a child links to its parent's link port), a level's at once."""
    places = {n: TreePlace(n, k, fanout, node_address(n), RUN_ID) for n in nodes}
    levels: dict[int, list[int]] = {}
    for n, place in places.items():
        levels.setdefault(depth(place), []).append(n)
    started: dict[int, StoreProcess] = {}

    def start(n: int) -> StoreProcess:
        place = places[n]
        upstream = f"127.0.0.1:{port}" if place.parent is None else \
            f"{node_address(place.parent)}:{started[place.parent].link_port}"
        extra = ["--link-listen", f"{node_address(n)}:0"] if place.has_children else []
        proc = StoreProcess(host=node_address(n), port=0, controlled=True, command="proxy", env=env, token=token,
                            extra_args=["--upstream", upstream, "--connect-timeout", "120", *extra],
                            start_timeout=300)
        proc.start()
        return proc

    with ThreadPoolExecutor(max_workers=32) as pool:
        for level in sorted(levels):
            for n, proc in zip(levels[level], pool.map(start, levels[level])):
                started[n] = proc
    return started


def measure(setup: str, k: int, p: int, skew: float, seed: str, args: argparse.Namespace,
            pace: float = 0.0) -> dict:
    """One start-up of K x P on one set-up: node 0's, the busiest node's and the total
    server-side CPU seconds, the wall time, and node 0's connections, requests, frames.
    ``pace``: tree-paced's relay pace, seconds."""
    token = secrets.token_hex(16)
    env = dict(os.environ, TIERRUN_TOKEN=token)
    if setup == "tree-10ms":  # (read by the front-ends' Settings.from_env)
        env["TIERRUN_LINK_BATCH_WINDOW"] = "0.01"
    if setup == "tree-paced":
        env["TIERRUN_LINK_RELAY_PACE"] = str(pace)
    fanout = args.fanout if setup in TREES else 0
    store = None
    proxies: dict[int, StoreProcess] = {}
    node0_port = 0  # tiered: node 0's own front-end, in its store process as the launcher runs it
    if setup == "torch":
        server = start_torch()
        port, pid = server.port, server.pid
    else:
        store = StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env,
                             node_frontend_unix=f"@tierrun-bench-{secrets.token_hex(4)}" if setup in TIERED else None)
        port = store.start()
        pid = store.pid
        node0_port = store.node_port or 0
    if setup == "tree-proxies":
        real = list(range(1, k))
    elif setup in TREES:
        real = [n for n in range(1, k) if TreePlace(n, k, fanout, "", RUN_ID).has_children]
    else:
        real = []
    plan = Plan(setup=setup, k=k, p=p, procs=args.procs, index=0, root_port=port, traffic=args.traffic,
                heartbeats=args.heartbeats, tierrun_agents=agents_of(setup, args) == "tierrun",
                node0=("127.0.0.1", node0_port) if setup in TIERED else None, fanout=fanout, skew=skew, seed=seed)
    sims: list[subprocess.Popen] = []
    try:
        for i in range(args.procs):
            plan.index = i
            sims.append(subprocess.Popen([sys.executable, __file__, "--sim-child", json.dumps(asdict(plan))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for s in sims:
            if s.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{setup}: a simulator did not start")
        cpu0 = process_cpu_seconds(pid)
        t_proxies = time.perf_counter()
        proxies = start_proxies(real, k, fanout or k, port, env, token.encode()) if real else {}
        proxies_s = time.perf_counter() - t_proxies
        # (their agents' wills: a listener each, as the launcher's agent opens it before its round)
        plan.wills = {n: (node_address(n), proc.open_namespace(WILL_NAMESPACE.decode())) for n, proc in proxies.items()}
        # (counted from here: a proxy's start and its link handshake precede the start of
        # the job, and node 0 idles through them; what it spent meanwhile is kept aside)
        node0_proxies_start = process_cpu_seconds(pid) - cpu0
        cpu0 = process_cpu_seconds(pid)
        base = {n: process_cpu_seconds(proc.pid) for n, proc in proxies.items()}
        plan.proxies = {n: (node_address(n), proc.port) for n, proc in proxies.items()}
        plan.relays = {n: (node_address(n), proc.link_port) for n, proc in proxies.items() if proc.link_port}
        t0 = time.time() + 0.2
        for s in sims:
            s.stdin.write(f"go {t0} {json.dumps({'proxies': plan.proxies, 'relays': plan.relays, 'wills': plan.wills})}\n")
            s.stdin.flush()
        outs = [s.stdout.readline() for s in sims]
        if not all(outs):
            raise RuntimeError(f"{setup} K={k} P={p}: a simulator failed")
        done = [json.loads(o) for o in outs]
        wall = max(d["end"] for d in done) - t0
        node0 = process_cpu_seconds(pid) - cpu0
        cpus = {n: process_cpu_seconds(proc.pid) - base[n] for n, proc in proxies.items()}
        for n, proc in proxies.items():
            if proc.exited() is not None:
                raise RuntimeError(f"{setup}: node {n}'s proxy exited: {proc.last_error()}")
        busiest_node, busiest = max(((0, node0), *cpus.items()), key=lambda kv: kv[1])
        requests = sum(d["requests"] for d in done)
        node0_own = sum(d["node0_requests"] for d in done)
        if setup == "torch":
            result = {"connections": k * (p + 1), "requests": requests, "frames": requests}
        else:
            st = store.stats()
            if setup in TIERED:
                # links, and node 0's own agent and ranks on its front-end (a request
                # each, read one by one as in a flat store)
                result = {"connections": st["clients_accepted"] + st["links_accepted"]
                          + st["node_frontend"]["clients_accepted"],
                          "requests": st["link_operations"] + node0_own,
                          "frames": st["link_batches"] + node0_own}
            else:
                result = {"connections": st["clients_accepted"], "requests": requests, "frames": requests}
        return {**result, "node0_cpu_s": node0, "busiest_cpu_s": busiest, "busiest_node": busiest_node,
                "total_cpu_s": node0 + sum(cpus.values()), "max_proxy_cpu_s": max(cpus.values(), default=0.0), "processes": 1 + len(proxies),
                "proxies_start_s": proxies_s, "node0_cpu_proxies_start_s": node0_proxies_start, "wall_s": wall}
    finally:
        for s in sims:
            s.kill()
            s.wait()
        with ThreadPoolExecutor(max_workers=32) as pool:
            list(pool.map(lambda proc: proc.stop(), proxies.values()))
        if store is not None:
            store.stop()
        else:
            server.stop()


def echo_server() -> None:
    """A do-nothing uvloop server: echoes what it reads (the --echo-server child)."""
    import asyncio

    from tierrun.server.eventloop import run

    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="KxP")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="simulator processes")
    p.add_argument("--traffic", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--heartbeats", type=int, default=3)
    p.add_argument("--fanout", type=int, default=8, help="links per front-end in the tree set-ups")
    p.add_argument("--relay-pace", type=float, nargs="+", default=[0.05],
                   help="tree-paced: at most a batch per this many seconds from a busy relay "
                        "(several: a tree-paced set-up each)")
    p.add_argument("--skew", type=float, default=1.0,
                   help="nodes start spread uniformly over this many seconds (0: lockstep)")
    p.add_argument("--no-lockstep", action="store_true",
                   help="skip the secondary lockstep runs (every node and rank at once)")
    p.add_argument("--seed", default="wireup", help="seeds the arrivals (then per round)")
    p.add_argument("--max-proxies", type=int, default=128,
                   help="run tree-proxies only up to this many nodes (a Python process per node)")
    p.add_argument("--agents", choices=("torch", "tierrun"), default="tierrun",
                   help="agent traffic of the tierrun-flat and tiered set-ups (the trees always "
                        "replay tierrun's, the torch set-up torch's)")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(DEFAULT_SETUPS),
                   help="set-ups to run (torch's always runs: the ratios need it); with another "
                        "list than the default, runs go to docs/bench/wireup-<sizes>-<N>rounds.json only")
    p.add_argument("--crossover", action="store_true",
                   help=f"flat vs tiered vs tree from small to mid sizes ({' '.join(CROSSOVER_SIZES)} unless "
                   "--sizes), skewed only: the crossover behind tierrun's choice with no tiering flag "
                   "(docs/benchmarks.md, section wireup_crossover)")
    p.add_argument("--report-only", action="store_true",
                   help="with --crossover: no run; the table again from docs/bench/wireup_crossover.json "
                   "(after a change of tierrun's thresholds, whose choice it shows)")
    p.add_argument("--no-write", action="store_true", help="print only: write nothing under docs/")
    p.add_argument("--sim-child", help=argparse.SUPPRESS)
    p.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_server:
        echo_server()
        return
    if args.sim_child:
        sim_child(args.sim_child)
        return
    raise_fd_limit()
    if args.crossover and args.report_only:  # (the table again, from the last run's raw runs)
        saved = json.loads((DOCS / "bench" / "wireup_crossover.json").read_text())
        table = crossover(saved["runs"], saved["args"]["repeat"], saved["args"]["skew"])
        print(table)
        if not args.no_write:
            write_section("wireup_crossover", table)
        return
    if args.crossover:
        args.setups, args.no_lockstep = list(CROSSOVER_SETUPS), True
        if args.sizes == DEFAULT_SIZES:
            args.sizes = list(CROSSOVER_SIZES)
    setups = [s for s in SETUPS if s == "torch" or s in args.setups]
    # (label, set-up, relay pace): one tree-paced run per --relay-pace value
    runs_of = [(f"{setup} {pace:g} s" if setup == "tree-paced" and len(args.relay_pace) > 1 else setup, setup, pace)
               for setup in setups for pace in (args.relay_pace if setup == "tree-paced" else [0.0])]
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes]
    variants = [args.skew] + ([0.0] if args.skew > 0 and not args.no_lockstep else [])
    runs: dict[str, dict[str, list[dict]]] = {}
    for k, pp in sizes:
        for i in range(args.repeat):  # interleaved, so that machine noise hits all alike
            for skew in variants:
                for label, setup, pace in runs_of:
                    if setup == "tree-proxies" and k > args.max_proxies:
                        continue
                    key = label if skew == args.skew else f"{label} lockstep"
                    r = measure(setup, k, pp, skew, f"{args.seed}:{i}", args, pace)
                    r["agents"] = agents_of(setup, args)
                    runs.setdefault(f"{k}x{pp}", {}).setdefault(key, []).append(r)
                    print(f"{k}x{pp} round {i + 1} {key}: "
                          + ", ".join(f"{m}={v:.3f}" if isinstance(v, float) else f"{m}={v}" for m, v in r.items()),
                          flush=True)
    floor = statistics.median(wakeup_floor_us(__file__) for _ in range(args.repeat))
    table, med = report(runs, args, floor)
    print(table)
    if args.crossover:
        table = crossover(runs, args.repeat, args.skew)
        print(table)
    if args.no_write:
        print("(--no-write: nothing written under docs/)")
        return
    if args.crossover:
        write_json("wireup_crossover", {"args": vars(args), "runs": runs, "wakeup_floor_us": floor})
        write_section("wireup_crossover", table)
        return
    name = ("wireup" if args.traffic == "nccl" else "wireup_gloo") + ("_torch_agents" if args.agents == "torch" else "")
    data = {"args": vars(args), "runs": runs, "wakeup_floor_us": floor}
    if sorted(setups) != sorted(DEFAULT_SETUPS):  # (raw runs kept, e.g. docs/bench/wireup-512x8-7rounds.json)
        write_json(f"{name}-{'-'.join(args.sizes)}-{args.repeat}rounds", data)
        print("(not the default set-ups: docs/benchmarks.md not updated)")
        return
    from wireup_report import plot

    write_json(name, data)
    plot(med, DOCS / "bench" / f"{name}.png")
    write_section(name, table + f"\n\n![busiest node and node 0](bench/{name}.png)")


if __name__ == "__main__":
    main()
