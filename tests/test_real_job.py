"""A real Gloo job whose workers use tierrun's store through env://."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "collectives.py"


def test_four_workers_init_all_reduce_barrier_new_group(store):
    world = 4
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        procs.append(
            subprocess.Popen([sys.executable, str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    expected_sum = sum(range(1, world + 1))
    results = sorted(line for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert len(results) == world
    for rank, line in enumerate(results):
        assert f"rank={rank} world={world} sum={expected_sum}" in line
