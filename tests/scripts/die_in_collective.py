"""Global rank $DIE_RANK dies while every other rank blocks in an all_reduce with it:
$DIE_HOW is ``exit`` (``sys.exit(3)``), ``kill`` (SIGKILL, as the OOM killer sends) or
``segv`` (a real segmentation fault, without a core dump). Just before, it prints
``DYING rank=R t=T`` (T: ``time.time()``), so that a test can check when the failure
report says it died."""

import ctypes
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == int(os.environ["DIE_RANK"]):
    time.sleep(1.0)  # the others are blocked in the all_reduce by now
    how = os.environ["DIE_HOW"]
    os.write(1, f"DYING rank={rank} t={time.time():.6f}\n".encode())
    if how == "exit":
        sys.exit(3)
    elif how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        # no core dump: where they are on (ulimit -c unlimited, systemd-coredump), the
        # kernel writes ~180 MB before the process ends, seconds on a loaded machine, and
        # the test times the exit; and a core file would land in the test's directory
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no piped dump either
        ctypes.string_at(0)  # reads address 0: SIGSEGV
dist.all_reduce(torch.ones(1))
