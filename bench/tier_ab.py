"""The tier layer against an older tierrun and torch's server, in the same run: what
the store host and the busiest node proxy spend per request when requests trickle in
as they do at a job's start-up (one request per frame, the worst case for a link).

Every tierrun is run from its source tree as real processes through its command line
(``tierrun store`` and one ``tierrun proxy`` per simulated node, each on its own
loopback address), so any two commits with those commands compare; torch's server
takes the same clients directly (flat, as torchrun runs).

Workloads (raw torch-protocol clients, threads of this process):
  trickle   one proxy, --clients clients, each --ops ADDs to a shared counter with a
            random 0-20 ms pause before each: every request travels alone.
  start-up  --nodes proxies x 8 clients; node i starts at a random time within --skew
            seconds, its ranks 100-300 ms apart (as worker spawn is); each rank: ADD
            to a count, SET its address, WAIT for rank 0's, GET it, ADD to a second
            count, and the last one SETs a done key that every rank WAITs for.

CPU is read from /proc (schedstat, ns) before and after each workload, medians of
--rounds rounds, the set-ups alternating within a round. Writes its table to
docs/benchmarks.md and the raw runs to docs/bench/tier_ab.json. Usage:

  python bench/tier_ab.py                      # torch's server and this tree
  git worktree add --detach /tmp/base 0a077af  # and an older tierrun alongside
  python bench/tier_ab.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import write_json, write_section  # noqa: E402
from servers import process_cpu_seconds, start_torch  # noqa: E402

from tierrun.client import StoreClient  # noqa: E402


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(host: str, port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {host}:{port} within 30 s")


class TierrunJob:
    """A ``tierrun store`` on 127.0.1.1 and ``nodes`` proxies on 127.0.2.x, run from
    the source tree ``tree``."""

    def __init__(self, tree: Path, nodes: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree), TIERRUN_TOKEN=secrets.token_hex(16))
        self.tree = tree
        self.procs: list[subprocess.Popen] = []
        port = free_port("127.0.1.1")
        self.store = self._start(env, ["store", "--host", "127.0.1.1", "--port", str(port)],
                                 "127.0.1.1", port, "the store")
        self.proxies: list[tuple[subprocess.Popen, tuple[str, int]]] = []
        for i in range(nodes):
            host = f"127.0.2.{i + 1}"
            pport = free_port(host)
            proc = self._start(env, ["proxy", "--host", host, "--port", str(pport),
                                     "--upstream", f"127.0.1.1:{port}"], host, pport, f"proxy {i}")
            self.proxies.append((proc, (host, pport)))

    def _start(self, env: dict, argv: list[str], host: str, port: int, what: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "tierrun", *argv, "--log-level", "WARNING"],
                                env=env, cwd=self.tree, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        wait_listening(host, port, proc, what)
        return proc

    def cpu(self) -> tuple[float, list[float]]:
        return (process_cpu_seconds(self.store.pid),
                [process_cpu_seconds(p.pid) for p, _ in self.proxies])

    def close(self) -> dict:
        """Stop every process; the store's last statistics (it prints them as it stops)."""
        for p in self.procs:
            p.terminate()
        outs = [p.communicate(timeout=30)[0] for p in self.procs]
        stats = [line.split(" stats ", 1)[1] for line in outs[0].splitlines() if " stats {" in line]
        return json.loads(stats[-1]) if stats else {}


def trickle(addresses: list[tuple[str, int]], clients: int, ops: int, seed: int) -> int:
    key = f"/trickle/{seed}".encode()

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with StoreClient(addresses[0], timeout=120) as c:
            for _ in range(ops):
                time.sleep(rng.uniform(0, 0.02))
                c.add(key, 1)

    run_threads([threading.Thread(target=client, args=(i,)) for i in range(clients)])
    return clients * ops


def start_up(addresses: list[tuple[str, int]], skew: float, seed: int) -> int:
    """Each rank's start-up traffic; returns the number of requests sent."""
    rng = random.Random(seed)
    nodes, per = len(addresses), 8
    world = nodes * per
    ns = f"/start/{seed}/".encode()
    starts = [[t + rng.uniform(0.1, 0.3) * r for r in range(per)]
              for t in (rng.uniform(0, skew) for _ in range(nodes))]
    t0 = time.monotonic() + 0.2

    def rank(node: int, local: int) -> None:
        r = node * per + local
        time.sleep(max(0.0, t0 + starts[node][local] - time.monotonic()))
        with StoreClient(addresses[node], timeout=120) as c:
            c.add(ns + b"count", 1)
            c.set(ns + b"addr/%d" % r, b"127.0.0.1:%d" % (30000 + r))
            c.wait([ns + b"addr/0"])
            c.get(ns + b"addr/0")
            if c.add(ns + b"ready", 1) == world:
                c.set(ns + b"done", b"1")
            c.wait([ns + b"done"])

    run_threads([threading.Thread(target=rank, args=(n, lr))
                 for n in range(nodes) for lr in range(per)])
    return world * 7


def run_threads(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure_tierrun(tree: Path, workload: str, args: argparse.Namespace, seed: int) -> dict:
    job = TierrunJob(tree, 1 if workload == "trickle" else args.nodes)
    try:
        addresses = [a for _, a in job.proxies]
        time.sleep(0.5)  # the links are up and idle
        store0, proxies0 = job.cpu()
        t = time.monotonic()
        n = run(workload, addresses, args, seed)
        wall = time.monotonic() - t
        store1, proxies1 = job.cpu()
    finally:
        stats = job.close()
    busiest = max(b - a for a, b in zip(proxies0, proxies1))
    # (frames the store host read per request: how much the proxies merged, which the
    # pace of answers decides; per-request CPU follows it)
    frames = stats.get("link_batches", float("nan")) / n
    return {"store_us": (store1 - store0) / n * 1e6, "proxy_us": busiest / n * 1e6, "wall": wall,
            "frames_per_request": frames}


def measure_torch(workload: str, args: argparse.Namespace, seed: int) -> dict:
    server = start_torch()
    try:
        nodes = 1 if workload == "trickle" else args.nodes
        addresses = [("127.0.0.1", server.port)] * nodes
        before = server.cpu_seconds()
        t = time.monotonic()
        n = run(workload, addresses, args, seed)
        wall = time.monotonic() - t
        after = server.cpu_seconds()
    finally:
        server.stop()
    return {"store_us": (after - before) / n * 1e6, "proxy_us": 0.0, "wall": wall, "frames_per_request": 0.0}


def run(workload: str, addresses: list[tuple[str, int]], args: argparse.Namespace, seed: int) -> int:
    if workload == "trickle":
        return trickle(addresses, args.clients, args.ops, seed)
    return start_up(addresses, args.skew, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, action="append", default=[],
                   help="source tree of another tierrun to compare (repeatable)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--ops", type=int, default=100)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--workloads", default="trickle,start-up")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    this = "tierrun (this tree)"
    targets: dict[str, Path | None] = {"torch": None, this: HERE.parent}
    for tree in args.baseline:  # (named by commit and folder; printed and kept in the raw runs, not in the docs' table)
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        targets[f"tierrun {rev} ({tree.name})"] = tree.resolve()
    raw: dict[str, dict[str, list[dict]]] = {}
    lines = [f"Medians of {args.rounds} rounds, CPU microseconds per request (requests sent by the clients). "
             f"trickle: one proxy, {args.clients} clients x {args.ops} ADDs, a 0-20 ms pause before each; "
             f"start-up: {args.nodes} proxies x 8 ranks, nodes over {args.skew:g} s, ranks 0.1-0.3 s apart, "
             "7 requests each. torch: its server, the clients on it directly.", "",
             "| workload | set-up | store host us/request | busiest proxy us/request | wall s | torch / store host |",
             "|---|---|---:|---:|---:|---:|"]
    for workload in args.workloads.split(","):
        results: dict[str, list[dict]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets.items())
            if r % 2:
                order.reverse()
            for name, tree in order:
                m = measure_torch(workload, args, r) if tree is None else measure_tierrun(tree, workload, args, r)
                results[name].append(m)
        raw[workload] = results
        med = {name: {k: statistics.median(m[k] for m in runs) for k in runs[0]} for name, runs in results.items()}
        print(f"\n{workload}: medians of {args.rounds} rounds (us of CPU per request)")
        print(f"{'':36} {'store host':>11} {'busiest proxy':>14} {'wall s':>7} {'frames/request':>15}")
        for name, m in med.items():
            print(f"{name:36} {m['store_us']:11.1f} {m['proxy_us']:14.1f} {m['wall']:7.2f} "
                  f"{m['frames_per_request']:15.2f}")
            ratio = "—" if name == "torch" else f"{med['torch']['store_us'] / m['store_us']:.2f}x"
            proxy = "—" if name == "torch" else f"{m['proxy_us']:.1f}"
            if name in ("torch", this):
                lines.append(f"| {workload} | {name} | {m['store_us']:.1f} | {proxy} | {m['wall']:.2f} | {ratio} |")
        for name in targets:
            if name not in ("torch", this):
                new, old = med[this], med[name]
                print(f"this tree / {name}: store host {new['store_us'] / old['store_us']:.2f}, "
                      f"busiest proxy {new['proxy_us'] / old['proxy_us']:.2f}")
    if not args.no_write:
        write_json("tier_ab", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": raw})
        write_section("tier_ab", "\n".join(lines))


if __name__ == "__main__":
    main()
