"""Whether a job's store is tiered, and its proxies stacked in a tree, when the flags do
not say: chosen from the job's size (``--nnodes``, its maximum), at the crossover that
``bench/wireup.py --crossover`` measures (docs/benchmarks.md, "When tierrun tiers by
itself").

Flags win: ``--tiered`` / ``--no-tiered``, torch_npu_run's
``--enable_tiered_parallel_tcpstore true|false``, ``--store-fanout F`` (which implies
tiering), ``--rdzv_conf tiered=...`` or ``store_fanout=...``, and ``--store-workers N``
(N > 1: the flat store's front-ends) each decide for the job. Every node decides alike
from the same flags, so the nodes of a job agree without a word.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Backends whose agents run the tier and the tree (``tierrun-etcd`` tiers only when told).
AUTO_BACKENDS = ("parallel", "tierrun")
#: From this many nodes a job is tiered: node 0's CPU in the wire-up is then below the
#: flat store's in every measured round, by a quarter or more, with agents that beat
#: through the store (the elastic backend's; below it, within the noise of rounds). A
#: static job's agents leave wills instead, and tiering wins it every round from 4
#: nodes (``docs/benchmarks.md``): a lower threshold for ``parallel`` alone is open.
TIERED_FROM_NODES = 32
#: From this many nodes its proxies form a tree of ``AUTO_FANOUT`` links per proxy:
#: node 0's CPU is then below flat tiering's in every round, and no relay costs more
#: than node 0 (at 32 nodes with beats, the tree's gain was within the noise, and it
#: adds a hop; with wills it wins from 32).
TREE_FROM_NODES = 64
AUTO_FANOUT = 8


@dataclass(frozen=True)
class Tiering:
    """What a job runs: ``tiered`` (a store proxy per node), in a tree of ``fanout``
    links per proxy (0: every proxy links to the store host); ``auto``: chosen by
    :func:`choose` from the job's size, not by a flag."""

    tiered: bool
    fanout: int
    auto: bool

    def describe(self) -> str:
        """A tiered job's layout, as its nodes say it."""
        return "tiered wire-up" + (f" in a tree of fanout {self.fanout}" if self.fanout else "")


def choose(backend: str, max_nodes: int, tiered: bool | None, fanout: int | None,
           store_workers: int = 1) -> Tiering:
    """The job's tiering. ``tiered``/``fanout``: what the flags say (None: nothing).
    ``fanout`` 2 or more implies tiering (the caller has checked that ``tiered`` is not
    False then); 0 says only "no tree". O(1)."""
    if fanout:
        return Tiering(True, fanout, False)
    if tiered is not None:
        return Tiering(tiered, 0, False)
    if backend not in AUTO_BACKENDS or store_workers > 1 or max_nodes < TIERED_FROM_NODES:
        return Tiering(False, 0, False)
    tree = fanout is None and max_nodes >= TREE_FROM_NODES
    return Tiering(True, AUTO_FANOUT if tree else 0, True)
