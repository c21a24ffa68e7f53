"""Worker for the etcd tests: all_reduce in a loop for ``--seconds``, then prints
``RESULT rank= world= sum= restart=``; fails if a collective gives a wrong sum. Rank 0's
clock decides when to stop, carried in the all_reduce, so every rank runs as many
collectives (each on its own clock, one could start one more after its peers exit)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
os.write(1, f"UP rank={rank} world={world} t={time.time():.3f}\n".encode())
deadline = time.time() + args.seconds
while True:
    x = torch.tensor([rank + 1.0, float(rank == 0 and time.time() >= deadline)])
    dist.all_reduce(x)
    assert int(x[0].item()) == world * (world + 1) // 2, x[0].item()
    if x[1].item() > 0:
        break
    time.sleep(0.1)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
os.write(1, f"RESULT rank={rank} world={world} sum={int(x[0].item())} restart={restart}\n".encode())
dist.destroy_process_group()
