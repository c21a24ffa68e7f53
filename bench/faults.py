"""Fault benchmark: from a node's death to the survivors' workers running again,
torchrun (torch's c10d rendezvous) vs tierrun (its elastic rendezvous), in the same run.

3 simulated nodes (127.0.1.1-3) x 1 Gloo worker, ``--nnodes 2:3``, default last call
(30 s), ``--max_restarts 3 --monitor_interval 0.5``, the same flags for both. Once all
three workers are up, node 3 and its workers get the fault:

    kill    SIGKILL: the workers' sockets close, the survivors' all_reduce fails at once
    freeze  SIGSTOP: the sockets stay open, the survivors' workers hang in all_reduce

Recovery is the time from the fault to the last survivor's worker printing ``UP`` in a
world of 2 (worker wall clocks, one machine). Runs past ``--limit`` are cut and shown
as "> limit". Writes docs/bench/faults.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import ROOT, write_json, write_section

sys.path.insert(0, str(ROOT / "tests"))
from launch import kill_tree, results  # noqa: E402  (the tests' process helpers)

WORKER = ROOT / "tests" / "scripts" / "heartbeat_worker.py"
LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run"], "tierrun": ["-m", "tierrun"]}
SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recovery(launcher: str, fault: str, limit: float, workdir: Path) -> float:
    """Seconds from the fault to both survivors' workers up in a world of 2 (inf: cut)."""
    port = free_port()
    logs = [workdir / f"{launcher}-{fault}-{k}.log" for k in range(3)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for k in range(3):
        cmd = [sys.executable, *LAUNCHERS[launcher], "--nnodes", "2:3", "--nproc_per_node", "1",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.1.1:{port}", "--rdzv_id", "faults",
               "--max_restarts", "3", "--monitor_interval", "0.5", "--local_addr", f"127.0.1.{k + 1}",
               str(WORKER), "--want", "2"]
        procs.append(subprocess.Popen(cmd, stdout=open(logs[k], "w"), stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True))
    try:
        deadline = time.time() + 120
        while len(results(*logs, tag="UP")) < 3:
            if time.time() > deadline:
                raise RuntimeError(f"{launcher}: the 3-node job did not start; see {logs[0]}")
            time.sleep(0.1)
        t_fault = time.time()
        kill_tree(procs[2].pid, SIGNALS[fault])
        while time.time() < t_fault + limit:
            up = [float(r["t"]) for r in results(*logs[:2], tag="UP") if r["world"] == "2"]
            if len(up) == 2:
                return max(up) - t_fault
            time.sleep(0.2)
        return float("inf")
    finally:
        for p in procs:
            kill_tree(p.pid, signal.SIGKILL)
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", default=["kill", "freeze"], choices=list(SIGNALS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit", type=float, default=90.0, help="seconds before a run is cut")
    args = p.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "tierrun-bench-faults"
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[float]]] = {f: {"torchrun": [], "tierrun": []} for f in args.faults}
    for fault in args.faults:
        for i in range(args.runs):
            for launcher in ("torchrun", "tierrun"):  # interleaved: the same machine state
                t = recovery(launcher, fault, args.limit, workdir)
                runs[fault][launcher].append(t)
                print(f"{fault} run {i + 1}: {launcher} {t:.2f} s", flush=True)
    write_json("faults", {"runs": args.runs, "limit_s": args.limit,
                          "recovery_s": {f: {k: [None if v == float("inf") else round(v, 3) for v in vs]
                                             for k, vs in r.items()} for f, r in runs.items()}})

    def fmt(x: float) -> str:
        return f"> {args.limit:.0f}" if x == float("inf") else f"{x:.1f}"

    lines = [f"Medians of {args.runs} runs, seconds from the fault to the survivors' workers up "
             f"again (cut at {args.limit:.0f} s).", "",
             "| fault | torchrun (c10d) | tierrun | torchrun / tierrun |", "|---|---:|---:|---:|"]
    for fault, r in runs.items():
        t, m = statistics.median(r["torchrun"]), statistics.median(r["tierrun"])
        ratio = f"> {args.limit / m:.1f}" if t == float("inf") else f"{t / m:.1f}"
        lines.append(f"| {fault} | {fmt(t)} | {fmt(m)} | {ratio} |")
        print(f"{fault}: torchrun {fmt(t)} s, tierrun {fmt(m)} s, ratio {ratio}")
    write_section("faults", "\n".join(lines))


if __name__ == "__main__":
    main()
