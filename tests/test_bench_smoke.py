"""The benchmarks behind docs/benchmarks.md still run: each at a toy size, printing only
(``--no-write``), as a person re-running them would start them. No figure is checked
here (performance lives in bench/, not in tests): a benchmark that cannot run leaves
the docs' tables without a way to reproduce them."""

import subprocess
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(*argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=BENCH, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_wireup_runs_every_default_setup_at_a_toy_size():
    out = run("wireup.py", "--sizes", "4x2", "--repeat", "1", "--no-lockstep", "--no-write")
    for setup in ("torch", "tierrun-flat", "tiered", "tree", "tree-proxies"):
        assert f"| 4x2 | {setup} |" in out


def test_heartbeat_steady_state_runs_with_tierruns_agents():
    out = run("heartbeat.py", "--agents", "tierrun", "--size", "4x2", "--low", "1", "--high", "2", "--repeat", "1",
              "--no-write")
    for setup in ("torch", "tiered", "tree"):
        assert f"| {setup} |" in out
