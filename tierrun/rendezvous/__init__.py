"""Rendezvous backends on tierrun's store. :mod:`tierrun.torchrun_plugin` registers them
with torch's elastic registry (torch's ``torchrun`` finds it through the
``torchrun.handlers`` entry points; tierrun's launcher calls its ``register``): both
launchers create the same handlers.
"""

import socket
from typing import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from ..extras import require
from ..settings import Settings
from . import elastic, parallel
from .conf import RendezvousSettingError

#: called with every handler tierrun's backends create (the launcher's reporting)
on_handler_created: list[Callable[[RendezvousHandler], None]] = []


def _etcd_handler(params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    require("etcd", "--rdzv_backend tierrun-etcd", ("requests", "etcd3gw"))
    from . import etcd  # needs etcd3gw (the etcd extra): imported only when used

    return etcd.create_handler(params, settings)


_CREATORS: dict[str, Callable[[RendezvousParameters, Settings], RendezvousHandler]] = {
    "tierrun": elastic.create_handler,
    "parallel": parallel.create_handler,
    "tierrun-etcd": _etcd_handler,
}


def create(backend: str, params: RendezvousParameters, settings: Settings) -> RendezvousHandler:
    """Create a handler of tierrun's ``backend`` and announce it to ``on_handler_created``.
    ``settings``: what the entry point read of the environment (``Settings.from_env()``).
    Raises :class:`RendezvousSettingError` (a ``ValueError`` and a ``RendezvousError``:
    the ``tierrun`` command prints it as one line) naming this node for a wrong setting,
    ``MissingExtraError`` for a missing extra."""
    try:
        handler = _CREATORS[backend](params, settings)
    except ValueError as e:  # (a setting the backend cannot use: its message says which)
        node = params.local_addr or socket.gethostname()
        raise RendezvousSettingError(f"node {node}: --rdzv_backend {backend}: {e}") from e
    for callback in on_handler_created:
        callback(handler)
    return handler
