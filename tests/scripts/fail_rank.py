"""A job where global rank $FAIL_RANK raises ValueError after one all_reduce; the others
then wait in a barrier and fail when Gloo loses that peer, or, with $OTHERS_SUCCEED set,
print RESULT and exit 0."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
if dist.get_rank() == int(os.environ["FAIL_RANK"]):
    raise ValueError(f"boom on purpose in rank {dist.get_rank()}")
if os.environ.get("OTHERS_SUCCEED"):
    os.write(1, f"RESULT rank={dist.get_rank()}\n".encode())
    os._exit(0)  # no teardown handshake with the failed peer
dist.barrier()
