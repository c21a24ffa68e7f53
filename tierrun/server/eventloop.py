"""Run a store process's coroutine on uvloop when it is installed, on plain asyncio
otherwise."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: Collect the youngest objects after this many allocations net (Python's default: 700).
#: A request allocates a few dozen short-lived objects, nearly none in cycles.
GC_THRESHOLDS = (20_000, 20, 20)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end. First moves what importing left on the heap out of the
    collector's sight (``gc.freeze``: modules, classes and functions, which live as long
    as the process) and collects less often, so that the collections of a busy store
    process scan its requests' objects, not tens of thousands of immortal ones: a node
    proxy spends ~20% less CPU per request in a start-up (``bench/tier_ab.py``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
