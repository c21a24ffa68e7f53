"""Replay real torch 2.13 traffic: our answers must equal the recorded ones byte for byte."""

import socket
from collections import defaultdict
from pathlib import Path

import pytest

from tierrun.core import StoreCore
from tierrun.protocol import RequestParser

TRACES = sorted((Path(__file__).parent / "fixtures").glob("*.trace"))


def read_trace(path):
    events = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5:
            events.append((parts[1], parts[2], bytes.fromhex(parts[4])))
        elif len(parts) >= 3:
            events.append((parts[1], parts[2], b""))
    return events


class Conn:
    def __init__(self):
        self.parser = RequestParser()
        self.out = bytearray()

    def wake(self, reply):
        self.out += reply


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_sans_io_replay(trace):
    core = StoreCore()
    conns = defaultdict(Conn)
    expected = defaultdict(bytearray)
    for conn_id, direction, data in read_trace(trace):
        if direction == "C->S":
            c = conns[conn_id]
            for req in c.parser.feed(data):
                reply = core.execute(req, c)
                if reply is not None:
                    c.out += reply
        elif direction == "S->C":
            expected[conn_id] += data
    assert expected
    for conn_id, want in expected.items():
        assert bytes(conns[conn_id].out) == bytes(want), conn_id


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_socket_replay_against_the_server(store, trace):
    socks = {}
    try:
        for conn_id, direction, data in read_trace(trace):
            if direction == "ACCEPT":
                socks[conn_id] = socket.create_connection(("127.0.0.1", store.port), timeout=10)
            elif direction == "C->S":
                socks[conn_id].sendall(data)
            elif direction == "S->C":
                got = b""
                while len(got) < len(data):
                    chunk = socks[conn_id].recv(len(data) - len(got))
                    assert chunk, f"{conn_id}: server closed the connection"
                    got += chunk
                assert got == data, conn_id
            elif direction == "EOF":
                socks.pop(conn_id).close()
    finally:
        for s in socks.values():
            s.close()
