"""Worker for fault tests: prints ``UP rank= world= t=`` (Unix time) once its process
group works, then keeps doing all_reduce until the world has ``--want`` ranks, where it
prints ``RESULT`` and exits. A dead or stopped peer leaves it failing or stuck in a
collective; only its agent can get it out."""

import argparse
import os
import time

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())


p = argparse.ArgumentParser()
p.add_argument("--want", type=int, required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1)
dist.all_reduce(x)
say(f"UP rank={rank} world={world} t={time.time():.3f}")
if world == args.want:
    say(f"RESULT rank={rank} world={world} sum={int(x.item())}")
    dist.destroy_process_group()
else:
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
