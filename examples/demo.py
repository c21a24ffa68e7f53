"""Demo: a 2-node x 2-worker DDP job simulated on this machine with tierrun, tiered.

Node 0 (127.0.1.1) hosts the job's store; every node runs a store front-end that its
agent and workers use on loopback (node 1 a proxy process; on node 0 the store process
is that node's front-end too), and only the front-ends talk to node 0's core, over links
authenticated with a job token. Both nodes run the toy model (Linear 784->128->10)
with Gloo. What each node prints is prefixed with its name.
"""

import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ddp_toy.py"
PORT = os.environ.get("TIERRUN_DEMO_PORT", "29531")
TOKEN = secrets.token_hex(16)  # the job token both nodes share


def node(rank: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tierrun", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1", "--master_port", PORT,
           "--node_rank", str(rank), "--rdzv_id", "demo", "--local_addr", f"127.0.1.{rank + 1}",
           "--enable_tiered_parallel_tcpstore", "true", str(SCRIPT)]
    print(f"node {rank}$ tierrun {' '.join(cmd[3:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TIERRUN_TOKEN=TOKEN,
               TIERRUN_LOG_LEVEL="INFO")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def relay(rank: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        print(f"[node {rank}] {line}", end="", flush=True)


procs = [node(0), node(1)]
threads = [threading.Thread(target=relay, args=(k, p)) for k, p in enumerate(procs)]
for t in threads:
    t.start()
codes = [p.wait() for p in procs]
for t in threads:
    t.join()
print("demo:", "OK, every worker finished" if codes == [0, 0] else f"FAILED, exit codes {codes}")
sys.exit(max(codes))
