"""Rendezvous of K agents through etcd (``tierrun-etcd``) vs tierrun's store (``tierrun``),
in the same run.

K rendezvous handlers (as K agents would have), one thread each, spread over --procs
processes, min = max = K; the time from all calling ``next_rendezvous()`` to the last
one returning, every measurement in fresh processes.

  tierrun       ``ElasticRendezvousHandler`` as in ``launch.py``: handler 0 hosts the
                store and every handler is connected before the start, as agents are.
  tierrun-etcd  ``EtcdRendezvousHandler`` on a real etcd (Debian's etcd-server, one
                member, on loopback, a fresh job id per run). Its time includes what
                the design adds: each agent's lease, and the rank-0 node starting the
                round's store and every other node connecting to it.

Also the server side's CPU seconds (tierrun: the store process; etcd: the etcd
process) and its request count (tierrun: store operations; etcd: gRPC messages
received, from its /metrics). Medians of --repeat runs; ratio etcd / tierrun.
Writes docs/bench/etcd_rendezvous.json and a table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from launch import tierrun_handlers
from report import raise_fd_limit, rendezvous_all, write_json, write_section
from servers import process_cpu_seconds

BACKENDS = ("tierrun", "tierrun-etcd")


class Etcd:
    """One etcd member on loopback in a temporary directory; ``requests()`` reads its
    gRPC message counter."""

    def __init__(self, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-etcd-"))
        self.url = f"http://127.0.0.1:{port}"
        peer = f"http://127.0.0.1:{port + 1}"
        binary = shutil.which("etcd")
        if binary is None:
            raise SystemExit("etcd is not installed: run `make etcd` (Debian's etcd-server)")
        self.proc = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", str(self.dir / "data"), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"bench={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"etcd did not start on {self.url}")
                time.sleep(0.1)

    def requests(self) -> int:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        return int(sum(float(v) for v in re.findall(r"^grpc_server_msg_received_total\{.*\} (\S+)$", text, re.M)))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def handlers_for(backend: str, indices: list[int], k: int, endpoint: str, run_id: str) -> tuple[list, int]:
    """The handlers of this process; for ``tierrun``, handler 0 hosts the store (its pid
    is returned; 0 otherwise)."""
    if backend == "tierrun":
        return tierrun_handlers(indices, k, int(endpoint.rsplit(":", 1)[1]))
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from tierrun.rendezvous.etcd import create_handler
    from tierrun.settings import Settings

    return [create_handler(RendezvousParameters(backend, endpoint, run_id, k, k, local_addr="127.0.0.1",
                                                progress="off", join_timeout=3600), Settings.from_env())
            for _ in indices], 0


def child(backend: str, k: int, procs: int, index: int, endpoint: str, run_id: str) -> None:
    """Handlers index, index + procs, ... of K, one thread each; told when to start on stdin."""
    raise_fd_limit()
    handlers, pid = handlers_for(backend, list(range(index, k, procs)), k, endpoint, run_id)
    if pid:
        endpoint = f"127.0.0.1:{handlers[0].job.port}"
    print(f"ready {endpoint} {pid}", flush=True)
    sys.stdin.readline()
    print(json.dumps({"ranks": rendezvous_all(handlers)}), flush=True)
    if pid:  # asked once every process is done: what the store counted
        sys.stdin.readline()
        print(json.dumps({"ops": handlers[0].job.root.stats()["operations"]}), flush=True)
    os._exit(0)  # the handlers' threads (leases, watches) end with us


def time_rendezvous(backend: str, k: int, procs: int, etcd: Etcd, run_id: str) -> dict:
    endpoint = etcd.url.removeprefix("http://") if backend == "tierrun-etcd" else "127.0.0.1:0"

    def spawn(index: int, where: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--child", backend, str(k), str(procs), str(index),
                                 where, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    first = spawn(0, endpoint)
    _, endpoint, pid = first.stdout.readline().split()
    children = [first] + [spawn(i, endpoint) for i in range(1, procs)]
    for c in children[1:]:
        c.stdout.readline()
    server_pid = int(pid) or etcd.proc.pid
    cpu0 = process_cpu_seconds(server_pid)
    requests0 = etcd.requests() if backend == "tierrun-etcd" else 0
    t0 = time.perf_counter()
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    try:
        results = [json.loads(c.stdout.readline()) for c in children]
        wall = time.perf_counter() - t0
        cpu = process_cpu_seconds(server_pid) - cpu0
        if backend == "tierrun":
            first.stdin.write("stats\n")
            first.stdin.flush()
            requests = json.loads(first.stdout.readline())["ops"]
        else:
            requests = etcd.requests() - requests0
    finally:
        for c in children:
            c.kill()
            c.wait()
    ranks = sorted(r for res in results for r in res["ranks"])
    assert ranks == list(range(k)), f"{backend} K={k}: ranks are not a permutation of 0..K-1"
    return {"wall_s": wall, "server_cpu_s": cpu, "requests": requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, nargs="+", default=[16, 64, 256], help="K values")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--procs", type=int, default=4, help="processes the K handlers are spread over")
    p.add_argument("--etcd-port", type=int, default=23791)
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        backend, k, procs, index, endpoint, run_id = args.child
        child(backend, int(k), int(procs), int(index), endpoint, run_id)
    raise_fd_limit()

    etcd = Etcd(args.etcd_port)
    runs: dict[int, dict[str, list[dict]]] = {k: {b: [] for b in BACKENDS} for k in args.agents}
    try:
        for k in args.agents:
            for i in range(args.repeat):  # interleaved: machine noise hits both alike
                for backend in BACKENDS:
                    runs[k][backend].append(time_rendezvous(backend, k, args.procs, etcd, f"bench-{k}-{i}"))
                    print(f"K={k} run {i + 1} {backend}: {runs[k][backend][-1]}", flush=True)
    finally:
        etcd.stop()

    med = statistics.median
    lines = [f"Rendezvous of K agents (handler level, min = max = K, spread over {args.procs} processes), "
             f"medians of {args.repeat} runs. etcd: one member on loopback; its time includes the leases "
             "and starting the round's store on the rank-0 node. Requests: tierrun's store operations; "
             "etcd's gRPC messages received.", "",
             "| K | tierrun wall s | tierrun-etcd wall s | etcd / tierrun | tierrun store CPU s | etcd CPU s "
             "| tierrun store ops | etcd requests |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in args.agents:
        t, e = (med(x["wall_s"] for x in runs[k][b]) for b in BACKENDS)
        tc, ec = (med(x["server_cpu_s"] for x in runs[k][b]) for b in BACKENDS)
        tr, er = (med(x["requests"] for x in runs[k][b]) for b in BACKENDS)
        lines.append(f"| {k} | {t:.2f} | {e:.2f} | {e / t:.1f} | {tc:.2f} | {ec:.2f} | {tr:,.0f} | {er:,.0f} |")
    table = "\n".join(lines)
    print(table)
    write_json("etcd_rendezvous", {"args": vars(args), "runs": {str(k): v for k, v in runs.items()}})
    write_section("etcd_rendezvous", table)


if __name__ == "__main__":
    main()
