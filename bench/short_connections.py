"""Short connections at the store host: what one connection that reads one key and
closes costs it, torch's server against tierrun's store, in the same run, and the same
read as one datagram (a LOOKUP over UDP).

A tree's nodes each read where their parent takes links with one LOOKUP at the store
host (``tierrun.tier.lookup``: a datagram, or a short connection where UDP does not
pass), so in a tree the store host pays one per node; this measures that cost apart
from the rest of a start-up.

Set-ups (each server a process of its own, fresh for every round):
  torch          torch's TCPStore server (libuv); each client: connect, VALIDATE, PING,
                 GET the key, close (what a torch client does to read one key)
  tierrun        tierrun's store, the same client bytes
  tierrun-lookup tierrun's store with a job token; each client: one LOOKUP frame over
                 TCP (``read_over_link`` with no UDP: connect, the frame, the answer, close)
  tierrun-udp    the same LOOKUP as one datagram (``read_over_udp``: what a tree's nodes
                 send first), its answer a datagram; the store host reads its LOOKUP
                 port in paced batches while they come often (``TIERRUN_LINK_LOOKUP_PACE``, 20 ms)
  tierrun-udp-unpaced  the same, each datagram read as it comes (``..._PACE=0``)

--clients connections spread uniformly over --seconds (seeded), from threads of this
process; the key is set before. Reported: the server's CPU from /proc (schedstat) per
connection, medians of --repeat rounds, the set-ups alternating within a round.
Writes docs/bench/short_connections.json and its section of docs/benchmarks.md unless
--no-write.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import socket
import statistics
import struct
import threading
import time

from report import raise_fd_limit, write_json, write_section
from servers import ServerHandle, start_torch

from tierrun.protocol import Op
from tierrun.protocol.opcodes import VALIDATION_MAGIC
from tierrun.protocol.requests import encode_request
from tierrun.server import StoreProcess
from tierrun.tier.lookup import read_over_link, read_over_udp

KEY = b"/tree/parent/7"
VALUE = b"127.0.3.7:41234"
SETUPS = ("torch", "tierrun", "tierrun-lookup", "tierrun-udp", "tierrun-udp-unpaced")
UDP = ("tierrun-udp", "tierrun-udp-unpaced")
_u64 = struct.Struct("<Q")


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        out += chunk
    return out


def torch_read(port: int) -> bytes:
    """One torch-protocol connection: VALIDATE, PING, GET, close; the value."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(encode_request((Op.VALIDATE, VALIDATION_MAGIC)) + encode_request((Op.PING, 7))
                     + encode_request((Op.GET, KEY)))
        _recv_exactly(sock, 4)  # (PING's answer)
        (length,) = _u64.unpack(_recv_exactly(sock, 8))
        return _recv_exactly(sock, length)


def set_key(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(encode_request((Op.VALIDATE, VALIDATION_MAGIC)) + encode_request((Op.SET, KEY, VALUE))
                     + encode_request((Op.PING, 1)))
        _recv_exactly(sock, 4)


def start(setup: str, token: bytes) -> ServerHandle:
    if setup == "torch":
        return start_torch()
    env = {**os.environ, "TIERRUN_LINK_LOOKUP_PACE": "0"} if setup == "tierrun-udp-unpaced" else None
    sp = StoreProcess(host="127.0.0.1", port=0, token=token if setup == "tierrun-lookup" or setup in UDP else None,
                      env=env)
    sp.start()
    return ServerHandle(setup, sp.port, sp.pid, sp.stop)


def measure(setup: str, clients: int, seconds: float, seed: int) -> dict:
    token = secrets.token_hex(16).encode()
    server = start(setup, token)
    try:
        set_key(server.port)
        rng = random.Random(seed)
        starts = sorted(rng.uniform(0, seconds) for _ in range(clients))
        errors: list[BaseException] = []
        if setup == "tierrun-lookup":
            def read() -> bytes:
                return read_over_link(("127.0.0.1", server.port), token, KEY, 30, udp_wait=0)
        elif setup in UDP:
            def read() -> bytes:
                value = read_over_udp(("127.0.0.1", server.port), token, KEY, time.monotonic() + 30, None, 5.0)
                if value is None:
                    raise RuntimeError("the store host did not answer the LOOKUP datagram")
                return value
        else:
            def read() -> bytes:
                return torch_read(server.port)

        time.sleep(0.3)  # (the server idle, as a store host between two nodes' arrivals)
        cpu0 = server.cpu_seconds()
        t0 = time.monotonic() + 0.05

        def one(at: float) -> None:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            try:
                if read() != VALUE:
                    raise AssertionError("wrong value")
            except BaseException as e:  # (reported after the round)
                errors.append(e)

        threads = [threading.Thread(target=one, args=(at,)) for at in starts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = server.cpu_seconds() - cpu0
        if errors:
            raise RuntimeError(f"{setup}: {len(errors)} of {clients} reads failed, e.g. {errors[0]!r}")
    finally:
        server.stop()
    return {"server_cpu_s": cpu, "cpu_us_per_connection": cpu / clients * 1e6}


def main() -> None:
    raise_fd_limit()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[250, 1000])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    runs: dict[str, dict[str, list[dict]]] = {}
    for n in args.clients:
        for i in range(args.repeat):
            order = SETUPS if i % 2 == 0 else SETUPS[::-1]
            for setup in order:
                r = measure(setup, n, args.seconds, i)
                runs.setdefault(str(n), {}).setdefault(setup, []).append(r)
                print(f"{n} clients round {i + 1} {setup}: {r['cpu_us_per_connection']:.0f} us per connection",
                      flush=True)
    lines = [
        f"Medians of {args.repeat} rounds; connections spread uniformly over {args.seconds:g} s; server CPU "
        "per connection (connect, read one key, close), from /proc.",
        "",
        "| connections | torch: GET | tierrun: GET | tierrun: LOOKUP (TCP) | tierrun: LOOKUP (UDP) "
        "| LOOKUP (UDP), each read as it comes | UDP / torch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.clients:
        med = {s: statistics.median(r["cpu_us_per_connection"] for r in runs[str(n)][s]) for s in SETUPS}
        lines.append(f"| {n:,} | {med['torch']:.0f} us | {med['tierrun']:.0f} us | {med['tierrun-lookup']:.0f} us "
                     f"| {med['tierrun-udp']:.0f} us | {med['tierrun-udp-unpaced']:.0f} us "
                     f"| {med['tierrun-udp'] / med['torch']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.no_write:
        return
    write_json("short_connections", {"args": vars(args), "runs": runs})
    write_section("short_connections", table)


if __name__ == "__main__":
    main()
