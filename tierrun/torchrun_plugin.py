"""tierrun's rendezvous backends for torch's own ``torchrun``.

pyproject.toml declares these functions as entry points of the group
``torchrun.handlers``; torch loads that group when ``torch.distributed.elastic.rendezvous``
is first imported and registers ``name -> entry_point()``, so with tierrun installed

    torchrun --rdzv-backend tierrun --rdzv-endpoint HOST:PORT --rdzv-id JOB ... train.py

runs torch's launcher on tierrun's rendezvous and store. This module imports nothing
(every process that imports torch's rendezvous package loads it); a backend's code is
imported when torch creates its handler. tierrun's own launcher registers the same
creators (:func:`register`), given the settings it read, so both ways create the same
handlers. Under torchrun the creators are entry points: each reads the environment
(``tierrun.settings``) and takes its secrets out of it, before torch starts a worker.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from .settings import Settings


def _log_like_torch() -> None:
    """Under torchrun, tierrun's messages follow ``$LOGLEVEL`` as torch's own do (the
    tierrun command configures its logger itself, from ``$TIERRUN_LOG_LEVEL``)."""
    logger = logging.getLogger("tierrun")
    if logger.level == logging.NOTSET and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tierrun] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("LOGLEVEL", "WARNING").upper())


def _create(backend: str, params: RendezvousParameters, settings: Settings | None) -> RendezvousHandler:
    """Create tierrun's ``backend`` handler with ``settings``, or, without (torch's
    ``torchrun``), with the environment's, whose secrets it then takes out of the
    process's environment (torch's agent gives every worker a copy of it, after it has
    created the handler)."""
    from .rendezvous import create
    from .settings import Settings

    if settings is None:
        _log_like_torch()
        settings = Settings.take_from_env()
    return create(backend, params, settings)


def create_tierrun(params: RendezvousParameters) -> RendezvousHandler:
    """``tierrun``: elastic, the store on the ``--rdzv-endpoint`` host."""
    return _create("tierrun", params, None)


def create_parallel(params: RendezvousParameters) -> RendezvousHandler:
    """``parallel``: fixed nodes; under torchrun, give the node rank as ``--rdzv-conf rank=K``."""
    return _create("parallel", params, None)


def create_tierrun_etcd(params: RendezvousParameters) -> RendezvousHandler:
    """``tierrun-etcd``: elastic, membership in etcd (needs ``pip install 'tierrun[etcd]'``)."""
    return _create("tierrun-etcd", params, None)


# the entry points: torch calls each with no arguments and registers what it returns
def tierrun() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_tierrun


def parallel() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_parallel


def tierrun_etcd() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_tierrun_etcd


def register(settings: Settings | None = None) -> None:
    """Make ``parallel``, ``tierrun`` and ``tierrun-etcd`` known to torch's elastic
    registry (torch has done so already when tierrun's entry points are installed).
    ``settings``: the tierrun launcher's (with the job token it may have made up, which
    is in no environment): its handlers use those instead of reading the environment."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    creators: dict[str, Callable[[RendezvousParameters], RendezvousHandler]] = {
        "tierrun": create_tierrun, "parallel": create_parallel, "tierrun-etcd": create_tierrun_etcd}
    if settings is not None:
        creators = {name: partial(_create, name, settings=settings) for name in creators}
    for name, creator in creators.items():
        try:
            rendezvous_handler_registry.register(name, creator)
        except ValueError:  # another installation's entry point took the name: this one's wins
            rendezvous_handler_registry._registry[name] = creator
