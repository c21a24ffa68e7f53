"""Property-based tests of the parser: random and mutated streams never crash it."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierrun.protocol import Limits, Op, ProtocolError, RequestParser
from tierrun.protocol.parser import decode_request
from tierrun.protocol.requests import encode_handshake, encode_request

keys = st.binary(max_size=20)
values = st.binary(max_size=40)
requests = st.one_of(
    st.tuples(st.just(Op.SET), keys, values),
    st.tuples(st.just(Op.COMPARE_SET), keys, values, values),
    st.tuples(st.just(Op.GET), keys),
    st.tuples(st.just(Op.ADD), keys, st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.sampled_from([Op.CHECK, Op.WAIT, Op.MULTI_GET]), st.lists(keys, max_size=5).map(tuple)),
    st.just((Op.GETNUMKEYS,)),
    st.tuples(st.sampled_from([Op.DELETE_KEY, Op.QUEUE_POP, Op.QUEUE_LEN]), keys),
    st.tuples(st.sampled_from([Op.APPEND, Op.QUEUE_PUSH]), keys, values),
    st.lists(st.tuples(keys, values), max_size=5).map(
        lambda kv: (Op.MULTI_SET, tuple(k for k, _ in kv), tuple(v for _, v in kv))
    ),
    st.just((Op.CANCEL_WAIT,)),
    st.tuples(st.just(Op.PING), st.integers(0, 2**32 - 1)),
    st.just((Op.LIST_KEYS,)),
    st.tuples(st.just(Op.BARRIER), keys, st.integers(-(2**63), 2**63 - 1)),
)
SMALL = Limits(max_key_bytes=64, max_value_bytes=128, max_keys_per_request=8, max_request_bytes=4096)


def feed_all(parser, data, cuts):
    out = []
    prev = 0
    for cut in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
        out += parser.feed(data[prev:cut])
        prev = cut
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(requests, max_size=12), st.lists(st.integers(0, 10_000), max_size=10))
def test_valid_streams_round_trip_at_any_split(reqs, cuts):
    data = encode_handshake(3) + b"".join(encode_request(r) for r in reqs)
    assert feed_all(RequestParser(), data, cuts) == [(Op.PING, 3)] + reqs


@settings(max_examples=500)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=6))
def test_random_bytes_only_ever_raise_protocol_error(data, cuts):
    parser = RequestParser(SMALL)
    try:
        feed_all(parser, data, cuts)
    except ProtocolError:
        pass
    assert parser.buffered <= len(data)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(requests, min_size=1, max_size=8),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.lists(st.integers(0, 10_000), max_size=6),
)
def test_mutated_streams_only_ever_raise_protocol_error(reqs, mutations, cuts):
    data = bytearray(encode_handshake(3) + b"".join(encode_request(r) for r in reqs))
    for pos, byte in mutations:
        data[pos % len(data)] = byte
    parser = RequestParser(SMALL)
    try:
        out = feed_all(parser, bytes(data), cuts)
    except ProtocolError:
        return
    for req in out:
        assert isinstance(req[0], Op)


def stream_parse_one(data: bytes, limits: Limits):
    """The stream parser's reading of ``data`` as a link entry: exactly one request."""
    reqs = RequestParser(limits, numbering="2.2").feed(data)
    if len(reqs) != 1 or encode_request(reqs[0]) != data:  # (the encoding is canonical)
        raise ProtocolError("not exactly one request")
    return reqs[0]


@settings(max_examples=300)
@given(requests)
def test_decode_request_reads_every_encoded_request(req):
    assert decode_request(encode_request(req)) == req


@settings(max_examples=1500)
@given(st.one_of(
    st.binary(max_size=120),
    # an encoded request, cut, extended or with one byte changed
    st.tuples(requests, st.integers(0, 200), st.binary(max_size=4), st.integers(0, 255)).map(
        lambda t: encode_request(t[0])[: t[1]] + t[2]),
    st.tuples(requests, st.integers(0, 200), st.integers(0, 255)).map(
        lambda t: bytes(b if i != t[1] else t[2] for i, b in enumerate(encode_request(t[0])))),
))
def test_decode_request_agrees_with_the_stream_parser(data):
    """The link's one-shot decoder accepts exactly what the stream parser reads as one
    whole request, with the same result, and raises only ProtocolError otherwise."""
    try:
        expected = stream_parse_one(data, SMALL)
    except ProtocolError:
        expected = ProtocolError
    try:
        got = decode_request(data, SMALL)
    except ProtocolError:
        got = ProtocolError
    assert got == expected
