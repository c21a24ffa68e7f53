"""Server processes: the root store (core + front-end) and how to start it."""

from .process import StoreProcess, StoreStartError
from .root import RootConfig, serve_root

__all__ = ["RootConfig", "StoreProcess", "StoreStartError", "serve_root"]
