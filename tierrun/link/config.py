"""Timing and memory bounds of a link session, shared by both ends (``tierrun.settings``
reads the variables that override them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkConfig:
    #: Each end sends an ACK at least this often (seconds): the link heartbeat.
    heartbeat_interval: float = 1.0
    #: Nothing heard from the peer for this long (seconds): the connection is presumed
    #: dead and closed (a silent partition, a frozen or vanished host).
    heartbeat_timeout: float = 5.0
    #: How long a session outlives its connection (seconds). Within it the front-end
    #: reconnects and resumes (its clients see only latency); past it the core drops the
    #: session's clients and the front-end gives up and closes its own.
    grace: float = 15.0
    #: A link connection that has not opened or resumed its session this long (seconds)
    #: after it was accepted is closed (a peer without the token cannot hold one longer).
    handshake_timeout: float = 5.0
    #: Most link connections from one address still in their handshake at once; a new
    #: one past it closes the oldest. Job members need one at a time each.
    max_handshakes_per_address: int = 64
    #: Most bytes of unacknowledged frames one end keeps for one session.
    max_unacked_bytes: int = 256 * 1024 * 1024
    #: Acknowledge after this many frames even before the next heartbeat.
    ack_every: int = 64
    #: A front-end's batch stays open this long (seconds) after its first request;
    #: 0 closes it at the end of the event-loop iteration.
    batch_window: float = 0.0
    #: A front-end sends a new batch only while fewer of its batches than this await
    #: their answers (0: no limit). Requests arriving meanwhile wait for the next batch,
    #: so under load batches grow by themselves, and an idle link adds no latency.
    batches_in_flight: int = 1
    #: A batch that opens with a *contended* write (an ADD, SET, MULTI_SET or APPEND to
    #: a key family, the key less its trailing number, that another client wrote within
    #: ``CONTENDED_WITHIN`` seconds: a barrier's count, every node's role record) stays
    #: open this long (seconds), so that the other clients' writes join it, and as long
    #: again after each write that joins it (up to ``HOLD_STRETCH`` times this in all);
    #: any other request closes it at once. 0: never held.
    contended_write_hold: float = 0.01
    #: A held batch whose hold is over leaves on the next multiple of this many seconds
    #: of the wall clock (0: at once), as every other front-end's do: the held batches
    #: of one storm (a barrier) reach the store host together, and it takes them in
    #: one wake-up (512x8 wire-up: ~10% fewer frames and context switches at node 0).
    hold_grid: float = 0.01
    #: A relay (a front-end that takes other front-ends' links: a store tree's inner
    #: node) sends its upstream at most one batch per this many seconds while busy
    #: (requests from two or more clients or front-ends below within this long): its
    #: upstream then reads at most ``1 / relay_pace`` frames a second from it, however
    #: large its subtree (``tier.pace``). A lone client one request at a time, and a
    #: batch after a quiet spell, leave at once. The price: while busy, every request
    #: whose client waited for the answer before it (a chain of dependent steps: a
    #: process group's creation, Gloo's address exchange) waits up to this long at each
    #: relay. 0 (the default): not paced.
    relay_pace: float = 0.0
    #: A node of a store tree asks where its parent takes links with a LOOKUP datagram
    #: first (UDP, to the store's port: the cheapest for the store host), and over TCP
    #: if no authenticated answer came within this many seconds (UDP filtered, an older
    #: store host). 0: TCP only.
    lookup_udp_wait: float = 0.5
    #: While LOOKUP datagrams come often (a tree's start-up, one per node), the store
    #: host reads them in batches this many seconds apart, on a timer, one wake-up per
    #: batch instead of one each (``hub.paced_udp``); a LOOKUP waits at most this long.
    #: 0: each read as it comes.
    lookup_pace: float = 0.02
