"""The loops the ``tierrun-etcd`` rendezvous runs on threads of their own: keep a lease
alive, and act once a key appears or goes. Each works on a session of its own (a clone
of the one it is given: sessions are not thread-safe), rides out etcd being away, and
returns once its ``stop`` is set."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .etcd_client import Etcd, EtcdUnavailable, KeyValue

log = logging.getLogger("tierrun.rendezvous")


def keep_alive(etcd: Etcd, lease: int, interval: float, stop: threading.Event,
               on_expired: Callable[[], None], node_addr: str) -> None:
    """Renew ``lease`` every ``interval`` seconds until ``stop`` is set. etcd away: retry
    quietly (etcd renews leases when it is back); the lease expired (the others re-formed
    without this node): ``on_expired()``, and return. Blocks."""
    etcd = etcd.clone()
    away_since: float | None = None
    while not stop.wait(interval):
        try:
            if not etcd.keepalive(lease):
                if stop.is_set():
                    break  # revoked: this node is leaving
                log.warning("node %s's etcd lease expired; the others re-formed without it. "
                            "Rejoining.", node_addr)
                on_expired()
                return
            if away_since is not None:
                log.warning("etcd is back after %.0f s", time.monotonic() - away_since)
                away_since = None
        except EtcdUnavailable as e:
            if away_since is None:
                away_since = time.monotonic()
                log.warning("node %s cannot reach etcd (%s); the workers go on, retrying", node_addr, e)
    etcd.close()


def when_set(etcd: Etcd, key: bytes, stop: threading.Event, watch_slice: float,
             then: Callable[[KeyValue], None]) -> None:
    """``then(kv)`` once ``key`` exists, unless ``stop`` is set first. Blocks; watches
    in slices of ``watch_slice`` seconds, retries every second while etcd is away."""
    etcd = etcd.clone()
    while not stop.is_set():
        try:
            kv, revision = etcd.get(key)
            if kv is not None:
                then(kv)
                break
            etcd.watch(key, revision + 1, watch_slice)
        except EtcdUnavailable:
            stop.wait(1.0)
    etcd.close()


def when_gone(etcd: Etcd, key: bytes, stop: threading.Event, watch_slice: float,
              then: Callable[[Etcd], None]) -> None:
    """``then(session)`` once ``key`` does not exist, unless ``stop`` is set first; an
    ``EtcdUnavailable`` from ``then`` is retried like the watch's own. Blocks."""
    etcd = etcd.clone()
    while not stop.is_set():
        try:
            kv, revision = etcd.get(key)
            if kv is None:
                if not stop.is_set():
                    then(etcd)
                break
            etcd.watch(key, revision + 1, watch_slice)
        except EtcdUnavailable:
            stop.wait(1.0)
    etcd.close()
