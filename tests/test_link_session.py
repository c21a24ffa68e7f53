"""The link session's state machine (``link.session``), both ends, with no sockets:
frames are passed by hand from one end's output to the other's input."""

from __future__ import annotations

import pytest

from tierrun.link import auth
from tierrun.link.frames import (
    ACK, AUTH, HELLO, RESUMED, SESSION, WELCOME, FrameDecoder, LinkError, encode_count, frame,
)
from tierrun.link.session import ClientHandshake, Heartbeat, Ledger, ServerHandshake

SID = b"s" * 16


def frames(data: bytes) -> list[tuple[int, bytes]]:
    return list(FrameDecoder().feed(data))


def handshake(client_token: bytes = b"tok", server_token: bytes | None = b"tok"):
    ledger = Ledger(1 << 20, 64)
    client = ClientHandshake(client_token, SID, True, ledger)
    server = ServerHandshake(server_token)
    return client, server, ledger


def test_one_flight_each_way_opens_the_session():
    client, server, _ = handshake()
    assert client.start() == bytes([0xA7])
    ((ftype, payload),) = frames(server.start())
    assert ftype == HELLO
    flight = client.feed(ftype, payload)
    assert [t for t, _ in frames(flight)] == [AUTH, SESSION]  # (the adapter adds the ACK)
    replies = b""
    for ftype, payload in frames(flight):
        replies += server.feed(ftype, payload)
    assert server.authenticated and server.session == (SID, True, 0)
    ((ftype, payload),) = frames(replies)
    assert ftype == WELCOME and client.feed(ftype, payload) == b""
    client.feed(RESUMED, encode_count(RESUMED, 7)[5:])
    assert client.resumed == 7 and client.max_frame > 4096


def test_a_wrong_token_is_refused_by_the_store_host():
    client, server, _ = handshake(client_token=b"wrong")
    ((ftype, payload),) = frames(server.start())
    (auth_frame, _) = frames(client.feed(ftype, payload))
    with pytest.raises(LinkError, match="wrong job token"):
        server.feed(*auth_frame)


def test_a_host_that_does_not_know_the_token_is_refused_by_the_front_end():
    client, _, _ = handshake()
    fake = ServerHandshake(b"other")
    ((ftype, payload),) = frames(fake.start())
    client.feed(ftype, payload)
    with pytest.raises(LinkError, match="does not know the job token"):
        client.feed(WELCOME, b"x" * 32)


@pytest.mark.parametrize("ftype", [RESUMED, ACK, WELCOME])
def test_frames_out_of_order_are_refused(ftype):
    client, server, _ = handshake()
    with pytest.raises(LinkError):
        client.feed(ftype, encode_count(ftype, 0)[5:])  # (before HELLO; RESUMED before WELCOME)
    with pytest.raises(LinkError, match="expected AUTH"):
        server.feed(SESSION, b"")


def test_a_store_without_a_token_takes_no_links():
    client, server, _ = handshake(server_token=None)
    ((ftype, payload),) = frames(server.start())
    (auth_frame, _) = frames(client.feed(ftype, payload))
    with pytest.raises(LinkError, match="accepts no links"):
        server.feed(*auth_frame)


def test_a_different_version_is_named():
    client, _, _ = handshake()
    hello = frame(HELLO, (99).to_bytes(2, "little") + b"n" * auth.NONCE)
    with pytest.raises(LinkError, match="link version 99"):
        client.feed(*frames(hello)[0])


def test_the_ledger_numbers_keeps_and_resends_what_the_peer_lacks():
    ledger = Ledger(1 << 20, ack_every=2)
    for i in range(3):
        ledger.sent(b"frame%d" % i)
    assert [ledger.got(), ledger.got()] == [False, True]  # (an ACK is due every 2 frames)
    assert ledger.ack() == encode_count(ACK, 2) and ledger.unacked_in == 0
    ledger.acked(1)
    assert ledger.resume(2) == [b"frame2"]
    with pytest.raises(LinkError):
        ledger.resume(1)  # (the peer had acknowledged 2: not this session's peer)
    with pytest.raises(LinkError):
        ledger.acked(9)  # (never sent)
    small = Ledger(10, 64)
    with pytest.raises(LinkError):
        small.sent(b"x" * 11)


def test_the_heartbeat_deadline():
    beat = Heartbeat(timeout=5.0, now=100.0)
    assert not beat.expired(104.9) and beat.expired(105.1)
    beat.heard(105.0)
    assert beat.silent(106.0) == 1.0 and not beat.expired(106.0)
