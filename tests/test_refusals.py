"""The store host's agent says why its store refused a connection of the other store
layout, or of another job token (``rendezvous.refusals``), read from the store process's
log lines."""

import logging

from tierrun.frontend.contracts import TORCH_CLIENT_REFUSED
from tierrun.link.auth import WRONG_TOKEN
from tierrun.link.session import NO_LINKS
from tierrun.rendezvous.refusals import MAX_ADDRESSES, Refusals


def closing(peer: str, reason: str) -> str:
    return f"[tierrun store] WARNING closing link from {peer}: {reason}\n"


def test_each_refusal_is_said_once_per_address_and_kind(caplog):
    said = Refusals("node 10.0.0.1", 29500)
    with caplog.at_level(logging.WARNING, logger="tierrun"):
        for port in (40001, 40002, 40003):  # (torch's client retries, from a new port each time)
            said(closing(f"::ffff:10.0.0.7:{port}", TORCH_CLIENT_REFUSED))
        said(closing("10.0.0.8:40004", NO_LINKS))
        said(closing("fd00::9:40005", TORCH_CLIENT_REFUSED))  # (as the store names a peer)
        said(closing("10.0.0.7:40006", "no link session within 5 s of connecting"))  # (not the other layout)
        for port in (40007, 40008):  # (its front-end retries)
            said(closing(f"10.0.0.8:{port}", WRONG_TOKEN))
        said("[tierrun store] WARNING link from 10.0.0.7:1: session resumed\n")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[0].startswith("node 10.0.0.1: the job's store refused a torch-protocol client from 10.0.0.7: "
                               "a tiered job's store port (29500) takes node links only")
    assert "store_public_clients=true" in lines[0] and "$MASTER_ADDR:$MASTER_PORT" in lines[0]
    assert lines[1].startswith("node 10.0.0.1: the job's store refused a node link from 10.0.0.8: this node runs "
                               "a flat store, that node is tiered")
    assert "client from fd00::9: a tiered" in lines[2]
    assert lines[3].startswith("node 10.0.0.1: the job's store refused a node link from 10.0.0.8: its job token "
                               "is not this job's. Give every node of the job the same secret")


def test_a_scan_from_many_addresses_does_not_flood_the_log(caplog):
    said = Refusals("node 10.0.0.1", 29500)
    with caplog.at_level(logging.WARNING, logger="tierrun"):
        for k in range(3 * MAX_ADDRESSES):
            said(closing(f"10.1.{k // 256}.{k % 256}:5000", TORCH_CLIENT_REFUSED))
    assert len(caplog.records) == MAX_ADDRESSES + 1
    assert "not said again" in caplog.records[-1].getMessage()
