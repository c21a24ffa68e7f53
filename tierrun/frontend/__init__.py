"""Front-ends: asyncio servers that speak the torch protocol to clients."""

from .frontend import FrontEnd, FrontEndConfig, Upstream

__all__ = ["FrontEnd", "FrontEndConfig", "Upstream"]
