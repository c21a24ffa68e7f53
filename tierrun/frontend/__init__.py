"""Front-ends: asyncio servers that speak the torch protocol to clients."""

from .contracts import Upstream
from .frontend import FrontEnd, FrontEndConfig

__all__ = ["FrontEnd", "FrontEndConfig", "Upstream"]
