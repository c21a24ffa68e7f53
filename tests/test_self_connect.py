"""A node polling the store host's port on the store host's own machine never takes a
TCP connection to itself for the store (a simultaneous open: the source port it drew
is the port it connects to, with nobody listening): it would report the store up and
hold the port the store is about to listen on. Seen once in a multi-node test."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tierrun.rendezvous import sockets


def _self_connected(address, timeout=None, source_address=None):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.connect(s.getsockname())  # (what the kernel allows when the ports happen to match)
    return s


def test_a_connection_to_itself_counts_as_nobody_listening(monkeypatch):
    monkeypatch.setattr(sockets.socket, "create_connection", _self_connected)
    with pytest.raises(ConnectionRefusedError, match="nothing listens"):
        sockets.connect("127.0.0.1", 1, 1.0)
    assert not sockets.await_listener("127.0.0.1", 1, 0.3)
    assert sockets.watch_connection("127.0.0.1", 1, 1.0) is None


def test_a_listener_is_found():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        # (it accepts, into its backlog, and never answers a PING: a frozen store host)
        assert sockets.await_listener("127.0.0.1", server.getsockname()[1], 1.0) == sockets.SILENT


def test_a_slow_store_is_no_silent_one():
    """A store host that takes its time to answer the probe's PING (loaded, still
    starting) is a store: it has until the timeout, and 2 s after taking the connection
    at least, to answer."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def slow() -> None:
            conn, _ = server.accept()
            with conn:
                time.sleep(1.5)
                conn.recv(64)  # (VALIDATE, PING)
                conn.sendall(struct.pack("<I", sockets._NONCE))
                time.sleep(0.5)

        threading.Thread(target=slow, daemon=True).start()
        assert sockets.await_listener("127.0.0.1", server.getsockname()[1], 1.0) == sockets.TORCH_STORE
