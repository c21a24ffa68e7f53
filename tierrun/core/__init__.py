"""The store's state and semantics, with no I/O."""

from .store import StoreCore, StoreError, Waiter

__all__ = ["StoreCore", "StoreError", "Waiter"]
