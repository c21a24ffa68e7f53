"""Store benchmark: torch's TCPStore server vs tierrun's, same clients, same run.

Workloads (each server in its own process, fresh for every repetition):
  rtt-1    one torch client doing ADD round trips
  rtt-64   64 torch clients (threads) doing ADD round trips at once
  storm    2,000 clients connect (VALIDATE+PING), ADD a counter, WAIT for a release
           key; one more client releases them when the counter reaches 2,000
Reported: ops/s or wall time, server CPU seconds (and per operation), server peak RSS;
medians of --repeat runs; ratios tierrun/torch. Writes docs/bench/store_ops.json and
the table in docs/benchmarks.md (between the store_ops markers).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from report import raise_fd_limit, write_json, write_section
from servers import SERVERS, ServerHandle

_pack_u64 = struct.Struct("<Q").pack


def rtt(server: ServerHandle, clients: int, seconds: float) -> dict:
    stores = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
              for _ in range(clients)]
    counts = [0] * clients
    stop = threading.Event()
    go = threading.Barrier(clients + 1)

    def loop(i: int) -> None:
        s = stores[i]
        go.wait()
        n = 0
        while not stop.is_set():
            s.add(f"rtt/{i % 8}", 1)
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    cpu0 = server.cpu_seconds()
    go.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = server.cpu_seconds() - cpu0
    ops = sum(counts)
    return {"ops_per_s": ops / wall, "server_cpu_s": cpu, "cpu_us_per_op": 1e6 * cpu / max(ops, 1)}


def _req(op: int, *parts: bytes) -> bytes:
    return bytes([op]) + b"".join(parts)


def _vec(b: bytes) -> bytes:
    return _pack_u64(len(b)) + b


HANDSHAKE = _req(0, struct.pack("<I", 0x3C85F7CE)) + _req(13, struct.pack("<I", 1))
ADD = _req(4, _vec(b"/storm/count"), struct.pack("<q", 1))
WAIT = _req(6, _pack_u64(1), _vec(b"/storm/release"))


async def storm_async(port: int, n: int) -> float:
    """What torch's client sends when it connects and joins: the same bytes."""
    release = asyncio.Event()
    joined = 0

    async def one() -> None:
        nonlocal joined
        for attempt in range(50):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.05 * (attempt + 1))
        writer.write(HANDSHAKE)
        await reader.readexactly(4)
        writer.write(ADD)
        count = struct.unpack("<q", await reader.readexactly(8))[0]
        joined += 1
        if count == n:
            release.set()
        writer.write(WAIT)
        await reader.readexactly(1)
        writer.close()

    async def releaser() -> None:
        await release.wait()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HANDSHAKE)
        await reader.readexactly(4)
        writer.write(_req(1, _vec(b"/storm/release"), _vec(b"go")))
        await writer.drain()
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(releaser(), *(one() for _ in range(n)))
    return time.perf_counter() - t0


def storm(server: ServerHandle, n: int) -> dict:
    cpu0 = server.cpu_seconds()
    wall = asyncio.run(storm_async(server.port, n))
    cpu = server.cpu_seconds() - cpu0
    return {"wall_s": wall, "server_cpu_s": cpu, "cpu_us_per_op": 1e6 * cpu / (3 * n)}


def run_once(name: str, args) -> dict:
    out = {}
    for label, fn in (
        ("rtt-1", lambda s: rtt(s, 1, args.seconds)),
        ("rtt-64", lambda s: rtt(s, 64, args.seconds)),
        ("storm", lambda s: storm(s, args.storm)),
    ):
        server = SERVERS[name]()
        try:
            out[label] = fn(server)
            out[label]["peak_rss_mb"] = server.peak_rss_mb()
        finally:
            server.stop()
    return out


def median_of(runs: list[dict], workload: str, metric: str) -> float:
    return statistics.median(r[workload][metric] for r in runs)


def main() -> None:
    raise_fd_limit()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--storm", type=int, default=2000)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"torch": [], "tierrun": [], "tierrun-w2": []}
    for i in range(args.repeat):  # interleave so that machine noise hits both alike
        for name in runs:
            runs[name].append(run_once(name, args))
            print(f"run {i + 1}/{args.repeat} {name}: done", flush=True)
    rows = []
    for workload, metric, better in (
        ("rtt-1", "ops_per_s", "higher"), ("rtt-64", "ops_per_s", "higher"), ("storm", "wall_s", "lower"),
        ("rtt-1", "cpu_us_per_op", "lower"), ("rtt-64", "cpu_us_per_op", "lower"),
        ("storm", "cpu_us_per_op", "lower"), ("storm", "peak_rss_mb", "lower"),
    ):
        t = median_of(runs["torch"], workload, metric)
        r = median_of(runs["tierrun"], workload, metric)
        w = median_of(runs["tierrun-w2"], workload, metric)
        rows.append((workload, metric, t, r, w, r / t if t else float("nan"), w / t if t else float("nan"), better))
    lines = [
        f"Medians of {args.repeat} runs; {args.seconds:.0f} s per round-trip run, storm of {args.storm} clients. "
        "`--workers 2`: two front-end processes and the core's process, CPU and RSS summed over the three.",
        "",
        "| workload | metric | torch (libuv) | tierrun | tierrun --workers 2 | tierrun / torch | --workers 2 / torch | better |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ] + [f"| {w} | {m} | {t:,.1f} | {r:,.1f} | {x:,.1f} | {q:.2f} | {qx:.2f} | {b} |"
         for w, m, t, r, x, q, qx, b in rows]
    table = "\n".join(lines)
    print(table)
    write_json("store_ops", {"args": vars(args), "runs": runs})
    write_section("store_ops", table)


if __name__ == "__main__":
    main()
