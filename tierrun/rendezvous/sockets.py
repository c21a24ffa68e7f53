"""Socket helpers of a node's view of the job's store (``job_store``): addresses as
links name them, and what a node that does not host the store checks with Python's
own sockets (quietly: torch's client prints C++ stack traces)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

from ..link.frames import HELLO
from ..protocol import Op
from ..protocol.opcodes import VALIDATION_MAGIC
from ..protocol.requests import encode_request

#: What ``await_listener`` found listening: a store of torch's protocol (a flat job's
#: store host), a port that takes node links only (a tiered job's store host), or
#: something that accepts connections but never answers (a frozen store host, another
#: program on the port), where torch's client would wait past any timeout.
TORCH_STORE, LINKS_ONLY, SILENT = "torch store", "links only", "silent"
_NONCE = 0x7E57


def bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def link_address(local_addr: str | None, store_host: str, port: int) -> str:
    """Where a node takes other nodes' links (a tree's relay): ``local_addr`` if given,
    else the address this machine sends from to reach the store host (the kernel's
    route, chosen by a UDP socket's connect: no packet is sent, no name is looked up in
    reverse), which the other nodes reach it by too: the first of the store host's
    addresses this machine has a route to, in the order a TCP connection tries them;
    the host name if there is none (or the name does not resolve here)."""
    if local_addr:
        return local_addr
    try:
        addresses = socket.getaddrinfo(store_host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        addresses = []
    for family, _, _, _, address in addresses:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)
                return probe.getsockname()[0]
        except OSError:  # (no route from here: an IPv6 address on a machine without IPv6)
            continue
    return socket.gethostname()


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port``, never one to itself: connecting on the store
    host's own machine to a port nobody listens on yet can, once in tens of thousands
    of tries, pick that very port as its source (TCP's simultaneous open): it then
    "connects" to itself and holds the port the store is about to listen on. Raises
    ConnectionRefusedError for that, as for nobody listening."""
    sock = socket.create_connection((host, port), timeout)
    if sock.getsockname() == sock.getpeername():
        sock.close()
        raise ConnectionRefusedError(errno.ECONNREFUSED, f"nothing listens on {host}:{port} yet")
    return sock


def await_listener(host: str, port: int, timeout: float, on_silent: Callable[[], None] = lambda: None) -> str | None:
    """What accepts connections on ``host:port`` within ``timeout`` seconds
    (``TORCH_STORE``, ``LINKS_ONLY`` or ``SILENT``), or None: nothing. Tries every 0.1 s
    to 1 s (backing off), with Python's sockets (quiet), and on the connection it gets
    sends torch's VALIDATE and a PING: a store of torch's protocol answers the PING, a
    links-only port greets every connection with a link's HELLO (and closes this one,
    which is no link), where torch's client would retry in C++ stack traces until its
    timeout. One round trip; a peer that has answered nothing by ``timeout`` (2 s after
    it took the connection at least) is ``SILENT`` (``on_silent()`` is called the first
    time a connection it took answered nothing: the caller may say so while it waits)."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    silent = False
    while True:
        try:
            with connect(host, port, max(min(deadline - time.monotonic(), 5.0), 0.1)) as sock:
                sock.sendall(encode_request((Op.VALIDATE, VALIDATION_MAGIC)) + encode_request((Op.PING, _NONCE)))
                # (a slow store host has until the deadline to answer, and 2 s at least;
                # silent for 2 s, it is said so meanwhile)
                sock.settimeout(2.0)
                head = _answer(sock)
                if head == b"" and not silent:
                    on_silent()
                    sock.settimeout(max(deadline - time.monotonic(), 0.1))
                    head = _answer(sock)
                if head is None or head:
                    return _what_answered(head)
                silent = True
        except OSError:
            pass
        if time.monotonic() + delay > deadline:
            return SILENT if silent else None
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def _answer(sock: socket.socket) -> bytes | None:
    """The first bytes the peer sent after VALIDATE and PING: b"" if nothing within the
    socket's timeout, None if the connection failed (a peer that closed or reset it)."""
    pong, head = struct.pack("<I", _NONCE), b""
    try:
        while len(head) < 5 and head[:4] != pong:  # (a PING's answer is 4 bytes; a frame's header 5)
            chunk = sock.recv(5 - len(head))
            if not chunk:
                return head or None
            head += chunk
    except TimeoutError:
        return head
    except OSError:
        return head or None
    return head


def _what_answered(head: bytes | None) -> str:
    """``LINKS_ONLY`` if the peer's first bytes are a link's HELLO frame rather than
    the answer to a PING; else ``TORCH_STORE`` (also when it cannot tell: torch's
    client then says what it finds)."""
    pong = struct.pack("<I", _NONCE)
    return LINKS_ONLY if head is not None and len(head) == 5 and head[:4] != pong and head[4] == HELLO else TORCH_STORE


def watch_connection(host: str, port: int, timeout: float) -> socket.socket | None:
    try:
        sock = connect(host, port, timeout)
    except OSError:
        return None  # the rendezvous itself reports an unreachable store
    sock.setblocking(False)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def port_in_use(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("0.0.0.0", port))
        return False
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()


_LOCALHOST = ("localhost", "127.0.0.1", "::1")


def hosts_store(host: str, local_addr: str | None) -> bool:
    """Whether the endpoint ``host`` names this node, as torch's c10d infers it (its
    host name or one of its addresses: ``_matches_machine_hostname``). Given
    ``--local_addr``, the node is that address, so a loopback endpoint (several simulated
    nodes on one machine) names only the node whose address it is or resolves to; any
    other endpoint names it also if it names this machine (a host name where the node's
    address is another of its interfaces')."""
    if not local_addr:
        return _matches_machine_hostname(host)
    if host == local_addr or (host in _LOCALHOST and local_addr in _LOCALHOST):
        return True
    endpoint = _addresses(host)
    if endpoint & _addresses(local_addr):
        return True
    return bool(endpoint) and not any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in endpoint) \
        and _matches_machine_hostname(host)


def on_this_machine(host: str) -> bool:
    """Whether the endpoint ``host`` is on this machine, whatever ``--local_addr`` makes
    the node: a loopback name or address, or one of the machine's own names."""
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in _addresses(host)) \
        or _matches_machine_hostname(host)


def unresolved(host: str) -> str | None:
    """A sentence for a node waiting for ``host``, if that name does not resolve here
    (a typo, or a name the cluster's DNS does not know yet); None if it does, or is an
    address. One forward lookup (it may wait for DNS): call it off the request path."""
    try:
        ipaddress.ip_address(host.split("%")[0])
        return None
    except ValueError:
        pass
    if _addresses(host):
        return None
    return (f"The name {host} does not resolve from this node: check its spelling, and that this node's DNS "
            "(or /etc/hosts) knows it.")


def _addresses(name: str) -> set[str]:
    """The addresses ``name`` resolves to (none if it does not)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


def loopback_source(addr: str | None, upstream_host: str) -> str | None:
    """``addr`` (a node's --local_addr) as the local address of a connection to
    ``upstream_host``, when it is a loopback IP literal (nodes simulated on one machine)
    of the family ``upstream_host`` is or resolves to (a name: one lookup, never a
    reverse one); else None, the system's choice."""
    try:
        ip = ipaddress.ip_address((addr or "").split("%")[0])
    except ValueError:
        return None
    if not ip.is_loopback:
        return None
    want = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        return addr if socket.getaddrinfo(upstream_host, None, want, socket.SOCK_STREAM) else None
    except (OSError, UnicodeError):
        return None
