"""Worker for elastic tests: finishes only in a world of ``--want`` nodes' workers.

While the world is smaller it keeps doing all_reduce (so a membership change or a
dead peer interrupts it); prints ``RESULT ...`` when the world has the wanted size.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())


p = argparse.ArgumentParser()
p.add_argument("--want", type=int, required=True, help="world size at which to finish")
p.add_argument("--patience", type=float, default=60.0)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1) * (rank + 1)
dist.all_reduce(x)
assert int(x.item()) == world * (world + 1) // 2, (x.item(), world)
say(f"ROUND rank={rank} world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}")
if world == args.want:
    say(f"RESULT rank={rank} world={world} sum={int(x.item())} group_rank={os.environ['GROUP_RANK']}")
    dist.destroy_process_group()
else:
    deadline = time.time() + args.patience
    while time.time() < deadline:
        y = torch.ones(1)
        dist.all_reduce(y)
        time.sleep(0.2)
    raise SystemExit(f"world stayed at {world}, wanted {args.want}")
