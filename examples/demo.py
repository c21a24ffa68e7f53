"""Demo: a Gloo job of 4 workers wired up through a tierrun store (env://)."""

import os
import subprocess
import sys
from pathlib import Path

from tierrun.server import StoreProcess

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "collectives.py"

with StoreProcess(host="127.0.0.1", port=0) as store:
    print(f"tierrun store on 127.0.0.1:{store.port}")
    procs = []
    for rank in range(4):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank),
                   WORLD_SIZE="4", LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env))
    codes = [p.wait() for p in procs]
sys.exit(max(codes))
