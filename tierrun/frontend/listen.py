"""Listening sockets: dual-stack TCP and Unix (path or Linux abstract name).

Only forward resolution of a host name given by the user; never a reverse lookup.
"""

from __future__ import annotations

import os
import socket

#: Accept queue length; the kernel caps it at net.core.somaxconn.
DEFAULT_BACKLOG = 16384

_ANY_HOSTS = (None, "", "*", "::")


def tcp_listen_socket(
    host: str | None, port: int, backlog: int = DEFAULT_BACKLOG, reuse_port: bool = False
) -> socket.socket:
    """Bind and listen on ``host:port``.

    With no host (or ``::``), listen on every address, IPv6 and v4-mapped IPv4 at once,
    falling back to plain IPv4 where the machine has no IPv6. Raises ``OSError``.
    """
    if host in _ANY_HOSTS:
        candidates = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
    else:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        candidates = [(family, addr) for family, _, _, _, addr in infos]
    last_error: OSError | None = None
    for family, addr in candidates:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:  # no IPv6 on this machine
            last_error = e
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
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


def unix_address(path: str) -> str:
    """``@name`` names a Linux abstract socket; anything else is a filesystem path."""
    return "\0" + path[1:] if path.startswith("@") else path


def unix_listen_socket(path: str, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """Listen on a Unix socket; a filesystem socket is made mode 0600 (owner only)."""
    address = unix_address(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not address.startswith("\0"):
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass
            old_umask = os.umask(0o177)
            try:
                sock.bind(address)
            finally:
                os.umask(old_umask)
        else:
            sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def describe(sock: socket.socket) -> str:
    """``tcp [::]:29500`` or ``unix /path`` / ``unix @name``, for humans and for parsing."""
    if sock.family == socket.AF_UNIX:
        name = sock.getsockname()
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return "unix " + ("@" + name[1:] if name.startswith("\0") else name)
    host, port = sock.getsockname()[:2]
    return f"tcp [{host}]:{port}" if ":" in host else f"tcp {host}:{port}"
