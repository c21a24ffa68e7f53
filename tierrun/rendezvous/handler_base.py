"""What tierrun's rendezvous handlers share: the job's store, the node's name, live
progress on the store host, and hooks that run before the store goes away."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError, RendezvousError, RendezvousHandler,
)
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from ..client import StoreClient, StoreClientError
from ..link.frames import WILL_NAMESPACE
from ..report.progress import MODES, Arrivals, RendezvousProgress, StillWaiting
from ..server import StoreProcess
from . import liveness, restart_together
from .conf import conf_float
from .job_store import PROXY_HOST, JobStore

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_PROGRESS_INTERVAL = 5.0

#: torch's agent assigns global ranks through the store (per node: a SET of its role
#: info, then a WAIT and a GET of its own assignment: three requests on keys of its own,
#: which no front-end can merge) unless this is "1", its path for nodes that all run the
#: same number of workers, where each agent computes its ranks itself. Same ranks.
IDENTICAL_WORKERS = "TORCH_ELASTIC_WORKER_IDENTICAL"


class JobStoppedError(RendezvousError):
    """A node of a static job left or died: the others cannot go on without it."""


class StoreRendezvousHandler(RendezvousHandler):
    """Base of ``parallel`` and ``tierrun``. ``--rdzv_conf progress=auto|bar|log|off``
    and ``progress_interval=SECONDS`` set the store host's progress display;
    ``heartbeat_interval`` and ``heartbeat_timeout`` (seconds) the members' liveness."""

    def __init__(self, job: JobStore | None, run_id: str, local_addr: str | None, config: dict) -> None:
        self.job = job
        self.run_id = run_id
        self.node_addr = local_addr or socket.gethostname()
        self.shutdown_hooks: list[Callable[[], None]] = []
        #: Why this node lost the job's store, if it had when it shut down (else None).
        self.store_lost: str | None = None
        #: This node was refused a place in the job (it never was a member): it reports nothing.
        self.refused = False
        mode = str(config.get("progress", "auto"))
        if mode not in MODES:
            raise ValueError(f"--rdzv_conf progress={mode}: write one of {', '.join(MODES)}")
        self._progress_mode = mode
        self._progress_interval = conf_float(config, "progress_interval", DEFAULT_PROGRESS_INTERVAL)
        self._beat_interval = conf_float(config, "heartbeat_interval", liveness.DEFAULT_INTERVAL)
        self._beat_timeout = conf_float(config, "heartbeat_timeout", liveness.DEFAULT_TIMEOUT)
        #: How often torch's agent asks ``num_nodes_waiting`` (the launcher passes it).
        self._monitor_interval = conf_float(config, "monitor_interval", 0.1)
        self._lock = threading.Lock()  # state the watch threads set
        self._watcher: StoreClient | None = None
        self._heartbeat: liveness.Heartbeat | None = None
        self._will: liveness.LinkWill | None = None  # (a tiered job's members' liveness, instead)
        self._stopped_beats: list[liveness.Heartbeat] = []  # (see _settle_stopped_beats)
        self._dead_addrs: dict[str, float] = {}  # members this node declared dead in its round: when
        self._together = restart_together.Barrier()  # (see _restart_together)
        #: Called (address, about when it was last heard from, Unix time) when this node's
        #: watcher declares a member dead, in a thread of its own: the failure report's.
        self.lost_hooks: list[Callable[[str, float], None]] = []
        #: Workers on this node, from the launcher: lets a round tell torch's agent that
        #: every node runs as many (None: unknown, torch's store-based path).
        self._local_world_size = int(config["local_world_size"]) if "local_world_size" in config else None
        self._user_identical = os.environ.get(IDENTICAL_WORKERS)  # a user's own choice stands
        #: How this round's global ranks are assigned, for the round's log line.
        self._rank_note = ""

    def _workers_key(self, base: str) -> str | None:
        """The key of round ``base`` of a static job that counts the nodes with this
        node's number of workers (one ADD each as they arrive, on a key shared by all such
        nodes: merged), or None when there is nothing to count (see
        :meth:`_choose_rank_assignment`)."""
        if self._local_world_size is None or self._user_identical is not None:
            return None
        return f"{base}/local_world_size/{self._local_world_size}"

    def _choose_rank_assignment(self, counted: int | None, nodes: int) -> None:
        """After every node of a static round has announced itself: all ``nodes`` run as
        many workers as this one iff ``counted`` (the count of :meth:`_workers_key`, read
        once all arrived) is ``nodes``. Nothing when there was no key."""
        if counted is not None:
            self._use_local_rank_assignment(counted == nodes)

    def _use_local_rank_assignment(self, identical: bool) -> None:
        """Tell torch's agent how to assign this round's ranks: itself when every member
        runs as many workers (``identical``), else through the store, as torchrun does."""
        if self._user_identical is not None:
            return
        os.environ[IDENTICAL_WORKERS] = "1" if identical else "0"
        if self._local_world_size is None:  # (under torchrun: not told how many workers)
            self._rank_note = "ranks assigned through the store"
        elif identical:
            n = self._local_world_size
            self._rank_note = f"every node runs {n} worker{'' if n == 1 else 's'}: ranks computed locally"
        else:
            self._rank_note = "nodes run different numbers of workers: ranks assigned through the store"

    def _log_round(self, r: int, rank: int, nodes: int) -> None:
        """One INFO line per round: who joined, and this node's place."""
        note = f"; {self._rank_note}" if self._rank_note else ""
        log.info("rendezvous '%s' round %d: %d node(s) joined; node %s is node rank %d%s",
                 self.run_id, r, nodes, self.node_addr, rank, note)

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def use_agent_store(self) -> bool:
        return True

    def _watch_round(self, key: Callable[[str], bytes], signal: str, on_signal: Callable[[StoreClient], None],
                     index: int, watched: list[int], on_dead: Callable[[int], None],
                     will: tuple[float, bytes] | None = None) -> None:
        """While a round runs: a standing WAIT for the round key ``signal`` on its own
        connection (then ``on_signal(client)``, from that thread), and this member's
        heartbeat, watching the members ``watched`` (see ``liveness``). ``key(name)`` gives a
        round key as sent on the wire. Replaces the previous round's. ``will`` (seconds,
        reason), in a tiered job: no heartbeat; instead the node's link is its liveness,
        and the first hop above its proxy sets ``signal`` to the reason once the link is
        silent that long (``liveness.LinkWill``); the store host's own node, which has no
        link, leaves none (its death is the store's). Blocks a round trip to the proxy for the will;
        raises ``StoreClientError``/``OSError`` if the proxy is gone."""
        self._stop_watching()
        with self._lock:
            self._dead_addrs = {}
        client = StoreClient(self.job.agent_address, timeout=365 * 24 * 3600)
        self._watcher = client

        def watch() -> None:
            try:
                client.wait([key(signal)])
                on_signal(client)
            except (OSError, StoreClientError):
                return  # stopped, or the store is gone (reported by check_store_host)

        threading.Thread(target=watch, daemon=True).start()
        if will is not None and self.job.tiered:
            proxy = self.job.proxy
            if isinstance(proxy, StoreProcess):
                self._will = liveness.LinkWill((PROXY_HOST, proxy.open_namespace(WILL_NAMESPACE.decode())))
                self._will.leave(will[0], key(signal), will[1])
            return
        self._heartbeat = liveness.Heartbeat(
            self.job.agent_address, key, index, watched, self._beat_interval, self._beat_timeout, on_dead,
        ).start()

    def _note_dead_by_will(self, addr: str, silence: float) -> None:
        """The round's signal names the member at ``addr`` dead: its link's first hop
        executed its will, after ``silence`` seconds or at once if its agent died (see
        :meth:`declared_dead`). Called by the round's watch thread."""
        self._record_dead(addr, time.time() - silence)

    def _note_dead(self, addr: str) -> None:
        """This node's watcher declared the member at ``addr`` dead (silent past the
        heartbeat timeout): see :meth:`declared_dead`. Called by the watch's heartbeat
        thread; a stopped one, still declaring when a new watch began (the next round's,
        or this round's moved by a tree's re-formation), is not heard: a new watch starts
        with no declaration (``_watch_round``), and may be another round's."""
        beat = self._heartbeat
        if beat is None or not beat.in_its_thread():
            return
        # (silent for the timeout when declared, counted from a sample up to an interval after its last beat)
        self._record_dead(addr, time.time() - self._beat_timeout - self._beat_interval)

    def _record_dead(self, addr: str, heard: float) -> None:
        """``addr`` was last heard at ``heard`` (wall clock): note it, and tell the lost
        hooks once."""
        with self._lock:
            first = addr not in self._dead_addrs
            self._dead_addrs.setdefault(addr, time.monotonic())
        if first and self.lost_hooks:  # (not in the heartbeat's thread: a publish must not delay the re-formation)
            threading.Thread(target=self._tell_lost, args=(addr, heard), daemon=True).start()

    def _tell_lost(self, addr: str, heard: float) -> None:
        for hook in self.lost_hooks:
            try:
                hook(addr, heard)
            except Exception:  # (reporting never stops anything)
                log.debug("a lost-node hook failed", exc_info=True)

    def declared_dead(self) -> dict[str, float]:
        """The members of the current round that this node declared dead: address ->
        when (``time.monotonic()``). A dead agent publishes nothing more, so a failure
        report need not wait long for it (one merely stalled may still publish)."""
        with self._lock:
            return dict(self._dead_addrs)

    def _wait_quietly(self, keys: list[str], timeout: float, check: Callable[[], None],
                      client: StoreClient | None = None) -> None:
        """WAIT for ``keys`` (as torch's client names them, without the leading ``/``) on
        a connection of its own, or on ``client`` (kept open if the wait completes; closed
        otherwise), up to ``timeout`` seconds, calling ``check()`` every second meanwhile
        (it must not use the store; raising ends the wait with its exception). One WAIT
        in all, not one per second: torch's C++ client prints two warnings for every wait
        that times out, which is what a poll in slices made of a late node. Blocks; raises
        ``TimeoutError`` after ``timeout``, ``OSError`` or ``StoreClientError`` if the
        store connection is lost."""
        own = client is None
        if client is None:
            client = StoreClient(self.job.agent_address, timeout=max(timeout, 1.0) + 30)
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def wait() -> None:
            try:
                client.wait([f"/{k}".encode() for k in keys], timeout=max(timeout, 0.001))
                outcome.append(None)
            except BaseException as e:  # handed to the caller
                outcome.append(e)
            finally:
                if own or outcome[0] is not None:
                    client.close()
                done.set()

        threading.Thread(target=wait, name="tierrun-rendezvous-wait", daemon=True).start()
        try:
            while not done.wait(1.0):
                check()
        except BaseException:
            client.abort()  # (the waiting thread then closes it)
            raise
        if outcome[0] is not None:
            raise outcome[0]

    def _restart_together(self, r: int, key: Callable[[str], str], members: int, why: bytes | None = None) -> None:
        """If round r changed because a node joined (``why``, or its ``changed`` key when
        None; not a death or a leave), block until its other members have seen it too, at
        most ``restart_together.wait_limit`` (see there). ``key(name)`` names a round key.
        Raises only torch's ``SignalException`` (the agent was told to stop): a lost store
        is for ``num_nodes_waiting``, which calls this, to find out."""
        try:
            store = self.job.client()
            if (store.multi_get([key("changed")])[0] if why is None else why) == b"joined":
                self._together.wait(r, store, key, members, restart_together.wait_limit(self._monitor_interval),
                                    lambda keys, timeout: self._wait_quietly(keys, timeout, self.check_store_host),
                                    f"rendezvous '{self.run_id}' round {r}, node {self.node_addr}")
        except SignalException:
            raise
        except Exception:
            log.debug("restarting together in round %d failed", r, exc_info=True)

    def _stop_watching(self, leaving: bool = False) -> None:
        """Stop the round's watch and heartbeat; ``leaving``: this agent is shutting down
        in order, and tells the round's watchers so (see ``liveness.LEFT``)."""
        if self._watcher is not None:
            self._watcher.abort()
            self._watcher = None
        if self._will is not None:
            self._will.revoke()
            self._will = None
        if self._heartbeat is not None:
            if leaving and self.store_lost is None:
                deadline = time.monotonic() + 5.0  # (a heartbeat stopped by a move beats the same
                for beat in self._stopped_beats:   # key: its late beat would overwrite LEFT too)
                    beat.join(max(0.0, deadline - time.monotonic()))
                self._heartbeat.leave()
            else:
                self._heartbeat.stop()
                self._stopped_beats = [b for b in self._stopped_beats if not b.join(0)] + [self._heartbeat]
            self._heartbeat = None

    def _stopped_beats_ended(self) -> Callable[[], bool]:
        """Whether the heartbeats stopped so far have ended, their last request answered
        (asked before the proxy they used goes away): a test that does not block."""
        beats, self._stopped_beats = self._stopped_beats, []
        return lambda: all(beat.join(0) for beat in beats)

    @contextlib.contextmanager
    def _progress(self, title: str, poll: Callable[[StoreClient], Arrivals]) -> Iterator[None]:
        """Show the round's progress while the body runs, on the store host only."""
        if not self.job.hosting or self._progress_mode == "off":
            yield
            return
        progress = RendezvousProgress(title, self.job.agent_address, poll,
                                      self._progress_mode, self._progress_interval).start()
        try:
            yield
        except BaseException:
            progress.stop(completed=False)  # (the error says what went wrong)
            raise
        progress.stop()

    def connect(self) -> TCPStore:
        """Start this node's store processes and connect to the job's store: blocks
        until it answers, up to the store timeout, and raises
        ``RendezvousConnectionError`` saying what is unreachable. A node that waits for
        the store (one that does not host it, or whose port another program holds) says
        every progress interval that it still does, for what, and what to check (a name
        that does not resolve is named) unless ``progress=off``: a node started before
        the store host, or with a wrong address, would otherwise wait the whole timeout
        in silence."""
        if self._progress_mode == "off" or self.job.ready():
            self.job.start()
            return self.job.client()
        # (quiet while this node hosts it; not once its port was taken: it waits as another's client)
        notice = StillWaiting(self.node_addr, lambda: self.job.upstream_name, self.job.connect_timeout,
                              self._progress_interval, self.job.waiting_hint, lambda: self.job.hosting).start()
        reached = False
        try:
            self.job.start()
            store = self.job.client()
            reached = True
            return store
        finally:
            notice.stop(reached)

    def check_store_host(self) -> None:
        """Raise ``RendezvousConnectionError`` if this node has lost the job's store. O(1),
        no store operation (see ``JobStore.lost``); torch's agent calls
        ``num_nodes_waiting`` every monitor interval, which calls this, and stops the
        node's workers when it raises."""
        failure = self.job.proxy_failure()
        if failure is not None:
            raise RendezvousConnectionError(
                f"the store proxy of node {self.node_addr} {failure}: this node's workers lost the "
                "job's store and were stopped, and a static job cannot go on without them. "
                "Restart the job (an elastic job replaces a dead proxy and goes on)."
            )
        reason = self.job.lost()
        if reason is not None:
            if self.job.tree is not None and self.job.tree.parent is not None:
                advice = (f"Its parent node (node rank {self.job.tree.parent}) stopped or died; "
                          "restart the job once every node is up again.")
            elif self.job.parent is not None:
                advice = "Its parent in the store tree stopped or died; restart this node to rejoin the job."
            else:
                advice = ("Restart the job when the store host (the --rdzv_endpoint or "
                          "--master_addr node) is up again.")
            raise RendezvousConnectionError(
                f"node {self.node_addr} lost {self.job.upstream_name}: {reason}. The job cannot "
                f"go on without its store; this node's workers were stopped. {advice}"
            )

    def blame_lost_store(self, within: float = 3.0) -> None:
        """After a store request failed: raise ``check_store_host``'s error if this node
        lost the job's store, waiting up to ``within`` seconds for its proxy to finish
        exiting (it closes its clients' connections first); else return, and the caller
        raises the request's own error."""
        deadline = time.monotonic() + within
        while self.job.lost() is None and self.job.proxy_failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.check_store_host()

    def replace_dead_proxy(self) -> bool:
        """If this node's store proxy died on its own (killed, crashed: not because the
        store host was lost), start a new one and return True: the caller must then have
        torch's agent restart this node's workers (their store connections died with the
        proxy) and rejoin. O(1) while the proxy runs; blocks while a new one starts and
        raises ``RendezvousConnectionError`` if it cannot link to the store host."""
        failure = self.job.proxy_failure()
        if failure is None:
            return False
        log.warning("the store proxy of node %s %s; starting a new one, restarting this node's "
                    "workers and rejoining the job", self.node_addr, failure)
        self._stop_watching()
        self.job.restart_proxy()
        return True

    def leave(self, reason: str) -> None:
        """This agent is going away (a signal; torch's agent has stopped its workers):
        tell the other nodes at once rather than let the heartbeats find out, and check in
        to the exit barrier so nobody waits there for this node. Best effort: errors are
        logged, never raised."""
        try:
            self._announce_leaving(reason)
            self.leave_exit_barrier()
        except Exception as e:
            log.warning("node %s could not tell the others it is leaving: %s", self.node_addr, e)

    def _announce_leaving(self, reason: str) -> None:
        raise NotImplementedError

    def _agents_store(self) -> tuple[str, int] | None:
        """The current round's agent-store prefix and node count; None before a round."""
        raise NotImplementedError

    def leave_exit_barrier(self) -> None:
        """Check this node in to torch's exit barrier of the current round, for an agent
        whose workers failed for good. torch's agent checks in only after success, so
        without this the other agents (the store host among them) would wait out the
        whole exit-barrier timeout (300 s) for a node that has already given up. One ADD
        (and one SET if this node is the last): the barrier still waits for the rest."""
        current = self._agents_store()
        if current is None:
            return
        prefix, n = current
        _barrier_nonblocking(store=PrefixStore(prefix, self.job.client()), world_size=n,
                             key_prefix=_TERMINAL_STATE_SYNC_ID)

    def _settle_store_verdict(self) -> None:
        """At shutdown, before anything uses the store: set ``store_lost`` if this node
        has lost the job's store. If its link is in doubt right now, wait until the link
        is sound again or the proxy gives up (at most the link timeout and grace period):
        the workers may have failed *because* the store was lost (another node noticed
        it first and stopped its workers, so ours failed in a collective before this
        agent's next check, and torch's agent never asks the handler after a failure).
        One stats request to the proxy while the link is sound."""
        if self.job is None:
            return
        config = self.job.link_config  # (what its proxy runs with)
        deadline = time.monotonic() + config.heartbeat_timeout + config.grace + 2
        while self.job.link_in_doubt(config.heartbeat_interval) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            self.check_store_host()
        except RendezvousConnectionError as e:
            self.store_lost = str(e)

    def _run_shutdown_hooks(self) -> None:
        self._settle_store_verdict()
        if self.store_lost is not None:
            return  # (every step reads or writes the store: they would only fail, slowly)
        for hook in self.shutdown_hooks:
            try:
                hook()
            except Exception as e:
                log.warning("a report step before shutdown failed: %s", e)
                log.debug("report step", exc_info=True)
