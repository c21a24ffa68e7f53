"""A model of the wire-up to 100k ranks, from costs measured on this machine.

Pure computation (seconds, no process started): reads ``docs/bench/wireup*.json``,
prints the validation and the projection, writes them between the ``model`` markers of
docs/benchmarks.md and, with matplotlib, ``docs/bench/model.png``. ``--no-write``: print
only. K nodes x P ranks, fanout F, nodes arriving over a skew window S (1 s).

Counts at the store host (node 0), from the traffic ``wireup_sim.py`` replays:
  torch, flat       connections = K (P + 1); requests = frames = 11 K P + 8 K + 3
                    (a rank: VALIDATE, PING, ADD init/, NCCL's id (WAIT, WAIT, GET),
                    barrier ADD + WAIT, 3 CHECKs; an agent: VALIDATE, PING, ADD init/,
                    SET role, WAIT + GET its ranks, exit ADD + WAIT; node 0's agent
                    3 more). Exact: no constant fitted.
  tierrun, flat     requests = frames = 11 K P + a K (a: an agent's rendezvous, standing
                    WAIT, beats; read off the flat points)
  a link carrying a subtree of n nodes brings its upstream, over a start-up,
                    frames   f(n) = f1 n^alpha
                    requests r(n) = max(r1 n^beta, u n)
                    f1, r1: a tiered node's link (n = 1); alpha, beta: the tree's top
                    links (their subtrees' sizes as TreePlace lays them out), per regime
                    (skewed, lockstep); u = 4 requests no front-end can merge (a node's
                    two COMPARE_SETs and APPEND of its record, its ADD to the count of
                    nodes with its number of workers; its liveness is its link's: a will
                    at the first hop, nothing at node 0).
                    Under skew a subtree's requests trickle in; a link sends one batch
                    in flight at a time, so frames grow sub-linearly with n (alpha < 1).
  own               node 0's own front-end: o = 11 P + a requests, each a frame
  tiered            node 0: K - 1 links, frames (K-1) f(1) + o, requests (K-1) r(1) + o
  tree (F)          places 1..K-1: the first F-1 link to node 0, place q >= F-1 to the
                    relay in place (q-F+1) // F (``TreePlace``: a heap, so the top
                    subtrees are unequal, n_top,j); levels = front-ends stacked above
                    the deepest leaf, ~ ceil(log_F K); node 0: F - 1 links, K - F parent
                    lookups (a LOOKUP each: a datagram, 1 frame, 2 requests),
                    frames sum_j f(n_top,j) + (K-F) + o,
                    requests sum_j r(n_top,j) + 2 (K-F) + o.
  a relay           children subtrees n_1..n_F: F links, relays R = sum r(n_i) + o requests.

CPU of a node (costs per thing, fitted by non-negative least squares on relative errors):
  torch's server    cpu = c_torch x requests
  tierrun's store   cpu = c_link x links + c_lookup x lookups + c_frame x frames
                    + c_req x requests
                    (the data barely separate c_frame from c_req: frames and requests
                    grow together; the projection also gives the busiest node with all
                    of the store's cost on frames, and all of it on requests)
  a relay           cpu = c_link x F + c_relay x R (c_relay from the busiest relay measured)
  busiest = max(node 0, every relay)

Wall time (common start to every rank done, as ``wireup.py`` measures it):
  wall = w0 + S + spawn [S > 0] + levels x (H x (hold + grid)) + busiest cpu
  w0: the replay's fixed part (3 CHECKs a second apart, handshakes), read off torch's
  points; spawn = 0.3 s (the last rank's spawn delay); H = 5 held phases (init/,
  rendezvous count and arrivals, barrier, exit) x (10 ms hold + 10 ms grid) per level;
  the busiest node's CPU counted as if all of it were on the critical path (it is one
  thread: libuv's, or tierrun's event loop).

Validation: constants fitted on 64x8, checked on 256x8 (the current method: skew 1 s and
lockstep lines, ``docs/bench/wireup.json``); the costs alone also leave-one-out over every
current point (measured counts). The current method's 1024x8 run (``LARGE``: torch and
the tree, skewed) and the older-method points (``wireup_tierrun_agents.json``:
64x8-1024x8, lockstep only, node 0 only, an older store, no parent lookups) ran in other
states of the machine: they are compared in units of each run's wake-up floor (CPU x the
current run's floor / theirs, both stored in the JSON files), as extrapolation checks only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

from report import DOCS, write_section

CURRENT = "wireup.json"
OLDER = "wireup_tierrun_agents.json"
#: The current method's larger runs (torch and the tree, skewed): an extrapolation check only.
LARGE = "wireup-1024x8-3rounds.json"
SETUPS = ("torch", "tierrun-flat", "tiered", "tree", "tree-proxies")
#: Per rank and per torch agent, from the replay (docstring).
PER_RANK, TORCH_AGENT, TORCH_NODE0 = 11, 8, 3


@dataclass(frozen=True)
class Point:
    """The medians of one measured set-up at one size."""

    source: str
    k: int
    p: int
    setup: str
    regime: str  # "skew" or "lockstep"
    connections: float
    requests: float
    frames: float
    node0_cpu: float
    relay_cpu: float  # the most any relay spent (0: none measured)
    wall: float
    floor_us: float  # the run's wake-up floor (CPU per message arriving alone)

    @property
    def name(self) -> str:
        return f"{self.k}x{self.p}"


def load(path: Path) -> list[Point]:
    """A wireup JSON file's medians, one Point per size, set-up and regime."""
    data = json.loads(path.read_text())
    skew = float(data["args"].get("skew", 0.0))
    out = []
    for size, by in data["runs"].items():
        k, p = (int(x) for x in size.split("x"))
        for name, runs in by.items():
            setup, regime = (name.removesuffix(" lockstep"), "lockstep") if name.endswith(" lockstep") or not skew \
                else (name, "skew")
            if setup not in SETUPS:
                continue
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0] if isinstance(runs[0][key], (int, float))}
            out.append(Point(path.name, k, p, setup, regime, med["connections"], med["requests"], med["frames"],
                             med.get("node0_cpu_s", med.get("cpu_s", 0.0)), med.get("max_proxy_cpu_s", 0.0),
                             med["wall_s"], float(data.get("wakeup_floor_us", 0.0))))
    return out


# -- parameters -------------------------------------------------------------------------


@dataclass
class Counts:
    """How much traffic a node or a link carries (read off the 64x8 points)."""

    agent: float = 20.0  # a: a tierrun agent's requests (rendezvous, WAIT, beats)
    f1: float = 24.0  # frames of one node's link
    alpha: float = 0.4
    r1: float = 28.0  # requests of one node's link
    beta: float = 0.7
    unmergeable: float = 4.0  # u
    lookup_frames: int = 1  # (a LOOKUP: one frame read, no session)
    lookup_requests: int = 2

    def frames(self, n: float) -> float:
        return self.f1 * n ** self.alpha if n > 0 else 0.0

    def requests(self, n: float) -> float:
        return max(self.r1 * n ** self.beta, self.unmergeable * n) if n > 0 else 0.0

    def own(self, p: int) -> float:
        return PER_RANK * p + self.agent


@dataclass
class Costs:
    """CPU seconds per thing (per regime)."""

    torch_req: float = 10e-6
    link: float = 500e-6
    lookup: float = 200e-6  # c_lookup: a parent LOOKUP at node 0 (a datagram and its answer)
    frame: float = 20e-6
    req: float = 0.0
    relay: float = 100e-6  # c_relay: a relay's CPU per request relayed

    def store(self, links: float, lookups: float, frames: float, requests: float) -> float:
        return self.link * links + self.lookup * lookups + self.frame * frames + self.req * requests


@dataclass
class Timing:
    base: float = 3.0  # w0
    spawn: float = 0.3
    held_phases: int = 5
    hold: float = 0.01
    grid: float = 0.01

    def wall(self, skew: float, levels: int, busiest: float) -> float:
        return self.base + skew + (self.spawn if skew > 0 else 0.0) + \
            levels * self.held_phases * (self.hold + self.grid) + busiest


@dataclass
class Model:
    counts: Counts = field(default_factory=Counts)
    costs: Costs = field(default_factory=Costs)
    timing: Timing = field(default_factory=Timing)
    skew: float = 1.0
    lookups: bool = True  # False: the older tree (or a tree whose parents need no lookup)


@dataclass
class Prediction:
    requests: float
    frames: float
    links: float  # long links + lookups at node 0
    node0_cpu: float
    relay_cpu: float
    levels: int
    wall: float

    @property
    def busiest(self) -> float:
        return max(self.node0_cpu, self.relay_cpu)

    @property
    def who(self) -> str:
        return "node 0" if self.node0_cpu >= self.relay_cpu else "a relay"


# -- the tree ---------------------------------------------------------------------------


@dataclass
class Tree:
    """TreePlace's tree of K nodes with fanout F: the top subtrees' sizes, every relay's
    children's subtree sizes and its own, and the levels of front-ends above the deepest leaf."""

    top: list[int]
    relays: list[tuple[list[int], int]]
    levels: int


def tree(k: int, f: int) -> Tree:
    parent = [None] * k  # node 0 has none; nodes 1..F-1 link to node 0 (None too)
    for r in range(1, k):
        q = r - 1
        parent[r] = None if q < f - 1 else (q - f + 1) // f + 1
    size, depth = [1] * k, [0] * k
    for r in range(1, k):  # a parent's rank is lower than its children's
        depth[r] = 1 if parent[r] is None else depth[parent[r]] + 1
    children: dict[int, list[int]] = {}
    for r in range(k - 1, 0, -1):
        if parent[r] is not None:
            size[parent[r]] += size[r]
            children.setdefault(parent[r], []).append(r)
    top = [size[r] for r in range(1, k) if parent[r] is None]
    relays = [([size[c] for c in cs], size[r]) for r, cs in children.items()]
    return Tree(top, relays, max(depth[1:], default=0))


# -- the model --------------------------------------------------------------------------


def predict(m: Model, setup: str, k: int, p: int, fanout: int = 8) -> Prediction:
    """Node 0's and the busiest relay's counts and CPU, and the wall time, of one set-up."""
    c, cost = m.counts, m.costs
    relay, levels = 0.0, 0
    if setup == "torch":
        req = PER_RANK * k * p + TORCH_AGENT * k + TORCH_NODE0
        cpu = cost.torch_req * req
        return Prediction(req, req, 0, cpu, 0.0, 0, m.timing.wall(m.skew, 0, cpu))
    lookups = 0.0
    if setup == "tierrun-flat":
        req = PER_RANK * k * p + c.agent * k
        frames, links = req, 0.0
    elif setup == "tiered":
        links, levels = k - 1, 1
        frames = (k - 1) * c.frames(1) + c.own(p)
        req = (k - 1) * c.requests(1) + c.own(p)
    else:  # a tree
        t = tree(k, fanout)
        lookups = max(k - fanout, 0) if m.lookups else 0
        links, levels = len(t.top), t.levels
        frames = sum(c.frames(n) for n in t.top) + c.lookup_frames * lookups + c.own(p)
        req = sum(c.requests(n) for n in t.top) + c.lookup_requests * lookups + c.own(p)
        relay = max((cost.link * links_ + cost.relay * reqs
                     for links_, reqs in (relay_units(m, ch, p) for ch, _ in t.relays)), default=0.0)
    cpu = cost.store(links, lookups, frames, req)
    return Prediction(req, frames, links + lookups, cpu, relay, levels, m.timing.wall(m.skew, levels, max(cpu, relay)))


# -- fitting ----------------------------------------------------------------------------


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Least squares by the normal equations (a few columns), None if singular."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(n)]
    for i in range(n):
        piv = max(range(i, n), key=lambda r: abs(m[r][i]))
        if abs(m[piv][i]) < 1e-18:
            return None
        m[i], m[piv] = m[piv], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares on relative errors (each row divided by its y), by
    trying every subset of columns (there are at most 4)."""
    a = [[x / y for x in r] for r, y in zip(rows, ys)]
    ones = [1.0] * len(ys)
    n, best, best_err = len(rows[0]), [0.0] * len(rows[0]), math.inf
    for size in range(1, n + 1):
        for cols in combinations(range(n), size):
            x = _solve([[r[c] for c in cols] for r in a], ones)
            if x is None or min(x) < 0:
                continue
            full = [0.0] * n
            for c, v in zip(cols, x):
                full[c] = v
            err = sum((sum(f * v for f, v in zip(full, r)) - 1) ** 2 for r in a)
            if err < best_err:
                best, best_err = full, err
    return best


def store_row(pt: Point, fanout: int = 8) -> list[float]:
    """A measured tierrun point's (links, lookups, frames, requests) at node 0."""
    links = {"tierrun-flat": 0, "tiered": pt.k - 1}.get(pt.setup, fanout - 1)
    lookups = 0 if pt.setup in ("tierrun-flat", "tiered") else max(pt.k - fanout, 0)
    return [links, lookups, pt.frames, pt.requests]


#: How the store's cost is split between frames and requests: both fitted ("free"), or
#: all of it on one of them (the data barely tell them apart: the projection shows both).
SPLITS = {"free": (0, 1, 2, 3), "frames": (0, 1, 2), "requests": (0, 1, 3)}


def fit_costs(points: list[Point], split: str = "free") -> Costs:
    torch = [pt for pt in points if pt.setup == "torch"]
    store = [pt for pt in points if pt.setup != "torch"]
    c = Costs()
    if torch:
        c.torch_req = sum(pt.node0_cpu / pt.requests for pt in torch) / len(torch)
    if store:
        cols = SPLITS[split]
        x = nnls([[store_row(pt)[i] for i in cols] for pt in store], [pt.node0_cpu for pt in store])
        full = [0.0, 0.0, 0.0, 0.0]
        for i, v in zip(cols, x):
            full[i] = v
        c.link, c.lookup, c.frame, c.req = full
    return c


def _exponent(ns: list[list[int]], totals: list[float], unit: float) -> float:
    """The exponent x minimising the squared log error of sum(unit n^x for n in ns[i])
    against totals[i] (a grid over [0, 1.5], step 0.0005: a few thousand sums)."""
    def err(x: float) -> float:
        return sum(math.log(sum(unit * n ** x for n in sizes) / total) ** 2 for sizes, total in zip(ns, totals))
    return min((i * 0.0005 for i in range(3001)), key=err)


def fit_counts(points: list[Point], fanout: int = 8) -> Counts:
    """The traffic constants: a and f1, r1 (means over the sizes given), alpha and beta
    (the tree's top links' traffic, their subtrees' sizes as TreePlace lays them out)."""
    c = Counts()
    flat = [pt for pt in points if pt.setup == "tierrun-flat"]
    c.agent = statistics.mean((pt.requests - PER_RANK * pt.k * pt.p) / pt.k for pt in flat)
    tiered = [pt for pt in points if pt.setup == "tiered"]
    c.f1 = statistics.mean((pt.frames - c.own(pt.p)) / (pt.k - 1) for pt in tiered)
    c.r1 = statistics.mean((pt.requests - c.own(pt.p)) / (pt.k - 1) for pt in tiered)
    trees = [pt for pt in points if pt.setup == "tree"]
    tops = [tree(pt.k, fanout).top for pt in trees]
    lookups = [pt.k - fanout for pt in trees]
    c.alpha = _exponent(tops, [pt.frames - c.own(pt.p) - c.lookup_frames * lu for pt, lu in zip(trees, lookups)], c.f1)
    c.beta = _exponent(tops, [pt.requests - c.own(pt.p) - c.lookup_requests * lu for pt, lu in zip(trees, lookups)],
                       c.r1)
    return c


def relay_units(m: Model, children: list[int], p: int) -> tuple[float, float]:
    """A relay's links to its children and the requests it relays (its children's and
    its own node's)."""
    return len(children), sum(m.counts.requests(n) for n in children) + m.counts.own(p)


def fit_relay(m: Model, points: list[Point], fanout: int = 8) -> float:
    """c_relay: a relay's CPU per request relayed, over and above c_link per child link,
    from the busiest relay measured (mean over the tree points given)."""
    ratios = []
    for pt in points:
        if pt.setup in ("tree", "tree-proxies") and pt.relay_cpu > 0:
            links, reqs = max((relay_units(m, ch, pt.p) for ch, _ in tree(pt.k, fanout).relays), key=lambda u: u[1])
            ratios.append(max(pt.relay_cpu - m.costs.link * links, 0.0) / reqs)
    return statistics.mean(ratios) if ratios else 0.0


def fit_timing(points: list[Point], costs: Costs, skew: float) -> Timing:
    t = Timing()
    t.base = statistics.mean(pt.wall - skew - (t.spawn if skew > 0 else 0.0) - costs.torch_req * pt.requests
                             for pt in points if pt.setup == "torch")
    return t


def fit(points: list[Point], regime: str, sizes: tuple[int, ...] | None = None, split: str = "free") -> Model:
    """A regime's model, every constant from the points of the sizes given (K; all if None)."""
    pts = [pt for pt in points if pt.regime == regime and (sizes is None or pt.k in sizes)]
    skew = 1.0 if regime == "skew" else 0.0
    costs = fit_costs(pts, split)
    m = Model(fit_counts(pts), costs, fit_timing(pts, costs, skew), skew)
    m.costs.relay = fit_relay(m, pts)
    return m


def loo_costs(points: list[Point]) -> dict[tuple[str, str, str], float]:
    """The costs alone (measured counts), each current point left out of its regime's fit."""
    out = {}
    for pt in points:
        rest = [q for q in points if q.regime == pt.regime and q.setup != "torch" and q is not pt] if pt.setup != "torch" \
            else [q for q in points if q.regime == pt.regime and q.setup == "torch" and q is not pt]
        c = fit_costs(rest)
        pred = c.torch_req * pt.requests if pt.setup == "torch" else c.store(*store_row(pt))
        out[(pt.name, pt.setup, pt.regime)] = pred / pt.node0_cpu - 1
    return out


def best_fanout(models: list[Model], k: int, p: int, fanouts: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)) -> int:
    """The fanout whose busiest node is cheapest in the worst of the models given (the
    splits of the store's cost: the data do not tell which holds)."""
    return min((f for f in fanouts if f < k), key=lambda f: max(predict(m, "tree", k, p, f).busiest for m in models))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only: no docs section, no plot")
    args = ap.parse_args()
    from model_report import report

    text = report(DOCS / "bench", with_plot=not args.no_write)
    print(text)
    if not args.no_write:
        write_section("model", text)


if __name__ == "__main__":
    main()
