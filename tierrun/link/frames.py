"""The front-end <-> core link, sans I/O: length-prefixed frames carrying batches.

    frame   := u32 length | u8 type | payload            (length counts type + payload)
    HELLO   := u16 version | 32-byte server nonce        core -> front-end, first
    AUTH    := u16 version | 32-byte client nonce | 32-byte HMAC    front-end -> core
    WELCOME := 32-byte HMAC                              core -> front-end
    ERROR   := utf-8 text, then the sender closes
    BATCH   := u32 n | n x entry                         front-end -> core
        entry := u8 OPEN    | u32 client | u32 len | namespace   (a new client; "" = root)
               | u8 REQUEST | u32 client | u64 rid | u32 len | torch-encoded request
               | u8 CANCEL  | u32 client | u64 rid              (drop that WAIT/BARRIER)
               | u8 AFTER   | u32 client | u64 rid              (the next REQUEST runs only
                                      if the write with no answer sent as rid was not
                                      refused; else it is answered FAILED, not run: a
                                      client's requests after its refused write, which
                                      its front-end sent before it knew, do not land,
                                      as its connection to the store alone would have
                                      been closed at that write; rid REFUSED: the
                                      front-end knows that write was refused)
               | u8 WAITS   | u32 client | u64 rid | u32 n | n x (u32 len | key)
                                      (n one-key WAITs, the i-th with request id rid + i)
               | u8 WATCH   | u32 client | u64 rid | u32 len | torch-encoded request
                                      (a one-key CHECK, GET or WAIT that also registers
                                      a watch of its key: see below)
               | u8 WATCHES | u32 client | u64 rid | u32 n | n x (u32 len | key)
                                      (n one-key WAITs that fetch, as WAITS: each is
                                      answered like a WATCH of it, but its key is
                                      watched only once it is there: see below)
               | u8 FETCHES | u32 client | u64 rid | u32 n | n x (u32 len | key)
                                      (the same, for clients with writes on their way:
                                      a front-end passing it on answers none from its
                                      own watches)
               | u8 PEEKS   | u32 client | u64 rid | u32 n | n x (u32 len | key)
                                      (a front-end reading ahead: each key's watch
                                      state, the key watched if it holds a value,
                                      answered at once; nothing waits: see below)
      A client is a namespace seen through the link, not a torch connection: a
      front-end opens one per namespace and sends every request in it under that id.
      Any number of its requests may be outstanding; a WAIT or BARRIER waits alone
      (answered by its rid whenever it completes) until answered or cancelled.
    REPLIES := u32 n | n x (u64 rid | u8 status | u32 len | bytes)  core -> front-end
        status 0: the torch-encoded reply; 1: an error message (the client must be closed);
        plus 2 (UNORDERED): a relay's answer that may be ahead of writes with no answer it
        relayed before it for that front-end (not yet known to have landed upstream), so
        it says nothing of them (``tier.writes``); every other answer follows every
        earlier write's execution, and the FAILED of any refused one
    SESSION := 16-byte session id | u8 fresh | u64 REPLIES frames received   front-end -> core,
               right after AUTH (in the same write, with its first ACK: the handshake
               is one flight each way): open a session (fresh) or resume one
    RESUMED := u64 BATCH frames received | 4 x u64 limits   core -> front-end, then both
               sides resend the frames the other has not received; the limits are
               the store's on one request (``protocol.limits.Limits``: key bytes, value
               bytes, keys per request, request bytes), which a front-end applies to
               its own clients too
    ACK     := u64 frames received from the peer         both ways: frees the peer's resend
               buffer; sent at least every heartbeat interval, so it is the heartbeat too
    PONG    := u64 BATCH frames received | u32 lease ms   core -> front-end: the answer to
               each ACK of the front-end, in order (an ACK in the other direction, and
               the front-end's watch lease: see below)
    INVALIDATE  := u64 round | u32 n | n x u64 watch id  core -> front-end
    INVALIDATED := u64 round                             front-end -> core
    LOOKUP  := u16 version | 32-byte nonce | 32-byte HMAC | key     instead of AUTH: one
               key's value, once it is set, and nothing else (``tier.lookup``: where a
               node's parent in a tree takes links); no session
    FOUND   := 32-byte HMAC | the GET's torch-encoded reply   core -> front-end, then
               the core closes (the HMACs: ``auth``)
    PENDING := 32-byte HMAC                              core -> front-end: a LOOKUP sent
               over UDP (``hub.lookup_datagrams``) was heard; its key is not set yet

Watches (docs/architecture.md: standing watches). A WATCH entry's answer is a watch state
(``tierrun.core.watch_state``) followed by the request's own answer; the core then tells the
front-end, with an INVALIDATE frame naming the watch by the entry's rid, before any
answer that could reveal a change of the key, and holds back every later answer until
the front-end answered INVALIDATED (or its lease ran out). Meanwhile the front-end
answers reads of the key from the state, but only within its lease: WATCH_LEASE
seconds from sending an ACK whose PONG it received (the core heard from it then).
A WATCH of a WAIT that blocks watches its key as absent while it waits (its front-end
lets later WAITs on the key join it, so the key's first write starts a round); a WAIT
of a WATCHES entry does not (nothing joins it: its key's first write just wakes it).
A PEEKS entry is a front-end reading keys no client asked for yet (the keys after a
fetched key: Gloo's ranks read every rank's address in turn): a key with a value
answers its state (VALUE) and is watched, as after a WATCH of a GET; any other key
answers UNWATCHABLE and nothing is registered. The answers carry no request's answer.

Sealing (``seal.py``): after the handshake every frame either end sends on a connection
(SESSION onwards one way, RESUMED onwards the other) is followed by a 16-byte MAC under
that connection's keys; a frame that fails it is :class:`Unauthenticated`.

BATCH, REPLIES and INVALIDATE frames are numbered 1, 2, ... per session and direction
(implicitly, in order), so a link that drops and reconnects resumes with nothing lost
or executed twice.

Every length is checked against a limit before anything is allocated for it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple, Protocol

LINK_MAGIC = 0xA7  # first byte a front-end sends: not an opcode of any torch version
VERSION = 14  # 2: sessions, resumption, heartbeats; 3: a client per namespace, CANCEL; 4: watches;
# 5: WATCHES; 6: FETCHES; 7: PEEKS; 8: sealed frames (a MAC each), the store's limits in RESUMED;
# 9: LOOKUP; 10: the MAC over the frame's number and the frame (the number was BLAKE2's salt);
# 11: the answer limit and the longest value in RESUMED; 12: AFTER; 13: UNORDERED, AFTER REFUSED;
# 14: wills (the first hop above a node holds its will: ``hub.wills``)

#: The namespace whose clients write their session's will, held by the first hop above
#: (``hub.wills``; no launcher namespace: those are ``<run id>/workers/<round>``), and
#: its one key.
WILL_NAMESPACE, WILL_KEY = b"/tierrun/will", b"/will"
#: The longest silence (seconds) a will may wait for.
MAX_WILL_AFTER = 3600.0

HELLO, AUTH, WELCOME, ERROR, BATCH, REPLIES, SESSION, RESUMED, ACK, PONG, INVALIDATE, INVALIDATED = range(1, 13)
LOOKUP, FOUND, PENDING = 13, 14, 15
OPEN, REQUEST, CANCEL, WAITS, WATCH, WATCHES, FETCHES, PEEKS, AFTER = range(9)
#: An AFTER entry's request id naming a write whose refusal the front-end has read: the
#: store host forgets a refused write's id once the front-end acknowledged its FAILED.
REFUSED = (1 << 64) - 1
#: A front-end answers from a watch only this long (seconds) after sending an ACK that
#: the core answered with a PONG; the core, holding its answers for a front-end that
#: does not confirm an invalidation, waits this long past that ACK's arrival, plus
#: LEASE_MARGIN (clock rates), before it presumes the watch lapsed. A protocol
#: constant, so that both ends agree.
WATCH_LEASE = 3.0
LEASE_MARGIN = 0.5
OK, FAILED, UNORDERED = 0, 1, 2

_hdr = struct.Struct("<IB")
_u32 = struct.Struct("<I")
_open = struct.Struct("<BII")
_req = struct.Struct("<BIQI")
_cancel = struct.Struct("<BIQ")
_waits = struct.Struct("<BIQI")
_reply = struct.Struct("<QBI")
_REQ_SIZE, _OPEN_SIZE, _CANCEL_SIZE = _req.size, _open.size, _cancel.size
_session = struct.Struct("<16sBQ")
_u64 = struct.Struct("<Q")
SESSION_ID_BYTES = 16

#: Largest frame accepted: two maximal requests (Limits.max_request_bytes) fit; a
#: larger batch leaves as several frames.
DEFAULT_MAX_FRAME = 512 * 1024 * 1024
#: Largest frame accepted before the peer has authenticated (HELLO/AUTH/WELCOME/SESSION/
#: ERROR): an unauthenticated peer cannot make us buffer more than this.
HANDSHAKE_MAX_FRAME = 4096
#: Bytes of the MAC after each sealed frame (``seal.TAG``).
TAG = 16


class LinkError(Exception):
    """The peer broke the link protocol; close the link."""


class Unauthenticated(LinkError):
    """Bytes the peer has not proved it sent: a frame that fails its MAC, framing that
    cannot be a frame, a refusal before the handshake proved the token. Drop the
    connection; the session is not at fault (nothing of it was acted upon), so it may
    resume on another."""


class Opener(Protocol):
    """Checks the MAC after each frame (``seal.Opener``)."""

    def valid(self, data: bytes, start: int, stop: int) -> bool: ...


def frame(ftype: int, payload: bytes) -> bytes:
    return _hdr.pack(len(payload) + 1, ftype) + payload


class FrameDecoder:
    """Bytes in, ``(type, payload)`` frames out. O(bytes read). Once ``opener`` is set,
    each frame must be followed by its MAC (``seal.TAG`` bytes): set it between two
    frames of :meth:`frames` and it applies from the next one on."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.partial = bytearray()  # the start of a frame not yet whole
        self.max_frame = max_frame
        self.opener: Opener | None = None

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every frame read from ``data`` (and what was buffered). Raises
        :class:`Unauthenticated`."""
        return list(self.frames(data))

    def frames(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """The frames read from ``data`` (and what was buffered), one at a time, so that
        handling one may change ``max_frame`` or ``opener`` for the next. One copy per
        frame: while nothing is buffered, whole frames are cut from ``data`` itself; a
        partial frame is buffered until it is whole (O(bytes read), not a copy per
        read), and the MAC is checked in place. Raises :class:`Unauthenticated` for a
        length past ``max_frame`` or a frame that fails its MAC; stop iterating only to
        drop the connection (what is left of ``data`` is then lost)."""
        buf = self.partial
        if buf:
            buf += data
            if len(buf) < 5:
                return
            length = _hdr.unpack_from(buf, 0)[0]
            if len(buf) - 4 - (TAG if self.opener is not None else 0) < length and 0 < length <= self.max_frame:
                return
            data = bytes(buf)
            buf.clear()
        pos = 0
        end = len(data)
        while end - pos >= 5:
            length, ftype = _hdr.unpack_from(data, pos)
            if length == 0 or length > self.max_frame:
                raise Unauthenticated(f"frame of {length} bytes (limit {self.max_frame})")
            stop = pos + 4 + length
            opener = self.opener
            if opener is None:
                if stop > end:
                    break
                payload = data[pos + 5 : stop]
                pos = stop
            else:
                if stop + TAG > end:
                    break
                if not opener.valid(data, pos, stop):
                    raise Unauthenticated(f"frame {opener.received + 1} of this connection (type {ftype}, "
                                          f"{length + 4} bytes) fails its MAC")
                payload = data[pos + 5 : stop]
                pos = stop + TAG
            yield ftype, payload
        if pos < end:
            buf += data[pos:]


#: A decoded batch entry: ``(kind, client, rid, data)``; ``data`` is the namespace of an
#: OPEN, the request bytes of a REQUEST; ``rid`` is 0 and ``data`` empty where unused.
Entry = tuple[int, int, int, bytes]


def encode_batch(entries: list[bytes]) -> bytes:
    """``entries`` are already-encoded entries (see the ``entry_*`` helpers)."""
    return frame(BATCH, _u32.pack(len(entries)) + b"".join(entries))


def entry_open(client: int, namespace: bytes) -> bytes:
    return _open.pack(OPEN, client, len(namespace)) + namespace


def entry_request(client: int, rid: int, request: bytes) -> bytes:
    return _req.pack(REQUEST, client, rid, len(request)) + request


def entry_watch(client: int, rid: int, request: bytes) -> bytes:
    return _req.pack(WATCH, client, rid, len(request)) + request


def entry_cancel(client: int, rid: int) -> bytes:
    return _cancel.pack(CANCEL, client, rid)


def entry_after(client: int, rid: int) -> bytes:
    """The next entry runs only if the write sent as ``rid`` was not refused."""
    return _cancel.pack(AFTER, client, rid)


def entry_waits(client: int, rid: int, keys: list[bytes], kind: int = WAITS) -> bytes:
    """A WAITS entry, or (``kind``) a WATCHES, FETCHES or PEEKS entry."""
    return _waits.pack(kind, client, rid, len(keys)) + b"".join([_u32.pack(len(k)) + k for k in keys])


def decode_keys(data: bytes, max_keys: int, max_key_bytes: int) -> list[bytes]:
    """The keys of a WAITS, WATCHES or FETCHES entry (its ``data``, count first). O(len(data)); raises
    LinkError past the limits or on a malformed list."""
    try:
        (n,) = _u32.unpack_from(data, 0)
        if n > max_keys:
            raise LinkError(f"{n} keys in one WAITS entry exceed the limit of {max_keys}")
        keys = []
        pos = 4
        for _ in range(n):
            (length,) = _u32.unpack_from(data, pos)
            if length > max_key_bytes:
                raise LinkError(f"key of {length} bytes exceeds the limit of {max_key_bytes}")
            pos += 4
            keys.append(data[pos : pos + length])
            pos += length
    except struct.error as e:
        raise LinkError(f"malformed WAITS entry: {e}") from None
    if pos != len(data):
        raise LinkError("malformed WAITS entry")
    return keys


def decode_batch(payload: bytes) -> list[Entry]:
    """O(len(payload)); tuples, not objects: this runs once per operation at the core."""
    try:
        (n,) = _u32.unpack_from(payload, 0)
        pos = 4
        out = []
        for _ in range(n):
            kind = payload[pos]
            if kind == REQUEST or kind == WATCH:
                _, client, rid, length = _req.unpack_from(payload, pos)
                pos += _REQ_SIZE
                out.append((kind, client, rid, payload[pos : pos + length]))
                pos += length
            elif kind == OPEN:
                _, client, length = _open.unpack_from(payload, pos)
                pos += _OPEN_SIZE
                out.append((OPEN, client, 0, payload[pos : pos + length]))
                pos += length
            elif kind == CANCEL or kind == AFTER:
                _, client, rid = _cancel.unpack_from(payload, pos)
                pos += _CANCEL_SIZE
                out.append((kind, client, rid, b""))
            elif WAITS <= kind <= PEEKS:  # (not WATCH, above; data: the key count and the keys)
                start = pos + 13
                _, client, rid, n = _waits.unpack_from(payload, pos)
                pos = start + 4
                for _ in range(n):
                    pos += 4 + _u32.unpack_from(payload, pos)[0]
                out.append((kind, client, rid, payload[start:pos]))
            else:
                raise LinkError(f"unknown batch entry kind {kind}")
            if pos > len(payload):
                raise LinkError("truncated batch")
        return out
    except (struct.error, IndexError) as e:
        raise LinkError(f"malformed batch: {e}") from None


_one_reply = struct.Struct("<IBIQBI")  # a REPLIES frame's header with its only reply's
#: A BATCH frame's header with its first entry's, when that is a REQUEST: length, type,
#: entries, kind, client, rid, request length (the request follows).
lone_request = struct.Struct("<IBIBIQI")


def encode_reply(rid: int, status: int, data: bytes) -> bytes:
    """A REPLIES frame of one answer (most frames of a start-up)."""
    return _one_reply.pack(len(data) + 18, REPLIES, 1, rid, status, len(data)) + data


def encode_replies(replies: list[tuple[int, int, bytes]]) -> bytes:
    if len(replies) == 1:
        return encode_reply(*replies[0])
    return frame(
        REPLIES,
        _u32.pack(len(replies)) + b"".join([_reply.pack(rid, st, len(b)) + b for rid, st, b in replies]),
    )


def replies_frames(replies: list[tuple[int, int, bytes]], max_frame: int = DEFAULT_MAX_FRAME) -> list[bytes]:
    """``replies`` in REPLIES frames of at most ``max_frame`` bytes each, in order (one,
    almost always). An answer that no frame can hold is replaced by a FAILED one: its
    client is closed, the link stays up. O(bytes of the replies)."""
    head = _u32.size + _reply.size + 8
    if len(replies) == 1:
        if len(replies[0][2]) + head <= max_frame:
            return [encode_reply(*replies[0])]
    elif sum([len(r[2]) for r in replies]) + len(replies) * _reply.size + _u32.size + 8 <= max_frame:
        return [encode_replies(replies)]  # (they fit in one frame: almost always)
    frames: list[bytes] = []
    chunk: list[tuple[int, int, bytes]] = []
    size = _u32.size
    for rid, status, data in replies:
        if len(data) + head > max_frame:
            data = f"an answer of {len(data)} bytes exceeds the link's frame limit".encode()
            status = FAILED | status & UNORDERED
        if chunk and size + _reply.size + len(data) > max_frame - 8:
            frames.append(encode_replies(chunk))
            chunk, size = [], _u32.size
        chunk.append((rid, status, data))
        size += _reply.size + len(data)
    if chunk:
        frames.append(encode_replies(chunk))
    return frames


def decode_replies(payload: bytes) -> list[tuple[int, int, bytes]]:
    try:
        (n,) = _u32.unpack_from(payload, 0)
        pos = 4
        out = []
        for _ in range(n):
            rid, status, length = _reply.unpack_from(payload, pos)
            if status > FAILED | UNORDERED:
                raise LinkError(f"an answer with status {status}")
            pos += _reply.size
            out.append((rid, status, payload[pos : pos + length]))
            pos += length
        if pos > len(payload):
            raise LinkError("truncated replies")
        return out
    except struct.error as e:
        raise LinkError(f"malformed replies: {e}") from None


def encode_session(session_id: bytes, fresh: bool, replies_received: int) -> bytes:
    return frame(SESSION, _session.pack(session_id, fresh, replies_received))


def decode_session(payload: bytes) -> tuple[bytes, bool, int]:
    if len(payload) != _session.size:
        raise LinkError("malformed SESSION")
    sid, fresh, received = _session.unpack(payload)
    return sid, bool(fresh), received


class StoreSizes(NamedTuple):
    """What a front-end tells the front-ends linked to it when their session opens."""

    key_bytes: int  # the longest key one request may hold here
    value_bytes: int  # the longest value one request may write here
    keys_per_request: int
    request_bytes: int
    reply_bytes: int  # the largest answer to one request, here and above
    #: The longest value the store may hold, which a GET may return: the store host's
    #: value limit, passed on unchanged by relays (their own may be tighter).
    largest_value: int


_resumed = struct.Struct("<QQQQQQQ")


def encode_resumed(received: int, sizes: StoreSizes) -> bytes:
    """A RESUMED frame: BATCH frames received, and the store's sizes."""
    return frame(RESUMED, _resumed.pack(received, *sizes))


def decode_resumed(payload: bytes) -> tuple[int, StoreSizes]:
    if len(payload) != _resumed.size:
        raise LinkError("malformed RESUMED")
    received, *sizes = _resumed.unpack(payload)
    return received, StoreSizes(*sizes)


def encode_count(ftype: int, n: int) -> bytes:
    """An ACK or INVALIDATED frame."""
    return frame(ftype, _u64.pack(n))


def decode_count(payload: bytes) -> int:
    if len(payload) != 8:
        raise LinkError("malformed ACK/INVALIDATED")
    return _u64.unpack(payload)[0]



_pong = struct.Struct("<QI")


def encode_pong(received: int, lease: float) -> bytes:
    return frame(PONG, _pong.pack(received, int(lease * 1000)))


def decode_pong(payload: bytes) -> tuple[int, float]:
    """(BATCH frames received, lease seconds)."""
    if len(payload) != _pong.size:
        raise LinkError("malformed PONG")
    received, lease_ms = _pong.unpack(payload)
    return received, min(lease_ms / 1000, WATCH_LEASE)


def encode_invalidate(round_id: int, watch_ids: list[int]) -> bytes:
    return frame(INVALIDATE, _u64.pack(round_id) + _u32.pack(len(watch_ids))
                 + b"".join([_u64.pack(w) for w in watch_ids]))


def decode_invalidate(payload: bytes) -> tuple[int, list[int]]:
    try:
        (round_id,) = _u64.unpack_from(payload, 0)
        (n,) = _u32.unpack_from(payload, 8)
        if len(payload) != 12 + 8 * n:
            raise LinkError("malformed INVALIDATE")
        return round_id, [_u64.unpack_from(payload, 12 + 8 * i)[0] for i in range(n)]
    except struct.error:
        raise LinkError("malformed INVALIDATE") from None
