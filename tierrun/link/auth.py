"""Mutual authentication of a link with a per-job token: HMAC challenge-response.

Each side sends a fresh random nonce and proves it knows the token by the HMAC of both
nonces (with a different label per direction, so a proof cannot be reflected). The
token itself never crosses the wire.

A LOOKUP (one key's value, no session) takes no round trip: its HMAC covers the
requester's nonce and the key, and FOUND's the nonce and the answer, so only a holder
of the token gets an answer, and it can trust it. Nothing is changed by a lookup, so a
recorded one replayed gets only what its first answer showed (the key's value, if it
did not change since).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from .frames import AUTH, ERROR, FOUND, HELLO, LOOKUP, PENDING, VERSION, WELCOME, LinkError, frame

NONCE = 32
_ver = struct.Struct("<H")

#: How a store host refuses a front-end whose proof of the job token fails (its log line).
WRONG_TOKEN = "wrong job token"


def new_token() -> str:
    return secrets.token_hex(32)


def _mac(token: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, label + a + b, hashlib.sha256).digest()


def check_version(payload: bytes, peer: str, us: str) -> None:
    """Raise LinkError unless the u16 version opening ``payload`` (the peer's HELLO,
    AUTH or LOOKUP) is ours; ``peer``/``us`` name both sides in the message."""
    (version,) = _ver.unpack_from(payload)
    if version != VERSION:
        raise LinkError(f"{peer} link version {version}, {us} {VERSION}: install the same tierrun version on every node")


def hello(server_nonce: bytes) -> bytes:
    return frame(HELLO, _ver.pack(VERSION) + server_nonce)


def answer_hello(token: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """Front-end side: check the version, return (AUTH frame, client nonce)."""
    if len(payload) != 2 + NONCE:
        raise LinkError("malformed HELLO")
    check_version(payload, "the store host speaks", "this node")
    server_nonce = payload[2:]
    client_nonce = secrets.token_bytes(NONCE)
    mac = _mac(token, b"tierrun-link-client", server_nonce, client_nonce)
    return frame(AUTH, _ver.pack(VERSION) + client_nonce + mac), client_nonce


def check_auth(token: bytes, server_nonce: bytes, payload: bytes) -> bytes:
    """Core side: verify AUTH; return the WELCOME frame. Raises LinkError."""
    if len(payload) != 2 + 2 * NONCE:
        raise LinkError("malformed AUTH")
    check_version(payload, "front-end speaks", "the store host")
    client_nonce, mac = payload[2 : 2 + NONCE], payload[2 + NONCE :]
    if not hmac.compare_digest(mac, _mac(token, b"tierrun-link-client", server_nonce, client_nonce)):
        raise LinkError(WRONG_TOKEN)
    return frame(WELCOME, _mac(token, b"tierrun-link-server", client_nonce, server_nonce))


def check_welcome(token: bytes, server_nonce: bytes, client_nonce: bytes, payload: bytes) -> None:
    if not hmac.compare_digest(payload, _mac(token, b"tierrun-link-server", client_nonce, server_nonce)):
        raise LinkError("the store host does not know the job token (wrong token, or not tierrun)")


def lookup(token: bytes, key: bytes) -> tuple[bytes, bytes]:
    """Requester side: (the LOOKUP frame of ``key``, its nonce)."""
    nonce = secrets.token_bytes(NONCE)
    return frame(LOOKUP, _ver.pack(VERSION) + nonce + _mac(token, b"tierrun-lookup", nonce, key) + key), nonce


def check_lookup(token: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """Core side: verify a LOOKUP; (nonce, key). Raises LinkError."""
    if len(payload) < 2 + 2 * NONCE:
        raise LinkError("malformed LOOKUP")
    check_version(payload, "front-end speaks", "the store host")
    nonce, mac, key = payload[2 : 2 + NONCE], payload[2 + NONCE : 2 + 2 * NONCE], payload[2 + 2 * NONCE :]
    if not hmac.compare_digest(mac, _mac(token, b"tierrun-lookup", nonce, key)):
        raise LinkError(WRONG_TOKEN)
    return nonce, key


def found(token: bytes, nonce: bytes, answer: bytes) -> bytes:
    return frame(FOUND, _mac(token, b"tierrun-found", nonce, answer) + answer)


def check_found(token: bytes, nonce: bytes, payload: bytes) -> bytes:
    """Requester side: the answer FOUND carries, once its HMAC is checked. Raises LinkError."""
    answer = payload[32:]
    if len(payload) < 32 or not hmac.compare_digest(payload[:32], _mac(token, b"tierrun-found", nonce, answer)):
        raise LinkError("the store host does not know the job token (wrong token, or not tierrun)")
    return answer


def pending(token: bytes, nonce: bytes) -> bytes:
    """A LOOKUP over UDP was heard, its key is not set yet (``hub.lookup_datagrams``)."""
    return frame(PENDING, _mac(token, b"tierrun-pending", nonce, b""))


def check_pending(token: bytes, nonce: bytes, payload: bytes) -> None:
    """Requester side: raises LinkError unless PENDING's HMAC is the store host's."""
    if not hmac.compare_digest(payload, _mac(token, b"tierrun-pending", nonce, b"")):
        raise LinkError("the store host does not know the job token (wrong token, or not tierrun)")


def error(message: str) -> bytes:
    return frame(ERROR, message.encode())
