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


def test_a_link_that_keeps_flapping_is_told_a_few_times_a_minute_then_counted(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("tierrun.logs.monotonic", lambda: clock[0])
    notices = ProxyNotices("node 10.0.0.2")
    lost = ("[tierrun proxy] WARNING link to the store host 10.0.0.1:29500 lost at 06:41:27 (closed by the peer); "
            "reconnecting (for up to 15 s)\n")
    back = "[tierrun proxy] WARNING link to the store host resumed after 0.1 s\n"
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        for _ in range(30):  # 30 flaps in 30 s: 60 lines
            notices(lost)
            notices(back)
            clock[0] += 1.0
        clock[0] += 60.0
        notices(lost)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 10 + 2  # the first 10, then the count of those left out and the next line
    assert said[10].startswith("node 10.0.0.2: its store proxy's link lines: 50 more not logged since ")
    assert said[11].endswith("reconnecting (for up to 15 s)")
