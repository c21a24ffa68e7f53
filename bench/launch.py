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
   connection each, as K agents would have), one thread each, in one process; the
   time from all calling ``next_rendezvous()`` to the last one returning, min = max =
   K nodes. torch: ``DynamicRendezvousHandler`` + ``C10dRendezvousBackend`` on torch's
   TCPStore server; tierrun: ``ElasticRendezvousHandler`` on tierrun's store, hosted by
   handler 0 as the store-host agent would. Also the store server's CPU seconds.

Medians of --repeat runs, each (launcher, K) in a fresh process; ratios torch/tierrun
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

from report import raise_fd_limit, write_json, write_section
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


def rendezvous_torch(k: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    server = start_torch()
    try:
        handlers = []
        for i in range(k):
            store = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                  timeout=timedelta(seconds=3600), wait_for_workers=False)
            params = RendezvousParameters("c10d", f"127.0.0.1:{server.port}", "bench", k, k,
                                          local_addr="127.0.0.1", join_timeout=3600)
            handlers.append(create_handler(store, C10dRendezvousBackend(store, "bench"), params))
        return _run_handlers(handlers, server.pid)
    finally:
        server.stop()


def rendezvous_tierrun(k: int) -> dict:
    from tierrun.rendezvous.elastic import ElasticRendezvousHandler
    from tierrun.rendezvous.job_store import JobStore

    timeout = timedelta(seconds=3600)
    host = JobStore("127.0.0.1", 0, hosting=True, timeout=timeout)
    host.start()
    jobs = [host] + [JobStore("127.0.0.1", host.port, hosting=False, timeout=timeout) for _ in range(k - 1)]
    handlers = []
    for i, job in enumerate(jobs):
        job.client()  # connect now, as an agent does before it rendezvous
        handlers.append(ElasticRendezvousHandler(job, "bench", k, k, 3600, 30, f"node{i}"))
    assert host.root is not None
    return _run_handlers(handlers, host.root.pid)


def _run_handlers(handlers: list, server_pid: int) -> dict:
    k = len(handlers)
    ranks: list[int] = [-1] * k
    go = threading.Barrier(k + 1)

    def agent(i: int) -> None:
        go.wait()
        ranks[i] = handlers[i].next_rendezvous().rank

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    cpu0 = process_cpu_seconds(server_pid)
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = process_cpu_seconds(server_pid) - cpu0
    assert sorted(ranks) == list(range(k)), "ranks are not a permutation of 0..K-1"
    return {"wall_s": wall, "server_cpu_s": cpu}


def rendezvous_child(launcher: str, k: int) -> None:
    raise_fd_limit()
    result = (rendezvous_torch if launcher == "torchrun" else rendezvous_tierrun)(k)
    print(json.dumps(result), flush=True)
    os._exit(0)  # handlers' background threads (keep-alives, watchers) end with us


def time_rendezvous(launcher: str, k: int, limit: float) -> dict:
    """One measurement in a fresh process; {"timeout": limit} past ``limit`` seconds."""
    cmd = [sys.executable, __file__, "--rendezvous-child", launcher, str(k)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"wall_s": float("inf"), "server_cpu_s": float("nan"), "timeout": limit}
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} K={k} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


# -- report -----------------------------------------------------------------------------


def fmt(x: float) -> str:
    return "—" if x != x else (">limit" if x == float("inf") else f"{x:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--agents", type=int, nargs="+", default=[64, 256, 1024], help="K values")
    p.add_argument("--rendezvous-repeat", type=int, default=3)
    p.add_argument("--limit", type=float, default=900, help="seconds before a rendezvous run is cut")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--rendezvous-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rendezvous_child:
        rendezvous_child(args.rendezvous_child[0], int(args.rendezvous_child[1]))
    raise_fd_limit()

    walls: dict[str, dict[str, list[float]]] = {m: {lau: [] for lau in MODES[m]} for m in MODES}
    for i in range(args.repeat):  # interleaved, so that machine noise hits both alike
        for mode, launchers in MODES.items():
            for launcher in launchers:
                walls[mode][launcher].append(time_job(launcher, mode, args.port))
        print(f"job run {i + 1}/{args.repeat}: "
              + ", ".join(f"{m}/{lau} {v[-1]:.1f}s" for m, d in walls.items() for lau, v in d.items()), flush=True)

    rdzv: dict[int, dict[str, list[dict]]] = {k: {"torchrun": [], "tierrun": []} for k in args.agents}
    for k in args.agents:
        for i in range(args.rendezvous_repeat):
            for launcher in ("torchrun", "tierrun"):
                rdzv[k][launcher].append(time_rendezvous(launcher, k, args.limit))
            print(f"rendezvous K={k} run {i + 1}: torch {rdzv[k]['torchrun'][-1]['wall_s']:.2f}s, "
                  f"tierrun {rdzv[k]['tierrun'][-1]['wall_s']:.2f}s", flush=True)

    med = statistics.median
    lines = [f"Wall time of a 2-node x 2-worker trivial job, seconds, medians of {args.repeat} runs.", "",
             "| flags | torchrun | tierrun | torchrun / tierrun |", "|---|---:|---:|---:|"]
    t_static = med(walls["static"]["torchrun"])
    for mode in ("static", "elastic"):
        t, r = med(walls[mode]["torchrun"]), med(walls[mode]["tierrun"])
        lines.append(f"| {mode} | {t:.2f} | {r:.2f} | {t / r:.2f} |")
    r = med(walls["tiered"]["tierrun"])
    lines.append(f"| static + tiered (tierrun only; vs torchrun static) | {t_static:.2f} | {r:.2f} | {t_static / r:.2f} |")
    lines += ["", f"Rendezvous of K agents (handler level), medians of {args.rendezvous_repeat} runs; "
              f"runs longer than {args.limit:.0f} s are cut (>limit).", "",
              "| K | torch c10d wall s | tierrun wall s | torch / tierrun | torch store CPU s | tierrun store CPU s |",
              "|---:|---:|---:|---:|---:|---:|"]
    for k in args.agents:
        t, r = (med(x["wall_s"] for x in rdzv[k][lau]) for lau in ("torchrun", "tierrun"))
        tc, rc = (med(x["server_cpu_s"] for x in rdzv[k][lau]) for lau in ("torchrun", "tierrun"))
        ratio = f">{args.limit / r:.0f}" if t == float("inf") else f"{t / r:.1f}"
        lines.append(f"| {k} | {fmt(t)} | {fmt(r)} | {ratio} | {fmt(tc)} | {fmt(rc)} |")
    table = "\n".join(lines)
    print(table)
    write_json("launch", {"args": vars(args), "walls": walls, "rendezvous": rdzv})
    write_section("launch", table)


if __name__ == "__main__":
    main()
