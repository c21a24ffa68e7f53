"""Helpers to run tierrun as a user would: real processes, simulated nodes on loopback."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    """A port free for TCP and UDP on every address, below the kernel's ephemeral range
    (32768 up): one picked there can be taken by some outgoing connection (a Slurm
    daemon's, another test's client) before the job binds it."""
    while True:
        port = random.randint(20000, 32000)
        try:
            with socket.socket() as t, socket.socket(type=socket.SOCK_DGRAM) as u:
                t.bind(("", port))
                u.bind(("", port))
            return port
        except OSError:
            continue


def tierrun(*args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    out = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tierrun", *map(str, args)],
        stdout=out, stderr=subprocess.STDOUT, env=e, start_new_session=True,
    )


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            codes.append(p.wait())
    return codes


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...)."""
    tree = [pid]
    for p in tree:
        tree += children(p)
    return tree[1:]


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Kill a process and all its descendants (torch puts workers in their own sessions)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def results(*logs: Path, tag: str = "RESULT") -> list[dict[str, str]]:
    rows = []
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith(tag + " "):
                rows.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return rows


def scale_up_out_of_phase(tmp_path: Path, *common) -> list[dict[str, str]]:
    """Two nodes of a 2:3 job whose agents poll 0.1 s and 2 s apart, with no restart to
    spare (``common`` has ``--max_restarts 0``), run a round of 2; a third node joins.
    The first agent to stop its workers would fail the other's collective before that
    agent looks (torch's agent checks its workers before it asks about waiting nodes):
    the members must restart together. Asserts all exit 0; returns the RESULT rows."""
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    start = lambda k, interval: tierrun(*common, "--monitor_interval", interval, "--local_addr",
                                        f"127.0.1.{k + 1}", SCRIPTS / "elastic_worker.py", "--want", 3, log=logs[k])
    procs = [start(0, "0.1"), start(1, "2")]
    deadline = time.time() + 60
    while len(results(*logs[:2], tag="ROUND")) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert {r["world"] for r in results(*logs[:2], tag="ROUND")} == {"2"}
    procs.append(start(2, "0.5"))
    assert finish(procs) == [0, 0, 0], logs[1].read_text()[-3000:]
    return results(*logs)
