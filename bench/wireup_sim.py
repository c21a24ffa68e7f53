"""The simulated cluster of ``bench/wireup.py``: raw torch-protocol clients replaying a
start-up's store traffic, node by node, in a simulator process (``python wireup.py
--sim-child CONFIG``).

Each simulated node starts at its own moment (``Plan``): the nodes' starts spread
uniformly over the skew window, and each node's ranks connect 0.1-0.3 s after their
agent's rendezvous completes (as worker spawn does), both seeded; with no skew every
node starts at once and its ranks at once after the rendezvous (lockstep).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from report import raise_fd_limit

from tierrun.link.frames import WILL_KEY, WILL_NAMESPACE
from tierrun.protocol import Op
from tierrun.protocol.opcodes import NO_REPLY_OPS, VALIDATION_MAGIC
from tierrun.protocol.requests import encode_request
from tierrun.rendezvous.tree import TreePlace
from tierrun.rendezvous.liveness import CONFIRM_EVERY, until

_u32 = struct.Struct("<I").unpack_from
_i64 = struct.Struct("<q").unpack_from
_u64 = struct.Struct("<Q").unpack_from
#: The run id of the simulated job (its tree keys: ``TreePlace.key``).
RUN_ID = "bench"
#: When a node's ranks start after its agent's rendezvous, as worker spawn spreads them (s).
SPAWN = (0.1, 0.3)


def node_address(n: int) -> str:
    """Simulated node n's own loopback address (its links leave from it; its proxy, if it
    runs one, listens on it)."""
    return f"127.3.{n // 250}.{n % 250 + 1}"


def start_offset(seed: str, n: int, skew: float) -> float:
    """When node n starts, seconds after the common start (uniform over the window)."""
    return random.Random(f"{seed}:node:{n}").uniform(0.0, skew) if skew > 0 else 0.0


def spawn_delays(seed: str, n: int, p: int, skew: float) -> list[float]:
    """When each of node n's p ranks starts, seconds after its agent's rendezvous."""
    if skew <= 0:
        return [0.0] * p
    rng = random.Random(f"{seed}:ranks:{n}")
    return [rng.uniform(*SPAWN) for _ in range(p)]


@dataclass
class Plan:
    """What a simulator process is told (one JSON argument)."""

    setup: str
    k: int
    p: int
    procs: int
    index: int
    root_port: int
    traffic: str
    heartbeats: int
    tierrun_agents: bool
    #: tiered: node 0's own front-end (in the store process); else None
    node0: tuple[str, int] | None
    #: tree fanout; 0: no tree
    fanout: int
    skew: float
    seed: str
    #: nodes served by a real ``tierrun proxy`` process: node -> where its clients connect
    proxies: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: relays (real proxies with children): node -> where they take links
    relays: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: the real proxies' will namespaces (``tierrun.hub.wills``): node -> where its agent writes
    wills: dict[int, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["node0"] = tuple(d["node0"]) if d["node0"] else None
        d["proxies"] = {int(n): tuple(a) for n, a in d["proxies"].items()}
        d["relays"] = {int(n): tuple(a) for n, a in d["relays"].items()}
        d["wills"] = {int(n): tuple(a) for n, a in d["wills"].items()}
        return cls(**d)


# -- a simulated torch client -------------------------------------------------------------


class SimClient(asyncio.Protocol):
    """One torch client connection: one request in flight, replies decoded by shape."""

    requests = 0  # sent by every client of this process
    node0_requests = 0  # of those, sent to node 0's own front-end (tiered set-ups)
    #: Node 0's own front-end (tiered set-ups): its clients' requests are node 0's.
    node0: tuple[str, int] | None = None

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pending: tuple[Op, int, asyncio.Future] | None = None
        self.transport: asyncio.Transport | None = None
        self.to_node0 = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.pending is not None:
            op, nkeys, fut = self.pending
            value = self._reply(op, nkeys)
            if value is not None:
                self.pending = None
                fut.set_result(value)

    def _reply(self, op: Op, nkeys: int):
        """The reply at the head of the buffer, consumed; None while incomplete."""
        b = self.buf
        if op in (Op.WAIT, Op.CHECK):
            size, value = 1, b[:1]
        elif op == Op.PING:
            size, value = 4, _u32(b)[0] if len(b) >= 4 else None
        elif op == Op.ADD:
            size, value = 8, _i64(b)[0] if len(b) >= 8 else None
        else:  # GET, MULTI_GET: nkeys length-prefixed values
            pos, values = 0, []
            for _ in range(nkeys):
                if len(b) < pos + 8:
                    return None
                n = _u64(b, pos)[0]
                if len(b) < pos + 8 + n:
                    return None
                values.append(bytes(b[pos + 8: pos + 8 + n]))
                pos += 8 + n
            size, value = pos, values
        if len(b) < size:
            return None
        del b[:size]
        return value

    async def call(self, *req):
        """Send one request; its decoded answer (None for a request with none)."""
        return (await self.pipeline(req))[0]

    async def pipeline(self, *reqs: tuple) -> list:
        """Send requests in one write (as tierrun's client pipelines them); their decoded
        answers, in order (None for a request with none)."""
        SimClient.requests += len(reqs)
        SimClient.node0_requests += self.to_node0 * len(reqs)
        assert self.transport is not None
        self.transport.write(b"".join(encode_request(r) for r in reqs))
        answers = []
        for req in reqs:
            if req[0] in NO_REPLY_OPS:
                answers.append(None)
                continue
            fut = asyncio.get_running_loop().create_future()
            self.pending = (req[0], len(req[1]) if req[0] == Op.MULTI_GET else 1, fut)
            self.data_received(b"")
            answers.append(await fut)
        return answers


async def connect(host: str, port: int) -> SimClient:
    """Connect (retrying while the server's backlog is full, as torch's client does) and
    do torch's handshake: VALIDATE, PING."""
    loop = asyncio.get_running_loop()
    delay = 0.05
    for _ in range(20):
        try:
            _, client = await loop.create_connection(SimClient, host, port)
            break
        except OSError:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
    else:
        raise ConnectionError(f"cannot connect to {host}:{port}")
    client.to_node0 = (host, port) == SimClient.node0
    await client.call(Op.VALIDATE, VALIDATION_MAGIC)
    await client.call(Op.PING, 1)
    return client


# -- the simulated cluster ----------------------------------------------------------------


class Cluster:
    """The nodes of one simulator process (every ``procs``-th node from ``index``)."""

    def __init__(self, plan: Plan, t0: float) -> None:
        self.plan = plan
        self.k, self.p, self.w = plan.k, plan.p, plan.k * plan.p
        self.root = ("127.0.0.1", plan.root_port)
        self.t0 = t0
        # (a lookup over a link blocks a thread while it WAITs for the parent's address)
        self.lookups = ThreadPoolExecutor(max_workers=max(1, len(range(plan.index, plan.k, plan.procs))))

    def place(self, n: int) -> TreePlace:
        return TreePlace(n, self.k, self.plan.fanout or self.k, node_address(n), RUN_ID)

    async def node(self, n: int) -> None:
        """Node n's agent and ranks, from node n's start to the exit barrier."""
        plan = self.plan
        await asyncio.sleep(max(0.0, self.t0 + start_offset(plan.seed, n, plan.skew) - time.time()))
        target, will = self.root, None
        if plan.node0 is not None:  # tiered: node 0's own front-end is in the store process
            if n == 0:
                target = plan.node0
            elif n in plan.proxies:
                target, will = plan.proxies[n], plan.wills[n]
                if plan.fanout and self.place(n).parent is not None:
                    await self.lookup_parent(n)  # (its proxy runs already: the store host's cost replayed)
            else:
                target, will = await self.front_end(n)
        agent = await connect(*target)
        if n in plan.relays:  # tell the children where to link, as JobStore.start does
            await agent.call(Op.SET, ("/" + self.place(n).key(n)).encode(),
                             "{}:{}".format(*plan.relays[n]).encode())
        await agent.call(Op.ADD, b"init/", 1)
        if plan.tierrun_agents:
            await self.tierrun_agent(n, agent, target, will)
            return
        await agent.call(Op.SET, f"/torchelastic/role_info/{n}".encode(),
                         json.dumps({"role": "default", "rank": n, "local_world_size": self.p}).encode())
        if n == 0:
            keys = tuple(f"/torchelastic/role_info/{j}".encode() for j in range(self.k))
            await agent.call(Op.WAIT, keys)
            await agent.call(Op.MULTI_GET, keys)
            assigned = tuple(f"/torchelastic/assigned_ranks/{j}".encode() for j in range(self.k))
            ranks = tuple(json.dumps([j * self.p, self.w, j, self.k]).encode() for j in range(self.k))
            await agent.call(Op.MULTI_SET, assigned, ranks)
        mine = f"/torchelastic/assigned_ranks/{n}".encode()
        await agent.call(Op.WAIT, (mine,))
        await agent.call(Op.GET, mine)
        await self.ranks(n, target)
        await self.exit_barrier(agent)

    async def ranks(self, n: int, target: tuple[str, int]) -> None:
        """Node n's ranks, each starting after its spawn delay."""
        delays = spawn_delays(self.plan.seed, n, self.p, self.plan.skew)
        await asyncio.gather(*(self.rank(n * self.p + i, target, delays[i]) for i in range(self.p)))

    async def exit_barrier(self, agent: SimClient) -> None:
        count = await agent.call(Op.ADD, b"/torchelastic/agent/terminal_state/num_members", 1)
        last = b"/torchelastic/agent/terminal_state/last_member"
        if count == self.k:
            await agent.call(Op.SET, last, b"<val_ignored>")
        await agent.call(Op.WAIT, (last,))
        agent.transport.close()

    async def tierrun_agent(self, n: int, agent: SimClient, target: tuple[str, int],
                            will: tuple[str, int] | None) -> None:
        """What a tierrun agent of a static job (--rdzv_backend parallel) sends instead of
        torch's static rendezvous and rank assignment: claim its node rank's record; in one
        write append to the arrivals, count itself among the nodes with its number of
        workers and among the arrived (the last SETs the key all wait for); wait; in one
        write confirm its record and read the count (all alike: torch's agent computes
        ranks locally); then, while its
        workers run, a standing WAIT on the round's ``failed`` key and its heartbeat, as
        ``liveness.Heartbeat`` sends it: ADD its beat counter at once, then SET its next
        count (every ``CONFIRM_EVERY``-th an ADD) on each whole second of the wall clock;
        the first 3 ranks also read every other node's in one MULTI_GET half a second
        after each beat."""
        base = "/tierrun/job/static/0"
        same = f"{base}/local_world_size/{self.p}".encode()
        fields = {"addr": f"10.0.{n // 250}.{n % 250}", "nonce": secrets.token_hex(8), "workers": self.p}
        record, key = json.dumps(fields).encode(), f"{base}/node/{n}".encode()
        await agent.call(Op.COMPARE_SET, key, b"", record)  # (node_claim: claim, then count)
        line = f"{n} 10.0.{n // 250}.{n % 250} {self.k}\n".encode()
        *_, arrived = await agent.pipeline((Op.APPEND, f"{base}/arrivals".encode(), line), (Op.ADD, same, 1),
                                           (Op.ADD, f"{base}/arrived".encode(), 1 + (self.k << 21)))
        if arrived == self.k * (1 + (self.k << 21)):
            await agent.call(Op.SET, f"{base}/all_arrived".encode(), b"1")
        await agent.call(Op.WAIT, (f"{base}/all_arrived".encode(),))
        await agent.pipeline((Op.COMPARE_SET, key, record, json.dumps({**fields, "formed": True}).encode()),
                             (Op.GET, same))  # (confirm, read the count)
        watcher = await connect(*target)
        watching = asyncio.ensure_future(watcher.call(Op.WAIT, (f"{base}/failed".encode(),)))
        if self.plan.node0 is not None:  # tiered: the link is the beat
            text = b"3\n%s/failed\nnode rank %d has not answered for 3 s" % (base.encode(), n)
            if will is not None:
                await self.will(will, text)
            await self.ranks(n, target)
            await self.exit_barrier(agent)
            if will is not None:
                await self.will(will, b"")
            watching.cancel()
            watcher.transport.close()
            return
        beater = await connect(*target)
        mine = f"{base}/beat/{n}".encode()
        theirs = tuple(f"{base}/beat/{j}".encode() for j in range(self.k) if j != n) if n < 3 else ()

        async def beat() -> None:  # on liveness.Heartbeat's schedule
            count = int(await beater.call(Op.ADD, mine, 1))
            while True:
                if theirs:  # the first 3 ranks watch every other node, half an interval later
                    await asyncio.sleep(until(0.5, 1.0, time.time()))
                    await beater.call(Op.MULTI_GET, theirs)
                await asyncio.sleep(until(0.0, 1.0, time.time()))
                if (count + 1) % CONFIRM_EVERY:
                    count += 1
                    await beater.call(Op.SET, mine, b"%d" % count)
                else:
                    count = int(await beater.call(Op.ADD, mine, 1))

        beating = asyncio.ensure_future(beat())
        await self.ranks(n, target)
        await self.exit_barrier(agent)
        for task, client in ((beating, beater), (watching, watcher)):
            task.cancel()
            client.transport.close()

    async def will(self, where: tuple[str, int], text: bytes) -> None:
        """Leave (or, empty, revoke) a will as ``liveness.LinkWill`` does: a SET and a GET,
        on a connection of its own to the proxy's will namespace."""
        hop = await connect(*where)
        await hop.call(Op.SET, WILL_KEY, text)
        await hop.call(Op.GET, WILL_KEY)
        hop.transport.close()

    async def lookup_parent(self, n: int) -> tuple[str, int]:
        """Where node n's parent in the tree takes links, as a tierrun agent learns it
        (``JobStore._parent_address``): WAIT + GET of the parent's key over a link of its
        own to the store host, from node n's address, in a thread (it blocks)."""
        from tierrun.settings import Settings
        from tierrun.tier.lookup import read_over_link

        place = self.place(n)
        assert place.parent is not None
        key = ("/" + place.key(place.parent)).encode()
        token = Settings.from_env().job_token()
        value = await asyncio.get_running_loop().run_in_executor(
            self.lookups, read_over_link, self.root, token, key, 120.0, node_address(n))
        host, _, port = value.decode().rpartition(":")
        return host.strip("[]"), int(port)

    async def front_end(self, n: int) -> tuple[tuple[str, int], tuple[str, int]]:
        """Node n's front-end, in this simulator process (the proxy's own components:
        FrontEnd + LinkUpstream), linked from node n's address to the store host or, in a
        tree, to its parent relay (a real proxy process: leaves only here): where its
        clients connect, and where its agent writes its will."""
        from tierrun.frontend import FrontEnd
        from tierrun.frontend.listen import tcp_listen_socket
        from tierrun.settings import Settings
        from tierrun.tier import connect_link

        def lost(reason: str) -> None:
            print(f"simulated node {os.getpid()}: link lost: {reason}", file=sys.stderr, flush=True)
            os._exit(1)  # the parent sees EOF and reports the failure

        settings = Settings.from_env()
        place = self.place(n)
        if self.plan.fanout and place.has_children:
            raise RuntimeError(f"node {n} relays: it must be a proxy process of its own")
        upstream = self.root if not self.plan.fanout or place.parent is None else await self.lookup_parent(n)
        link = await connect_link(*upstream, settings.job_token(), lost, 120, settings.link, source=node_address(n))
        where = []
        for namespace in ("", WILL_NAMESPACE.decode()):
            sock = tcp_listen_socket("127.0.0.1", 0)
            await FrontEnd(link.view(namespace)).listen(sock)
            where.append(("127.0.0.1", sock.getsockname()[1]))
        return where[0], where[1]

    async def rank(self, g: int, target: tuple[str, int], delay: float) -> None:
        """Global rank g: handshake, init count, NCCL's unique id (or Gloo's exchange),
        a barrier, then NCCL's heartbeat CHECKs."""
        if delay:
            await asyncio.sleep(delay)
        c = await connect(*target)
        await c.call(Op.ADD, b"init/", 1)
        if self.plan.traffic == "nccl":
            uid = b"/default_pg/0//nccl/0"
            if g == 0:
                await c.call(Op.SET, uid, secrets.token_bytes(128))
            else:
                await c.call(Op.WAIT, (uid,))
                await c.call(Op.WAIT, (uid,))
                await c.call(Op.GET, uid)
        else:
            await c.call(Op.SET, f"/default_pg/0//cpu//0/{g}".encode(), secrets.token_bytes(96))
            for j in range(self.w):
                key = f"/default_pg/0//cpu//0/{j}".encode()
                await c.call(Op.WAIT, (key,))
                await c.call(Op.WAIT, (key,))
                await c.call(Op.GET, key)
        if await c.call(Op.ADD, b"/default_pg/0/barrier/count", 1) == self.w:
            await c.call(Op.SET, b"/default_pg/0/barrier/done", b"1")
        await c.call(Op.WAIT, (b"/default_pg/0/barrier/done",))
        for _ in range(self.plan.heartbeats):
            await asyncio.sleep(1.0)
            await c.call(Op.CHECK, (b"/default_pg/0/dump_nccl_trace",))
        c.transport.close()


def sim_child(config: str) -> None:
    """Simulate nodes index, index + procs, ...: say ``ready``, read ``go T0 WHERE`` (T0
    the common start, wall clock; WHERE the real proxies' addresses), run them, print the requests sent; then serve (the
    simulated front-ends) until stdin closes."""
    from tierrun.server.eventloop import run

    raise_fd_limit()
    plan = Plan.from_json(config)
    SimClient.node0 = plan.node0
    print("ready", flush=True)
    _, t0_text, where = sys.stdin.readline().split(" ", 2)  # go T0 {"proxies": ..., "relays": ...}
    t0, where = float(t0_text), json.loads(where)
    plan.proxies = {int(n): tuple(a) for n, a in where["proxies"].items()}
    plan.relays = {int(n): tuple(a) for n, a in where["relays"].items()}
    plan.wills = {int(n): tuple(a) for n, a in where["wills"].items()}

    async def main() -> None:
        cluster = Cluster(plan, t0)
        await asyncio.gather(*(cluster.node(n) for n in range(plan.index, plan.k, plan.procs)))
        print(json.dumps({"requests": SimClient.requests, "node0_requests": SimClient.node0_requests,
                          "end": time.time()}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    run(main())
