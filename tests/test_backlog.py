"""A connect storm must not overflow the store's accept queue: the kernel completes
handshakes into the listen backlog even while the server is busy (here: stopped)."""

import os
import select
import signal
import socket

from tierrun.server import StoreProcess


def test_hundreds_of_connects_complete_while_the_server_is_not_accepting():
    n = 600  # asyncio's default backlog of 100 would leave ~500 of these in SYN retries
    with StoreProcess(host="127.0.0.1", port=0) as store:
        os.kill(store.pid, signal.SIGSTOP)
        socks = []
        try:
            for _ in range(n):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", store.port))
                socks.append(s)
            pending = set(socks)
            for _ in range(40):  # 2 s
                _, writable, _ = select.select([], list(pending)[:1000], [], 0.05)
                for s in writable:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        pending.discard(s)
                if not pending:
                    break
            assert not pending, f"{len(pending)} of {n} connects did not complete within 2 s"
        finally:
            os.kill(store.pid, signal.SIGCONT)
            for s in socks:
                s.close()
