"""A relay's pace (``tier.pace``, ``LinkConfig.relay_pace``): while a relay's batches keep
leaving it sends at most one per ``gap`` seconds, and one after a quiet spell leaves at
once. The policy as a table, then real processes (``tierrun store``, a relay
``tierrun proxy --link-listen``, a proxy under it) and torch's own client."""

from __future__ import annotations

import threading
import time

import pytest

from test_tree import ENV, client, proxy
from tierrun.server import StoreProcess
from tierrun.tier.pace import BatchPace


A, B = "client a", "client b"


@pytest.mark.parametrize("events, now, wait", [
    ([], 0.0, 0.0),  # nothing sent yet: at once
    ([("req", A, 10.0), ("sent", 10.0), ("req", B, 10.01)], 10.01, 0.04),  # busy: what is left of the gap
    ([("req", A, 10.0), ("sent", 10.0), ("req", B, 10.01)], 10.05, 0.0),  # a gap since the last batch
    ([("req", A, 10.0), ("req", B, 10.0), ("sent", 10.0)], 10.02, 0.03),  # two issuers in the last batch
    ([("req", A, 10.0), ("req", B, 10.0), ("sent", 10.0)], 11.0, 0.0),  # a quiet spell
    ([("req", A, 10.0), ("sent", 10.0), ("req", A, 10.01)], 10.01, 0.0),  # one client, one at a time: never
    ([("req", A, 9.0), ("req", B, 9.0), ("sent", 10.0), ("req", B, 10.01)], 10.01, 0.0),  # others long ago
    ([("req", A, 10.0), ("sent", 10.0), ("req", B, 10.04), ("sent", 10.06)], 10.07, 0.04),  # the last batch counts
    ([("req", A, 10.0), ("sent", 10.0), ("req", B, 10.2)], 10.2, 0.0),  # one after the other, a gap apart
])
def test_a_busy_relay_waits_what_is_left_of_a_gap_since_its_last_batch(events, now, wait):
    pace = BatchPace(0.05)
    for kind, *args in events:
        pace.request(*args) if kind == "req" else pace.sent(*args)
    assert pace.wait(now) == pytest.approx(wait)


def _trickle(pace: str, leaves: int = 1) -> tuple[list[int], int, float, float]:
    """24 torch clients under ``leaves`` proxies under a relay, each sending one ADD,
    25 ms apart: their answers, the batches the store host read meanwhile, a lone ADD's
    round trip after a quiet second, and then 20 ADDs of one client one after another
    (seconds in all)."""
    env = dict(ENV, TIERRUN_LINK_RELAY_PACE=pace)
    with StoreProcess(port=0, controlled=True, env=env) as root:
        relay = proxy(root.port, takes_links=True, env=env)
        below = [proxy(relay.link_port, env=env) for _ in range(leaves)]
        try:
            clients = [client(below[i % leaves].port) for i in range(24)]
            clients[0].add("warm", 1)
            time.sleep(1.0)
            before = root.stats()["link_batches"]
            answers: list[int] = []
            threads = []
            for c in clients:
                threads.append(threading.Thread(target=lambda c=c: answers.append(c.add("n", 1))))
                threads[-1].start()
                time.sleep(0.025)
            for t in threads:
                t.join(10)
            batches = root.stats()["link_batches"] - before
            time.sleep(1.0)
            start = time.monotonic()
            clients[0].add("lone", 1)
            lone = time.monotonic() - start
            start = time.monotonic()
            for _ in range(20):
                clients[1].add("one by one", 1)
            return answers, batches, lone, time.monotonic() - start
        finally:
            for p in below:
                p.stop()
            relay.stop()


def test_a_relay_sends_what_trickles_in_a_few_batches_and_a_lone_client_at_once():
    """Three proxies under the relay (whose batches of writes are held for each other:
    the relay's pace holds them too)."""
    answers, batches, lone, one_by_one = _trickle("0.5", leaves=3)
    assert sorted(answers) == list(range(1, 25))  # (what one server answers)
    assert batches <= 6, f"{batches} batches for 24 ADDs over 0.6 s at a 0.5 s pace"
    assert lone < 0.3, f"a lone request after a quiet second took {lone:.3f} s"
    assert one_by_one < 2.0, f"20 ADDs of one client, one at a time, took {one_by_one:.2f} s at a 0.5 s pace"


@pytest.mark.parametrize("pace, leaves", [("0", 3), ("0.5", 1)])
def test_an_unpaced_relay_or_one_with_a_single_proxy_below_sends_each_request_on_its_own(pace, leaves):
    """Not paced; or paced with one proxy below, which sends a batch once the one before
    is answered: to the relay it is one client, sending one request at a time."""
    answers, batches, _, one_by_one = _trickle(pace, leaves)
    assert sorted(answers) == list(range(1, 25))
    assert batches >= 10, f"{batches} batches: the paced test above shows nothing"
    assert one_by_one < 2.0
