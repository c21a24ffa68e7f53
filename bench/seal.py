"""The cost of sealed link frames (a MAC each: ``tierrun/link/seal.py``).

Two measures, printed and written to docs/benchmarks.md:

- the primitives: sealing one frame and checking one, by frame size;
- the store host's hot path of a wire-up: one link frame carrying one ADD (the most
  common frame of a start-up), read, checked, executed and answered (a sealed REPLIES
  frame) by ``LinkServerConnection.data_received``, in-process, no sockets: the cost
  per frame with this tree, and with a baseline revision's code (``--baseline REV``,
  default ``89ed34b^1``: main just before the trust branch was merged, whose frames
  carry no MAC), taken from git into a temporary directory and run in a child process,
  alternating runs so that both see the same machine.

    python bench/seal.py [--baseline REV] [--frames N] [--rounds R] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def primitives() -> list[tuple[int, float, float]]:
    """(frame bytes, CPU µs to seal one, to check one): best of 7 runs."""
    from tierrun.link.seal import Opener, Sealer, session_keys

    up, _ = session_keys(b"token", os.urandom(32), os.urandom(32))
    out = []
    for size in (40, 100, 1024, 64 * 1024, 1 << 20):
        frame = (size - 4).to_bytes(4, "little") + os.urandom(size - 4)
        n = max(200, 200_000 // max(size // 64, 1))
        sealer = Sealer(up)
        seal = min(timeit.repeat(lambda: sealer.seal(frame), number=n, repeat=7, timer=time.process_time)) / n
        sealed = Sealer(up).seal(frame)
        opener = Opener(up)

        def check() -> None:
            opener.received = 0
            opener.valid(sealed, 0, size)

        valid = min(timeit.repeat(check, number=n, repeat=7, timer=time.process_time)) / n
        out.append((size, seal * 1e6, valid * 1e6))
    return out


def store_host_per_frame(frames: int) -> float:
    """CPU µs the store host spends per lone-ADD frame (read, MAC checked, executed,
    answer sealed and written), best of 5 runs of ``frames`` frames, with whatever
    tierrun is importable (this tree, or a baseline's)."""
    from tierrun.core import StoreCore
    from tierrun.hub.link_server import LinkServer
    from tierrun.hub.session import core_upstreams
    from tierrun.link.frames import FrameDecoder, encode_batch, entry_open, entry_request
    from tierrun.link.session import ClientHandshake, Ledger
    from tierrun.protocol import Op
    from tierrun.protocol.requests import encode_request

    written: list[bytes] = []

    class Sink(asyncio.Transport):
        def write(self, data) -> None:  # type: ignore[override]
            written.append(bytes(data))

        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name, default=None):  # type: ignore[override]
            return ("127.0.0.1", 1) if name == "peername" else default

        def abort(self) -> None:
            pass

        def close(self) -> None:
            pass

    async def run() -> float:
        core = StoreCore()
        server = LinkServer(core_upstreams(core), b"tok", drop_watches=core.drop_watches_of)
        conn = server.accept("bench", sniffed=False)
        conn.connection_made(Sink())
        handshake = ClientHandshake(b"tok", b"s" * 16, True, Ledger(1 << 30, 64))
        decoder = FrameDecoder(handshake.max_frame)
        conn.data_received(handshake.start())
        while handshake.resumed is None:
            data = b"".join(written)
            written.clear()
            for ftype, payload in getattr(decoder, "frames", decoder.feed)(data):  # (the baseline: feed)
                out = handshake.feed(ftype, payload)
                if out:
                    conn.data_received(out)
                decoder.max_frame = handshake.max_frame
                decoder.opener = getattr(handshake, "opener", None)
        seal = getattr(handshake, "sealer", None)
        seal = seal.seal if seal is not None else (lambda frame: frame)
        conn.data_received(seal(encode_batch([entry_open(1, b"")])))
        add = encode_request((Op.ADD, b"/init/", 1))
        batches = [seal(encode_batch([entry_request(1, rid, add)])) for rid in range(1, frames + 1)]
        written.clear()
        feed = conn.data_received
        t0 = time.process_time()  # (CPU time: a busy machine's other processes do not count)
        for batch in batches:
            feed(batch)
        elapsed = time.process_time() - t0
        assert core.execute((Op.ADD, b"/init/", 0), None) == frames.to_bytes(8, "little", signed=True)
        assert len(written) >= frames  # (one answer each, and the ACKs)
        written.clear()
        return elapsed / frames * 1e6

    return min(asyncio.run(run()) for _ in range(5))


def _baseline_tree(rev: str, into: Path) -> Path:
    """``rev``'s tierrun package, exported from git into ``into``."""
    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "tierrun"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _child(pythonpath: Path, frames: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--host-only", "--frames", str(frames)], check=True,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(pythonpath)))
    return float(out.stdout.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="89ed34b^1", help="a revision without sealed frames")
    p.add_argument("--frames", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--host-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.host_only:
        print(store_host_per_frame(args.frames))
        return
    here = Path(__file__).resolve().parents[1]
    prims = primitives()
    with tempfile.TemporaryDirectory() as tmp:
        base = _baseline_tree(args.baseline, Path(tmp))
        sealed, plain = [], []
        for _ in range(args.rounds):  # (alternating: both see the same machine)
            sealed.append(_child(here, args.frames))
            plain.append(_child(base, args.frames))
    s, b = min(sealed), min(plain)  # (the least disturbed runs; medians in the JSON)
    lines = ["Frame bytes | seal one (µs) | check one (µs)", "---: | ---: | ---:"]
    lines += [f"{size:,} | {seal:.2f} | {valid:.2f}" for size, seal, valid in prims]
    body = "\n".join([
        *lines,
        "",
        f"The store host, per frame ({args.frames:,} frames; CPU time, the best of {args.rounds} alternating",
        f"runs of 5; medians {statistics.median(sealed):.2f} and {statistics.median(plain):.2f} µs; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}):",
        "",
        "Code | µs per frame at the store host",
        "--- | ---:",
        f"sealed (this tree) | {s:.2f}",
        f"no MAC (`{args.baseline}`: main before sealed frames) | {b:.2f}",
        f"the MAC's cost | {s - b:+.2f} ({(s - b) / b:+.0%})",
    ])
    print(body)
    print(json.dumps({"sealed_us": sealed, "plain_us": plain}))
    if not args.no_write:
        from report import write_json, write_section

        write_section("seal", body)
        write_json("seal", {"primitives": prims, "sealed_us": sealed, "plain_us": plain, "frames": args.frames})


if __name__ == "__main__":
    main()
