"""The job's store, seen from one agent: host it, front it, connect to it.

One store per job serves the agents and, through per-round namespaces, the workers.
The hosting agent runs the root store in a child process. With tiering (a job token
is given), every agent also runs its node's proxy in a child process: the agent and
the workers of the node talk to the proxy on loopback, and only the proxies talk to
the store host, over authenticated links. On the store host the store process is
that node's front-end too (``HostedFrontEnd``: on the core in that process, so the
store host's own agent and workers wake no other process and need no link). Child processes stop when
the agent does (they watch its stdin pipe).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from ..link.auth import WRONG_TOKEN
from ..link.config import LinkConfig
from ..link.frames import LinkError
from ..link.session import NO_LINKS
from ..server import AGENT_SILENCE, LINK_LOST, HostedFrontEnd, StoreProcess, StoreStartError
from ..settings import store_process_env
from ..tier.lookup import read_over_link
from .messages import SILENT_HINT, other_layout, token_refused
from .proxy_notices import store_host_lines
from .refusals import LimitRefusals, Refusals
from .sockets import (
    LINKS_ONLY, SILENT, await_listener, bracket, closed_by_peer, last_line, loopback_source, port_in_use, unresolved,
    watch_connection,
)
from .tree import TreePlace

log = logging.getLogger("tierrun.rendezvous")

#: Where a node's proxy listens for its workers and its agent.
PROXY_HOST = "127.0.0.1"
#: What a proxy says when its upstream refused its job token (``tierrun.link.auth``).
TOKEN_REFUSED = (WRONG_TOKEN, "does not know the job token")


class JobStore:
    """``start`` blocks until the processes this agent runs accept connections;
    ``client`` until the store answers. Both raise ``RendezvousConnectionError``
    saying what is unreachable (the launcher prints it as one line)."""

    def __init__(self, host: str, port: int, hosting: bool, timeout: timedelta,
                 token: bytes | str | None = None, store_workers: int = 1,
                 tree: TreePlace | None = None, link_config: LinkConfig = LinkConfig(),
                 host_fallback: str = "port_in_use", node: str | None = None, public_clients: bool = False,
                 host_hint: str | None = None, connect_timeout: float | None = None,
                 unreachable_hint: str | None = None,
                 port_setting: str = "--master_port or --rdzv_endpoint HOST:PORT",
                 link_addr: str | None = None) -> None:
        """``token``: the job token (tiered when given), which the store processes this
        agent starts get through a pipe, not their environment (none of them inherits a
        secret variable); ``link_config``: the link timings of the store processes it
        starts, which read them from the environment they inherit (give ``Settings.link``);
        ``host_fallback``: what a ``hosting`` node does when its store cannot start
        (``start``): ``"any"`` (its hosting was inferred, torch's c10d rule): become a
        client of ``host:port`` whatever the reason; ``"port_in_use"``: only when the port
        is taken (then by another agent of the job on this machine); ``"never"``: raise;
        ``node``: this node's address, as messages name it (default: its host name);
        ``public_clients``: a tiered store host's public port serves torch-protocol
        clients too (by default it takes node links only: ``tierrun store --links-only``);
        ``host_hint``: what ends the message of a host that cannot start its store;
        ``connect_timeout``: seconds a node that does not host waits for the store host
        to answer (default: ``timeout``, which stays every store operation's timeout);
        ``unreachable_hint``: what to do, ending the message of a node that gave up;
        ``port_setting``: the setting that gives the store's port, as a host that cannot
        start its store names it; ``link_addr``: every proxy this node starts takes other
        nodes' links on this address (an elastic job's tree, whose relays change from round
        to round: ``relink``)."""
        if host_fallback not in ("any", "port_in_use", "never"):
            raise ValueError(f"host_fallback={host_fallback!r}")
        self.host = host
        self.port = port
        self.hosting = hosting
        self.host_fallback = host_fallback
        self.public_clients = public_clients
        self.host_hint = host_hint
        self.timeout = timeout
        self.connect_timeout = timeout.total_seconds() if connect_timeout is None else connect_timeout
        self.unreachable_hint = unreachable_hint
        self.port_setting = port_setting
        self.token = token.encode() if isinstance(token, str) else token
        self.store_workers = store_workers
        self.tree = tree if token is not None else None
        self.link_addr = link_addr if token is not None else None
        #: Where this node's proxy links instead of the store host ("host:port", and how
        #: messages name it): its parent in an elastic round's tree (``relink``).
        self.parent: tuple[str, str] | None = None
        #: Proxies this node replaced that still relay other nodes' links (``retire``).
        self._retiring: list[StoreProcess] = []
        self.link_config = link_config
        self.node = f"node {node or socket.gethostname()}"
        self._local_addr = node
        #: What this node's store traffic goes through, as messages name it.
        self.upstream_name = f"the job's store host {host}:{port}"
        self.root: StoreProcess | None = None
        self.proxy: StoreProcess | HostedFrontEnd | None = None
        self._client: TCPStore | None = None
        self.reached = False  # a client of the job's store was made once (the store was up)
        self.silent = False  # what listens on the store's port took a connection and answered nothing
        self._watch: socket.socket | None = None
        self._round_listener: tuple[StoreProcess | HostedFrontEnd, str] | None = None  # (see worker_endpoint)
        self._relay: str | None = None  # a static tree relay's link address (see advertise_relay)
        self._relay_advertised = False

    @property
    def tiered(self) -> bool:
        return self.token is not None

    def start(self) -> None:
        if self.hosting and self.root is None:
            self._start_root()
            if self.root is not None and self.root.node_frontend_unix is not None:
                self.proxy = HostedFrontEnd(self.root)
        if self.tiered and self.proxy is None:
            tree, host = self.tree, f"the job's store host {self.host}:{self.port}"
            upstream = f"{self.host}:{self.port}", host
            if tree is not None and tree.parent is not None:  # (what this node waits for, meanwhile)
                self.upstream_name = f"{host} to say where its parent in the store tree, node rank {tree.parent}, takes links"
                address = self._parent_address(tree)
                upstream = address, f"its parent in the store tree (node rank {tree.parent}'s proxy, {address})"
            elif self.parent is not None:
                upstream = self.parent
            self.proxy = proxy = self._start_proxy(*upstream, self.connect_timeout)
            self.upstream_name, self.silent = upstream[1], False  # (linked: whatever was silent answered)
            if tree is not None and tree.has_children:  # (the children learn it: advertise_relay)
                self._relay, self._relay_advertised = f"{bracket(tree.addr)}:{proxy.link_port}", False

    def advertise_relay(self, again: bool = False) -> None:
        """Tell this node's children in a static store tree where to link, once this node
        holds its node rank (one refused its rank must not send them to a proxy about to
        stop: ``node_claim``), after a new proxy started, and ``again`` once its hold is
        confirmed (a node it took the rank from may have advertised after it). One SET,
        or none."""
        if self._relay is not None and (again or not self._relay_advertised):
            assert self.tree is not None
            self.client().set(self.tree.key(self.tree.rank), self._relay)
            self._relay_advertised = True

    def _start_proxy(self, upstream: str, name: str, connect_timeout: float) -> StoreProcess:
        """Start a node proxy linked to ``upstream`` (named ``name`` in messages), taking
        other nodes' links if this node relays (a static tree's place) or may relay (an
        elastic tree). Raises ``RendezvousConnectionError`` saying what to do."""
        tree, extra = self.tree, []
        if tree is not None and tree.has_children:
            extra = ["--link-listen", f"{bracket(tree.addr)}:0"]
        elif self.link_addr is not None:
            extra = ["--link-listen", f"{bracket(self.link_addr)}:0"]
        # (from the node's own address when that is a loopback one, nodes simulated on one
        # machine: the store host counts and names them apart; else the system's choice)
        source = loopback_source(self._local_addr, upstream.rpartition(":")[0].strip("[]"))
        if source is not None:
            extra += ["--link-source", source]
        proxy = StoreProcess(
            host=PROXY_HOST, port=0, unix=f"@tierrun-proxy-{os.getpid()}-{secrets.token_hex(4)}",
            controlled=True, command="proxy", env=store_process_env(), token=self.token, agent_silence=AGENT_SILENCE,
            extra_args=["--upstream", upstream, "--connect-timeout", str(connect_timeout), *extra],
            start_timeout=connect_timeout + 10,  # (a parent's loss is said by the tree's own lines)
            on_line=store_host_lines(self.node, self._silent_listener) if upstream == f"{self.host}:{self.port}"
            else LimitRefusals(self.node, "its store proxy"),
        )
        try:
            proxy.start()
        except StoreStartError as e:
            if any(why in str(e) for why in TOKEN_REFUSED):
                raise RendezvousConnectionError(self._token_refused(upstream)) from None
            if NO_LINKS in str(e) and upstream == f"{self.host}:{self.port}":
                raise RendezvousConnectionError(self.other_layout(host_tiered=False)) from None
            if "cannot connect to the store host" in str(e) and upstream == f"{self.host}:{self.port}":
                raise RendezvousConnectionError(self.unreachable(connect_timeout)) from None
            relay = "" if upstream == f"{self.host}:{self.port}" else (
                " A relay of the store tree takes links on an ephemeral port of its node: open it between the job's "
                "nodes (the guide's Network ACLs), or run the job without a tree (--store-fanout 0).")
            raise RendezvousConnectionError(
                f"{self.node}: its store proxy could not link to {name}: {last_line(str(e))}{relay}") from e
        return proxy

    def _token_refused(self, upstream: str) -> str:
        """What to say when ``upstream`` refused this node's job token."""
        return token_refused(self.node, upstream, upstream == f"{self.host}:{self.port}")

    def other_layout(self, host_tiered: bool) -> str:
        """What a node says whose store layout (flat or tiered) is not the store host's."""
        return other_layout(self.node, f"{self.host}:{self.port}", host_tiered)

    def _silent_listener(self) -> None:
        self.silent = True

    def waiting_hint(self) -> str | None:
        """What a node still waiting for the store should check, when it knows better
        than whether the store host is up: a silent listener, or a name that does not
        resolve (one forward lookup: not on the request path)."""
        if self.silent:
            return f"Something there accepts connections but does not answer as a store: {SILENT_HINT}"
        return unresolved(self.host)

    def unreachable(self, after: float | None = None) -> str:
        """What a node that does not host the store says when the store host has not
        answered within ``after`` seconds (default ``connect_timeout``): one line, with
        what to do."""
        hint = self.unreachable_hint or ("check that the store host (node rank 0 / the --rdzv_endpoint "
                                         "host) is running and that its port is open, or give it more time "
                                         "if it starts later (--rdzv_conf timeout=SECONDS).")
        after = self.connect_timeout if after is None else after
        found = self.waiting_hint()
        if found is not None:  # (a name that does not resolve, a silent listener: then nothing else matters)
            hint = found[0].lower() + found[1:]
        return f"{self.node}: no store at {self.host}:{self.port} after {after:.0f} s; {hint}"

    def ready(self) -> bool:
        """``start`` and ``client`` have nothing left to do (they return at once)."""
        return self._client is not None and (not self.tiered or self.proxy is not None)

    def _parent_address(self, tree: TreePlace) -> str:
        """Where the parent node's proxy takes links, as it published it: a LOOKUP of its
        key at the store host (``tier.lookup``: its public port takes links only). Blocks
        up to the store timeout; raises RendezvousConnectionError naming the parent."""
        assert self.token is not None
        key = ("/" + tree.key(tree.parent)).encode()  # (torch's client adds the "/")
        deadline = time.monotonic() + self.timeout.total_seconds()
        delay = 0.1
        try:
            while True:  # the store host may not be up yet
                try:
                    value = read_over_link((self.host, self.port), self.token, key,
                                           max(deadline - time.monotonic(), 1.0),
                                           udp_wait=self.link_config.lookup_udp_wait)
                    return value.decode()
                except (ConnectionRefusedError, ConnectionResetError):
                    if time.monotonic() + delay > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
        except (OSError, LinkError) as e:
            if isinstance(e, LinkError) and any(why in str(e) for why in TOKEN_REFUSED):
                raise RendezvousConnectionError(self._token_refused(f"{self.host}:{self.port}")) from None
            if isinstance(e, LinkError) and NO_LINKS in str(e):
                raise RendezvousConnectionError(self.other_layout(host_tiered=False)) from None
            raise RendezvousConnectionError(
                f"node rank {tree.rank} did not learn where its parent in the store tree, node "
                f"rank {tree.parent}, takes links within {self.timeout.total_seconds():.0f} s "
                f"({type(e).__name__}: {e}). Is node rank {tree.parent} running, with the same "
                "--store-fanout?"
            ) from e

    def lost(self) -> str | None:
        """Why this node has lost the job's store, or None while it has not. O(1) and no
        store operation, so agents may ask every monitor interval: with tiering the node
        proxy exits once its link is not back within the grace period (it logged why);
        without, a connection that sends nothing is watched for the store host closing it.
        A store host that vanishes without closing its connections is noticed by link
        heartbeats, so only with tiering."""
        proxy = self.proxy
        if isinstance(proxy, StoreProcess) and proxy.exited() is not None:
            return proxy.last_error() or f"this node's store proxy exited ({proxy.exited()})"
        if self.root is not None and self.root.exited() is not None:
            return f"the store process on this node exited with status {self.root.exited()}"
        if self._watch is not None and closed_by_peer(self._watch):
            return "the store host closed this node's connection"
        return None

    def link_in_doubt(self, heartbeat_interval: float) -> bool:
        """This node's proxy is reconnecting to its upstream, or has heard nothing from
        it for over two heartbeats: the link may be dying (the proxy gives up after its
        grace period). One stats request to the proxy; False without tiering or once the
        proxy has exited (``lost`` then says why)."""
        if not isinstance(self.proxy, StoreProcess) or self.proxy.exited() is not None:
            return False  # (the store host's own front-end has no link)
        try:
            silence = self.proxy.stats(timeout=2.0).get("upstream_silence_s", 0.0)
        except StoreStartError:
            return False
        return silence < 0 or silence > 2 * heartbeat_interval

    def proxy_failure(self) -> str | None:
        """How this node's proxy died on its own (killed, crashed), or None while it runs
        or when it stopped because its link was lost (``lost`` says so). O(1)."""
        code = self.proxy.exited() if isinstance(self.proxy, StoreProcess) else None
        if code is None or code == LINK_LOST:
            return None
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}" + (f" ({err})" if (err := self.proxy.last_error()) else "")

    def restart_proxy(self) -> None:
        """Replace a dead proxy with a new one (a new link session: what the old one's
        clients had pending at the store host expires with that session), linked to the
        store host in an elastic job's tree (its parent may be what killed it). Clients
        of the old proxy, this agent's included, must reconnect: ``client`` gives a new
        one. Blocks and raises like ``start``."""
        self.proxy = None
        self._client = None
        self.parent = None
        self.start()

    def relink(self, parent: tuple[str, str] | None) -> StoreProcess:
        """Start a new node proxy linked to ``parent`` ("host:port" of a parent proxy and
        how messages name it; None: the store host), on a fresh link session, and make it
        this node's: ``client``, ``agent_address`` and ``worker_endpoint`` use it from
        now on. Returns the proxy it replaces, still running, for ``retire``. Call it only
        while this node has nothing in flight through the old proxy (its workers stopped,
        its agent's round watch moved or stopped). Blocks while the new proxy starts (a
        parent gets the link timeout to answer, the store host, up until now, the link
        grace period); raises ``RendezvousConnectionError`` like ``start``, leaving the old
        proxy in place."""
        old = self.proxy
        assert isinstance(old, StoreProcess) and self.tiered
        if parent is None:
            try:
                new = self._start_proxy(f"{self.host}:{self.port}", f"the job's store host {self.host}:{self.port}",
                                        self.link_config.grace)
            except RendezvousConnectionError as e:
                why = "it did not answer" if str(e) == self.unreachable(self.link_config.grace) else \
                    str(e).removeprefix(self.node + ": ")
                raise RendezvousConnectionError(
                    f"{self.node} could not link its store proxy to the job's store host {self.host}:{self.port} "
                    f"within {self.link_config.grace:.0f} s while re-forming (it linked to {self.upstream_name}): "
                    f"{why}. The job cannot go on without its store; this node's workers were stopped. Restart "
                    "the job when the store host is up again.") from e
        else:
            new = self._start_proxy(*parent, self.link_config.heartbeat_timeout)
        self.proxy, self._client, self.parent = new, None, parent
        self.upstream_name = parent[1] if parent is not None else f"the job's store host {self.host}:{self.port}"
        return old

    def retire(self, proc: StoreProcess, idle: Callable[[], bool] = lambda: True) -> None:
        """Stop a proxy ``relink`` replaced once this node is done with it (``idle()``:
        its own last requests through it answered) and no other node's proxy links to it
        any more (they move as they re-form), at most the link grace period; at once if
        it lost its own link (the nodes below then re-form through the store host). In
        a thread of its own: the requests still on their way through it are answered on
        the path they took. Returns at once."""
        self._retiring.append(proc)

        def run() -> None:
            self._drain(proc, idle)
            proc.stop()
            if proc in self._retiring:
                self._retiring.remove(proc)

        threading.Thread(target=run, name="tierrun-retire-proxy", daemon=True).start()

    def _store_args(self) -> list[str]:
        """Front-end processes for the workers' connections: flat only (tiered, workers
        talk to their node's proxy and the store host sees only links)."""
        if self.tiered:  # (its own node's agent and workers use its node front-end)
            return [] if self.public_clients else ["--links-only"]
        if self.store_workers == 1:
            return []
        return ["--workers", str(self.store_workers), "--workers-for", "namespaces"]

    def _start_root(self) -> None:
        # tiered, the store process is this node's front-end too (unless this node takes
        # other nodes' links in a store tree: a proxy of its own does that)
        node = self.tiered and (self.tree is None or not self.tree.has_children)
        proc = StoreProcess(host=None, port=self.port, controlled=True, env=store_process_env(), token=self.token,
                            extra_args=self._store_args(), on_line=Refusals(self.node, self.port),
                            node_frontend_unix=f"@tierrun-proxy-{os.getpid()}-{secrets.token_hex(4)}" if node else None)
        try:
            self.port = proc.start()
        except StoreStartError as e:
            taken = self.port != 0 and port_in_use(self.port)
            why = f"port {self.port} is taken" if taken else last_line(str(e))
            if self.host_fallback == "any" or (self.host_fallback == "port_in_use" and taken):
                log.log(logging.INFO if taken else logging.WARNING,
                        "this node could not host the job's store (%s); joining as a client of "
                        "%s:%d", why, self.host, self.port)
                self.hosting = False
                return
            hint = self.host_hint if self.host_hint is not None else \
                ", or let another node host it (--rdzv_conf is_host=false here)." if self.host_fallback == "never" else "."
            fix = "Raise this node's open-files limit (ulimit -Hn)." if why.endswith("open files") else \
                "Check this node's load and Python environment, or run without --store-workers." \
                if "front-end process" in why else f"Pick a free port with {self.port_setting}{hint}"
            raise RendezvousConnectionError(f"{self.node}: could not start the job's store on port {self.port} "
                                            f"({why}). {fix}") from e
        self.root = proc
        log.info("this node hosts the job's store (pid %d): the other nodes reach it at %s:%d",
                 proc.pid, self.host, self.port)

    @property
    def client_address(self) -> tuple[str, int]:
        if self.proxy is not None:
            assert self.proxy.port is not None
            return PROXY_HOST, self.proxy.port
        return self.host, self.port

    @property
    def agent_address(self) -> tuple[str, int] | str:
        """Where this agent's own tierrun clients (heartbeats, progress, reports)
        connect: the node proxy's Unix socket when tiered, else the store's TCP port."""
        if self.proxy is not None and self.proxy.unix:
            return self.proxy.unix
        return self.client_address

    def client(self) -> TCPStore:
        if self._client is None:
            host, port = self.client_address
            if self.proxy is None and self.root is None:  # flat, on a node without the store
                # (torch's client would wait in silence, then print C++ stack traces)
                self.silent = False
                found = await_listener(host, port, self.connect_timeout, self._silent_listener)
                if found is None:
                    raise RendezvousConnectionError(self.unreachable())
                if found == LINKS_ONLY:
                    raise RendezvousConnectionError(self.other_layout(host_tiered=True))
                if found == SILENT:
                    raise RendezvousConnectionError(
                        f"{self.node}: something at {host}:{port} accepts connections but did not answer as a "
                        f"store within {self.connect_timeout:.0f} s: {SILENT_HINT}")
            try:
                self._client = TCPStore(host, port, is_master=False, timeout=self.timeout,
                                        wait_for_workers=False)
                self.reached = True
            except Exception as e:
                raise RendezvousConnectionError(
                    f"{self.node}: cannot reach the job's store at {host}:{port} within "
                    f"{self.timeout.total_seconds():.0f} s ({type(e).__name__}). Check that the "
                    "store host (node rank 0 / the --rdzv_endpoint host) is running and that "
                    "the port is open."
                ) from e
            if self.proxy is None and self.root is None:  # flat, on a node without the store
                self._watch = watch_connection(host, port, self.timeout.total_seconds())
        return self._client

    def worker_endpoint(self, namespace: str) -> tuple[str, int] | None:
        """Where this node's workers of a round connect: a listener whose clients see only
        keys under ``namespace/``. None when another agent (the host) publishes it. The
        previous round's listener (another namespace) is closed: its workers are gone or
        going, and keep their connections until they close."""
        served: StoreProcess | HostedFrontEnd | None = self.proxy if self.proxy is not None else self.root
        if served is None:
            return None
        endpoint = (PROXY_HOST if self.proxy is not None else self.host), served.open_namespace(namespace)
        previous, self._round_listener = self._round_listener, (served, namespace)
        if previous is not None and previous[1] != namespace:
            previous[0].close_namespace(previous[1])
        return endpoint

    def _drain(self, proc: StoreProcess, replaced: Callable[[], bool] | None = None) -> None:
        """Keep a store process that other nodes link to (the store host, a relay of the
        tree) up until their links have closed (they close them as they leave), at most
        the link grace period: a node's path to the store must not end before the node
        is done with it (its report, its last words to the watchers). A ``replaced``
        proxy (``retire``: the function says whether this node is done with it) that has
        lost its own link is not kept: the path through it is cut, and its end tells the
        nodes below to re-form now. Blocks; one stats request every 50 ms."""
        deadline = time.monotonic() + self.link_config.grace
        while proc.exited() is None:
            try:
                stats = proc.stats(timeout=2.0)
            except StoreStartError:
                return
            if replaced is not None and stats.get("upstream_silence_s", 0.0) < 0:
                return
            if not stats.get("links") and (replaced is None or replaced()):
                return
            if time.monotonic() > deadline:
                what = "its replaced store proxy" if replaced else \
                    f"the store {'host' if proc is self.root else 'relay'}"
                why = (f"{stats['links']} other node(s) still linked to it" if stats.get("links") else
                       "a request of this node's still unanswered through it")
                log.warning("%s: stopping %s with %s (after %g s)", self.node, what, why, self.link_config.grace)
                return
            time.sleep(0.05)

    def stop(self) -> None:
        self._client = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for proc in list(self._retiring):  # (before the store host: they link to it)
            self._drain(proc, lambda: True)
            proc.stop()
        self._retiring.clear()
        served = (("node proxy", self.proxy), ("store host", self.root))
        for _, proc in served:
            if isinstance(proc, StoreProcess):
                self._drain(proc)
                proc.stop()
        # (after both stopped: the store host's own front-end reports through its store)
        for name, proc in served:  # statistics: TIERRUN_LOG_LEVEL=DEBUG shows them
            if proc is not None:
                log.debug("%s served: %s", name, json.dumps(proc.last_stats))
        self.proxy = self.root = None
