"""tierrun's backends under torch's own torchrun (``python -m torch.distributed.run``),
found through the ``torchrun.handlers`` entry points that pyproject.toml declares; and
a backend whose extra is missing fails in one line naming the install command.

The entry points are read from pyproject.toml into a ``tierrun`` distribution's metadata
on a directory put first on the path, so the test checks this tree's declaration
whatever tierrun installation the interpreter has."""

import os
import re
import subprocess
import sys
from pathlib import Path

from launch import SCRIPTS, finish, free_port, results

ROOT = Path(__file__).resolve().parents[1]


def torchrun_handlers(pyproject: str) -> dict[str, str]:
    """pyproject's ``[project.entry-points."torchrun.handlers"]`` table."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: read the table's lines
        table = re.search(r'^\[project\.entry-points\."torchrun\.handlers"\]\n((?:[^\[\n].*\n|\n)*)', pyproject, re.M)
        return dict(re.findall(r'^([\w-]+) = "([^"]+)"', table.group(1), re.M)) if table else {}
    return tomllib.loads(pyproject)["project"]["entry-points"]["torchrun.handlers"]


def entry_points_path(tmp_path: Path) -> str:
    """A PYTHONPATH holding tierrun's metadata with pyproject's entry points, then this tree."""
    handlers = torchrun_handlers((ROOT / "pyproject.toml").read_text())
    assert set(handlers) == {"tierrun", "parallel", "tierrun-etcd"}, handlers
    info = tmp_path / "meta" / "tierrun-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tierrun\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchrun.handlers]\n" + "".join(f"{name} = {target}\n" for name, target in handlers.items()))
    return os.pathsep.join([str(info.parent), str(ROOT)])


def test_torchrun_runs_a_job_on_tierrun_with_is_host(tmp_path):
    """torch's torchrun registers tierrun, parallel and tierrun-etcd; then 2 simulated
    nodes run a Gloo job with --rdzv-backend tierrun. The endpoint 127.0.1.1 names
    neither node (a Kubernetes service's address, say): --rdzv-conf is_host=true makes
    127.0.1.2 host the store, is_host=false keeps 127.0.1.3 a client."""
    env = dict(os.environ, PYTHONPATH=entry_points_path(tmp_path), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", LOGLEVEL="INFO")  # (tierrun's messages follow torch's LOGLEVEL)
    registered = subprocess.run(
        [sys.executable, "-c", "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
         "import tierrun.torchrun_plugin as p;"
         "print(r._registry['tierrun'] is p.create_tierrun, r._registry['parallel'] is p.create_parallel,"
         " r._registry['tierrun-etcd'] is p.create_tierrun_etcd)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert registered.stdout.split() == ["True"] * 3, registered.stderr[-3000:]

    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = []
    for k, is_host in enumerate(("true", "false")):
        with open(logs[k], "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--rdzv-backend", "tierrun", "--rdzv-endpoint", f"127.0.1.1:{port}", "--rdzv-id", "stock",
                 "--rdzv-conf", f"is_host={is_host},last_call_timeout=1", "--local-addr", f"127.0.1.{k + 2}",
                 str(SCRIPTS / "collectives.py")], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True))
    assert finish(procs, timeout=120) == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    rows = results(*logs)
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2, 3], rows
    assert all(r["world"] == "4" and r["sum"] == "10" for r in rows), rows
    # torch's launcher, tierrun's rendezvous: each round's workers get a namespace port
    assert all(r["master"].startswith("127.0.1.1:") and r["master"] != f"127.0.1.1:{port}" for r in rows)
    host, client = (log.read_text() for log in logs)
    assert re.search(r"rdzv_backend\s+: tierrun\n", host), host[-3000:]
    assert "this node hosts the job's store" in host and "hosts the job's store" not in client


def test_a_backend_without_its_extra_fails_in_one_line():
    """requests (the etcd extra's) cannot be imported: tierrun --rdzv_backend tierrun-etcd
    says so in one line and exits 1; torchrun's creator raises the same message."""
    code = (
        "import sys; sys.modules['requests'] = None\n"
        "from tierrun.cli import main\n"
        "rc = main(['--rdzv_backend', 'tierrun-etcd', '--rdzv_endpoint', '127.0.0.1:1', '--nnodes', '2',"
        " 'train.py'])\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from tierrun.torchrun_plugin import create_tierrun_etcd\n"
        "try:\n"
        "    create_tierrun_etcd(RendezvousParameters('tierrun-etcd', '127.0.0.1:1', 'x', 1, 1))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = ("--rdzv_backend tierrun-etcd needs the Python module 'requests', which is not installed: "
            "pip install 'tierrun[etcd]'")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr == f"tierrun: error: {line}\n"
    assert out.stdout == f"MissingExtraError {line}\n"
