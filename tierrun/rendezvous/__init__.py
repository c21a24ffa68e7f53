"""Rendezvous backends on tierrun's store, registered with torch's elastic registry.

The creators are :mod:`tierrun.torchrun_plugin`'s, which torch's ``torchrun`` also finds
through the ``torchrun.handlers`` entry points: both launchers create the same handlers.
"""

from typing import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from .. import torchrun_plugin
from ..extras import require
from . import elastic, parallel

#: called with every handler tierrun's backends create (the launcher's reporting)
on_handler_created: list[Callable[[RendezvousHandler], None]] = []
_registered = False


def _etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    require("etcd", "--rdzv_backend tierrun-etcd", ("requests", "etcd3gw"))
    from . import etcd  # needs etcd3gw (the etcd extra): imported only when used

    return etcd.create_handler(params)


_CREATORS: dict[str, Callable[[RendezvousParameters], RendezvousHandler]] = {
    "tierrun": elastic.create_handler,
    "parallel": parallel.create_handler,
    "tierrun-etcd": _etcd_handler,
}


def create(backend: str, params: RendezvousParameters) -> RendezvousHandler:
    """Create a handler of tierrun's ``backend`` and announce it to ``on_handler_created``.
    Raises what the backend raises: ``ValueError`` for a wrong setting,
    ``MissingExtraError`` for a missing extra."""
    handler = _CREATORS[backend](params)
    for callback in on_handler_created:
        callback(handler)
    return handler


def register() -> None:
    """Make ``parallel``, ``tierrun`` and ``tierrun-etcd`` known to ``torch.distributed.elastic``
    (torch has done so already when tierrun's entry points are installed)."""
    global _registered
    if _registered:
        return
    for name, creator in (("tierrun", torchrun_plugin.create_tierrun),
                          ("parallel", torchrun_plugin.create_parallel),
                          ("tierrun-etcd", torchrun_plugin.create_tierrun_etcd)):
        try:
            rendezvous_handler_registry.register(name, creator)
        except ValueError:  # another installation's entry point took the name: this one's wins
            rendezvous_handler_registry._registry[name] = creator
    _registered = True
