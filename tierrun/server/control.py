"""The control lines between a store process and its parent: both sides, written and
parsed here, and nowhere else.

A store process (``tierrun store``, ``tierrun proxy``) says what happens on stdout, one
line each, ``tierrun PROCESS `` (``store`` or ``proxy``) and then one of:

    listening on tcp HOST:PORT              a listener is open (``unix PATH`` for a Unix
                                            socket); the first says the process is ready
    taking links on tcp HOST:PORT           a proxy's ``--link-listen`` listener
    namespace NAME listening on tcp port N  the answer to ``namespace NAME``
    stats {JSON}                            the answer to ``stats``, and once more as it stops

A store that is also its host's node front-end (``--node-frontend``) says that
front-end's lines with ``node front-end `` after ``tierrun store ``. Any other line of
its output is a log line.

With ``--control-stdin`` its parent (the launcher's agent, through ``StoreProcess``)
writes commands on its stdin, one a line, and the process stops when stdin closes:

    namespace NAME             open a listener whose clients see only keys under NAME/
    node-namespace NAME        the same, on the node front-end
    close-namespace NAME       stop listening for NAME's clients (its round is over;
                               the clients it has keep their connections until they close)
    close-node-namespace NAME  the same, on the node front-end
    stats                      say your counters
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Union

#: The processes that say control lines.
PROCESSES = ("store", "proxy")
_NODE = "node front-end "
_LINE = re.compile(r"^tierrun (store|proxy) (node front-end )?(.*)$")
_TCP = re.compile(r"^tcp \[?([^\]]*?)\]?:(\d+)$")
_NAMESPACE = re.compile(r"^namespace (\S+) listening on tcp port (\d+)$")


def _tcp_port(address: str) -> int | None:
    m = _TCP.match(address)
    return int(m.group(2)) if m else None


@dataclass(frozen=True)
class Listening:
    """A listener is open. ``address``: ``tcp HOST:PORT`` (``[HOST]`` for IPv6) or
    ``unix PATH`` (``@name``: abstract), as ``frontend.listen.describe`` says it."""

    address: str
    node: bool = False

    @property
    def port(self) -> int | None:
        """The TCP port; None for a Unix socket."""
        return _tcp_port(self.address)


@dataclass(frozen=True)
class TakingLinks:
    """A proxy takes other front-ends' links on ``address`` (as :class:`Listening`'s)."""

    address: str
    node: bool = False

    @property
    def port(self) -> int | None:
        return _tcp_port(self.address)


@dataclass(frozen=True)
class NamespaceListening:
    """The listener of namespace ``name`` is on TCP port ``port``."""

    name: str
    port: int
    node: bool = False


@dataclass(frozen=True)
class Stats:
    """The process's counters."""

    counters: dict
    node: bool = False


Event = Union[Listening, TakingLinks, NamespaceListening, Stats]


def _check_name(name: str) -> None:
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"namespace {name!r}: a namespace is one word, without spaces")


def format_event(process: str, event: Event) -> str:
    """The line (without its newline) that ``process`` (one of :data:`PROCESSES`) says
    for ``event``. Raises ``ValueError`` for another process, or a namespace name
    that is empty or holds whitespace."""
    if process not in PROCESSES:
        raise ValueError(f"process {process!r}: write one of {', '.join(PROCESSES)}")
    if isinstance(event, Listening):
        body = f"listening on {event.address}"
    elif isinstance(event, TakingLinks):
        body = f"taking links on {event.address}"
    elif isinstance(event, NamespaceListening):
        _check_name(event.name)
        body = f"namespace {event.name} listening on tcp port {event.port}"
    else:
        body = "stats " + json.dumps(event.counters)
    return f"tierrun {process} {_NODE if event.node else ''}{body}"


def parse_event(line: str) -> tuple[str, Event] | None:
    """``(process, event)`` for a control line (trailing whitespace ignored), None for
    any other line (a log line). Raises ``ValueError`` if a stats line's JSON is
    malformed."""
    m = _LINE.match(line.rstrip())
    if m is None:
        return None
    process, node, body = m.group(1), m.group(2) is not None, m.group(3)
    if body.startswith("listening on "):
        return process, Listening(body[len("listening on "):], node)
    if body.startswith("taking links on "):
        return process, TakingLinks(body[len("taking links on "):], node)
    if body.startswith("stats {"):
        return process, Stats(json.loads(body[len("stats "):]), node)
    n = _NAMESPACE.match(body)
    if n is not None:
        return process, NamespaceListening(n.group(1), int(n.group(2)), node)
    return None


@dataclass(frozen=True)
class OpenNamespace:
    """Open the listener of namespace ``name`` (on the node front-end: ``node``)."""

    name: str
    node: bool = False


@dataclass(frozen=True)
class CloseNamespace:
    """Close the listener of namespace ``name`` (on the node front-end: ``node``)."""

    name: str
    node: bool = False


@dataclass(frozen=True)
class SendStats:
    """Say the process's counters."""


Command = Union[OpenNamespace, CloseNamespace, SendStats]


def format_command(command: Command) -> str:
    """The line (without its newline) a parent writes for ``command``. Raises
    ``ValueError`` for a namespace name that is empty or holds whitespace."""
    if isinstance(command, OpenNamespace):
        _check_name(command.name)
        return f"{'node-namespace' if command.node else 'namespace'} {command.name}"
    if isinstance(command, CloseNamespace):
        _check_name(command.name)
        return f"{'close-node-namespace' if command.node else 'close-namespace'} {command.name}"
    return "stats"


def parse_command(line: str) -> Command | None:
    """The command on ``line``; None for a blank line. Raises ``ValueError`` for
    anything else."""
    words = line.split()
    if not words:
        return None
    if len(words) == 2 and words[0] in ("namespace", "node-namespace"):
        return OpenNamespace(words[1], node=words[0] == "node-namespace")
    if len(words) == 2 and words[0] in ("close-namespace", "close-node-namespace"):
        return CloseNamespace(words[1], node=words[0] == "close-node-namespace")
    if words == ["stats"]:
        return SendStats()
    raise ValueError(f"unknown control command {line.strip()!r}")
