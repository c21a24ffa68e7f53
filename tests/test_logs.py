"""Log lines a flood multiplies (tierrun/logs.py): a budget per kind of line."""

import logging

from tierrun import logs
from tierrun.logs import FloodLog


def test_past_its_burst_a_kind_of_line_is_counted_and_the_count_told_with_the_next_window(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(logs, "monotonic", lambda: now[0])
    flood = FloodLog(logging.getLogger("tierrun.store"), "connections closed", burst=3, window=10.0)
    with caplog.at_level(logging.WARNING, logger="tierrun.store"):
        for i in range(50):
            flood.warning("closing connection from %s: bad", f"10.0.0.{i}")
        assert [r.getMessage() for r in caplog.records] == [f"closing connection from 10.0.0.{i}: bad" for i in range(3)]
        now[0] += 10.0
        flood.warning("closing connection from %s: bad", "10.0.0.99")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[3].startswith("connections closed: 47 more not logged since ")
    assert messages[3].endswith(" (at most 3 lines per 10 s)")
    assert messages[4] == "closing connection from 10.0.0.99: bad"
    assert len(messages) == 5


def test_a_kind_of_line_within_its_budget_is_logged_whole(caplog):
    flood = FloodLog(logging.getLogger("tierrun.store"), "link connections closed")
    with caplog.at_level(logging.WARNING, logger="tierrun.store"):
        for i in range(20):
            flood.warning("closing link from %s: %s", "127.0.0.1:1", i)
    assert len(caplog.records) == 20
