"""Rendezvous backends on tierrun's store, registered with torch's elastic registry."""

from typing import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from ..settings import Settings
from . import elastic, parallel

#: called with every handler tierrun's backends create (the launcher's reporting)
on_handler_created: list[Callable[[RendezvousHandler], None]] = []
_registered = False


def _announced(create: Callable[[RendezvousParameters, Settings], RendezvousHandler]):
    """The creator torch's registry calls: an entry point, so it reads the environment
    (``tierrun.settings``), as the launcher left it, for the handler."""
    def creator(params: RendezvousParameters) -> RendezvousHandler:
        handler = create(params, Settings.from_env())
        for callback in on_handler_created:
            callback(handler)
        return handler

    return creator


def _etcd_handler(params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    from . import etcd  # needs etcd3gw (the etcd extra): imported only when used

    return etcd.create_handler(params, settings)


def register() -> None:
    """Make ``parallel``, ``tierrun`` and ``tierrun-etcd`` known to ``torch.distributed.elastic``."""
    global _registered
    if not _registered:
        rendezvous_handler_registry.register("parallel", _announced(parallel.create_handler))
        rendezvous_handler_registry.register("tierrun", _announced(elastic.create_handler))
        rendezvous_handler_registry.register("tierrun-etcd", _announced(_etcd_handler))
        _registered = True
