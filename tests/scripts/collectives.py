"""A worker that exercises torch's store traffic: init, all_reduce, barrier, new_group.

Prints one line: ``RESULT rank=<r> world=<w> sum=<s>``.
"""

import os

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(4) * (rank + 1)
dist.all_reduce(x)
dist.barrier()
group = dist.new_group(list(range(world)))
y = torch.ones(1)
dist.all_reduce(y, group=group)
assert int(y.item()) == world
say(f"RESULT rank={rank} world={world} sum={int(x[0].item())} "
    f"local_rank={os.environ.get('LOCAL_RANK')} group_rank={os.environ.get('GROUP_RANK')} "
    f"master={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
dist.destroy_process_group()
