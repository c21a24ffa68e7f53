"""A man in the middle of node links, for attack tests: a TCP relay between node proxies
and the store host that forwards, cuts connections, injects bytes into a stream, or
answers new connections itself as an impostor would (no token, so it cannot seal)."""

from __future__ import annotations

import os
import socket
import struct
import threading

from tierrun.link.frames import BATCH, ERROR, HELLO, VERSION, frame

#: What the relay does with a new connection.
FORWARD, IMPOSTOR, GARBAGE = "forward", "impostor", "garbage"


class Relay:
    """Listens on 127.0.0.1; ``port`` is where proxies should link."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = FORWARD
        self.impostors = 0  # connections answered as an impostor (or with garbage)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket, threading.Lock, threading.Lock]] = []
        #: The last write a proxy sent the store host that began with a BATCH frame.
        self.last_batch: bytes | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _serve(self, down: socket.socket) -> None:
        mode = self.mode
        if mode != FORWARD:
            self.impostors += 1
            with down:
                try:
                    down.recv(1)  # the link's first byte
                    if mode == GARBAGE:
                        down.sendall(b"\xff" * 64)
                    else:  # a store host without the token: HELLO, then refuse the session
                        down.sendall(frame(HELLO, struct.pack("<H", VERSION) + os.urandom(32)))
                        down.recv(4096)  # AUTH + SESSION + ACK
                        down.sendall(frame(ERROR, b"this store host does not know the node's link session"))
                    down.settimeout(2)
                    down.recv(4096)  # (until the proxy closes)
                except OSError:
                    pass
            return
        try:
            up = socket.create_connection(self.upstream)
        except OSError:
            down.close()
            return
        to_up, to_down = threading.Lock(), threading.Lock()
        with self._lock:
            self._pairs.append((down, up, to_up, to_down))
        threading.Thread(target=self._pump, args=(down, up, to_up, True), daemon=True).start()
        self._pump(up, down, to_down, False)

    def _pump(self, src: socket.socket, dst: socket.socket, lock: threading.Lock, upward: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if upward and len(data) > 4 and data[4] == BATCH:
                    self.last_batch = data
                with lock:
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, data: bytes, upward: bool) -> None:
        """Write ``data`` into every forwarded stream, between two of its writes:
        towards the store host (``upward``) or towards the node."""
        with self._lock:
            pairs = list(self._pairs)
        for down, up, to_up, to_down in pairs:
            with to_up if upward else to_down:
                try:
                    (up if upward else down).sendall(data)
                except OSError:
                    pass

    def cut(self) -> None:
        """Close every forwarded connection (both ends)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for down, up, _, _ in pairs:
            for s in (down, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.cut()
        self._listener.close()


def forged(ftype: int, payload: bytes) -> bytes:
    """A frame as an attacker without the session's keys sends it: a MAC of zeros."""
    return frame(ftype, payload) + bytes(16)


__all__ = ["FORWARD", "GARBAGE", "IMPOSTOR", "Relay", "forged", "ERROR"]
