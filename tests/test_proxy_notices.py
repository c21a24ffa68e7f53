"""The agent repeats its node proxy's link lines (tierrun/rendezvous/proxy_notices.py)."""

import logging

from tierrun.rendezvous.proxy_notices import ProxyNotices


def test_the_agent_says_when_its_proxys_link_drops_and_comes_back_and_nothing_else(caplog):
    notices = ProxyNotices("node 10.0.0.2")
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        notices("[tierrun proxy] WARNING link to the store host 10.0.0.1:29500 lost at 06:41:27 (closed by the "
                "peer); reconnecting (for up to 15 s)\n")
        notices("[tierrun proxy] WARNING closing connection from 127.0.0.1:5000: invalid request: ...\n")
        notices("[tierrun proxy] INFO link to the store host 10.0.0.1:29500: new session\n")
        notices("[tierrun proxy] WARNING link to the store host resumed after 2.1 s\n")
    assert [r.getMessage() for r in caplog.records] == [
        "node 10.0.0.2: its store proxy: link to the store host 10.0.0.1:29500 lost at 06:41:27 (closed by "
        "the peer); reconnecting (for up to 15 s)",
        "node 10.0.0.2: its store proxy: link to the store host resumed after 2.1 s",
    ]
