"""A worker whose local rank 1 exits with code 3 after init, on every attempt."""

import os

import torch.distributed as dist


def say(line: str) -> None:
    """One write() per line: lines of workers sharing a pipe never interleave."""
    os.write(1, (line + "\n").encode())


dist.init_process_group("gloo")
say(f"ATTEMPT restart={os.environ['TORCHELASTIC_RESTART_COUNT']} rank={dist.get_rank()}")
if os.environ["LOCAL_RANK"] == "1":
    raise SystemExit(3)
dist.barrier()
