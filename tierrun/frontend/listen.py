"""Listening sockets: dual-stack TCP and Unix (path or Linux abstract name).

Only forward resolution of a host name given by the user; never a reverse lookup.
TCP connections accepted here probe a silent peer (keepalive, inherited from the
listening socket on Linux): a client whose host vanished without closing (half-open)
is closed after ``KEEPALIVE_IDLE + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL`` seconds of
silence instead of holding its connection forever.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import NamedTuple

#: Accept queue length; the kernel caps it at net.core.somaxconn.
DEFAULT_BACKLOG = 16384
#: Keepalive probes of accepted TCP connections: first after this many idle seconds,
#: then every KEEPALIVE_INTERVAL; after KEEPALIVE_COUNT unanswered the kernel closes it.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 30, 10, 3

_ANY_HOSTS = (None, "", "*", "::")


class ListenError(OSError):
    """A socket this process could not listen on. ``where``: which (``127.0.0.1:29500``,
    ``the Unix socket /path``), for a person; ``flag``: the option that chose it. Its
    ``errno`` and ``strerror`` are the system's (or what is wrong at a Unix path)."""

    def __init__(self, error: OSError, where: str, flag: str) -> None:
        super().__init__(error.errno, error.strerror or str(error))
        self.where = where
        self.flag = flag

    def __str__(self) -> str:
        taken = self.errno == errno.EADDRINUSE and not self.where.startswith("the Unix")
        return (f"cannot listen on {self.where}: {self.strerror}"
                + (f". Pick another {self.flag}, or stop whatever uses it." if taken else ""))


def tcp_listen_socket(
    host: str | None, port: int, backlog: int = DEFAULT_BACKLOG, reuse_port: bool = False
) -> socket.socket:
    """Bind and listen on ``host:port``.

    With no host (or ``::``), listen on every address, IPv6 and v4-mapped IPv4 at once,
    falling back to plain IPv4 where the machine has no IPv6. Raises ``ListenError``
    (naming ``host:port`` and ``--port``).
    """
    try:
        return _tcp_listen_socket(host, port, backlog, reuse_port)
    except OSError as e:
        where = "*" if host in _ANY_HOSTS else f"[{host}]" if ":" in host else host  # type: ignore[operator]
        raise ListenError(e, f"{where}:{port}", "--port") from e


def _tcp_listen_socket(host: str | None, port: int, backlog: int, reuse_port: bool) -> socket.socket:
    if host in _ANY_HOSTS:
        candidates = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
    else:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        candidates = [(family, addr) for family, _, _, _, addr in infos]
    last_error: OSError | None = None
    for family, addr in candidates:
        try:  # (protocol TCP, not 0: what it accepts has it too, and asyncio sets TCP_NODELAY
            # only on those; uvloop sets it on every TCP socket: see frontend.connection)
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        except OSError as e:  # no IPv6 on this machine
            last_error = e
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            _keepalive(sock)
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
            return sock
        except OSError as e:
            sock.close()
            last_error = e
            if e.errno == getattr(socket, "EADDRINUSE", 98) or host not in _ANY_HOSTS:
                raise
    assert last_error is not None
    raise last_error


#: Receive buffer asked for a UDP socket (the kernel caps it at net.core.rmem_max): a
#: burst of datagrams waits there while the process is busy.
UDP_RECEIVE_BUFFER = 4 << 20


def udp_socket_beside(tcp: socket.socket) -> socket.socket:
    """A UDP socket bound to the address and port a listening TCP socket is bound to
    (dual-stack too, if it is). Raises ``OSError`` (the UDP port is someone else's)."""
    family = tcp.family
    addr = tcp.getsockname()
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            v6only = tcp.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RECEIVE_BUFFER)
        except OSError:
            pass
        sock.bind(addr[:2] if family == socket.AF_INET else addr)
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        raise


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # (Linux; elsewhere the system's defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def unix_address(path: str) -> str:
    """``@name`` names a Linux abstract socket; anything else is a filesystem path."""
    return "\0" + path[1:] if path.startswith("@") else path


class UnixFile(NamedTuple):
    """The file of a Unix socket a process bound (empty ``path`` for an abstract one)."""

    path: str
    inode: int


def unix_listen_socket(path: str, backlog: int = DEFAULT_BACKLOG) -> tuple[socket.socket, UnixFile]:
    """Listen on a Unix socket; a filesystem socket is made mode 0600 (owner only).
    Returns it and its file, for :func:`remove_unix_file` when done.

    A file already at ``path`` is replaced only if it is a socket nobody listens on (one
    left by a process that died); anything else raises ``OSError`` saying what is
    there: a regular file (or any other kind) is never deleted, another process's live
    socket never taken over. Raises ``ListenError`` (naming the path and ``--unix``)."""
    try:
        return _unix_listen_socket(path, backlog)
    except OSError as e:
        raise ListenError(e, f"the Unix socket {path}", "--unix") from e


def _unix_listen_socket(path: str, backlog: int) -> tuple[socket.socket, UnixFile]:
    address = unix_address(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not address.startswith("\0"):
            _remove_stale(address)
            old_umask = os.umask(0o177)
            try:
                sock.bind(address)
            finally:
                os.umask(old_umask)
            owned = UnixFile(address, os.stat(address).st_ino)
        else:
            sock.bind(address)
            owned = UnixFile("", 0)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock, owned


def _remove_stale(path: str) -> None:
    """Remove ``path`` if it is a socket nobody listens on. Raises ``OSError`` if it
    is anything else. Blocks for one local connect() at most."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, "it exists and is not a socket (left as it is): name a path "
                      "where nothing is, or remove it yourself", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # (nobody listens: left by a process that died)
        return
    except BlockingIOError:  # (its accept queue is full: it is alive)
        pass
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another process listens on it: stop it, or name another path", path)


def remove_unix_file(owned: UnixFile) -> None:
    """Remove the socket file a process bound, if it is still there (not replaced
    since by another process's). Never raises."""
    if not owned.path:
        return
    try:
        if os.lstat(owned.path).st_ino == owned.inode:
            os.unlink(owned.path)
    except OSError:
        pass


def describe(sock: socket.socket) -> str:
    """``tcp [::]:29500`` or ``unix /path`` / ``unix @name``, for humans and for parsing."""
    if sock.family == socket.AF_UNIX:
        name = sock.getsockname()
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return "unix " + ("@" + name[1:] if name.startswith("\0") else name)
    host, port = sock.getsockname()[:2]
    return f"tcp [{host}]:{port}" if ":" in host else f"tcp {host}:{port}"
