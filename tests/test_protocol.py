"""The sans-I/O parser, byte by byte, without a network."""

import struct

import pytest

from tierrun.protocol import Limits, Op, ProtocolError, RequestParser
from tierrun.protocol.opcodes import VALIDATION_MAGIC
from tierrun.protocol.requests import encode_handshake, encode_request

EVERY_REQUEST = [
    (Op.SET, b"/k", b"value"),
    (Op.COMPARE_SET, b"/k", b"", b"new"),
    (Op.GET, b"/k"),
    (Op.ADD, b"/n", -3),
    (Op.CHECK, (b"/a", b"/b")),
    (Op.WAIT, (b"/a",)),
    (Op.GETNUMKEYS,),
    (Op.DELETE_KEY, b"/k"),
    (Op.APPEND, b"/k", b"more"),
    (Op.MULTI_GET, (b"/a", b"/b", b"/c")),
    (Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2")),
    (Op.CANCEL_WAIT,),
    (Op.PING, 0xDEADBEEF),
    (Op.QUEUE_PUSH, b"/q", b"item"),
    (Op.QUEUE_POP, b"/q"),
    (Op.QUEUE_LEN, b"/q"),
    (Op.LIST_KEYS,),
    (Op.BARRIER, b"/bar", 8),
    (Op.CHECK, ()),
    (Op.SET, b"", b""),
]
STREAM = encode_handshake(7) + b"".join(encode_request(r) for r in EVERY_REQUEST)
EXPECTED = [(Op.PING, 7)] + EVERY_REQUEST


def test_every_opcode_in_one_read():
    assert RequestParser().feed(STREAM) == EXPECTED


def test_byte_by_byte_gives_the_same_requests():
    p = RequestParser()
    out = []
    for i in range(len(STREAM)):
        out += p.feed(STREAM[i : i + 1])
    assert out == EXPECTED
    assert p.buffered == 0


@pytest.mark.parametrize("cut", [1, 3, 5, 9, 17, 40, 100])
def test_any_split_point(cut):
    p = RequestParser()
    assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) == EXPECTED


def test_validate_produces_no_request_and_opcode_names_are_normalised():
    reqs = RequestParser().feed(encode_handshake(1))
    assert reqs == [(Op.PING, 1)]
    assert isinstance(reqs[0][0], Op)


def test_torch21_numbering_is_detected_and_translated():
    legacy = [r for r in EVERY_REQUEST if r[0] <= Op.CANCEL_WAIT]
    data = b"".join(encode_request(r, legacy=True) for r in legacy)
    # byte level: torch 2.1's SET is opcode 0, GET is 2
    assert encode_request((Op.SET, b"k", b"v"), legacy=True)[0] == 0
    assert encode_request((Op.GET, b"k"), legacy=True)[0] == 2
    p = RequestParser()
    out = []
    for i in range(len(data)):
        out += p.feed(data[i : i + 1])
    assert out == legacy
    assert p.is_legacy


def test_torch21_connection_rejects_opcodes_that_did_not_exist():
    p = RequestParser()
    p.feed(encode_request((Op.GET, b"k"), legacy=True))
    with pytest.raises(ProtocolError, match="unknown opcode 12"):
        p.feed(bytes([12]))


def test_wrong_validate_magic():
    with pytest.raises(ProtocolError, match="VALIDATE magic"):
        RequestParser().feed(b"\x00" + struct.pack("<I", 0x12345678) + b"\xff" * 8)


@pytest.mark.parametrize("magic", [VALIDATION_MAGIC, VALIDATION_MAGIC + 1])
def test_a_validate_after_the_first_request_is_invalid_as_torch_has_it(magic):
    """torch's server closes a connection that sends VALIDATE again; the requests
    before it are still answered (``ProtocolError.requests``)."""
    p = RequestParser()
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError, match="VALIDATE after the connection's first request") as e:
        p.feed(encode_request((Op.GET, b"/a")) + b"\x00" + struct.pack("<I", magic))
    assert e.value.requests == [(Op.GET, b"/a")]


def test_unknown_opcode():
    p = RequestParser()
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError, match="unknown opcode 19"):
        p.feed(b"\x13")


@pytest.mark.parametrize(
    "req, limits, match",
    [
        ((Op.SET, b"k" * 11, b"v"), Limits(max_key_bytes=10), "key of 11 bytes"),
        ((Op.SET, b"k", b"v" * 101), Limits(max_value_bytes=100), "value of 101 bytes"),
        ((Op.WAIT, (b"a",) * 5), Limits(max_keys_per_request=4), "5 keys"),
        ((Op.MULTI_SET, (b"a",) * 5, (b"v",) * 5), Limits(max_keys_per_request=4), "5 keys"),
        ((Op.MULTI_GET, (b"a" * 11,)), Limits(max_key_bytes=10), "key of 11"),
        ((Op.MULTI_SET, (b"a",), (b"v" * 101,)), Limits(max_value_bytes=100), "value of 101"),
        ((Op.MULTI_GET, (b"a" * 50,) * 4), Limits(max_request_bytes=100), "request exceeds"),
    ],
)
def test_limits_are_enforced_from_the_length_alone(req, limits, match):
    data = encode_handshake(1) + encode_request(req)
    p = RequestParser(limits)
    with pytest.raises(ProtocolError, match=match):
        # the bytes after the offending length never need to arrive
        for i in range(len(data)):
            p.feed(data[i : i + 1])


@pytest.mark.parametrize("bad", [b"\x13", bytes((Op.GET,)) + struct.pack("<Q", 1 << 40),
                                 bytes((Op.CHECK,)) + struct.pack("<Q", 1 << 20)])
def test_requests_before_an_invalid_one_come_with_its_error(bad):
    """torch's server executes and answers what came before the bad request, then closes."""
    good = [(Op.SET, b"/a", b"1"), (Op.ADD, b"/n", 2)]
    p = RequestParser()
    with pytest.raises(ProtocolError) as err:
        p.feed(encode_handshake(1) + b"".join(encode_request(r) for r in good) + bad)
    assert err.value.requests == [(Op.PING, 1)] + good  # (the handshake's PING)
    p = RequestParser()
    p.feed(encode_handshake(1) + encode_request(good[0]))
    with pytest.raises(ProtocolError) as err:  # (only those of the same feed)
        p.feed(bad)
    assert err.value.requests == []


def test_a_huge_claimed_length_allocates_nothing():
    p = RequestParser()
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError):
        p.feed(b"\x01" + struct.pack("<Q", 2**63))
    p = RequestParser(Limits(max_value_bytes=2**40))
    p.feed(encode_handshake(1))
    p.feed(b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 2**39))
    assert p.buffered < 64  # only what arrived is held


def test_partial_multi_key_request_is_resumed_not_reparsed():
    keys = tuple(f"/key/{i}".encode() for i in range(1000))
    data = encode_handshake(1) + encode_request((Op.MULTI_GET, keys))
    p = RequestParser()
    out = []
    for i in range(0, len(data), 7):
        out += p.feed(data[i : i + 7])
        assert p.buffered < 7 + 8 + 16  # consumed keys are not kept in the buffer
    assert out == [(Op.PING, 1), (Op.MULTI_GET, keys)]


def _multi_set_bytes(pairs) -> bytes:
    out = bytes([Op.MULTI_SET]) + struct.pack("<Q", len(pairs))
    for key, value in pairs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<Q", len(value)) + value
    return out


@pytest.mark.parametrize("pairs,partial", [
    # a key past the limit: the pairs before it
    ([(b"/a", b"1"), (b"k" * 9, b"2"), (b"/c", b"3")], (Op.MULTI_SET, (b"/a",), (b"1",))),
    # a value past the limit: the pairs before its key's
    ([(b"/a", b"1"), (b"/b", b"22"), (b"/c", b"3" * 9)], (Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"22"))),
    # the first pair bad: nothing
    ([(b"k" * 9, b"1"), (b"/b", b"2")], None),
    ([(b"/a", b"1" * 9)], None),
])
def test_a_multi_set_with_a_bad_pair_sets_the_pairs_before_it_as_torch_does(pairs, partial):
    """torch's server sets each pair of a MULTI_SET as it reads it and closes the
    connection at the first past a limit: the pairs before it take effect."""
    p = RequestParser(Limits(max_key_bytes=8, max_value_bytes=8))
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError, match="exceeds the limit") as e:
        p.feed(encode_request((Op.GET, b"/x")) + _multi_set_bytes(pairs))
    assert e.value.requests == [(Op.GET, b"/x")] + ([partial] if partial else [])


def test_a_multi_set_with_a_bad_pair_arriving_in_pieces_still_sets_the_pairs_before_it():
    p = RequestParser(Limits(max_key_bytes=8, max_value_bytes=8))
    p.feed(encode_handshake(1))
    data = _multi_set_bytes([(b"/a", b"1"), (b"/b", b"2"), (b"/c", b"3" * 9)])
    cut = data.index(b"/b") + 2  # (the second pair's key in, its value not yet)
    assert p.feed(data[:cut]) == []
    with pytest.raises(ProtocolError) as e:
        p.feed(data[cut:])
    assert e.value.requests == [(Op.MULTI_SET, (b"/a", b"/b"), (b"1", b"2"))]


def test_pairs_before_a_bad_one_past_the_request_bytes_limit_are_not_set():
    """tierrun's own limit on a request's bytes (torch has none): a MULTI_SET past it is
    refused whole, never split into a part that passes it."""
    p = RequestParser(Limits(max_key_bytes=8, max_value_bytes=8, max_request_bytes=40))
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError) as e:
        p.feed(_multi_set_bytes([(b"/a", b"11111111"), (b"/b", b"22222222"), (b"/c", b"3" * 9)]))
    assert e.value.requests == []


@pytest.mark.parametrize("tail", [b"", b"\xce", b"\xce\xf7\x85"])
def test_a_later_validate_is_refused_at_its_opcode_as_torch_has_it(tail):
    """torch's server closes the connection as soon as it reads a VALIDATE opcode after
    the first request (its switch has no case for it): a client that sends the opcode
    and stops (or fewer than the 4 bytes of its magic) is closed at once, not held
    open waiting for the rest (review: tierrun kept such a connection open)."""
    p = RequestParser()
    p.feed(encode_handshake(1))
    with pytest.raises(ProtocolError, match="VALIDATE after the connection's first request") as e:
        p.feed(encode_request((Op.GET, b"/a")) + b"\x00" + tail)
    assert e.value.requests == [(Op.GET, b"/a")]
