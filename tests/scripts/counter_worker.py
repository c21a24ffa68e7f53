"""Worker for the store-fault tests: ADDs 1 to a store counter for ``--seconds`` (and
all_reduces now and then), then checks the counter holds exactly every rank's ADDs.
Prints ``UP rank=`` once started and ``RESULT rank= world= adds= total= ok= restart=``."""

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
while time.time() < deadline:
    store.add("count", 1)
    adds += 1
    if adds % 20 == 0:
        x = torch.ones(1)
        dist.all_reduce(x)
        assert int(x.item()) == world, x.item()
    time.sleep(0.005)
mine = torch.tensor([adds])
dist.all_reduce(mine)
dist.barrier()
total = store.add("count", 0)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
ok = int(total == int(mine.item()))
os.write(1, f"RESULT rank={rank} world={world} adds={int(mine.item())} total={total} ok={ok} restart={restart}\n".encode())
dist.destroy_process_group()
