"""The Slurm and Kubernetes examples of the user guide: the Slurm batch script runs a
3-node job here (stub srun and scontrol start local processes on loopback addresses);
the Kubernetes manifest parses, is wired consistently, and its tierrun flags parse."""

import os
import re
import subprocess
from pathlib import Path

import yaml

from launch import SCRIPTS, free_port, results
from tierrun.launcher.args import build_parser, normalise

ROOT = Path(__file__).resolve().parents[1]
STUBS = Path(__file__).parent / "stubs"


def test_slurm_batch_script_runs_a_tiered_job(tmp_path):
    env = dict(os.environ, PATH=f"{STUBS}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[1-3]",
               SLURM_JOB_NUM_NODES="3", SLURM_JOB_ID="42", NPROC_PER_NODE="2",
               TIERRUN_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TIERRUN_TOKEN", None)  # the script makes one
    log = tmp_path / "slurm.log"
    with open(log, "w") as out:
        rc = subprocess.run(["bash", str(ROOT / "examples/slurm/tierrun.sbatch"), str(SCRIPTS / "collectives.py")],
                            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=240).returncode
    assert rc == 0, log.read_text()[-3000:]
    rows = results(log)
    assert sorted(int(r["rank"]) for r in rows) == list(range(6))
    assert all(r["world"] == "6" and r["sum"] == "21" for r in rows)
    assert all(r["master"].startswith("127.0.0.1:") for r in rows)  # each node's proxy: tiered
    assert len(list((tmp_path / "logs" / "42").iterdir())) == 3  # --log_dir per job id


def test_kubernetes_manifest_is_consistent():
    docs = list(yaml.safe_load_all((ROOT / "examples/kubernetes/tierrun-job.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert job["spec"]["completionMode"] == "Indexed"
    container = pod["containers"][0]
    assert container["command"] == ["tierrun"]
    argv = [re.sub(r"\$\(JOB_COMPLETION_INDEX\)", "3", a) for a in container["args"]]
    args = normalise(build_parser().parse_args(argv))
    assert int(args.nnodes) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert args.node_rank == 3 and args.tiered and args.rdzv_backend == "parallel"
    assert args.master_addr == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert args.master_port == service["spec"]["ports"][0]["port"]
    assert args.training_script == "train.py"
    token = next(e for e in container["env"] if e["name"] == "TIERRUN_TOKEN")
    assert "secretKeyRef" in token["valueFrom"]
