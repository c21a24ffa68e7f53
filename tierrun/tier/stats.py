"""What a front-end merged before its requests left the node (its ``stats`` answer), and
what one batch merged (:class:`MergeCounts`, the planner's)."""

from __future__ import annotations

from dataclasses import dataclass


class CoalescingStats:
    """What a front-end merged before its requests left the node."""

    def __init__(self) -> None:
        self.requests = 0  # from local clients
        self.upstream_ops = 0
        self.batches = 0
        self.merged_reads = 0
        self.merged_waits = 0
        self.merged_adds = 0
        self.folded_gets = 0  # GETs answered from another's MULTI_GET
        self.folded_waits = 0  # one-key WAITs sent in another's WAITS entry
        self.ids_opened = 0  # link client ids (namespaces) opened upstream: an OPEN entry each
        self.watches_sent = 0  # reads sent as WATCH entries
        self.watch_answers = 0  # reads answered from a watch (no request upstream)
        self.watch_joins = 0  # WAITs that joined a WAIT sent earlier, through its watch
        self.peeks_sent = 0  # keys read ahead (PEEKS entries), of our own or for front-ends below
        self.invalidations = 0  # watches the core invalidated
        self.held_batches = 0  # batches held open for a contended write (LinkConfig.contended_write_hold)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))

    def merged(self, counts: MergeCounts) -> None:
        """Add what one batch merged."""
        for name, n in vars(counts).items():
            if n:
                setattr(self, name, getattr(self, name) + n)

    def sent(self, ops: int, opened: int, watches: int, peeks: int) -> None:
        """Count a batch sent: its operations, namespaces opened, watching reads, keys read ahead."""
        self.batches += 1
        self.upstream_ops += ops
        self.ids_opened += opened
        self.watches_sent += watches
        self.peeks_sent += peeks


@dataclass
class MergeCounts:
    merged_reads: int = 0
    merged_waits: int = 0
    merged_adds: int = 0
    folded_gets: int = 0  # GETs answered from another's MULTI_GET
    folded_waits: int = 0  # one-key WAITs sent in another's WAITS entry
