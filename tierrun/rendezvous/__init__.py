"""Rendezvous backends on tierrun's store, registered with torch's elastic registry."""

from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from . import elastic, parallel

_registered = False


def register() -> None:
    """Make ``parallel`` and ``tierrun`` known to ``torch.distributed.elastic``."""
    global _registered
    if not _registered:
        rendezvous_handler_registry.register("parallel", parallel.create_handler)
        rendezvous_handler_registry.register("tierrun", elastic.create_handler)
        _registered = True
