"""Worker for the secrets tests: joins the process group, all_reduces, and prints one line
``ENV rank=<r> pid=<pid> sum=<s> names=<every variable's name, comma-separated>``; then,
when ``$ENV_WORKER_RELEASE`` names a file, waits (up to 60 s) for that file to exist, so
that the test can read ``/proc/<pid>/environ`` of every worker while they all run. Its
environment's values are not printed: a test looks for secrets in them itself, through
``/proc``, and a leak should not land in the logs."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
names = ",".join(sorted(os.environ))
os.write(1, f"ENV rank={dist.get_rank()} pid={os.getpid()} sum={int(x.item())} names={names}\n".encode())
release = os.environ.get("ENV_WORKER_RELEASE")
deadline = time.monotonic() + 60
while release and not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
