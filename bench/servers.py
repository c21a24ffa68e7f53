"""Start the servers that benchmarks compare, each in its own process, and read what
they cost (CPU seconds and peak RSS from /proc)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tierrun.server import StoreProcess

_TORCH_SERVER = """
import sys, time, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                  timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def process_cpu_seconds(pid: int) -> float:
    """CPU time of a live process so far, to the nanosecond: the sum over its threads of
    /proc's schedstat (utime + stime in /proc/<pid>/stat count 10 ms ticks, too coarse
    for a node 0 that spends tens of milliseconds). A thread that exits between two
    readings takes its time with it: the servers measured here keep theirs."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # (the thread just exited)
    return total / 1e9


def child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@dataclass
class ServerHandle:
    """A server; with ``with_children``, its child processes count as part of it (the
    front-end processes of ``tierrun store --workers N``)."""

    name: str
    port: int
    pid: int
    _stop: object
    with_children: bool = False

    def pids(self) -> list[int]:
        return [self.pid] + (child_pids(self.pid) if self.with_children else [])

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(p) for p in self.pids())

    def peak_rss_mb(self) -> float:
        total = 0.0
        for pid in self.pids():
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) / 1024
        return total

    def stop(self) -> None:
        self._stop()  # type: ignore[operator]


def start_torch() -> ServerHandle:
    """torch's own TCPStore server (the libuv backend, torch's default)."""
    proc = subprocess.Popen([sys.executable, "-c", _TORCH_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())

    def stop() -> None:
        proc.stdin.close()
        proc.wait(10)

    return ServerHandle("torch", port, proc.pid, stop)


def start_tierrun() -> ServerHandle:
    sp = StoreProcess(host="127.0.0.1", port=0)
    sp.start()
    return ServerHandle("tierrun", sp.port, sp.pid, sp.stop)


def start_tierrun_workers(n: int) -> ServerHandle:
    """``tierrun store --workers n``: n front-end processes and the core's process."""
    sp = StoreProcess(host="127.0.0.1", port=0, extra_args=["--workers", str(n)])
    sp.start()
    return ServerHandle(f"tierrun --workers {n}", sp.port, sp.pid, sp.stop, with_children=True)


SERVERS = {"torch": start_torch, "tierrun": start_tierrun, "tierrun-w2": lambda: start_tierrun_workers(2)}
