"""Worker for the elastic tree test: prints ``UP rank= world= t=`` once its process
group works. In a world of ``--want`` ranks it ADDs 1 to a store counter ``--adds``
times, all_reduces, and checks the counter holds exactly every rank's ADDs (each one
applied once, through its node's proxy and the tree above it), then prints ``RESULT``.
In any other world it keeps ADDing to the store and all_reducing until its agent stops
it (store requests are on their way through the tree when a node dies)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())


p = argparse.ArgumentParser()
p.add_argument("--want", type=int, required=True)
p.add_argument("--adds", type=int, default=50)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
store = _get_default_store()
x = torch.ones(1) * (rank + 1)
dist.all_reduce(x)
assert int(x.item()) == world * (world + 1) // 2, (x.item(), world)
say(f"UP rank={rank} world={world} t={time.time():.3f}")
if world != args.want:
    while True:
        store.add("busy", 1)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
for _ in range(args.adds):
    store.add("count", 1)
dist.barrier()
total = store.add("count", 0)
ok = int(total == args.adds * world)
say(f"RESULT rank={rank} world={world} sum={int(x.item())} total={total} ok={ok}")
dist.destroy_process_group()
