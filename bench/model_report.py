"""The report of ``bench/model.py``: the validation tables, the projection, what the model
cannot capture, the plot."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from model import CURRENT, LARGE, OLDER, SPLITS, Model, Point, best_fanout, fit, load, loo_costs, predict

#: Projected sizes (nodes; 8 ranks each) and the fanouts tried for the best one.
SIZES = (64, 256, 1024, 4096, 12500)
P = 8

CAVEATS = [
    "**Torch's server at 100k connections.** The model prices a connection as its requests; "
    "it does not know the limits a real 100,000-client server meets: `ulimit -n` (this machine's hard limit "
    "is 20,000 open files: torch's server would need ~112,500 descriptors at 12,500x8), the listen backlog "
    "(`somaxconn` is 4,096 here: 112,500 connects within a 1 s window can overflow the accept queue, and a "
    "dropped SYN is retried after 1 s, then after twice as long), and the memory of as many connections "
    "(not measured). Its wall time there is a lower bound.",
    "**One thread.** The busiest node's CPU is counted as if all of it lay on the critical path (libuv's "
    "single loop, tierrun's single event loop): right when a phase's requests queue up behind each other, "
    "pessimistic when they trickle in over the skew window. Whether it is a few seconds of queueing or "
    "none depends on how the requests bunch, which the model does not see.",
    "**Traffic growth of a link (`f1 n^alpha`, `max(r1 n^beta, u n)`)** is an empirical power law "
    "through the top links' sizes of the measured points (up to 1,024 nodes, F = 8); at n = 1,786 "
    "(12,500 nodes, F = 8) it is outside its data. The floor `u n` (requests no front-end merges) is what keeps it honest there, and it is "
    "an estimate (u = 4: a node's two COMPARE_SETs and APPEND of its record, its ADD to a count).",
    "**Parent lookups.** Every node with a parent reads its parent's address with a LOOKUP at node 0 (a "
    "datagram each, or a short connection where UDP does not pass): K - F of them at node 0, each at a fitted "
    "cost of its own (c_lookup; measured apart by `bench/short_connections.py`), so in the model the tree's "
    "node 0 stays linear in K and the lookups dominate it at 12,500 nodes. The "
    "*no lookups* line shows the same tree if a node learned its parent's address without node 0.",
    "**Wall time on one machine.** Every process shares 2 cores here: the tree's measured wall grows "
    "with its proxy processes' CPU (128 at 1024x8), which the model (a cluster: a node per machine) "
    "leaves out (-8% at 256x8, -48% at 1024x8). No network latency, no NIC, no real spawn or imports in the replay, so "
    "neither in the model.",
    "**Relays** are priced per request relayed (one constant, from the busiest relay measured at "
    "64x8-1024x8, up to 128 relays); at 12,500 nodes a top relay relays 1,786 nodes' requests, untested.",
]


def _err(model: float, measured: float) -> str:
    return f"{model / measured - 1:+.0%}" if measured else "—"


def validation(points: list[Point]) -> tuple[list[str], list[float]]:
    """Fit on the smallest size, check on the others, per regime; the costs' leave-one-out alongside."""
    loo = loo_costs(points)
    lines = [
        "| K x P | set-up | regime | role | node-0 requests meas / model | node-0 frames meas / model "
        "| node-0 CPU s meas / model | error | costs only, leave-one-out | busiest relay CPU s meas / model "
        "| error | wall s meas / model | error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    checks: list[float] = []
    for regime in ("skew", "lockstep"):
        pts = [pt for pt in points if pt.regime == regime]
        small = min(pt.k for pt in pts)
        m = fit(points, regime, (small,))
        for pt in pts:
            pr = predict(m, pt.setup, pt.k, pt.p)
            role = "fit" if pt.k == small else "check"
            if role == "check":
                checks.append(pr.node0_cpu / pt.node0_cpu - 1)
            relay = f"{pt.relay_cpu:.3f} / {pr.relay_cpu:.3f} | {_err(pr.relay_cpu, pt.relay_cpu)}" \
                if pt.relay_cpu else "— | —"
            lines.append(
                f"| {pt.name} | {pt.setup} | {regime} | {role} | {pt.requests:,.0f} / {pr.requests:,.0f} "
                f"| {pt.frames:,.0f} / {pr.frames:,.0f} | {pt.node0_cpu:.3f} / {pr.node0_cpu:.3f} "
                f"| {_err(pr.node0_cpu, pt.node0_cpu)} | {loo[(pt.name, pt.setup, regime)]:+.0%} | {relay} "
                f"| {pt.wall:.2f} / {pr.wall:.2f} | {_err(pr.wall, pt.wall)} |")
    return lines, checks


def _floor_scale(points: list[Point], current: list[Point]) -> tuple[float, float, float]:
    """(the points' wake-up floor, the current run's, and the factor that puts the
    points' CPU in the current run's units)."""
    floor_now = statistics.median(pt.floor_us for pt in current)
    floor_then = statistics.median(pt.floor_us for pt in points)
    return floor_then, floor_now, floor_now / floor_then


def large(points: list[Point], current: list[Point]) -> list[str]:
    """The current method's larger runs (a subset of the set-ups, not fitted on) against
    the model fitted on every current point of their regime, in units of each run's
    wake-up floor (as the older points): an extrapolation check."""
    floor_then, floor_now, scale = _floor_scale(points, current)
    models = {regime: fit(current, regime) for regime in {pt.regime for pt in points}}
    lines = [
        f"Extrapolation check (`{LARGE}`: current method, skewed, torch and the tree only; not fitted on; "
        f"a wake-up cost {floor_then:.0f} us in it, {floor_now:.0f} us in the current run: its CPU is shown "
        f"x {scale:.2f}). Model: the skewed constants fitted on every `wireup.json` point.",
        "",
        "| K x P | set-up | node-0 requests meas / model | node-0 frames meas / model "
        "| node-0 CPU s (scaled) meas / model | error | busiest relay CPU s (scaled) meas / model | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pt in points:
        pr = predict(models[pt.regime], pt.setup, pt.k, pt.p)
        cpu, relay_cpu = pt.node0_cpu * scale, pt.relay_cpu * scale
        relay = f"{relay_cpu:.3f} / {pr.relay_cpu:.3f} | {_err(pr.relay_cpu, relay_cpu)}" \
            if pt.relay_cpu else "— | —"
        lines.append(f"| {pt.name} | {pt.setup} | {pt.requests:,.0f} / {pr.requests:,.0f} "
                     f"| {pt.frames:,.0f} / {pr.frames:,.0f} | {cpu:.3f} / {pr.node0_cpu:.3f} "
                     f"| {_err(pr.node0_cpu, cpu)} | {relay} |")
    return lines


def older(points: list[Point], current: list[Point]) -> tuple[list[str], float]:
    """The older-method points against the lockstep model fitted on every current point, in
    units of each run's wake-up floor; the tree as it was (no parent lookups)."""
    m = fit(current, "lockstep")
    floor_then, floor_now, scale = _floor_scale(points, current)
    lines = [
        f"Older method (`{OLDER}`: lockstep, node 0 only, the store before this month's changes, no parent "
        f"lookups in the tree; a wake-up cost {floor_then:.0f} us then, {floor_now:.0f} us in the current run: "
        f"its CPU is shown x {scale:.2f}). Model: lockstep constants fitted on every current point.",
        "",
        "| K x P | set-up | node-0 requests meas / model | error | node-0 frames meas / model | error "
        "| node-0 CPU s (scaled) meas / model | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    m_old = replace(m, lookups=False)
    for pt in points:
        pr = predict(m_old, pt.setup, pt.k, pt.p)
        cpu = pt.node0_cpu * scale
        lines.append(f"| {pt.name} | {pt.setup} | {pt.requests:,.0f} / {pr.requests:,.0f} "
                     f"| {_err(pr.requests, pt.requests)} | {pt.frames:,.0f} / {pr.frames:,.0f} "
                     f"| {_err(pr.frames, pt.frames)} | {cpu:.3f} / {pr.node0_cpu:.3f} | {_err(pr.node0_cpu, cpu)} |")
    return lines, scale


def projection(models: dict[str, Model]) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """Torch flat, tiered, the tree (F = 8 and the best F, with and without parent
    lookups); the busiest CPU under each split of the store's cost (frames / requests)."""
    m = models["free"]
    lines = [
        "| K x P (ranks) | set-up | levels | node-0 CPU s | busiest CPU s (who) | range over cost splits "
        "| torch / busiest | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    series: dict[str, list[tuple[int, float]]] = {}
    for k in SIZES:
        torch = predict(m, "torch", k, P).busiest
        bf = best_fanout(list(models.values()), k, P)
        bf_nl = best_fanout([replace(mm, lookups=False) for mm in models.values()], k, P)
        rows = [("torch (flat)", "torch", 8, True), ("tierrun tiered", "tiered", 8, True),
                ("tree F=8", "tree", 8, True), (f"tree best F={bf}", "tree", bf, True),
                ("tree F=8, no lookups", "tree", 8, False), (f"tree best F={bf_nl}, no lookups", "tree", bf_nl, False)]
        for label, setup, f, lookups in rows:
            pr = predict(replace(m, lookups=lookups), setup, k, P, f)
            span = [predict(replace(mm, lookups=lookups), setup, k, P, f).busiest for mm in models.values()]
            key = label if "best" not in label else "tree best F" + (", no lookups" if not lookups else "")
            series.setdefault(key, []).append((k * P, pr.busiest))
            lines.append(f"| {k:,}x{P} ({k * P:,}) | {label} | {pr.levels} | {pr.node0_cpu:.3f} "
                         f"| {pr.busiest:.3f} ({pr.who if setup == 'tree' else 'node 0'}) "
                         f"| {min(span):.3f}-{max(span):.3f} | {torch / pr.busiest:.1f}x | {pr.wall:.2f} |")
    return lines, series


def constants(m: Model, label: str) -> str:
    c, k, t = m.counts, m.costs, m.timing
    return (f"{label}: c_torch = {k.torch_req * 1e6:.1f} us/request; c_link = {k.link * 1e6:.0f} us, "
            f"c_lookup = {k.lookup * 1e6:.0f} us, c_frame = {k.frame * 1e6:.1f} us, c_req = {k.req * 1e6:.1f} us, c_relay = {k.relay * 1e6:.0f} us; "
            f"a = {c.agent:.1f}, f1 = {c.f1:.1f}, alpha = {c.alpha:.3f}, r1 = {c.r1:.1f}, beta = {c.beta:.3f}, "
            f"u = {c.unmergeable:g}; w0 = {t.base:.2f} s")


def plot(current: list[Point], m: Model, series: dict[str, list[tuple[int, float]]], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, pts) in enumerate(series.items()):
        ax.plot([x for x, _ in pts], [y for _, y in pts], "-", color=f"C{i}", label=f"model: {label}")
    for i, setup in enumerate(("torch", "tiered", "tree")):
        meas = [pt for pt in current if pt.setup == setup and pt.regime == "skew"]
        ax.plot([pt.k * pt.p for pt in meas], [max(pt.node0_cpu, pt.relay_cpu) for pt in meas], "o",
                color=f"C{i}", label=f"measured: {setup} (skew 1 s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ranks (8 per node)")
    ax.set_ylabel("busiest node's CPU seconds over the start-up")
    ax.set_title("Wire-up model: busiest node, nodes arriving over 1 s")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def falling_costs(current: list, checks: list[float], measured: list | None = None) -> str:
    """The caveat of constant costs, with this run's figures: torch's server's CPU per
    request at the smallest and largest size (skewed), the range of the checks, and how
    far 12,500 nodes lie beyond the fitted points and every ``measured`` one."""
    torch = sorted((pt.k, pt.p, pt.node0_cpu / pt.requests) for pt in current
                   if pt.setup == "torch" and pt.regime == "skew")
    (k0, p0, small), (k1, p1, large) = torch[0], torch[-1]
    top, fitted = SIZES[-1], max(pt.k for pt in current)
    largest = max([*current, *(measured or [])], key=lambda pt: pt.k)
    return ("**Per-thing costs are constants; measured, they fall with load.** A busier server gets more "
            f"per wake-up (torch: {small * 1e6:.1f} us a request at {k0}x{p0}, {large * 1e6:.1f} at {k1}x{p1}, "
            f"skewed), so constants from small points overestimate large ones: the fit-on-{k0}x{p0} check is "
            f"{min(checks):+.0%} to {max(checks):+.0%} at {_sizes(current, k0)}. The extrapolation to {top:,} nodes is "
            f"{top / fitted:.0f}x beyond the largest point fitted on ({fitted}x{p1}) and {top / largest.k:.0f}x "
            f"beyond the largest measured point ({largest.name}, checked, not fitted).")


def _sizes(points: list[Point], but: int | None = None) -> str:
    """The sizes among ``points`` (but ``but`` nodes), as "64x8, 256x8"."""
    return ", ".join(f"{k}x{p}" for k, p in sorted({(pt.k, pt.p) for pt in points if pt.k != but}))


def report(bench: Path, with_plot: bool = True) -> str:
    """The section's markdown (and the plot, if asked and matplotlib is there)."""
    current = load(bench / CURRENT)
    old = load(bench / OLDER)
    val, checks = validation(current)
    old_lines, _ = older(old, current)
    large_points = load(bench / LARGE) if (bench / LARGE).exists() else []
    large_lines = large(large_points, current) if large_points else []
    skew = fit(current, "skew")
    proj, series = projection({split: fit(current, "skew", None, split) for split in SPLITS})
    loo = [abs(e) for e in loo_costs(current).values()]
    plotted = with_plot and plot(current, skew, series, bench / "model.png")
    smallest_k = min(pt.k for pt in current)
    smallest = _sizes([pt for pt in current if pt.k == smallest_k])
    out = [
        "Pure computation from the stored runs (`cd bench && python model.py`, formulas in its docstring). "
        f"Points: `wireup.json` (current method: {_sizes(current)}, nodes over 1 s and lockstep lines, busiest "
        f"node measured), `{LARGE}` (current method, 1024x8, torch and the tree, skewed, another run: checked, not fitted) and "
        f"`{OLDER}` (older method: 64x8-1024x8, lockstep, node 0 only). Not used: "
        "`wireup-512x8-7rounds*.json` (older method, torch's agents' traffic through a tree only tierrun's "
        "agents can run).",
        "",
        f"**Validation.** Every constant fitted on the {smallest} points of a regime, then checked on "
        f"{_sizes(current, smallest_k)}: "
        f"node-0 CPU error on the checks {', '.join(f'{e:+.0%}' for e in checks)} (median |error| "
        f"{statistics.median(abs(e) for e in checks):.0%}, worst {max(abs(e) for e in checks):.0%}). The costs "
        f"alone, leave-one-out on measured counts: median |error| {statistics.median(loo):.0%}, worst "
        f"{max(loo):.0%}.",
        "",
        *val,
        "",
        *([*large_lines, ""] if large_lines else []),
        *old_lines,
        "",
        "**Constants** used for the projection (every current point of the regime):",
        "",
        "- " + constants(skew, "skewed (1 s)"),
        "- " + constants(fit(current, "lockstep"), "lockstep"),
        "",
        "**Projection**, nodes arriving over 1 s, 8 ranks a node, skewed constants (wall: the replay's "
        "start-up, 3 heartbeat CHECKs included, as measured; busiest: node 0 or the busiest relay; range: the "
        "busiest node's CPU with the store's cost fitted on frames and requests, on frames only, on requests "
        "only; best F: the fanout of 2-128 whose worst case over the splits is least; *no lookups*: the same tree if nodes learned their parent's address without a link to node 0):",
        "",
        *proj,
        "",
        "**What the model cannot be trusted for:**",
        "",
        f"- {falling_costs(current, checks, [*large_points, *old])}",
        *(f"- {c}" for c in CAVEATS),
    ]
    if plotted:
        out += ["", "![model: busiest node against ranks](bench/model.png)"]
    return "\n".join(out)
