"""The control-line protocol between a store process and its parent, as tables of lines:
each line parses to its event or command, and formatting that gives the line back."""

import pytest

from tierrun.server.control import (
    CloseNamespace, Listening, NamespaceListening, OpenNamespace, SendStats, Stats, TakingLinks,
    format_command, format_event, parse_command, parse_event,
)

EVENTS = [
    ("tierrun store listening on tcp [::]:29500", "store", Listening("tcp [::]:29500")),
    ("tierrun store listening on tcp 0.0.0.0:29500", "store", Listening("tcp 0.0.0.0:29500")),
    ("tierrun proxy listening on tcp 127.0.0.1:40001", "proxy", Listening("tcp 127.0.0.1:40001")),
    ("tierrun proxy listening on unix @tierrun-proxy-12-ab", "proxy", Listening("unix @tierrun-proxy-12-ab")),
    ("tierrun store listening on unix /tmp/a b.sock", "store", Listening("unix /tmp/a b.sock")),
    ("tierrun proxy taking links on tcp [fe80::1]:41000", "proxy", TakingLinks("tcp [fe80::1]:41000")),
    ("tierrun store namespace job/workers/0 listening on tcp port 40002", "store",
     NamespaceListening("job/workers/0", 40002)),
    ("tierrun proxy namespace listening listening on tcp port 1", "proxy", NamespaceListening("listening", 1)),
    ('tierrun store stats {"keys": 3, "links": 1}', "store", Stats({"keys": 3, "links": 1})),
    ('tierrun proxy stats {"node_frontend": {"clients_open": 2}}', "proxy",
     Stats({"node_frontend": {"clients_open": 2}})),
    ("tierrun store node front-end listening on tcp 127.0.0.1:40003", "store",
     Listening("tcp 127.0.0.1:40003", node=True)),
    ("tierrun store node front-end listening on unix @tierrun-proxy-9-cd", "store",
     Listening("unix @tierrun-proxy-9-cd", node=True)),
    ("tierrun store node front-end namespace job/workers/1 listening on tcp port 40004", "store",
     NamespaceListening("job/workers/1", 40004, node=True)),
]


@pytest.mark.parametrize("line, process, event", EVENTS, ids=[e[0] for e in EVENTS])
def test_event_lines(line, process, event):
    assert parse_event(line) == (process, event)
    assert parse_event(line + "\n") == (process, event)
    assert format_event(process, event) == line


@pytest.mark.parametrize("event, port", [
    (Listening("tcp [::]:29500"), 29500),
    (Listening("tcp 10.0.0.7:1"), 1),
    (Listening("unix /run/store.sock"), None),
    (Listening("unix @name:5"), None),
    (TakingLinks("tcp [::1]:41000"), 41000),
])
def test_tcp_ports(event, port):
    assert event.port == port


@pytest.mark.parametrize("line", [
    "[tierrun store] WARNING closing connection from 127.0.0.1:5: invalid request",
    "tierrun: error: the store proxy died",
    "tierrun store-frontend: no $TIERRUN_FRONTEND_TOKEN",
    "tierrun worker listening on tcp 1.2.3.4:5",
    "tierrun store namespace a b listening on tcp port 5",
    "tierrun store namespace x listening on tcp port many",
    "tierrun store something else",
    "",
])
def test_other_lines_are_not_events(line):
    assert parse_event(line) is None


def test_a_stats_line_with_broken_json_raises():
    with pytest.raises(ValueError):
        parse_event("tierrun store stats {not json")


@pytest.mark.parametrize("process, event", [
    ("worker", Listening("tcp 1.2.3.4:5")),
    ("store", NamespaceListening("a b", 5)),
    ("store", NamespaceListening("", 5)),
])
def test_events_that_cannot_be_said(process, event):
    with pytest.raises(ValueError):
        format_event(process, event)


COMMANDS = [
    ("namespace job/workers/0", OpenNamespace("job/workers/0")),
    ("node-namespace job/workers/0", OpenNamespace("job/workers/0", node=True)),
    ("close-namespace job/workers/0", CloseNamespace("job/workers/0")),
    ("close-node-namespace job/workers/0", CloseNamespace("job/workers/0", node=True)),
    ("stats", SendStats()),
]


@pytest.mark.parametrize("line, command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_lines(line, command):
    assert parse_command(line) == command
    assert parse_command(f"  {line} \n") == command
    assert format_command(command) == line


@pytest.mark.parametrize("line", ["", "\n", "   \n"])
def test_blank_lines_are_no_command(line):
    assert parse_command(line) is None


@pytest.mark.parametrize("line", ["namespace", "namespace a b", "stats now", "open x", "node-namespace",
                                  "close-namespace", "close-namespace a b"])
def test_unknown_commands_raise(line):
    with pytest.raises(ValueError, match="unknown control command"):
        parse_command(line)


@pytest.mark.parametrize("name", ["", "a b", "a\tb", "a\nb"])
def test_namespace_names_are_one_word(name):
    with pytest.raises(ValueError, match="one word"):
        format_command(OpenNamespace(name))
