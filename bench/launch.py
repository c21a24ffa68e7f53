"""Launch benchmark: torchrun vs tierrun, in the same run.

1. Wall time from the command to every worker done, for a trivial script (join the
   Gloo process group, one all_reduce), 2 simulated nodes (127.0.1.1, 127.0.1.2) x 2
   workers, the same flags for both launchers:
     static   --rdzv_backend static --master_addr/--master_port --node_rank
              (torchrun: torch's static rendezvous; tierrun: ``parallel``)
     elastic  --rdzv_backend c10d --rdzv_endpoint (torchrun: torch's c10d rendezvous
              on torch's TCPStore; tierrun: its elastic ``tierrun`` backend)
     tiered   tierrun only: static flags + --enable_tiered_parallel_tcpstore true
2. Rendezvous time of K agents at the handler level: K rendezvous handlers (one store
   connection each, as K agents would have), one thread each, spread over --procs
   processes; the time from all calling ``next_rendezvous()`` to the last one
   returning, min = max = K nodes. torch: ``DynamicRendezvousHandler`` + ``C10dRendezvousBackend`` on torch's
   TCPStore server; tierrun: ``ElasticRendezvousHandler`` on tierrun's store, hosted by
   handler 0 as the store-host agent would. Also the store server's CPU seconds and
   store operations (torch: counted at its rendezvous backend; tierrun: the store's).

Medians of --repeat runs, each measurement in fresh processes; ratios torch/tierrun
(> 1: tierrun faster). Writes docs/bench/launch.json and two tables in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from report import raise_fd_limit, rendezvous_all, write_json, write_section
from servers import process_cpu_seconds, start_torch

HERE = Path(__file__).resolve().parent
TRIVIAL = HERE / "scripts" / "trivial.py"
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"], "tierrun": ["-m", "tierrun"]}
MODES = {  # mode -> the launchers it compares
    "static": ("torchrun", "tierrun"),
    "elastic": ("torchrun", "tierrun"),
    "tiered": ("tierrun",),
}


# -- 1. wall time of a 2 x 2 job -----------------------------------------------------------


def node_command(launcher: str, mode: str, rank: int, port: int) -> list[str]:
    cmd = [sys.executable, *LAUNCHERS[launcher], "--nnodes", "2", "--nproc_per_node", "2",
           "--local_addr", f"127.0.1.{rank + 1}"]
    if mode == "elastic":
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "bench"]
    else:
        cmd += ["--rdzv_backend", "static", "--master_addr", "127.0.1.1", "--master_port", str(port),
                "--node_rank", str(rank)]
    if mode == "tiered":
        cmd += ["--enable_tiered_parallel_tcpstore", "true"]
    return cmd + [str(TRIVIAL)]


def time_job(launcher: str, mode: str, port: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERRUN_TOKEN=secrets.token_hex(16))
    t0 = time.perf_counter()
    procs = [subprocess.Popen(node_command(launcher, mode, r, port), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    wall = time.perf_counter() - t0
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"{launcher} {mode} failed (exit {p.returncode}):\n{err[-3000:]}")
    return wall


# -- 2. rendezvous of K agents ----------------------------------------------------------


class CountingStore:
    """What torch's C10dRendezvousBackend sees as its store; counts its operations."""

    def __init__(self, store) -> None:
        self._store = store
        self.ops = 0

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)

        return counted


def torch_handlers(indices: list[int], k: int, port: int) -> tuple[list, list[CountingStore]]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    handlers, counters = [], []
    for _ in indices:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=3600), wait_for_workers=False)
        counting = CountingStore(store)
        params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "bench", k, k,
                                      local_addr="127.0.0.1", join_timeout=3600)
        handlers.append(create_handler(store, C10dRendezvousBackend(counting, "bench"), params))
        counters.append(counting)
    return handlers, counters


def tierrun_handlers(indices: list[int], k: int, port: int) -> tuple[list, int]:
    """Handler 0 hosts the store, as the store-host agent does; returns its pid too."""
    from tierrun.rendezvous.elastic import ElasticRendezvousHandler
    from tierrun.rendezvous.job_store import JobStore

    timeout = timedelta(seconds=3600)
    handlers, server_pid = [], 0
    for i in indices:
        job = JobStore("127.0.0.1", port, hosting=(i == 0), timeout=timeout)
        job.start()
        if job.root is not None:
            port, server_pid = job.port, job.root.pid
        job.client()  # connect now, as an agent does before it rendezvous
        handlers.append(ElasticRendezvousHandler(job, "bench", k, k, 3600, 30, f"node{i}", {"progress": "off"}))
    return handlers, server_pid


def rendezvous_child(launcher: str, k: int, procs: int, index: int, port: int) -> None:
    """Handlers index, index + procs, ... of K, one thread each; told when to start on stdin."""
    raise_fd_limit()
    mine = list(range(index, k, procs))
    counters: list[CountingStore] = []
    server_pid = 0
    if launcher == "torchrun":
        handlers, counters = torch_handlers(mine, k, port)
    else:
        handlers, server_pid = tierrun_handlers(mine, k, port)
        port = handlers[0].job.port
    print(f"ready {port} {server_pid}", flush=True)
    sys.stdin.readline()
    ranks = rendezvous_all(handlers)
    print(json.dumps({"ranks": ranks, "ops": sum(c.ops for c in counters)}), flush=True)
    if server_pid:  # asked once every process is done: what the store host counted
        sys.stdin.readline()
        root = handlers[0].job.root
        print(json.dumps({"ops": root.stats()["operations"]}), flush=True)
    os._exit(0)  # handlers' background threads (keep-alives, watchers) end with us


def time_rendezvous(launcher: str, k: int, procs: int, limit: float) -> dict:
    """K handlers over ``procs`` processes, all fresh; {"timeout": limit} past ``limit`` s."""
    server = start_torch() if launcher == "torchrun" else None

    def child(index: int, port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--rendezvous-child", launcher, str(k),
                                 str(procs), str(index), str(port)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    first = child(0, server.port if server else 0)
    _, port, pid = first.stdout.readline().split()
    server_pid = server.pid if server else int(pid)
    children = [first] + [child(i, int(port)) for i in range(1, procs)]
    for c in children[1:]:
        c.stdout.readline()
    cpu0 = process_cpu_seconds(server_pid)
    t0 = time.perf_counter()
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    results = []
    timer = threading.Timer(limit, lambda: [c.kill() for c in children])
    timer.start()
    try:
        for c in children:
            line = c.stdout.readline()
            if not line:
                return {"wall_s": float("inf"), "server_cpu_s": float("nan"), "ops": float("nan"), "timeout": limit}
            results.append(json.loads(line))
        wall = time.perf_counter() - t0
        cpu = process_cpu_seconds(server_pid) - cpu0
        if launcher == "tierrun":
            first.stdin.write("stats\n")
            first.stdin.flush()
            ops = json.loads(first.stdout.readline())["ops"]
        else:
            ops = sum(res["ops"] for res in results)
    finally:
        timer.cancel()
        for c in children:
            c.kill()
            c.wait()
        if server:
            server.stop()
    ranks = sorted(r for res in results for r in res["ranks"])
    assert ranks == list(range(k)), f"{launcher} K={k}: ranks are not a permutation of 0..K-1"
    return {"wall_s": wall, "server_cpu_s": cpu, "ops": ops}


# -- report -----------------------------------------------------------------------------


def fmt(x: float) -> str:
    return "—" if x != x else (">limit" if x == float("inf") else f"{x:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--agents", type=int, nargs="+", default=[64, 256, 1024], help="K values")
    p.add_argument("--rendezvous-repeat", type=int, default=3)
    p.add_argument("--limit", type=float, default=300, help="seconds before a rendezvous run is cut")
    p.add_argument("--procs", type=int, default=4, help="processes the K handlers are spread over")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--rendezvous-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rendezvous_child:
        launcher, *numbers = args.rendezvous_child
        rendezvous_child(launcher, *map(int, numbers))
    raise_fd_limit()

    walls: dict[str, dict[str, list[float]]] = {m: {lau: [] for lau in MODES[m]} for m in MODES}
    for i in range(args.repeat):  # interleaved, so that machine noise hits both alike
        for mode, launchers in MODES.items():
            for launcher in launchers:
                walls[mode][launcher].append(time_job(launcher, mode, args.port))
        print(f"job run {i + 1}/{args.repeat}: "
              + ", ".join(f"{m}/{lau} {v[-1]:.1f}s" for m, d in walls.items() for lau, v in d.items()), flush=True)

    rdzv: dict[int, dict[str, list[dict]]] = {k: {"torchrun": [], "tierrun": []} for k in args.agents}
    cut: set[str] = set()  # launchers cut at a smaller K are not run at larger ones
    for k in args.agents:
        for i in range(args.rendezvous_repeat):
            for launcher in ("torchrun", "tierrun"):
                if launcher in cut:
                    continue
                rdzv[k][launcher].append(time_rendezvous(launcher, k, args.procs, args.limit))
                print(f"rendezvous K={k} run {i + 1} {launcher}: {rdzv[k][launcher][-1]}", flush=True)
                if "timeout" in rdzv[k][launcher][-1]:
                    cut.add(launcher)

    med = statistics.median
    lines = [f"Wall time of a 2-node x 2-worker trivial job, seconds, medians of {args.repeat} runs.", "",
             "| flags | torchrun | tierrun | torchrun / tierrun |", "|---|---:|---:|---:|"]
    t_static = med(walls["static"]["torchrun"])
    for mode in ("static", "elastic"):
        t, r = med(walls[mode]["torchrun"]), med(walls[mode]["tierrun"])
        lines.append(f"| {mode} | {t:.2f} | {r:.2f} | {t / r:.2f} |")
    r = med(walls["tiered"]["tierrun"])
    lines.append(f"| static + tiered (tierrun only; vs torchrun static) | {t_static:.2f} | {r:.2f} | {t_static / r:.2f} |")
    lines += ["", f"Rendezvous of K agents (handler level, spread over {args.procs} processes), medians "
              f"of {args.rendezvous_repeat} runs; a run longer than {args.limit:.0f} s is cut (>limit) and "
              "that launcher is not run at larger K. Store ops: torch's rendezvous-state operations "
              "(counted at its backend), tierrun's store host's count of every operation.", "",
              "| K | torch c10d wall s | tierrun wall s | torch / tierrun | torch store CPU s | "
              "tierrun store CPU s | torch store ops | tierrun store ops |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def median_or_cut(runs: list[dict], metric: str) -> float:
        if not runs or any("timeout" in x for x in runs):
            return float("inf") if metric == "wall_s" else float("nan")
        return med(x[metric] for x in runs)

    for k in args.agents:
        t, r = (median_or_cut(rdzv[k][lau], "wall_s") for lau in ("torchrun", "tierrun"))
        tc, rc = (median_or_cut(rdzv[k][lau], "server_cpu_s") for lau in ("torchrun", "tierrun"))
        to, ro = (median_or_cut(rdzv[k][lau], "ops") for lau in ("torchrun", "tierrun"))
        ratio = f">{args.limit / r:.0f}" if t == float("inf") else f"{t / r:.1f}"
        lines.append(f"| {k} | {fmt(t)} | {fmt(r)} | {ratio} | {fmt(tc)} | {fmt(rc)} | {to:,.0f} | {ro:,.0f} |"
                     .replace("nan", "—"))
    table = "\n".join(lines)
    print(table)
    write_json("launch", {"args": vars(args), "walls": walls, "rendezvous": rdzv})
    write_section("launch", table)


if __name__ == "__main__":
    main()
