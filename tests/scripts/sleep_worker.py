"""Worker for fault tests: joins the process group, prints ``UP rank= world= t=``, then
sleeps (no collective in flight) until its agent stops it."""

import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
os.write(1, f"UP rank={dist.get_rank()} world={dist.get_world_size()} t={time.time():.3f}\n".encode())
time.sleep(600)
