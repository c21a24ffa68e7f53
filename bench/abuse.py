"""Abuse: greedy and hostile clients against the store host, tierrun vs torch's server.

Each attack runs against a fresh server (in its own process) while a well-behaved torch
client does ADD round trips; measured: the store host's peak RSS (VmHWM) and the
well-behaved client's round-trip times (median, max; failed requests counted), and
whether the adversary was closed. Servers: torch's own (libuv, torch's default: the
baseline), ``tierrun store`` flat, and tiered (``tierrun store`` and a ``tierrun
proxy`` linked to it: the adversary and the well-behaved client use the proxy, as a
node's clients do; the proxy's peak RSS is reported too). Every server runs with its
defaults (tierrun: 1 GiB and 1,048,576 keys of budget, 136 MiB for one answer).

Attacks:
  none        nothing: the baseline of the round trip
  multi-get   one 22 KB MULTI_GET of --copies copies of a --value-mib MiB value, never read
  gets        --gets pipelined GETs of that value, never read
  set-flood   SETs of --value-mib MiB values under new keys, --flood-mib MiB in all
  append      --appends APPENDs of --value-mib MiB to one key
  scans       --scanners clients listing --scan-keys keys over and over (reading them)
  idle        --idle connections opened (VALIDATE and PING) and left idle

Medians of --repeat runs (interleaved). Writes docs/bench/abuse.json and the abuse
section of docs/benchmarks.md. Do not run it on a busy machine: torch's server holds
~2x --copies x --value-mib MiB under multi-get, and --flood-mib under set-flood.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from report import raise_fd_limit, write_json, write_section
from servers import start_torch

from tierrun.protocol import Op
from tierrun.protocol.requests import encode_handshake, encode_request
from tierrun.server import StoreProcess

MiB = 1 << 20
ATTACKS = ("none", "multi-get", "gets", "set-flood", "append", "scans", "idle")
SERVERS = ("torch", "tierrun", "tiered")
ENV = dict(os.environ, TIERRUN_TOKEN="bench-abuse")


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024


class Setup:
    """A server to attack: ``port`` (where clients go), ``host_pid`` (the store host),
    ``proxy_pid`` (tiered only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proxy_pid: int | None = None
        self._stops = []
        if name == "torch":
            server = start_torch()
            self.port, self.host_pid = server.port, server.pid
            self._stops.append(server.stop)
            return
        root = StoreProcess(host="127.0.0.1", port=0, env=ENV)
        root.start()
        self._stops.append(root.stop)
        self.port, self.host_pid = root.port, root.pid
        if name == "tiered":
            proxy = StoreProcess(host="127.0.0.1", port=0, command="proxy", env=ENV,
                                 extra_args=["--upstream", f"127.0.0.1:{root.port}"])
            proxy.start()
            self._stops.insert(0, proxy.stop)
            self.port, self.proxy_pid = proxy.port, proxy.pid

    def alive(self) -> bool:
        pids = [self.host_pid] + ([self.proxy_pid] if self.proxy_pid else [])
        return all(os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()
                   for p in pids)

    def stop(self) -> None:
        for stop in self._stops:
            try:
                stop()
            except Exception as e:  # (a server the attack killed)
                print(f"  stopping {self.name}: {e!r}", flush=True)


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A raw client that has sent VALIDATE and PING and read the PING's answer."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(encode_handshake(1))
    got = b""
    while len(got) < 4:
        chunk = sock.recv(4 - len(got))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        got += chunk
    return sock


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send; False if the server closed the connection meanwhile."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def closed(sock: socket.socket) -> bool:
    """Did the server close ``sock``? (Reads what is there without blocking.)"""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def put_value(port: int, key: bytes, value: bytes) -> None:
    """SET, then a round trip that makes sure it is in."""
    sock = connect(port)
    sock.sendall(encode_request((Op.SET, key, value)) + encode_request((Op.CHECK, (key,))))
    sock.recv(1)
    sock.close()


class Attack:
    """Starts an attack on ``port``; ``outcome()``: was the adversary closed."""

    def __init__(self, kind: str, port: int, args) -> None:
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.refused = 0  # adversary connections closed by the server
        value = b"v" * (args.value_mib * MiB)
        if kind in ("multi-get", "gets"):
            put_value(port, b"/v", value)
            hog = connect(port, rcvbuf=4096)
            self.socks.append(hog)
            request = (encode_request((Op.MULTI_GET, (b"/v",) * args.copies)) if kind == "multi-get"
                       else encode_request((Op.GET, b"/v")) * args.gets)
            self.refused += not send_quietly(hog, request)
        elif kind in ("set-flood", "append"):
            hog = connect(port, rcvbuf=4096)
            self.socks.append(hog)
            n = args.flood_mib // args.value_mib if kind == "set-flood" else args.appends

            def flood() -> None:
                for i in range(n):
                    key = b"/flood/%d" % i if kind == "set-flood" else b"/grow"
                    op = Op.SET if kind == "set-flood" else Op.APPEND
                    if self.stop.is_set() or not send_quietly(hog, encode_request((op, key, value))):
                        return

            self.threads.append(threading.Thread(target=flood, daemon=True))
        elif kind == "scans":
            fill = connect(port)
            for start in range(0, args.scan_keys, 100_000):
                keys = tuple(b"/scan/%07d" % i for i in range(start, min(start + 100_000, args.scan_keys)))
                fill.sendall(encode_request((Op.MULTI_SET, keys, (b"",) * len(keys))))
            fill.sendall(encode_request((Op.GETNUMKEYS,)))
            fill.settimeout(120)
            fill.recv(8)
            fill.close()
            answer = 8 + args.scan_keys * (8 + 13)
            for _ in range(args.scanners):
                self.threads.append(threading.Thread(target=self._scan, args=(port, answer), daemon=True))
        elif kind == "idle":
            for _ in range(args.idle):
                self.socks.append(connect(port))
        for t in self.threads:
            t.start()

    def _scan(self, port: int, answer: int) -> None:
        buffer = bytearray(1 << 20)
        while not self.stop.is_set():
            try:
                sock = connect(port)
            except OSError:
                time.sleep(0.1)
                continue
            try:
                while not self.stop.is_set():
                    sock.sendall(encode_request((Op.LIST_KEYS,)))
                    left = answer
                    while left:
                        got = sock.recv_into(buffer, min(left, len(buffer)))
                        if not got:
                            raise ConnectionResetError
                        left -= got
            except OSError:
                self.refused += 1
            finally:
                sock.close()

    def end(self) -> bool:
        """Stop; was (any of) the adversary closed by the server?"""
        self.stop.set()
        for t in self.threads:
            t.join(5)
        gone = self.refused > 0 or any(closed(s) for s in self.socks[:1])
        for s in self.socks:
            s.close()
        return gone


def bystander(port: int, seconds: float, limit: float, busy) -> dict:
    """A torch client doing ADD round trips (each waited for up to ``limit``) for
    ``seconds``, and on while ``busy()`` (an attack still sending), up to ``limit``:
    median and max round trip (ms), failed requests."""
    rtts: list[float] = []
    errors = 0
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit))
    t0 = time.monotonic()
    while (time.monotonic() < t0 + seconds
           or busy() and time.monotonic() < t0 + limit):
        t = time.monotonic()
        try:
            store.add("bystander", 1)
        except Exception:
            errors += 1
            rtts.append(time.monotonic() - t)
            break  # (its connection is gone: torch's client does not reconnect)
        rtts.append(time.monotonic() - t)
        time.sleep(0.01)
    return {"rtt_median_ms": 1000 * statistics.median(rtts), "rtt_max_ms": 1000 * max(rtts),
            "requests": len(rtts), "errors": errors}


def run_once(server: str, kind: str, args) -> dict:
    setup = Setup(server)
    try:
        warm = dist.TCPStore("127.0.0.1", setup.port, is_master=False, timeout=timedelta(seconds=60))
        warm.add("warm", 1)
        t0 = time.monotonic()
        attack = Attack(kind, setup.port, args)
        started = time.monotonic() - t0
        sending = [t for t in attack.threads if kind != "scans"]  # (scanners go on until stopped)
        out = bystander(setup.port, args.seconds, args.limit, lambda: any(t.is_alive() for t in sending))
        out["adversary_closed"] = attack.end()
        out["attack_start_s"] = started
        out["host_peak_rss_mb"] = peak_rss_mb(setup.host_pid)
        out["proxy_peak_rss_mb"] = peak_rss_mb(setup.proxy_pid) if setup.proxy_pid else None
        out["alive"] = setup.alive()
        return out
    finally:
        setup.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0,
                   help="the well-behaved client's window per run (longer while a flood is being sent)")
    p.add_argument("--limit", type=float, default=30.0, help="its timeout per request (seconds)")
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--value-mib", type=int, default=1)
    p.add_argument("--copies", type=int, default=2000)
    p.add_argument("--gets", type=int, default=300)
    p.add_argument("--flood-mib", type=int, default=2048)
    p.add_argument("--appends", type=int, default=200)
    p.add_argument("--scan-keys", type=int, default=1_000_000)
    p.add_argument("--scanners", type=int, default=3)
    p.add_argument("--idle", type=int, default=5000)
    p.add_argument("--no-write", action="store_true", help="print only (a trial run)")
    args = p.parse_args()
    raise_fd_limit()
    runs: dict[str, dict[str, list[dict]]] = {a: {s: [] for s in args.servers} for a in args.attacks}
    for i in range(args.repeat):
        for kind in args.attacks:
            for server in args.servers:  # (interleaved: machine noise hits all alike)
                r = run_once(server, kind, args)
                runs[kind][server].append(r)
                proxy = f" (proxy {r['proxy_peak_rss_mb']:.0f})" if r["proxy_peak_rss_mb"] else ""
                print(f"run {i + 1}/{args.repeat} {kind:9} {server:7}: host {r['host_peak_rss_mb']:7.0f} MB{proxy}, "
                      f"rtt {r['rtt_median_ms']:6.1f} / {r['rtt_max_ms']:8.1f} ms, errors {r['errors']}, "
                      f"adversary closed {r['adversary_closed']}, alive {r['alive']}", flush=True)
    table = report(runs, args)
    print(table)
    if not args.no_write:
        write_json("abuse", {"args": vars(args), "runs": runs})
        write_section("abuse", table)


def report(runs: dict[str, dict[str, list[dict]]], args) -> str:
    def med(rs: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rs if r[key] is not None]
        return statistics.median(vals) if vals else None

    lines = [
        f"Medians of {args.repeat} runs; the well-behaved client's ADD round trips over {args.seconds:g} s, or "
        f"while a flood is being sent (each waited for up to {args.limit:g} s). Values of {args.value_mib} MiB; multi-get: {args.copies} "
        f"copies; gets: {args.gets}; set-flood: {args.flood_mib} MiB; append: {args.appends}; scans: "
        f"{args.scanners} clients, {args.scan_keys:,} keys; idle: {args.idle:,} connections. Tiered: the "
        "clients use a node proxy; \"store host\" is the `tierrun store` behind it.",
        "",
        "| attack | server | store host peak RSS MB | proxy peak RSS MB | RTT median ms | RTT max ms "
        "| client failed | adversary closed | server up |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for kind, by_server in runs.items():
        for server, rs in by_server.items():
            proxy = med(rs, "proxy_peak_rss_mb")
            lines.append(
                f"| {kind} | {server} | {med(rs, 'host_peak_rss_mb'):,.0f} | "
                f"{'' if proxy is None else f'{proxy:,.0f}'} | {med(rs, 'rtt_median_ms'):,.1f} | "
                f"{med(rs, 'rtt_max_ms'):,.1f} | {sum(r['errors'] > 0 for r in rs)}/{len(rs)} | "
                f"{sum(r['adversary_closed'] for r in rs)}/{len(rs)} | {sum(r['alive'] for r in rs)}/{len(rs)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
