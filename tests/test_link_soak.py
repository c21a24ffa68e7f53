"""A seeded soak: several front-ends drive a root store through relays that cut, freeze
and refuse at random moments; at the end the store must match a model of every
operation applied exactly once.

Each simulated node has clients that ADD to a shared counter and to their own counter,
SET their own keys, APPEND to a shared log, and read back what they wrote. The model
is exact because every write a client makes is to a key only it writes, or is
commutative (ADD, APPEND of a unique token). $TIERRUN_SOAK_SECONDS (default 15) sets
the length, $TIERRUN_SOAK_SEED the seed.
"""

import asyncio
import os
import random

from tierrun.tier import connect_link
from tierrun.link.config import LinkConfig
from tierrun.protocol import Op

from inproc import Client
from test_link_resume import Relay, counter, request, run, start_root

SECONDS = float(os.environ.get("TIERRUN_SOAK_SECONDS", "15"))
SEED = int(os.environ.get("TIERRUN_SOAK_SEED", "20261122"))
NODES, CLIENTS = 3, 4
CONFIG = LinkConfig(heartbeat_interval=0.1, heartbeat_timeout=0.6, grace=10.0)


def test_soak_with_random_link_faults_matches_the_model():
    rng = random.Random(SEED)

    async def client_loop(link, node: int, c: int, stop: asyncio.Event, model: dict, crng: random.Random):
        me = Client()
        own = f"/n{node}c{c}".encode()
        n = 0
        while not stop.is_set():
            op = crng.random()
            if op < 0.4:
                assert counter(await request(link, (Op.ADD, b"/shared", 1), me)) >= 1
                model["shared"] += 1
            elif op < 0.6:
                got = counter(await request(link, (Op.ADD, own + b"/count", 2), me))
                model[own + b"/count"] += 2
                assert got == model[own + b"/count"], (own, got)
            elif op < 0.8:
                n += 1
                link.view("").execute((Op.SET, own + b"/value", str(n).encode()), me)
                model[own + b"/value"] = str(n).encode()
                assert (await request(link, (Op.GET, own + b"/value"), me))[8:]  # after the u64 length == str(n).encode()
            else:
                token = f"{node}.{c}.{n};".encode()
                n += 1
                link.view("").execute((Op.APPEND, b"/log", token), me)
                model["log"].add(token)
            await asyncio.sleep(crng.random() * 0.01)

    async def faults(relays: list[Relay], stop: asyncio.Event, counts: dict) -> None:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.3, 1.5))
            relay = rng.choice(relays)
            kind = rng.choice(["cut", "cut_mid", "freeze", "refuse"])
            counts[kind] += 1
            if kind == "cut":
                relay.cut_all()
            elif kind == "cut_mid":
                relay.cut_at = rng.randint(1, 400)
            elif kind == "freeze":  # longer than the heartbeat timeout
                relay.frozen = True
                await asyncio.sleep(rng.uniform(0.2, 1.2))
                relay.frozen = False
            else:  # a partition: reconnects refused for a while
                relay.refusing = True
                relay.cut_all()
                await asyncio.sleep(rng.uniform(0.2, 2.0))
                relay.refusing = False

    async def main():
        port, stop_root, root_task = await start_root()
        relays = [Relay(port) for _ in range(NODES)]
        lost: list[str] = []
        links = [await connect_link("127.0.0.1", await r.start(), b"tok", lost.append, 10, CONFIG)
                 for r in relays]
        model: dict = {"shared": 0, "log": set()}
        for node in range(NODES):
            for c in range(CLIENTS):
                model[f"/n{node}c{c}/count".encode()] = 0
        stop = asyncio.Event()
        counts = {"cut": 0, "cut_mid": 0, "freeze": 0, "refuse": 0}
        tasks = [asyncio.ensure_future(client_loop(links[node], node, c, stop, model, random.Random(rng.random())))
                 for node in range(NODES) for c in range(CLIENTS)]
        fault_task = asyncio.ensure_future(faults(relays, stop, counts))
        await asyncio.sleep(SECONDS)
        stop.set()
        await fault_task
        for r in relays:
            r.frozen = r.refusing = False
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert not lost, lost
        assert sum(counts.values()) >= 3, counts
        # the final state, read over a fresh link that saw no fault
        check = await connect_link("127.0.0.1", port, b"tok", lost.append, 10, CONFIG)
        assert counter(await request(check, (Op.ADD, b"/shared", 0))) == model["shared"]
        for node in range(NODES):
            for c in range(CLIENTS):
                own = f"/n{node}c{c}".encode()
                assert counter(await request(check, (Op.ADD, own + b"/count", 0))) == model[own + b"/count"]
                if own + b"/value" in model:
                    assert (await request(check, (Op.GET, own + b"/value")))[8:] == model[own + b"/value"]
        if model["log"]:
            log = (await request(check, (Op.GET, b"/log")))[8:]  # after the u64 length
            tokens = [t + b";" for t in log.split(b";") if t]
            assert len(tokens) == len(model["log"]) and set(tokens) == model["log"]  # once each
        for link in links + [check]:
            link.close()
        for r in relays:
            r.close()
        stop_root.set()
        await root_task

    run(main(), timeout=SECONDS + 90)
