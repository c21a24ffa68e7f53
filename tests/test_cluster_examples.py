"""The Slurm and Kubernetes examples of the user guide: the Slurm batch script runs a
3-node tiered job under a real Slurm (Debian's munge, slurmctld and slurmd, started here:
``slurm_cluster.py``); the Kubernetes manifest parses, is wired consistently, and its
tierrun flags parse."""

import os
import re
from pathlib import Path

import yaml

from launch import SCRIPTS, free_port, results
from slurm_cluster import SlurmCluster
from tierrun.launcher.args import build_parser, normalise

ROOT = Path(__file__).resolve().parents[1]


def test_slurm_batch_script_runs_a_tiered_job(tmp_path):
    """sbatch --nodes=3 examples/slurm/tierrun.sbatch: srun starts one tierrun agent per
    node, node n1 (127.0.1.1) hosts the store, every node runs a proxy (tiered), the job
    token in a file the script writes and copies to every node (sbcast) before srun."""
    cluster = SlurmCluster(tmp_path / "slurm", nodes=3).start()
    try:
        env = dict(cluster.env, NPROC_PER_NODE="2", TIERRUN_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.pop("TIERRUN_TOKEN", None)  # the script makes one, in a file
        env.pop("TIERRUN_TOKEN_FILE", None)
        log = tmp_path / "slurm.log"
        job_id, state, code = cluster.run_batch(
            ["--nodes=3", f"--output={log}", str(ROOT / "examples/slurm/tierrun.sbatch"),
             str(SCRIPTS / "collectives.py")], env=env, cwd=tmp_path)
        text = log.read_text() if log.exists() else ""
        assert (state, code) == ("COMPLETED", "0:0"), f"{state} {code}\n{text[-3000:]}\n{cluster.logs()}"
    finally:
        cluster.stop()
    rows = results(log)
    assert sorted(int(r["rank"]) for r in rows) == list(range(6)), text[-3000:]
    assert all(r["world"] == "6" and r["sum"] == "21" for r in rows)
    assert all(r["master"].startswith("127.0.0.1:") for r in rows)  # each node's proxy: tiered
    assert sorted(int(r["group_rank"]) for r in rows) == [0, 0, 1, 1, 2, 2]  # $SLURM_NODEID
    assert len(list((tmp_path / "logs" / job_id).iterdir())) == 3  # --log_dir per job id
    # every node read the token file sbcast copied (no token derived from flags), removed after
    assert "no job token" not in text and "Traceback" not in text, text[-3000:]
    assert not Path(f"/tmp/tierrun-token-{job_id}").exists()


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
    # the token: a Secret mounted read-only, 0400, named by TIERRUN_TOKEN_FILE; no secret in the env
    assert not any("valueFrom" in e for e in container["env"]), container["env"]
    token_file = next(e["value"] for e in container["env"] if e["name"] == "TIERRUN_TOKEN_FILE")
    mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] == 0o400
    # the key the guide's `kubectl create secret ... --from-literal=token=` makes is the file's name
    assert token_file == f"{mount['mountPath']}/token" and volume["secret"]["secretName"] == "tierrun-token"
