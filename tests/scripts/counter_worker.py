"""Worker for the store-fault tests: ADDs 1 to a store counter for ``--seconds`` (and
all_reduces now and then), then checks the counter holds exactly every rank's ADDs.
Prints ``UP rank=`` once started and ``RESULT rank= world= adds= total= ok= restart=``.
Rank 0's clock decides when to stop, carried in the all_reduce, so every rank runs as
many collectives (each on its own clock, one rank's final all_reduce could meet a
peer's periodic one and both would see a wrong sum)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
store = _get_default_store()
os.write(1, f"UP rank={rank} world={world} t={time.time():.3f}\n".encode())
adds = 0
deadline = time.time() + args.seconds
while True:
    for _ in range(20):
        store.add("count", 1)
        adds += 1
        time.sleep(0.005)
    x = torch.tensor([1.0, float(rank == 0 and time.time() >= deadline)])
    dist.all_reduce(x)
    assert int(x[0].item()) == world, x[0].item()
    if x[1].item() > 0:
        break
mine = torch.tensor([adds])
dist.all_reduce(mine)
dist.barrier()
total = store.add("count", 0)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
ok = int(total == int(mine.item()))
os.write(1, f"RESULT rank={rank} world={world} adds={int(mine.item())} total={total} ok={ok} restart={restart}\n".encode())
dist.destroy_process_group()
