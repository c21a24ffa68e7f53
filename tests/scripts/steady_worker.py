"""Worker for the etcd tests: all_reduce in a loop for ``--seconds``, then prints
``RESULT rank= world= sum= restart=``; fails if a collective gives a wrong sum."""

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
while time.time() < deadline:
    x = torch.ones(1) * (rank + 1)
    dist.all_reduce(x)
    assert int(x.item()) == world * (world + 1) // 2, x.item()
    time.sleep(0.1)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
os.write(1, f"RESULT rank={rank} world={world} sum={int(x.item())} restart={restart}\n".encode())
dist.destroy_process_group()
