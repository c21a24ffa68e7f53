"""A store process's open files: as many as the system lets it have, and never all of
them taken by connections.

Every connection a store or proxy process accepts is a file descriptor. When none is
left, ``accept`` fails with EMFILE: libuv (under uvloop) then accepts and closes the
waiting connections at once, saying nothing (and, if even that fails, uvloop closes the
listening socket for good), so agents and workers fail to connect with no line
anywhere saying why. So each store process (``tierrun store``, ``tierrun proxy``, a
store's front-end process):

- raises its soft limit of open files to its hard limit (``ulimit -n`` is often 1,024
  by default, and a flat job's node 0 holds a connection per agent and per worker);
- takes at most its soft limit less the descriptors it holds at its start and
  ``RESERVE`` connections, all its front-ends together (clients and links): past that
  it accepts and closes at once with a line naming the limit (as past
  ``--max-connections``), so a descriptor is always left for the next ``accept``.

The system's limits for large jobs are in the guide (System limits).
"""

from __future__ import annotations

import os
import resource

#: Descriptors kept, beyond those open when the process starts, for what is not a
#: connection: listening sockets, the event loop's, the link upstream, a spare.
RESERVE = 16
_NR_OPEN = "/proc/sys/fs/nr_open"  # (the most a process may raise its limit to, Linux)


def raise_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (or to the
    system's most, when the hard limit is unlimited); the soft limit now. Never fails:
    a limit that cannot be raised stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _system_most()
    if soft == resource.RLIM_INFINITY:
        return target
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def kept(in_use: int | None = None) -> int:
    """Descriptors a store process keeps for itself: ``in_use`` (default: those open
    now, at its start) and ``RESERVE``."""
    if in_use is None:
        try:
            in_use = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
        except OSError:
            in_use = 16
    return in_use + RESERVE


def connection_cap(max_connections: int, soft_limit: int, keep: int) -> int:
    """The connections a process whose soft limit of open files is ``soft_limit``, and
    which keeps ``keep`` of them for itself, may take when asked for at most
    ``max_connections`` (1 at least)."""
    return max(1, min(max_connections, soft_limit - keep))


def _system_most() -> int:
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def store_host_shortfall(nodes: int, workers: int, tiered: bool, fanout: int, store_processes: int,
                         max_connections: int) -> str | None:
    """What a node says, before a job of up to ``nodes`` nodes of ``workers`` workers
    starts, if a store process here could not take the connections such a job brings
    to its store host (a flat job: every agent and worker, spread over
    ``store_processes``; tiered: a link per node and the node's own clients; a tree:
    ``fanout`` links, never a problem); None if it could. Reads this process's hard
    limit, which the store processes it starts inherit. O(1)."""
    if tiered and fanout:
        return None
    need = nodes + workers + 1 if tiered else -(-nodes * (workers + 1) // max(store_processes, 1))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    most = hard if hard != resource.RLIM_INFINITY else _system_most()
    cap = connection_cap(max_connections, most, kept(4))  # (4: a store process's own at its start, about)
    if need <= cap:
        return None
    takes = f"takes at most {_n(cap, 'connection')}"
    by_files = cap < max_connections
    why = (f"a store process here may open at most {most:,} files (the hard limit, ulimit -Hn) and {takes}"
           if by_files else f"a store process {takes}")
    host = "its store host" if store_processes <= 1 else "each front-end process of its store host"
    return (f"a {'tiered' if tiered else 'flat'} job of up to {_n(nodes, 'node')} x {_n(workers, 'worker')} brings "
            f"about {need:,} connections to {host}, but {why}: past that, connections are refused and the job "
            "cannot form. " + ("Raise the hard limit of open files (guide: System limits)." if by_files else "")
            + ("" if tiered else " Or run tiered (--tiered, or --store-fanout 8), which needs one connection per node."))

def _n(count: int, what: str) -> str:
    return f"{count:,} {what}{'' if count == 1 else 's'}"
