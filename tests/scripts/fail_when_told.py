"""Worker for fault tests: joins the process group, prints ``UP rank= world= t=``, then
exits with status 1 as soon as the file named by ``--fail-file`` exists (a worker that
fails on its own, at a moment the test chooses)."""

import argparse
import os
import time

import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--fail-file", required=True)
args = p.parse_args()

dist.init_process_group("gloo")
os.write(1, f"UP rank={dist.get_rank()} world={dist.get_world_size()} t={time.time():.3f}\n".encode())
while not os.path.exists(args.fail_file):
    time.sleep(0.05)
raise SystemExit(1)
