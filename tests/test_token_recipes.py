"""The guide's recipes that give every node a real secret with no launcher flag, run as a
user would: a Kubernetes Secret mounted read-only as the file ``TIERRUN_TOKEN_FILE``
names. (The Slurm recipe, a token file written before ``srun``, runs under a real Slurm
in ``test_cluster_examples.py``.)

Each simulated node runs in a mount namespace of its own (``unshare --mount
--map-root-user``) where, as the kubelet does for a pod, a read-only tmpfs is mounted at
the same path and holds the Secret's key as a 0400 file behind Kubernetes' ``..data``
symlinks. Where user namespaces are not allowed, each node gets a 0400 file in a
read-only directory of its own instead."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from launch import SCRIPTS, finish, free_port, results

#: What the kubelet does for a Secret volume, in the node's own mount namespace; then
#: the node's command. Arguments: mount point, the secret's file, the command.
MOUNT_SECRET = r'''set -e
dir=$1 secret=$2; shift 2
mount -t tmpfs -o size=64k,mode=0755 tierrun-secret "$dir"
mkdir "$dir/..2026_01_01_00_00_00.1"
cp "$secret" "$dir/..2026_01_01_00_00_00.1/token"
chmod 0400 "$dir/..2026_01_01_00_00_00.1/token"
ln -s ..2026_01_01_00_00_00.1 "$dir/..data"
ln -s ..data/token "$dir/token"
mount -o remount,ro "$dir"
exec "$@"
'''


@functools.cache
def namespaces_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class SecretMount:
    """Every node's view of the Secret: ``TIERRUN_TOKEN_FILE``'s path and the command
    that runs a node with ``secret`` there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mount_point = root / "secret-volume"
        self.mount_point.mkdir()
        self.shared_path = namespaces_allowed()

    def node(self, name: str, secret: str, argv: list[str]) -> tuple[list[str], str]:
        """(the node's command, its TIERRUN_TOKEN_FILE)."""
        source = self.root / f"{name}.secret"
        source.write_text(secret + "\n")  # (kubectl create secret --from-file keeps a newline)
        source.chmod(0o400)
        if self.shared_path:
            return (["unshare", "--mount", "--map-root-user", "sh", "-c", MOUNT_SECRET, "mount-secret",
                     str(self.mount_point), str(source), *argv], str(self.mount_point / "token"))
        own = self.root / f"{name}-volume"
        own.mkdir()
        (own / "token").write_text(secret + "\n")
        (own / "token").chmod(0o400)
        own.chmod(0o500)
        return argv, str(own / "token")


def start_node(mount: SecretMount, name: str, secret: str, rank: int, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tierrun", "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
            "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1", "--master_port", str(port),
            "--enable_tiered_parallel_tcpstore", "true", "--rdzv_id", "k8s-recipe",
            "--local_addr", f"127.0.1.{rank + 1}", str(SCRIPTS / "collectives.py")]
    command, token_file = mount.node(name, secret, argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERRUN_")}
    env.update(TIERRUN_TOKEN_FILE=token_file, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_mounted_kubernetes_secret_authenticates_the_nodes(tmp_path):
    """Node 0 and node 1 read the same secret from TIERRUN_TOKEN_FILE (read-only, 0400)
    and run a tiered job; a node 1 whose Secret holds another value, started first, is
    refused by the store host with one line saying what to fix, and changes nothing."""
    mount = SecretMount(tmp_path)
    port = free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("node0", "intruder", "node1")}
    node0 = start_node(mount, "node0", "the-job-secret", 0, port, logs["node0"])
    intruder = start_node(mount, "intruder", "another-secret", 1, port, logs["intruder"])
    assert finish([intruder], timeout=60) == [1], logs["intruder"].read_text()[-3000:]
    said = logs["intruder"].read_text()
    errors = [line for line in said.splitlines() if line.startswith("tierrun: error:")]
    assert errors == [
        f"tierrun: error: node 127.0.1.2: the store host 127.0.1.1:{port} refused this node's job token. "
        "Every node of the job needs the same secret: check that TIERRUN_TOKEN_FILE names a file with "
        "the same contents on every node (or that TIERRUN_TOKEN is the same); with no secret, the token "
        "is derived from --rdzv_id and the store port, which must then be the same."], said[-3000:]
    assert "Traceback" not in said
    node1 = start_node(mount, "node1", "the-job-secret", 1, port, logs["node1"])
    assert finish([node0, node1], timeout=120) == [0, 0], logs["node0"].read_text()[-3000:]
    rows = results(logs["node0"], logs["node1"])
    assert sorted(int(r["rank"]) for r in rows) == [0, 1] and all(r["sum"] == "3" for r in rows), rows
    assert all(r["master"].startswith("127.0.0.1:") for r in rows)  # through each node's proxy: tiered
    assert not any("no job token" in log.read_text() for log in logs.values())  # (no derived token)


def test_a_token_file_that_cannot_be_used_stops_the_node_in_one_line(tmp_path):
    """A missing (the Secret not mounted) or empty (a failed `openssl rand`) token file:
    the node stops at once, saying which node, which file and what to check."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for token_file, why in ((tmp_path / "missing", "No such file or directory. Check that the file"),
                            (empty, "is empty: write the job's secret in it")):
        env = dict(os.environ, TIERRUN_TOKEN_FILE=str(token_file), TIERRUN_TOKEN="")
        done = subprocess.run(
            [sys.executable, "-m", "tierrun", "--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "parallel",
             "--master_addr", "127.0.1.1", "--master_port", str(free_port()), "--tiered", "--local_addr",
             "127.0.1.2", str(SCRIPTS / "collectives.py")], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("tierrun: error: "), done.stderr
        assert done.stderr.startswith("tierrun: error: node 127.0.1.2: "), done.stderr
        assert f"TIERRUN_TOKEN_FILE={token_file}" in done.stderr and why in done.stderr, done.stderr
