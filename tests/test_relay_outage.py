"""A relay whose own link waits for the store host keeps its children's links alive.

In a tree, a relay (a proxy that takes other proxies' links) stops reading a child that
pushes writes while its own link to the store host has no room for them (their
acknowledgements are not coming: the store host is unreachable). A child that hears
nothing for the heartbeat timeout drops its link and reconnects, so every node under a
relay churned its links through any outage of the store host longer than that timeout.
The relay now sends a paused child an ACK every heartbeat interval: the child keeps its
connection, and once the store host is back every write lands, once."""

from __future__ import annotations

import os
import signal
import threading
import time

from tierrun.client import StoreClient
from tierrun.server import StoreProcess

ENV = dict(os.environ, TIERRUN_TOKEN="relay-outage-test", TIERRUN_LINK_HEARTBEAT="0.25",
           TIERRUN_LINK_TIMEOUT="1.5", TIERRUN_LINK_GRACE="30")
MiB = 1 << 20


def test_a_relay_waiting_for_the_store_host_keeps_its_children_linked():
    store = StoreProcess(host="127.0.1.1", port=0, controlled=True, env=ENV)
    store.start()
    relay = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=ENV,
                         extra_args=["--upstream", f"127.0.1.1:{store.port}", "--link-listen", "127.0.1.2:0"])
    child = None
    try:
        relay.start()
        assert relay.link_port
        child = StoreProcess(host="127.0.0.1", port=0, command="proxy", controlled=True, env=ENV,
                             extra_args=["--upstream", f"127.0.1.2:{relay.link_port}"])
        child.start()
        with StoreClient(("127.0.0.1", child.port), timeout=60) as c:
            c.set(b"/before", b"1")
            os.kill(store.pid, signal.SIGSTOP)  # the store host is gone: nothing acknowledged
            stopped = time.monotonic()
            value = b"v" * MiB
            flood = threading.Thread(target=lambda: [c.set(b"/flood/%d" % i, value) for i in range(40)])
            flood.start()  # (40 MiB: past the relay's room of 16 MiB unacknowledged)
            time.sleep(5.0)  # > 3 heartbeat timeouts of the child's link
            os.kill(store.pid, signal.SIGCONT)
            flood.join(60)
            assert not flood.is_alive()
            assert c.check([b"/flood/%d" % i for i in range(40)])
            assert time.monotonic() - stopped < 40
        with StoreClient(("127.0.1.1", store.port)) as direct:
            assert direct.num_keys() >= 41
        assert "paused" not in child.output  # (nothing unexpected)
        assert "nothing heard from the store host" not in child.output, child.output[-3000:]
        assert "lost" not in child.output, child.output[-3000:]
        assert "nothing heard from the store host" in relay.output  # (the relay's own link did drop)
    finally:
        try:
            os.kill(store.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for p in (child, relay, store):
            if p is not None:
                p.stop()
