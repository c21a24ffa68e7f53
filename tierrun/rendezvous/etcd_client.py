"""etcd's v3 API as the ``tierrun-etcd`` rendezvous uses it, over etcd3gw.

etcd3gw (OpenStack's client for etcd's v3 JSON gateway) is plain HTTP on ``requests``:
no gRPC or protobuf to clash with torch's, a pure-Python wheel that installs anywhere,
TLS client certificates through ``requests``. It supplies the session, the gateway's
API path and its error mapping; the few requests the rendezvous needs (a counted
range, a transaction, a watch that resumes from a revision) are written here in the
gateway's JSON. Every call fails over to the next endpoint when one does not answer.

Not thread-safe (one HTTP session): give each thread its own ``clone()``.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

try:
    from etcd3gw import exceptions as etcd_errors
    from etcd3gw.client import Etcd3Client
except ImportError as e:  # pragma: no cover - an install without the extra
    raise ImportError("the tierrun-etcd rendezvous needs etcd3gw: pip install 'tierrun[etcd]'") from e

log = logging.getLogger("tierrun.rendezvous")

DEFAULT_PORT = 2379


class EtcdUnavailable(Exception):
    """No endpoint answered: the message names every endpoint and the last error."""


class EtcdAuthError(Exception):
    """etcd refused the user name or password."""


@dataclass(frozen=True)
class EtcdOptions:
    """Where etcd is and how to talk to it. ``endpoints`` are URLs (``http://host:port``).
    TLS: ``cacert`` (server check), ``cert`` + ``key`` (client certificate);
    etcd authentication: ``username`` + ``password``."""

    endpoints: tuple[str, ...]
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    timeout: float = 5.0

    @classmethod
    def parse(cls, endpoint: str, config: dict, password: str | None = None) -> EtcdOptions:
        """From ``--rdzv_endpoint`` (``host[:port]`` or URLs, comma-separated) and
        ``--rdzv_conf`` (``protocol``, ``cacert``, ``cert``, ``key``, ``username``,
        ``etcd_timeout``). Raises ``ValueError`` naming what is wrong."""
        protocol = str(config.get("protocol", "https" if config.get("cacert") else "http"))
        if protocol not in ("http", "https"):
            raise ValueError(f"--rdzv_conf protocol={protocol}: write http or https")
        endpoints = []
        for item in (e.strip() for e in endpoint.split(",")):
            if not item:
                continue
            url = urlsplit(item if "://" in item else f"{protocol}://{item}")
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(f"etcd endpoint '{item}': write HOST:PORT or http(s)://HOST:PORT")
            host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
            endpoints.append(f"{url.scheme}://{host}:{url.port or DEFAULT_PORT}")
        if not endpoints:
            raise ValueError("the tierrun-etcd rendezvous needs --rdzv_endpoint: etcd's client URLs, comma-separated")
        if bool(config.get("cert")) != bool(config.get("key")):
            raise ValueError("--rdzv_conf cert= and key= go together (the client certificate and its key)")
        if config.get("username") and password is None:
            raise ValueError("--rdzv_conf username= needs the password in TIERRUN_ETCD_PASSWORD")
        return cls(tuple(endpoints), config.get("cacert"), config.get("cert"), config.get("key"),
                   config.get("username"), password if config.get("username") else None,
                   float(config.get("etcd_timeout", 5.0)))


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int


@dataclass(frozen=True)
class Event:
    kind: str  # "PUT" or "DELETE"
    key: bytes
    value: bytes


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range that starts with ``prefix`` (etcd's ``range_end``)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def put(key: bytes, value: bytes, lease: int = 0) -> dict:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = lease
    return {"request_put": request}


def count(prefix: bytes) -> dict:
    return {"request_range": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "count_only": True}}


def absent(key: bytes) -> dict:
    """A transaction condition: ``key`` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


class Etcd:
    """One HTTP session to the etcd cluster. Every method blocks for at most
    ``options.timeout`` per endpoint tried and raises ``EtcdUnavailable`` when none
    answers, ``etcd3gw.exceptions.Etcd3Exception`` when etcd refuses the request."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._current = 0
        self._client: Etcd3Client | None = None

    def clone(self) -> Etcd:
        """Another session, starting at the endpoint that answered this one last."""
        other = Etcd(self.options)
        other._current = self._current
        return other

    def close(self) -> None:
        if self._client is not None:
            self._client.session.close()
            self._client = None

    # -- transport ------------------------------------------------------------------------

    def _connect(self, endpoint: str) -> Etcd3Client:
        url = urlsplit(endpoint)
        o = self.options
        session = _Session()
        if o.cacert:
            session.verify = o.cacert
        if o.cert and o.key:
            session.cert = (o.cert, o.key)
        client = Etcd3Client(host=url.hostname or "", port=url.port or DEFAULT_PORT, protocol=url.scheme,
                             timeout=o.timeout, api_path="/v3/", session=session)
        if o.username:
            try:
                reply = client.post(client.get_url("/auth/authenticate"),
                                    json={"name": o.username, "password": o.password})
            except etcd_errors.Etcd3Exception as e:
                if isinstance(e, (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError)):
                    raise
                detail = (e.detail_text or str(e))[:300]
                raise EtcdAuthError(f"etcd at {endpoint} refused user '{o.username}': {detail}") from None
            client.session.headers["Authorization"] = reply["token"]
        return client

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        errors = []
        endpoints = self.options.endpoints
        for attempt in range(len(endpoints)):
            try:
                if self._client is None:
                    self._client = self._connect(endpoints[self._current])
                if timeout is not None:
                    self._client.timeout = timeout
                return self._client.post(self._client.get_url(path), json=body)
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                    requests.exceptions.RequestException) as e:
                errors.append(f"{endpoints[self._current]}: {_short(e)}")
                self.close()
                self._current = (self._current + 1) % len(endpoints)
            finally:
                if self._client is not None:
                    self._client.timeout = self.options.timeout
        raise EtcdUnavailable(f"no etcd endpoint answered ({'; '.join(errors)})")

    # -- key-value ------------------------------------------------------------------------

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (None if absent) and the store's revision when read."""
        reply = self._post("/kv/range", {"key": _b64(key)})
        kvs = _kvs(reply)
        return (kvs[0] if kvs else None), int(reply["header"]["revision"])

    def range(self, prefix: bytes, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Keys starting with ``prefix`` in creation order (at most ``limit``; 0: all)."""
        reply = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                         "limit": limit, "sort_order": "ASCEND", "sort_target": "CREATE"})
        return _kvs(reply), int(reply["header"]["revision"])

    def count(self, prefix: bytes) -> int:
        reply = self._post("/kv/range", count(prefix)["request_range"])
        return int(reply.get("count", 0))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._post("/kv/put", put(key, value, lease)["request_put"])

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Put ``key`` only if it does not exist; True if this call created it."""
        return self.txn([absent(key)], [put(key, value, lease)])[0]

    def txn(self, compare: Sequence[dict], success: Sequence[dict],
            failure: Sequence[dict] = ()) -> tuple[bool, list[dict], int]:
        """One transaction: (succeeded, the responses of the branch taken, revision)."""
        reply = self._post("/kv/txn", {"compare": list(compare), "success": list(success),
                                       "failure": list(failure)})
        responses = [next(iter(r.values())) for r in reply.get("responses", [])]
        return bool(reply.get("succeeded", False)), responses, int(reply["header"]["revision"])

    # -- leases ---------------------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        return int(self._post("/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> bool:
        """False once the lease has expired (its keys are gone)."""
        reply = self._post("/lease/keepalive", {"ID": lease})
        return int(reply.get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease})
        except etcd_errors.Etcd3Exception as e:
            if "not found" not in str(e):
                raise

    # -- watches --------------------------------------------------------------------------

    def wait_for(self, key: bytes, stop: threading.Event, done: Callable[[KeyValue | None], bool],
                 slice_: float = 5.0) -> tuple[bool, KeyValue | None]:
        """Block until ``done(key's value, or None if absent)`` holds: (True, that value);
        or until ``stop`` is set: (False, None). Watches ``slice_`` seconds at a time and
        re-reads; while etcd is away, retries every second."""
        while not stop.is_set():
            try:
                kv, revision = self.get(key)
                if done(kv):
                    return True, kv
                self.watch(key, revision + 1, slice_)
            except EtcdUnavailable:
                stop.wait(1.0)
        return False, None

    def watch(self, key: bytes, start_revision: int, timeout: float, prefix: bool = False) -> list[Event]:
        """Events on ``key`` (or under it, with ``prefix``) from ``start_revision`` on:
        the first batch, or [] when none came within ``timeout`` seconds or the stream
        broke. Callers re-read the state after [] (etcd may be restarting), so nothing
        is missed: a watch from a revision replays every event since."""
        create: dict[str, Any] = {"key": _b64(key), "start_revision": start_revision}
        if prefix:
            create["range_end"] = _b64(prefix_end(key))
        try:
            if self._client is None:
                self._client = self._connect(self.options.endpoints[self._current])
            client = self._client
            with client.session.post(client.get_url("/watch"), json={"create_request": create}, stream=True,
                                     timeout=(self.options.timeout, timeout)) as response:
                if response.status_code != 200:
                    return []
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("canceled"):  # compacted past start_revision: re-read
                        return []
                    if "events" in result:
                        return [Event(e.get("type", "PUT"), _unb64(e["kv"]["key"]), _unb64(e["kv"].get("value")))
                                for e in result["events"]]
        except (requests.exceptions.RequestException, etcd_errors.Etcd3Exception, ValueError) as e:
            if "timed out" in str(e):
                return []  # no event within timeout
            self.close()
            self._current = (self._current + 1) % len(self.options.endpoints)
        return []


class _Session(requests.Session):
    """A session whose CA file (``cacert``) wins over REQUESTS_CA_BUNDLE and
    CURL_CA_BUNDLE in the environment, which plain ``requests`` lets override it."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):  # type: ignore[override]
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str):
            settings["verify"] = self.verify
        return settings


def _kvs(reply: dict) -> list[KeyValue]:
    return [KeyValue(_unb64(kv["key"]), _unb64(kv.get("value")), int(kv.get("create_revision", 0)))
            for kv in reply.get("kvs", [])]


def _short(e: Exception) -> str:
    text = str(getattr(e, "detail_text", None) or e)
    for marker in ("Connection refused", "timed out", "Name or service not known", "certificate verify failed"):
        if marker in text:
            return marker.lower()
    return text[:200]
