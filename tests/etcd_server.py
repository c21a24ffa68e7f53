"""A real etcd server (Debian's etcd-server package) on loopback, for the tests."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from launch import free_port


class EtcdServer:
    """``start`` blocks until etcd answers /health (``RuntimeError`` with its log if it
    does not within 30 s). The v2 API is on: torch's etcd backends use it."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: run `make install` (it installs etcd-server)")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.log = data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EtcdServer:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"test={peer}", "--enable-v2=true"]
        with open(self.log, "w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy on {client}:\n{self.log.read_text()[-2000:]}")

    def stop(self, kill: bool = False) -> None:
        """Terminate etcd (``kill``: SIGKILL, no clean shutdown); its data stays, so
        ``start`` brings the same cluster back on the same ports."""
        if self.proc is not None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
