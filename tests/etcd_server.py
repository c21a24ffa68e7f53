"""A real etcd server (Debian's etcd-server package) on loopback, for the tests."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

from launch import free_port


class EtcdServer:
    """``start`` blocks until etcd answers /health (``RuntimeError`` with its log if it
    does not within 30 s). The v2 API is on: torch's etcd backends use it."""

    def __init__(self, data_dir: Path, tls: Certificates | None = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: run `make install` (it installs etcd-server)")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.log = data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None
        self.tls = tls

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"test={peer}", "--enable-v2=true"]
        context = None
        if self.tls:
            t = self.tls
            cmd += ["--cert-file", str(t.server_cert), "--key-file", str(t.server_key),
                    "--trusted-ca-file", str(t.ca), "--client-cert-auth"]
            context = ssl.create_default_context(cafile=str(t.ca))
            context.load_cert_chain(str(t.client_cert), str(t.client_key))
        with open(self.log, "w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1, context=context) as r:
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


class Certificates:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate,
    made with the openssl command."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.ca, ca_key = directory / "ca.pem", directory / "ca-key.pem"
        self.server_cert, self.server_key = directory / "server.pem", directory / "server-key.pem"
        self.client_cert, self.client_key = directory / "client.pem", directory / "client-key.pem"
        run = lambda *args: subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)  # noqa: E731
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tierrun-test-ca",
            "-keyout", ca_key, "-out", self.ca)
        for cert, key, cn in ((self.server_cert, self.server_key, "127.0.0.1"),
                              (self.client_cert, self.client_key, "tierrun-test-client")):
            csr, ext = directory / f"{cn}.csr", directory / f"{cn}.ext"
            ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
            run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", csr)
            run("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
                "-extfile", ext, "-out", cert)
