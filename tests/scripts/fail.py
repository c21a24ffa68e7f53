"""A worker whose local rank 1 exits with code 3 after init, on every attempt."""

import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"ATTEMPT restart={os.environ['TORCHELASTIC_RESTART_COUNT']} rank={dist.get_rank()}", flush=True)
if os.environ["LOCAL_RANK"] == "1":
    raise SystemExit(3)
dist.barrier()
