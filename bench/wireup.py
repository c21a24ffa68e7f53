"""Wire-up benchmark: what node 0 pays to start a job of K nodes x P ranks.

A simulated cluster replays torch 2.13's start-up store traffic (as recorded in
tests/fixtures and read from torch's sources) against three set-ups, in the same run:

  torch         torch's TCPStore server (libuv), flat: every agent and rank connects to it
  tierrun-flat  tierrun's store, flat
  tiered        tierrun's store with a node front-end per simulated node (the proxy's own
                components: FrontEnd + LinkUpstream): agents and ranks connect to their
                node's front-end on loopback; only the K front-ends link to node 0's core
  tree          tiered, with front-ends stacked (--store-fanout F, default 8) in the
                launcher's tree (rendezvous.job_store.TreePlace): F - 1 other nodes
                link to node 0's core (besides node 0's own front-end), the others to
                another node's front-end (which also accepts links: LinkServer over its
                own upstream), so node 0 sees F - 1 links
  tree-10ms     tree, every front-end keeping its batch open 10 ms
                (TIERRUN_LINK_BATCH_WINDOW=0.01): fewer, larger batches, 10 ms more
                latency per level

Per agent (one per node): connect, VALIDATE+PING, ADD init/, SET role_info/<node>;
node 0's agent WAITs for and MULTI_GETs every role_info, MULTI_SETs every node's
assigned ranks (torch's static rendezvous and rank assignment); every agent WAITs and
GETs its assignment, starts its P ranks, and at the end joins the exit barrier (ADD,
the last one SETs last_member, WAIT).
--agents tierrun: tierrun's set-ups replay what tierrun's own agents of a static job
(--rdzv_backend parallel) send instead: ADD to the count of nodes with P workers,
COMPARE_SET its node record, ADD to the arrival count (the last SETs all_arrived),
APPEND to the arrivals, WAIT for all_arrived, GET the count
(every node runs P: torch's agent then computes ranks without the store); while the
ranks run, a standing WAIT on the round's failed key and the heartbeat (ADD its beat
counter at once, then on every whole second of the wall clock; nodes 0-2 also MULTI_GET
every other node's half a second later); then the same exit
barrier.
Per rank, --traffic nccl (default): connect, VALIDATE+PING, ADD init/; NCCL's unique-id
broadcast (rank 0 SETs it, the others WAIT and GET it: torch's get is WAIT+GET); a
barrier (ADD; the last SETs a key every rank WAITs for); then --heartbeats CHECKs of the
dump key one second apart, as ProcessGroupNCCL's heartbeat monitor does.
--traffic gloo: Gloo's full-mesh address exchange instead of the unique id (each rank
SETs its address, then WAIT, WAIT, GET of every rank's: O(W^2) requests; small K only).

Node 0 is the store server process. In the tiered set-ups it is node 0's own front-end
too, as the launcher runs it (`tierrun store --node-frontend`: node 0's agent and ranks
connect to it, and it hands their requests to the core, in-process, with no link); the
other nodes' front-ends run inside the simulator processes, each linking from a loopback
address of its own (127.3.x.y), as real nodes do from theirs. Reported per set-up:
connections node 0 accepted, requests it parsed (flat: every request; tiered: operations
carried by links and node 0's own agent's and ranks' requests), frames it received
(flat: one per request; tiered: link batches and node 0's own requests), its CPU seconds (/proc), and the
wall time from start to every rank done. All simulated nodes share this machine's cores
with node 0, so wall times are pessimistic for every set-up alike; node 0's CPU is what
a real node 0 would pay. Medians of --repeat runs; writes docs/bench/wireup.json, a
plot (docs/bench/wireup.png) and a table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import time

from report import DOCS, raise_fd_limit, write_json, write_section
from servers import process_cpu_seconds, start_torch

from tierrun.protocol import Op
from tierrun.protocol.opcodes import NO_REPLY_OPS, VALIDATION_MAGIC
from tierrun.protocol.requests import encode_request
from tierrun.rendezvous.job_store import TreePlace
from tierrun.rendezvous.liveness import until
from tierrun.server import StoreProcess

SETUPS = ("torch", "tierrun-flat", "tiered", "tree", "tree-10ms")
#: The tiered set-ups (node front-ends) and those stacked in a tree.
TIERED = ("tiered", "tree", "tree-10ms")
TREES = ("tree", "tree-10ms")
_u32 = struct.Struct("<I").unpack_from
_i64 = struct.Struct("<q").unpack_from
_u64 = struct.Struct("<Q").unpack_from


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
        SimClient.requests += 1
        SimClient.node0_requests += self.to_node0
        assert self.transport is not None
        self.transport.write(encode_request(req))
        if req[0] in NO_REPLY_OPS:
            return None
        fut = asyncio.get_running_loop().create_future()
        self.pending = (req[0], len(req[1]) if req[0] == Op.MULTI_GET else 1, fut)
        self.data_received(b"")
        return await fut


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
    def __init__(self, k: int, p: int, traffic: str, heartbeats: int, root: tuple[str, int],
                 tiered: bool, fanout: int = 0, tree_port: int = 0, tierrun_agents: bool = False,
                 node0_frontend: tuple[str, int] | None = None) -> None:
        self.k, self.p, self.w = k, p, k * p
        self.node0_frontend = node0_frontend
        self.tierrun_agents = tierrun_agents
        self.traffic = traffic
        self.heartbeats = heartbeats
        self.root = root
        self.tiered = tiered
        self.fanout = fanout
        self.tree_port = tree_port

    def tree_address(self, n: int) -> tuple[str, int]:
        """Where node n's front-end takes its children's links (a loopback address per node)."""
        return f"127.3.{n // 250}.{n % 250 + 1}", self.tree_port

    async def node(self, n: int) -> None:
        target = self.root
        if self.tiered:
            # node 0's own front-end is node 0's store process (measure() starts it), as
            # the launcher runs it: its CPU is node 0's
            target = self.node0_frontend if n == 0 else await self.front_end(n)
        agent = await connect(*target)
        await agent.call(Op.ADD, b"init/", 1)
        if self.tierrun_agents:
            await self.tierrun_agent(n, agent, target)
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
        await asyncio.gather(*(self.rank(n * self.p + i, target) for i in range(self.p)))
        await self.exit_barrier(agent)

    async def exit_barrier(self, agent: SimClient) -> None:
        count = await agent.call(Op.ADD, b"/torchelastic/agent/terminal_state/num_members", 1)
        last = b"/torchelastic/agent/terminal_state/last_member"
        if count == self.k:
            await agent.call(Op.SET, last, b"<val_ignored>")
        await agent.call(Op.WAIT, (last,))
        agent.transport.close()

    async def tierrun_agent(self, n: int, agent: SimClient, target: tuple[str, int]) -> None:
        """What a tierrun agent of a static job (--rdzv_backend parallel) sends instead of
        torch's static rendezvous and rank assignment: count itself among the nodes with
        its number of workers, write its record, count its arrival (the last SETs the key
        all wait for), append to the arrivals, wait, read the count (all alike: torch's
        agent computes ranks locally); then, while its workers run, a
        standing WAIT on the round's ``failed`` key and its heartbeat, as
        ``liveness.Heartbeat`` sends it: ADD its beat counter at once, then on each whole
        second of the wall clock; the first 3 ranks also read every other node's in one
        MULTI_GET half a second after each beat."""
        base = "/tierrun/job/static/0"
        same = f"{base}/local_world_size/{self.p}".encode()
        await agent.call(Op.ADD, same, 1)
        record = json.dumps({"addr": f"10.0.{n // 250}.{n % 250}", "nonce": secrets.token_hex(8)}).encode()
        await agent.call(Op.COMPARE_SET, f"{base}/node/{n}".encode(), b"", record)
        if await agent.call(Op.ADD, f"{base}/arrived".encode(), 1) == self.k:
            await agent.call(Op.SET, f"{base}/all_arrived".encode(), b"1")
        await agent.call(Op.APPEND, f"{base}/arrivals".encode(), f"{n} 10.0.{n // 250}.{n % 250}\n".encode())
        await agent.call(Op.WAIT, (f"{base}/all_arrived".encode(),))
        await agent.call(Op.GET, same)
        watcher, beater = await connect(*target), await connect(*target)
        watching = asyncio.ensure_future(watcher.call(Op.WAIT, (f"{base}/failed".encode(),)))
        mine = f"{base}/beat/{n}".encode()
        theirs = tuple(f"{base}/beat/{j}".encode() for j in range(self.k) if j != n) if n < 3 else ()

        async def beat() -> None:  # on liveness.Heartbeat's schedule
            await beater.call(Op.ADD, mine, 1)
            while True:
                if theirs:  # the first 3 ranks watch every other node, half an interval later
                    await asyncio.sleep(until(0.5, 1.0, time.time()))
                    await beater.call(Op.MULTI_GET, theirs)
                await asyncio.sleep(until(0.0, 1.0, time.time()))
                await beater.call(Op.ADD, mine, 1)

        beating = asyncio.ensure_future(beat())
        await asyncio.gather(*(self.rank(n * self.p + i, target) for i in range(self.p)))
        await self.exit_barrier(agent)
        for task, client in ((beating, beater), (watching, watcher)):
            task.cancel()
            client.transport.close()

    async def front_end(self, n: int) -> tuple[str, int]:
        from tierrun.frontend import FrontEnd
        from tierrun.tier import connect_link
        from tierrun.frontend.listen import tcp_listen_socket
        from tierrun.hub.link_server import LinkServer
        from tierrun.hub.reply_gate import break_watches
        from tierrun.settings import Settings

        def lost(reason: str) -> None:
            print(f"simulated node {os.getpid()}: link lost: {reason}", file=sys.stderr, flush=True)
            os._exit(1)  # the parent sees EOF and reports the failure

        settings = Settings.from_env()
        token = settings.job_token()
        place = TreePlace(n, self.k, self.fanout or self.k, "", "")
        upstream = self.root if place.parent is None else self.tree_address(place.parent)
        # (from the node's own loopback address, as a real node links from its own: the
        # store host caps the handshakes under way per address)
        link = await connect_link(*upstream, token, lost, 120, settings.link, source=self.tree_address(n)[0])
        if place.has_children:  # take their links
            link.on_watches_broken = break_watches
            links = LinkServer(lambda ns: link.view(ns.decode()), token, lease=link.lease_left)
            await asyncio.get_running_loop().create_server(
                lambda: links.accept(sniffed=False), *self.tree_address(n))
        frontend = FrontEnd(link.view(""))
        sock = tcp_listen_socket("127.0.0.1", 0)
        await frontend.listen(sock)
        return "127.0.0.1", sock.getsockname()[1]

    async def rank(self, g: int, target: tuple[str, int]) -> None:
        c = await connect(*target)
        await c.call(Op.ADD, b"init/", 1)
        if self.traffic == "nccl":
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
        for _ in range(self.heartbeats):
            await asyncio.sleep(1.0)
            await c.call(Op.CHECK, (b"/default_pg/0/dump_nccl_trace",))
        c.transport.close()


def sim_child(setup: str, k: int, p: int, procs: int, index: int, port: int, traffic: str,
              heartbeats: int, fanout: int, tree_port: int, agents: str, node0_port: int) -> None:
    """Simulate nodes index, index + procs, ...; start when told on stdin."""
    from tierrun.server.eventloop import run

    raise_fd_limit()
    cluster = Cluster(k, p, traffic, heartbeats, ("127.0.0.1", port), setup in TIERED,
                      fanout if setup in TREES else 0, tree_port, agents == "tierrun" and setup != "torch",
                      ("127.0.0.1", node0_port))
    if setup in TIERED:
        SimClient.node0 = cluster.node0_frontend
    print("ready", flush=True)
    sys.stdin.readline()

    async def main() -> None:
        await asyncio.gather(*(cluster.node(n) for n in range(index, k, procs)))
        print(json.dumps({"requests": SimClient.requests, "node0_requests": SimClient.node0_requests}), flush=True)
        # in a tree, other processes' nodes may still be linked through ours: serve
        # until the parent says everyone is done (stdin closes)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    run(main())


# -- one measurement ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.3.0.1", 0))
        return s.getsockname()[1]


def measure(setup: str, k: int, p: int, args) -> dict:
    env = dict(os.environ, TIERRUN_TOKEN=secrets.token_hex(16))
    if setup == "tree-10ms":  # (read by the simulated front-ends' Settings.from_env)
        env["TIERRUN_LINK_BATCH_WINDOW"] = "0.01"
    store = None
    node0_port = 0  # tiered: node 0's own front-end, in its store process as the launcher runs it
    if setup == "torch":
        server = start_torch()
        port, pid = server.port, server.pid
    else:
        store = StoreProcess(host="127.0.0.1", port=0, controlled=True, env=env,
                             node_frontend_unix=f"@tierrun-bench-{secrets.token_hex(4)}" if setup in TIERED else None)
        port = store.start()
        pid = store.pid
        node0_port = store.node_port or 0
    tree_port = free_port()
    sims = [subprocess.Popen([sys.executable, __file__, "--sim-child", setup, str(k), str(p), str(args.procs),
                              str(i), str(port), args.traffic, str(args.heartbeats),
                              str(args.fanout), str(tree_port), args.agents, str(node0_port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for i in range(args.procs)]
    try:
        for s in sims:
            if s.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{setup}: a simulator did not start")
        cpu0 = process_cpu_seconds(pid)
        t0 = time.perf_counter()
        for s in sims:
            s.stdin.write("go\n")
            s.stdin.flush()
        outs = [s.stdout.readline() for s in sims]
        wall = time.perf_counter() - t0
        cpu = process_cpu_seconds(pid) - cpu0
        if not all(outs):
            raise RuntimeError(f"{setup} K={k} P={p}: a simulator failed")
        requests = sum(json.loads(o)["requests"] for o in outs)
        node0_own = sum(json.loads(o)["node0_requests"] for o in outs)
        if setup == "torch":
            result = {"connections": k * (p + 1), "requests": requests, "frames": requests}
        else:
            st = store.stats()
            if setup in TIERED:
                # links, and node 0's own agent and ranks on its front-end (a request
                # each, read one by one as in a flat store)
                result = {"connections": st["clients_accepted"] + st["links_accepted"]
                          + st["node_frontend"]["clients_accepted"],
                          "requests": st["link_operations"] + node0_own,
                          "frames": st["link_batches"] + node0_own}
            else:
                result = {"connections": st["clients_accepted"], "requests": requests, "frames": requests}
        return {**result, "cpu_s": cpu, "wall_s": wall}
    finally:
        for s in sims:
            s.kill()
            s.wait()
        if store is not None:
            store.stop()
        else:
            server.stop()


# -- what one wake-up of node 0 costs on this machine --------------------------------------


def echo_server() -> None:
    """A do-nothing uvloop server: echoes what it reads (the --echo-server child)."""
    class Echo(asyncio.Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    from tierrun.server.eventloop import run
    run(main())


def wakeup_floor_us(messages: int = 1000, gap: float = 0.005) -> float:
    """CPU microseconds a do-nothing uvloop server spends per 100-byte message echoed
    when messages come one at a time, ``gap`` apart (each one a wake-up: epoll, read,
    write, two context switches), over 8 connections. What any node 0 pays per frame
    that arrives alone, before doing anything with it."""
    child = subprocess.Popen([sys.executable, __file__, "--echo-server"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        cpu0 = process_cpu_seconds(child.pid)
        for i in range(messages):
            conns[i % 8].sendall(b"x" * 100)
            conns[i % 8].recv(1000)
            time.sleep(gap)
        return (process_cpu_seconds(child.pid) - cpu0) / messages * 1e6
    finally:
        child.kill()
        child.wait()


# -- report -------------------------------------------------------------------------------


def plot(sizes: list[tuple[int, int]], med: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{k}x{p}" for k, p in sizes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "cpu_s", "node 0 CPU seconds"), (axes[1], "requests", "node 0 requests")):
        setups = list(med[labels[0]])
        width = 0.8 / len(setups)
        for i, setup in enumerate(setups):
            ax.bar([x + (i - (len(setups) - 1) / 2) * width for x in range(len(sizes))],
                   [med[s][setup][metric] for s in labels], width, label=setup)
        ax.set_xticks(range(len(sizes)), labels)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("nodes x ranks per node")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["64x8", "256x8", "512x8", "1024x8"], help="KxP")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="simulator processes")
    p.add_argument("--traffic", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--heartbeats", type=int, default=3)
    p.add_argument("--fanout", type=int, default=8, help="links per front-end in the tree set-up")
    p.add_argument("--agents", choices=("torch", "tierrun"), default="torch",
                   help="agent traffic of tierrun's set-ups: torch's static rendezvous and rank "
                        "assignment (as the torch set-up), or what tierrun's parallel backend sends")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS),
                   help="set-ups to run (torch's always runs: the ratios need it); with a subset, "
                        "the runs go to docs/bench/wireup-<sizes>-<N>rounds.json, not to the table")
    p.add_argument("--sim-child", nargs=12, help=argparse.SUPPRESS)
    p.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_server:
        echo_server()
        return
    if args.sim_child:
        setup, k, pp, procs, index, port, traffic, hb, fanout, tree_port, agents, node0 = args.sim_child
        sim_child(setup, int(k), int(pp), int(procs), int(index), int(port), traffic, int(hb),
                  int(fanout), int(tree_port), agents, int(node0))
        return
    raise_fd_limit()
    setups = [s for s in SETUPS if s == "torch" or s in args.setups]
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes]
    runs: dict[str, dict[str, list[dict]]] = {f"{k}x{pp}": {s: [] for s in setups} for k, pp in sizes}
    for k, pp in sizes:
        for i in range(args.repeat):  # interleaved, so that machine noise hits all alike
            for setup in setups:
                r = measure(setup, k, pp, args)
                runs[f"{k}x{pp}"][setup].append(r)
                print(f"{k}x{pp} run {i + 1} {setup}: {r}", flush=True)
    med = {size: {s: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for s, rs in by.items()}
           for size, by in runs.items()}
    floor = statistics.median(wakeup_floor_us() for _ in range(args.repeat))
    agents = ("agents: torch's static rendezvous and rank assignment in every set-up" if args.agents == "torch"
              else "agents: torchrun's in the torch set-up, tierrun's parallel backend (rendezvous, "
                   "local rank assignment, heartbeats) in tierrun's")
    lines = [f"Traffic: {args.traffic}, {args.heartbeats} heartbeat CHECKs per rank; {agents}; medians of "
             f"{args.repeat} runs; {args.procs} simulator processes. On this machine a do-nothing "
             f"uvloop server spends {floor:.0f} us of CPU per message that arrives alone (a wake-up: "
             "epoll, read, write, context switches; median, same run): node-0 frames x that is "
             "a floor no store code can go below.", "",
             "| K x P | set-up | node-0 connections | node-0 requests | node-0 frames | node-0 CPU s | wall s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for size, by in med.items():
        for setup, m in by.items():
            lines.append(f"| {size} | {setup} | {m['connections']:,.0f} | {m['requests']:,.0f} | "
                         f"{m['frames']:,.0f} | {m['cpu_s']:.3f} | {m['wall_s']:.2f} |")
    lines += ["", f"Ratios torch / tierrun's tiered set-ups (tree fanout {args.fanout}; higher: tierrun cheaper). "
              "Node-0 CPU is the ratio of the medians; per round, the ratio within each round "
              "(torch's run and tierrun's of the same round): median, and lowest-highest, which shows "
              "how much of the figure is the machine's noise:", "",
              "| K x P | set-up | connections | requests | frames | node-0 CPU | node-0 CPU per round | wall |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for size, by in med.items():
        for setup in (s for s in TIERED if s in by):
            t, c = by["torch"], by[setup]
            q = {m: t[m] / c[m] if c[m] else float("inf") for m in t}
            paired = [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs[size]["torch"], runs[size][setup])]
            lines.append(f"| {size} | {setup} | {q['connections']:.0f}x | {q['requests']:.1f}x | "
                         f"{q['frames']:.1f}x | {q['cpu_s']:.1f}x | {statistics.median(paired):.1f}x "
                         f"({min(paired):.1f}-{max(paired):.1f}) | {q['wall_s']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    name = ("wireup" if args.traffic == "nccl" else "wireup_gloo") + ("_tierrun_agents" if args.agents == "tierrun" else "")
    if len(setups) < len(SETUPS):  # (raw runs kept, e.g. docs/bench/wireup-512x8-7rounds.json)
        write_json(f"{name}-{'-'.join(args.sizes)}-{args.repeat}rounds",
                   {"args": vars(args), "runs": runs, "wakeup_floor_us": floor})
        print("(a subset of the set-ups: docs/benchmarks.md not updated)")
        return
    write_json(name, {"args": vars(args), "runs": runs, "wakeup_floor_us": floor})
    plot(sizes, med, DOCS / "bench" / f"{name}.png")
    write_section(name, table + f"\n\n![node 0 cost](bench/{name}.png)")


if __name__ == "__main__":
    main()
