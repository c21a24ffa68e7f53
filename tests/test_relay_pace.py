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


@pytest.mark.parametrize("sent, now, wait", [
    ([], 0.0, 0.0),  # nothing sent yet: at once
    ([10.0], 10.0, 0.05),  # right after a batch: a whole gap
    ([10.0], 10.02, 0.03),
    ([10.0], 10.05, 0.0),  # a gap later: at once
    ([10.0], 11.0, 0.0),  # after a quiet spell: at once
    ([10.0, 10.05], 10.06, 0.04),  # the last batch counts
])
def test_the_wait_is_what_is_left_of_a_gap_since_the_last_batch(sent, now, wait):
    pace = BatchPace(0.05)
    for t in sent:
        pace.sent(t)
    assert pace.wait(now) == pytest.approx(wait)


def _trickle(pace: str) -> tuple[list[int], int, float]:
    """24 torch clients under a proxy under a relay, each sending one ADD, 25 ms apart:
    their answers, the batches the store host read meanwhile, and a lone ADD's round
    trip after a quiet second."""
    env = dict(ENV, TIERRUN_LINK_RELAY_PACE=pace)
    with StoreProcess(port=0, controlled=True, env=env) as root:
        relay = proxy(root.port, takes_links=True, env=env)
        leaf = proxy(relay.link_port, env=env)
        try:
            clients = [client(leaf.port) for _ in range(24)]
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
            return answers, batches, time.monotonic() - start
        finally:
            leaf.stop()
            relay.stop()


def test_a_relay_sends_what_trickles_in_a_few_batches_and_a_lone_request_at_once():
    answers, batches, lone = _trickle("0.5")
    assert sorted(answers) == list(range(1, 25))  # (what one server answers)
    assert batches <= 6, f"{batches} batches for 24 ADDs over 0.6 s at a 0.5 s pace"
    assert lone < 0.3, f"a lone request after a quiet second took {lone:.3f} s"


def test_an_unpaced_relay_sends_each_trickled_request_on_its_own():
    answers, batches, _ = _trickle("0")
    assert sorted(answers) == list(range(1, 25))
    assert batches >= 10, f"{batches} batches: the paced test above shows nothing"
