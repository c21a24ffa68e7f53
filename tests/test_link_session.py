"""The link session's state machine (``link.session``), both ends, with no sockets:
frames are passed by hand from one end's output to the other's input."""

from __future__ import annotations

import pytest

from tierrun.link import auth
from tierrun.link.frames import (
    ACK, AUTH, ERROR, HELLO, RESUMED, SESSION, WELCOME, FrameDecoder, LinkError, StoreSizes, Unauthenticated,
    encode_count, encode_resumed, frame,
)
from tierrun.link.session import (
    LATE_CHECK, RECHECK_AFTER, ClientHandshake, DeadlineCheck, Heartbeat, Ledger, ServerHandshake,
)

SID = b"s" * 16


def frames(data: bytes) -> list[tuple[int, bytes]]:
    return list(FrameDecoder().feed(data))


def first(data: bytes) -> tuple[int, bytes]:
    """The first frame of ``data`` (AUTH, before the sealed SESSION)."""
    return frames(data[: 4 + int.from_bytes(data[:4], "little")])[0]


def handshake(client_token: bytes = b"tok", server_token: bytes | None = b"tok"):
    ledger = Ledger(1 << 20, 64)
    client = ClientHandshake(client_token, SID, True, ledger)
    server = ServerHandshake(server_token)
    return client, server, ledger


def deliver(decoder: FrameDecoder, data: bytes, end) -> bytes:
    """Feed ``data`` to ``end`` (a handshake) frame by frame as an adapter does: the
    decoder checks MACs from the frame after the one that set them up."""
    out = b""
    for ftype, payload in decoder.frames(data):
        out += end.feed(ftype, payload)
        decoder.opener = end.opener
    return out


def open_link(client, server):
    """Run the handshake; returns the decoders of both ends (client's, server's)."""
    at_client, at_server = FrameDecoder(), FrameDecoder()
    flight = deliver(at_client, server.start(), client)
    replies = deliver(at_server, flight, server)
    server_sealer = server.sealer
    resumed = server_sealer.seal(encode_resumed(7, StoreSizes(1, 2, 3, 4, 5, 6)))
    deliver(at_client, replies + resumed, client)
    return at_client, at_server


def test_one_flight_each_way_opens_the_session():
    client, server, _ = handshake()
    assert client.start() == bytes([0xA7])
    ((ftype, payload),) = frames(server.start())
    assert ftype == HELLO
    flight = client.feed(ftype, payload)
    assert first(flight)[0] == AUTH  # (then SESSION, sealed; the adapter adds the ACK)
    decoder = FrameDecoder()
    replies = b""
    for ftype, payload in decoder.frames(flight):
        replies += server.feed(ftype, payload)
        decoder.opener = server.opener
    assert server.authenticated and server.session == (SID, True, 0)
    ((ftype, payload),) = frames(replies)
    assert ftype == WELCOME and client.feed(ftype, payload) == b""
    assert client.opener is not None
    decoder = FrameDecoder()
    decoder.opener = client.opener
    ((ftype, payload),) = decoder.feed(server.sealer.seal(encode_resumed(7, StoreSizes(1, 2, 3, 4, 5, 6))))
    client.feed(ftype, payload)
    assert client.resumed == 7 and client.limits == StoreSizes(1, 2, 3, 4, 5, 6) and client.max_frame > 4096


def test_every_frame_after_the_handshake_is_sealed_and_checked():
    """A frame altered, replayed, reordered or sealed on another connection fails its
    MAC, and counts for nothing: the next genuine frame still passes."""
    client, server, _ = handshake()
    at_client, at_server = open_link(client, server)
    assert client.resumed == 7
    sealed = [client.sealer.seal(encode_count(ACK, i)) for i in range(3)]
    assert at_server.feed(sealed[0]) == [(ACK, (0).to_bytes(8, "little"))]
    tampered = bytearray(sealed[1])
    tampered[6] ^= 1
    for bad in (bytes(tampered), sealed[0], sealed[2]):  # altered, replayed, reordered
        with pytest.raises(Unauthenticated, match="fails its MAC"):
            FrameDecoder.feed(_copy(at_server), bad)
    assert at_server.feed(sealed[1] + sealed[2]) == [(ACK, (1).to_bytes(8, "little")), (ACK, (2).to_bytes(8, "little"))]
    other_client, other_server, _ = handshake()  # the same token, another connection
    open_link(other_client, other_server)
    with pytest.raises(Unauthenticated):
        at_server.feed(other_client.sealer.seal(encode_count(ACK, 3)))
    with pytest.raises(Unauthenticated):
        at_server.feed(encode_count(ACK, 3) + b"x" * 16)  # (a frame with no valid MAC)


def _copy(decoder: FrameDecoder) -> FrameDecoder:
    """A decoder in the same state (the MAC counter included), to try bytes on."""
    import copy

    twin = FrameDecoder()
    twin.opener = copy.copy(decoder.opener)
    return twin


def test_a_refusal_counts_only_once_the_host_proved_the_token():
    """Before WELCOME anyone can send ERROR (an impostor, garbage on the path): that is
    Unauthenticated, and a reconnecting node tries again. After WELCOME the host's
    frames are sealed, so an ERROR there is the host's own: a plain LinkError."""
    client, server, _ = handshake()
    deliver(FrameDecoder(), server.start(), client)
    with pytest.raises(Unauthenticated, match="refused the link: go away"):
        client.feed(ERROR, b"go away")
    client, server, _ = handshake()
    at_client, at_server = FrameDecoder(), FrameDecoder()
    replies = deliver(at_server, deliver(at_client, server.start(), client), server)
    deliver(at_client, replies, client)  # WELCOME
    with pytest.raises(Unauthenticated):  # an unsealed ERROR now fails its MAC
        at_client.feed(frame(ERROR, b"forged") + bytes(16))
    ((ftype, payload),) = at_client.feed(server.sealer.seal(frame(ERROR, b"no such session")))
    with pytest.raises(LinkError, match="no such session") as e:
        client.feed(ftype, payload)
    assert not isinstance(e.value, Unauthenticated)


def test_a_wrong_token_is_refused_by_the_store_host():
    client, server, _ = handshake(client_token=b"wrong")
    ((ftype, payload),) = frames(server.start())
    auth_frame = first(client.feed(ftype, payload))
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
    auth_frame = first(client.feed(ftype, payload))
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


@pytest.mark.parametrize("late, again, looks_again", [
    (0.0, False, False),               # on time: a silent peer is silent
    (LATE_CHECK, False, False),        # within the slack
    (LATE_CHECK + 0.01, False, True),  # late: this process was not running; read first
    (5.0, True, False),                # a look again, late itself: condemn (no endless deferral)
])
def test_a_late_deadline_check_looks_again_once(late, again, looks_again):
    check = DeadlineCheck()
    assert check.armed(100.0, 1.0, again) == 1.0
    assert check.look_again(101.0 + late) is looks_again


def test_every_late_check_looks_again_once_not_every_other_one():
    """A look again that found the peer alive leaves nothing behind: the next late
    check (the process frozen once more) looks again too (it condemned at once)."""
    check = DeadlineCheck()
    for start in (0.0, 10.0, 20.0):
        check.armed(start, 1.0)
        assert check.look_again(start + 3.0)  # late: look again
        check.armed(start + 3.0, RECHECK_AFTER, again=True)
        # (the look again finds the peer alive: look_again is not asked; the next beat is armed)
        check.armed(start + 3.0 + RECHECK_AFTER, 1.0)
    check.armed(30.0, 1.0)
    assert check.look_again(33.0)
    check.armed(33.0, RECHECK_AFTER, again=True)
    assert not check.look_again(33.0 + RECHECK_AFTER)  # silent still: condemned
