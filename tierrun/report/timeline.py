"""The wire-up timeline: per node, when each start-up phase began and ended.

``--timeline FILE`` makes the agent that hosts the store write it when the job ends,
from every agent's record on the board; ``tierrun timeline FILE --png OUT`` draws it.
Times come from each node's clock (Unix seconds), so on a real cluster they are as
close as the nodes' clocks are (NTP: milliseconds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .board import NodeRecord

#: phase name -> colour, in start-up order
PHASES = {"agent start": "#9e9e9e", "rendezvous": "#1f77b4", "worker start": "#ff7f0e", "run": "#2ca02c"}


def build(run_id: str, records: list[NodeRecord]) -> dict:
    """``{"run_id", "t0", "nodes": [{"node", "addr", "attempts": [{"number", "group_rank",
    "state", "phases": [{"name", "start", "end"}]}]}]}``; times in seconds after ``t0``,
    the earliest agent start. Nodes are sorted by their first node rank. A node that a
    watcher saw die (``NodeRecord.lost``) while its record says its workers run ends
    there: its last attempt is LOST, its run ends when it was last heard from."""
    t0 = min((r.started for r in records), default=0.0)
    lost: dict[str, list[float]] = {}
    for n in (n for r in records for n in r.lost):
        lost.setdefault(n.addr, []).append(n.silent_since)
    nodes = []
    for r in records:
        attempts = []
        for a in r.attempts:
            state, ended = a.state, a.ended
            # (its death: the first since this attempt's rendezvous, not an earlier agent's there)
            died = min((t for t in lost.get(r.addr, ()) if a.rendezvous is not None and t >= a.rendezvous[0]),
                       default=None)
            if (died is not None and ended is None and state == "RUNNING" and a is r.attempts[-1]
                    and a.workers_started is not None):
                state, ended = "LOST", max(died, a.workers_started)
            spans: list[tuple[str, float, float | None]] = []
            if a.rendezvous is not None:
                if a.number == 0 and not attempts:
                    spans.append(("agent start", r.started, a.rendezvous[0]))
                spans.append(("rendezvous", *a.rendezvous))
                if a.workers_started is not None:
                    spans.append(("worker start", a.rendezvous[1], a.workers_started))
                    spans.append(("run", a.workers_started, ended))
            attempts.append({
                "number": a.number, "group_rank": a.group_rank, "state": state,
                "phases": [{"name": n, "start": round(s - t0, 4), "end": None if e is None else round(e - t0, 4)}
                           for n, s, e in spans],
            })
        nodes.append({"node": r.node, "addr": r.addr, "attempts": attempts})
    nodes.sort(key=lambda n: (n["attempts"][0]["group_rank"] if n["attempts"] else 1 << 30, n["node"]))
    return {"run_id": run_id, "t0": t0, "nodes": nodes}


def write(path: Path, timeline: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline, indent=1))


def render_png(timeline: dict, out: Path, start_up_only: bool = True) -> None:
    """One row per node, one bar per phase (the run phase drawn short when
    ``start_up_only``, so start-up stays readable). Needs matplotlib (``tierrun[plot]``)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("tierrun timeline: drawing needs matplotlib: pip install 'tierrun[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = timeline["nodes"]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.45 * len(nodes)))
    phases = [(row, p) for row, node in enumerate(nodes) for attempt in node["attempts"] for p in attempt["phases"]]
    # (the start-up's length, over every node: each short run bar is drawn alike)
    horizon = max((p["end"] if p["end"] is not None else p["start"] for _, p in phases if p["name"] != "run"),
                  default=1.0)
    for row, p in phases:
        end = p["end"] if p["end"] is not None else p["start"]
        if p["name"] == "run" and start_up_only:
            end = p["start"] + max(0.05 * max(horizon, 1.0), 0.1)
        ax.barh(row, end - p["start"], left=p["start"], color=PHASES[p["name"]], edgecolor="white")
    ax.set_yticks(range(len(nodes)))
    ax.set_yticklabels([f"{n['addr']} (rank {n['attempts'][0]['group_rank'] if n['attempts'] else '?'})" for n in nodes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first agent started")
    ax.set_title(f"tierrun wire-up timeline: {timeline['run_id']}")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASES.values()],
              labels=list(PHASES), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tierrun timeline",
                                description="Draw a wire-up timeline written by tierrun --timeline.")
    p.add_argument("file", type=Path)
    p.add_argument("--png", type=Path, default=None, help="output image (default: FILE with .png)")
    p.add_argument("--with-run", action="store_true", help="draw the run phase at full length")
    args = p.parse_args(argv)
    out = args.png or args.file.with_suffix(".png")
    try:
        data = json.loads(args.file.read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read {args.file} (written by tierrun --timeline FILE): {e}")
    render_png(data, out, start_up_only=not args.with_run)
    print(out)
    return 0
