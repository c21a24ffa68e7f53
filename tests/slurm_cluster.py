"""A real Slurm cluster on this machine, from Debian's packages (munge, slurmctld,
slurmd, slurm-client: ``make install``), for the tests: one munged, one slurmctld and one
slurmd per simulated node, each node on its own loopback address (127.0.1.k), every
daemon on free ports, with its configuration, state and logs in a directory of its own.
Nothing under /etc is used or changed; clients find the cluster through ``SLURM_CONF``.

Several slurmd on one host is Slurm's own emulation mode (``slurmd -N NODE``, a
``Port`` per node). Process tracking is ``proctrack/linuxproc`` and there is no task
plugin, so no cgroup is needed. The daemons run as the current user (root in CI)."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from launch import free_port

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo", "scancel")


class SlurmCluster:
    """``start`` blocks until every node is idle (``RuntimeError`` with the daemons' logs
    if they are not within 30 s); ``stop`` ends the daemons it started, by pid."""

    def __init__(self, root: Path, nodes: int = 3, cpus: int = 2) -> None:
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # (daemons: sbin)
        self.bin = {c: shutil.which(c, path=path) for c in COMMANDS}
        missing = [c for c, where in self.bin.items() if where is None]
        if missing:
            raise RuntimeError(f"Slurm is not installed (no {', '.join(missing)}): run `make install` "
                               "(it installs Debian's munge, slurmctld, slurmd and slurm-client)")
        self.root = root
        self.nodes = [f"n{k}" for k in range(1, nodes + 1)]
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "socket"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client (sbatch, srun, scontrol) of this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        host = socket.gethostname().split(".")[0]  # slurmctld checks it runs on SlurmctldHost
        user = pwd.getpwuid(os.getuid()).pw_name
        nodes = "".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.1.{k + 1} Port={free_port()} "
                        f"CPUs={self.cpus} State=UNKNOWN\n" for k, n in enumerate(self.nodes))
        self.conf.write_text(f"""ClusterName=tierruntest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, name: str, *args: str) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen([self.bin[name], *args], stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))

    def start(self) -> SlurmCluster:
        self._write_config()
        m = self.root / "munge"
        # -f: munged refuses root and group-writable paths otherwise (the key is 0600)
        self._daemon("munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={m}/key",
                     f"--pid-file={m}/pid", f"--seed-file={m}/seed", f"--log-file={self.root}/log/munged.log")
        self._wait(lambda: self.munge_socket.exists(), "munged did not create its socket")
        self._daemon("slurmctld", "-D", "-c")
        for node in self.nodes:
            self._daemon("slurmd", "-D", "-N", node)
        self._wait(self._all_idle, "the Slurm nodes did not come up idle")
        return self

    def _all_idle(self) -> bool:
        out = subprocess.run([self.bin["sinfo"], "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{what} within {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def run_batch(self, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> tuple[str, str, str]:
        """``sbatch ARGS``, then wait for the job to end; returns (job id, final state,
        exit code ``"N:SIGNAL"``). Polls ``scontrol show job`` 5 times a second
        (``sbatch --wait`` polls with backoff: ~10 s for a job of a second). Raises
        ``RuntimeError`` if sbatch fails, ``TimeoutError`` after ``timeout``."""
        out = subprocess.run([self.bin["sbatch"], "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr}\n{self.logs()}")
        job = out.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            show = subprocess.run([self.bin["scontrol"], "-o", "show", "job", job], env=self.env, capture_output=True, text=True)
            fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
            if fields.get("JobState") in FINAL_STATES:
                return job, fields["JobState"], fields.get("ExitCode", "?")
            time.sleep(0.2)
        subprocess.run([self.bin["scancel"], job], env=self.env, capture_output=True)
        raise TimeoutError(f"Slurm job {job} did not end within {timeout:.0f} s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted((self.root / "log").iterdir()))

    def stop(self) -> None:
        subprocess.run([self.bin["scontrol"], "shutdown"], env=self.env, capture_output=True, timeout=30)
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
