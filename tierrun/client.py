"""A small blocking client of the torch store protocol, for places torch's own client
cannot go (Unix sockets) and for tools and tests. Not thread-safe: one per thread.

Keys are sent as given (torch's client adds a leading ``/``; this one does not).
"""

from __future__ import annotations

import socket
import struct

from .frontend.listen import unix_address
from .protocol import Op
from .protocol.opcodes import VALIDATION_MAGIC
from .protocol.requests import encode_request


class StoreClientError(RuntimeError):
    pass


#: What :meth:`StoreClient.pipeline` sends, by the answer each gets.
_NO_ANSWER = frozenset({Op.SET, Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH})
_INT_ANSWER = frozenset({Op.ADD, Op.GETNUMKEYS, Op.QUEUE_LEN})
_BYTES_ANSWER = frozenset({Op.GET, Op.COMPARE_SET})
_STATUS_ANSWER = frozenset({Op.CHECK, Op.WAIT})
_PIPELINED = _NO_ANSWER | _INT_ANSWER | _BYTES_ANSWER | _STATUS_ANSWER


class StoreClient:
    """``StoreClient(("127.0.0.1", 29500))`` or ``StoreClient("@abstract-name")`` or a path.

    Every method blocks until the server answers; ``wait`` honours ``timeout`` (seconds)
    and sends CANCEL_WAIT when it expires, raising ``TimeoutError``.
    """

    def __init__(self, address: tuple[str, int] | str, timeout: float = 30.0) -> None:
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(unix_address(address))
        else:
            self._sock = socket.create_connection(address, timeout=timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        self._send((Op.VALIDATE, VALIDATION_MAGIC), (Op.PING, 0x5EED))
        if self._u32() != 0x5EED:
            raise StoreClientError("server answered PING with another nonce")

    # -- plumbing ---------------------------------------------------------------------

    def _send(self, *reqs: tuple) -> None:
        self._sock.sendall(b"".join(encode_request(r) for r in reqs))

    def _exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self._sock.recv(min(n, 1 << 20))
            if not chunk:
                raise StoreClientError("the store closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _u8(self) -> int:
        return self._exact(1)[0]

    def _u32(self) -> int:
        return struct.unpack("<I", self._exact(4))[0]

    def _i64(self) -> int:
        return struct.unpack("<q", self._exact(8))[0]

    def _vec(self) -> bytes:
        (n,) = struct.unpack("<Q", self._exact(8))
        return self._exact(n)

    def _answer(self, op: Op) -> object:
        """Read the answer to one request of ``op``, one of ``_PIPELINED``."""
        if op in _NO_ANSWER:
            return None
        if op in _INT_ANSWER:
            return self._i64()
        if op in _BYTES_ANSWER:
            return self._vec()
        return self._u8()

    # -- operations -------------------------------------------------------------------

    def pipeline(self, *reqs: tuple) -> list:
        """Send ``reqs`` (tuples as ``encode_request`` takes them) in one write, then read
        their answers: one round trip for all. A store answers a connection's requests in
        the order they came, except a WAIT that blocks, whose answer comes when its keys
        are set, after those of what follows it: so a WAIT may only come last. Each answer
        is the raw value: None (SET, APPEND, MULTI_SET, QUEUE_PUSH), an int (ADD,
        GETNUMKEYS, QUEUE_LEN; CHECK and WAIT: their status byte, 0 = ready / done),
        bytes (COMPARE_SET; GET, which does not WAIT first: a missing key reads as
        empty). Raises ValueError for other ops, or a WAIT before the last, before
        sending anything."""
        for i, r in enumerate(reqs):
            if r[0] not in _PIPELINED or (r[0] == Op.WAIT and i != len(reqs) - 1):
                raise ValueError(f"{r[0]!r} cannot be pipelined by this client"
                                 + (" but last" if r[0] == Op.WAIT else ""))
        self._send(*reqs)
        return [self._answer(r[0]) for r in reqs]

    def ping(self, nonce: int = 1) -> int:
        self._send((Op.PING, nonce))
        return self._u32()

    def set(self, key: bytes, value: bytes) -> None:
        self._send((Op.SET, key, value))

    def get(self, key: bytes) -> bytes:
        self.wait([key])
        self._send((Op.GET, key))
        return self._vec()

    def add(self, key: bytes, delta: int) -> int:
        self._send((Op.ADD, key, delta))
        return self._i64()

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        self._send((Op.COMPARE_SET, key, expected, desired))
        return self._vec()

    def check(self, keys: list[bytes]) -> bool:
        self._send((Op.CHECK, tuple(keys)))
        return self._u8() == 0

    def wait(self, keys: list[bytes], timeout: float | None = None) -> None:
        self._send((Op.WAIT, tuple(keys)))
        self._sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            answer = self._u8()
        except TimeoutError:
            self._sock.settimeout(self.timeout)
            self._send((Op.CANCEL_WAIT,))
            answer = self._u8()
            if answer == 0:  # the wait completed just before the cancel
                answer = self._u8()
            raise TimeoutError(f"wait for {keys!r} timed out") from None
        finally:
            self._sock.settimeout(self.timeout)
        if answer != 0:
            raise StoreClientError(f"unexpected WAIT answer {answer}")

    def num_keys(self) -> int:
        self._send((Op.GETNUMKEYS,))
        return self._i64()

    def delete_key(self, key: bytes) -> bool:
        self._send((Op.DELETE_KEY, key))
        return self._i64() == 1

    def append(self, key: bytes, value: bytes) -> None:
        self._send((Op.APPEND, key, value))

    def multi_get(self, keys: list[bytes], wait: bool = True) -> list[bytes]:
        """``wait=False``: missing keys read as empty (tierrun's store), no WAIT first
        (torch's client waits for every key)."""
        if wait:
            self.wait(keys)
        self._send((Op.MULTI_GET, tuple(keys)))
        return [self._vec() for _ in keys]

    def multi_set(self, keys: list[bytes], values: list[bytes]) -> None:
        self._send((Op.MULTI_SET, tuple(keys), tuple(values)))

    def queue_push(self, key: bytes, value: bytes) -> None:
        self._send((Op.QUEUE_PUSH, key, value))

    def queue_pop(self, key: bytes, block: bool = True) -> bytes | None:
        if block:
            self.wait([key])
        self._send((Op.QUEUE_POP, key))
        if self._i64() == 0:
            return None
        return self._vec()

    def queue_len(self, key: bytes) -> int:
        self._send((Op.QUEUE_LEN, key))
        return self._i64()

    def list_keys(self) -> list[bytes]:
        self._send((Op.LIST_KEYS,))
        return [self._vec() for _ in range(self._i64())]

    def barrier(self, key: bytes, world_size: int) -> None:
        self._send((Op.BARRIER, key, world_size))
        if self._u8() != 0:
            raise StoreClientError("unexpected BARRIER answer")

    def close(self) -> None:
        self._sock.close()

    def abort(self) -> None:
        """End a blocking call in another thread (it raises ``StoreClientError``)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
