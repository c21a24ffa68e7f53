"""Which WAITs and BARRIERs each client has upstream (their groups: one upstream op each,
waited on by every client whose WAIT joined it), so that its CANCEL_WAIT drops them all.

A torch client has at most one WAIT at a time (it blocks on it): one group, kept as is;
a client that pipelines several gets a list. O(1) per WAIT and answer for the first
kind, O(its waits) for the second.
"""

from __future__ import annotations

from typing import Any


class WaitsOf:
    __slots__ = ("_of",)

    def __init__(self) -> None:
        self._of: dict[Any, Any] = {}  # waiter -> a group, or a list of groups

    def add(self, waiter: Any, group: Any) -> None:
        had = self._of.get(waiter)
        if had is None:
            self._of[waiter] = group
        elif type(had) is list:
            had.append(group)
        else:
            self._of[waiter] = [had, group]

    def answered(self, waiter: Any, group: Any) -> None:
        """``group``'s answer reached ``waiter``."""
        had = self._of.get(waiter)
        if had is group:
            del self._of[waiter]
        elif type(had) is list and group in had:
            had.remove(group)
            if len(had) == 1:
                self._of[waiter] = had[0]

    def pop(self, waiter: Any) -> list[Any]:
        """Every group ``waiter`` waits under, forgotten here."""
        had = self._of.pop(waiter, None)
        return [] if had is None else had if type(had) is list else [had]
