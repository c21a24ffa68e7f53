"""Server processes: the root store (core + front-end) and how to start it."""

from .process import HostedFrontEnd, StoreProcess, StoreStartError
from .proxy import LINK_LOST
from .root import RootConfig, serve_root

__all__ = ["HostedFrontEnd", "LINK_LOST", "RootConfig", "StoreProcess", "StoreStartError", "serve_root"]
