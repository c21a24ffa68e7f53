"""Worker that connects a TCPStore of its own to ``HOST PORT`` (argv), as scripts do that
pass the launcher's --master_addr/--master_port on to their own store client, rather
than use $MASTER_ADDR:$MASTER_PORT. Prints ``RESULT rank=<r> store=ok`` or
``RESULT rank=<r> store=failed``; exits 3 when it failed."""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

rank = os.environ["RANK"]
try:
    dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=3)).set("x", "1")
except Exception:
    print(f"RESULT rank={rank} store=failed", flush=True)
    sys.exit(3)
print(f"RESULT rank={rank} store=ok", flush=True)
