"""The agent repeats its node proxy's link lines (tierrun/rendezvous/proxy_notices.py)."""

import logging
import re
import time

from tierrun.rendezvous import proxy_notices
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


LOST = ("[tierrun proxy] WARNING link to the store host 10.0.0.1:29500 lost at 06:41:27 (closed by the peer); "
        "reconnecting (for up to 15 s)\n")
BACK = "[tierrun proxy] WARNING link to the store host resumed after 0.1 s\n"


def _said(caplog, count: int | None = None):
    """What was logged, once ``count`` lines are (the timer thread's too), or within 10 s."""
    deadline = time.monotonic() + 10
    while count is not None and len(caplog.records) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3 if count is not None else 0)  # (and nothing more comes)
    return [r.getMessage() for r in caplog.records]


def test_a_link_that_keeps_flapping_is_told_ten_lines_then_only_what_holds(caplog, monkeypatch):
    monkeypatch.setattr(proxy_notices, "SETTLE", 0.2)
    notices = ProxyNotices("node 10.0.0.2")
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        for _ in range(30):  # 30 flaps at once: 60 lines
            notices(LOST)
            notices(BACK)
        said = _said(caplog, 11)
        assert len(said) == 10 + 1  # the first 10, then how many flaps were left out (the link is back)
        assert said[9].endswith("resumed after 0.1 s")
        assert said[10].startswith("node 10.0.0.2: its store proxy's link dropped and came back 25 more times since ")
        notices(LOST)  # a drop that lasts: told once it held for SETTLE
        assert len(_said(caplog)) == 11
        said = _said(caplog, 12)
    assert len(said) == 12 and said[11].endswith("reconnecting (for up to 15 s)")


def test_the_last_drop_after_a_burst_of_flaps_is_told(caplog, monkeypatch):
    """After 5 flaps (the burst), a drop the link never comes back from: the agent's last
    line must say the link is lost, not that it resumed."""
    monkeypatch.setattr(proxy_notices, "SETTLE", 0.2)
    notices = ProxyNotices("node 10.0.0.2")
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        for _ in range(5):
            notices(LOST)
            notices(BACK)
        notices(LOST)
        notices(BACK)
        notices(LOST)
        said = _said(caplog, 11)
    assert len(said) == 11
    assert said[10].startswith("node 10.0.0.2: its store proxy: link to the store host 10.0.0.1:29500 lost at ")
    assert re.search(r"reconnecting \(for up to 15 s\) \(2 link lines left out since \d\d:\d\d:\d\d\)$", said[10])
