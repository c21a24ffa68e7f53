"""The store's state and semantics, with no I/O."""

from .budget import BudgetExceeded
from .store import StoreCore, Waiter
from .values import StoreError

__all__ = ["BudgetExceeded", "StoreCore", "StoreError", "Waiter"]
