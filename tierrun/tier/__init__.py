"""The tier layer: a front-end's upstream over a link. Pure parts (plan, fanout,
watches, readahead, hold) composed by thin asyncio adapters (upstream, connection)."""

from .connection import LinkConnection
from .plan import PlanLimits
from .stats import CoalescingStats
from .connect import connect_link
from .upstream import LinkUpstream, LinkView

__all__ = ["CoalescingStats", "LinkConnection", "LinkUpstream", "LinkView", "PlanLimits", "connect_link"]
