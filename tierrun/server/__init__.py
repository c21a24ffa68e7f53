"""Server processes: the root store (core + front-end) and how to start it."""

from .process import AGENT_SILENCE, HostedFrontEnd, StoreProcess, StoreStartError
from .proxy import LINK_LOST
from .root import RootConfig, serve_root

__all__ = ["AGENT_SILENCE", "HostedFrontEnd", "LINK_LOST", "RootConfig", "StoreProcess", "StoreStartError", "serve_root"]
