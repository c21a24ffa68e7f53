"""The report of ``bench/wireup.py``: medians, the table (with the ratios to torch's
server), the plot, and the wake-up floor measured in the same run."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from servers import process_cpu_seconds

#: The figures whose median the table gives (the others are counts or labels).
METRICS = ("connections", "requests", "frames", "node0_cpu_s", "busiest_cpu_s", "total_cpu_s", "max_proxy_cpu_s", "processes",
           "proxies_start_s", "wall_s")


def medians(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per size and set-up: the median of each metric over the rounds, the agents, and
    the node most often the busiest."""
    med: dict[str, dict[str, dict]] = {}
    for size, by in runs.items():
        for setup, rs in by.items():
            m = {key: statistics.median(r[key] for r in rs) for key in METRICS}
            m["agents"] = rs[0]["agents"]
            m["busiest_node"] = Counter(r["busiest_node"] for r in rs).most_common(1)[0][0]
            med.setdefault(size, {})[setup] = m
    return med


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b else "inf"


def report(runs: dict[str, dict[str, list[dict]]], args: argparse.Namespace, floor_us: float
           ) -> tuple[str, dict[str, dict[str, dict]]]:
    """The markdown table (and the lines above it) and the medians it was made from."""
    med = medians(runs)
    agents = {"torch": "torch's (static rendezvous, rank assignment)",
              "tierrun": "tierrun's parallel backend (rendezvous, local ranks; liveness: flat, heartbeats; "
                         "with front-ends, wills at the first hop)"}
    lines = [
        f"Traffic: {args.traffic}, {args.heartbeats} heartbeat CHECKs per rank; nodes start spread uniformly "
        f"over {args.skew:g} s, each node's ranks 0.1-0.3 s after its rendezvous (seed {args.seed!r}); "
        f"medians of {args.repeat} rounds; {args.procs} simulator processes; tree fanout {args.fanout}. "
        "Agents: " + "; ".join(f"`{a}` = {d}" for a, d in agents.items()) + ". "
        "Busiest: the node whose measured store process (node 0's, a relay's or a proxy's) spent the most "
        "CPU; server total: every measured server-side process (tierrun's leaf front-ends inside the "
        "simulators are not measured: see the processes column). Ratios: torch's server CPU over "
        "tierrun's busiest node and node 0 (higher: tierrun cheaper), of the medians; in brackets, the "
        "lowest-highest within a round. Lines marked *lockstep*: every node and rank starting at once. "
        f"On this machine a do-nothing uvloop server spends {floor_us:.0f} us of CPU per message that arrives "
        "alone (same run).",
        "",
        "| K x P | set-up | agents | processes measured | node-0 frames | node 0 CPU s | busiest CPU s (node) "
        "| server total CPU s | wall s | torch / busiest | torch / node 0 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, by in med.items():
        for lockstep in (False, True):
            torch_key = "torch lockstep" if lockstep else "torch"
            for setup, m in by.items():
                if setup.endswith(" lockstep") != lockstep:
                    continue
                label = f"*{setup.removesuffix(' lockstep')}, lockstep*" if lockstep else setup
                who = "node 0" if m["busiest_node"] == 0 else f"node {m['busiest_node']}"
                ratios = "| — | —"
                if setup != torch_key and torch_key in by:
                    t = by[torch_key]
                    paired = [tr["node0_cpu_s"] / sr["busiest_cpu_s"]
                              for sr, tr in zip(runs[size][setup], runs[size][torch_key]) if sr["busiest_cpu_s"]]
                    span = f" ({min(paired):.1f}-{max(paired):.1f})" if len(paired) > 1 else ""
                    ratios = (f"| {_ratio(t['node0_cpu_s'], m['busiest_cpu_s'])}{span} "
                              f"| {_ratio(t['node0_cpu_s'], m['node0_cpu_s'])}")
                lines.append(
                    f"| {size} | {label} | {m['agents']} | {m['processes']:.0f} | {m['frames']:,.0f} "
                    f"| {m['node0_cpu_s']:.3f} | {m['busiest_cpu_s']:.3f} ({who}) | {m['total_cpu_s']:.3f} "
                    f"| {m['wall_s']:.2f} {ratios} |")
    return "\n".join(lines), med


def plot(med: dict[str, dict[str, dict]], path: Path) -> None:
    """Busiest node (solid) and node 0 (dashed) CPU seconds against K, per set-up (the
    skewed runs; lockstep left out), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    setups = [s for s in dict.fromkeys(s for by in med.values() for s in by) if not s.endswith(" lockstep")]
    for i, setup in enumerate(setups):
        sizes = [size for size in med if setup in med[size]]
        ks = [int(size.split("x")[0]) for size in sizes]
        colour = f"C{i}"
        ax.plot(ks, [med[s][setup]["busiest_cpu_s"] for s in sizes], "o-", color=colour, label=f"{setup}: busiest")
        if setup != "torch":
            ax.plot(ks, [med[s][setup]["node0_cpu_s"] for s in sizes], "x--", color=colour,
                    label=f"{setup}: node 0")
    ax.set_xscale("log", base=2)
    ks = sorted({int(size.split("x")[0]) for size in med})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("nodes K (8 ranks each)" if all(s.endswith("x8") for s in med) else "nodes K")
    ax.set_ylabel("CPU seconds over the start-up")
    ax.set_title("Wire-up: busiest node and node 0, arrivals skewed")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def wakeup_floor_us(script: str, messages: int = 1000, gap: float = 0.005) -> float:
    """CPU microseconds a do-nothing uvloop server (``script --echo-server``) spends per
    100-byte message echoed when messages come one at a time, ``gap`` apart (each one a
    wake-up: epoll, read, write, two context switches), over 8 connections: what any
    node pays per frame that arrives alone, before doing anything with it."""
    import socket

    child = subprocess.Popen([sys.executable, script, "--echo-server"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        cpu0 = process_cpu_seconds(child.pid)
        for i in range(messages):
            conns[i % 8].sendall(b"x" * 100)
            conns[i % 8].recv(1000)
            time.sleep(gap)
        return (process_cpu_seconds(child.pid) - cpu0) / messages * 1e6
    finally:
        child.kill()
        child.wait()


def crossover(runs: dict[str, dict[str, list[dict]]], repeat: int, skew: float) -> str:
    """The crossover table: per size, node 0's and the busiest node's CPU of tierrun
    flat, tiered and tree (torch's server alongside), in how many rounds tiered cost
    node 0 less than flat and the tree less than tiered, and what
    ``tierrun.launcher.tiering`` chooses at that size with no flag."""
    from tierrun.launcher import tiering

    def chosen(k: int) -> str:
        t = tiering.choose("parallel", k, None, None)
        return "tree" if t.fanout else "tiered" if t.tiered else "tierrun-flat"

    def wins(by: dict[str, list[dict]], a: str, b: str) -> str:
        if a not in by or b not in by:
            return "—"
        won = sum(ra["node0_cpu_s"] < rb["node0_cpu_s"] for ra, rb in zip(by[a], by[b]))
        return f"{won}/{min(len(by[a]), len(by[b]))}"

    med = medians(runs)
    setups = ("tierrun-flat", "tiered", "tree")
    lines = [
        f"Medians of {repeat} rounds, nodes spread over {skew:g} s; CPU seconds of node 0 / of the busiest "
        "node (node 0 or a relay). Chosen: what tierrun runs with no tiering flag (tiered from "
        f"{tiering.TIERED_FROM_NODES} nodes, a tree of fanout {tiering.AUTO_FANOUT} from {tiering.TREE_FROM_NODES}).",
        "",
        "| K x P | torch | tierrun-flat | tiered | tree | wins: tiered < flat | wins: tree < tiered | chosen |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size, by in med.items():
        k = int(size.split("x")[0])
        cells = [f"{by['torch']['node0_cpu_s']:.3f}" if "torch" in by else "—"]
        cells += [f"{by[s]['node0_cpu_s']:.3f} / {by[s]['busiest_cpu_s']:.3f}" if s in by else "—" for s in setups]
        cells += [wins(runs[size], "tiered", "tierrun-flat"), wins(runs[size], "tree", "tiered"), chosen(k)]
        lines.append(f"| {size} | {' | '.join(cells)} |")
    return "\n".join(lines)
