"""tierrun's rendezvous backends for torch's own ``torchrun``.

pyproject.toml declares these functions as entry points of the group
``torchrun.handlers``; torch loads that group when ``torch.distributed.elastic.rendezvous``
is first imported and registers ``name -> entry_point()``, so with tierrun installed

    torchrun --rdzv-backend tierrun --rdzv-endpoint HOST:PORT --rdzv-id JOB ... train.py

runs torch's launcher on tierrun's rendezvous and store. This module imports nothing
(every process that imports torch's rendezvous package loads it); a backend's code is
imported when torch creates its handler. tierrun's own launcher registers the very same
creators (:func:`register`), so both ways name the same functions. The creators are
entry points: each reads the environment as the launcher left it (``tierrun.settings``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def _log_like_torch() -> None:
    """Under torchrun, tierrun's messages follow ``$LOGLEVEL`` as torch's own do (the
    tierrun command configures its logger itself, from ``$TIERRUN_LOG_LEVEL``)."""
    logger = logging.getLogger("tierrun")
    if logger.level == logging.NOTSET and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tierrun] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("LOGLEVEL", "WARNING").upper())


def create_tierrun(params: RendezvousParameters) -> RendezvousHandler:
    """``tierrun``: elastic, the store on the ``--rdzv-endpoint`` host."""
    from .rendezvous import create
    from .settings import Settings

    _log_like_torch()
    return create("tierrun", params, Settings.from_env())


def create_parallel(params: RendezvousParameters) -> RendezvousHandler:
    """``parallel``: fixed nodes; under torchrun, give the node rank as ``--rdzv-conf rank=K``."""
    from .rendezvous import create
    from .settings import Settings

    _log_like_torch()
    return create("parallel", params, Settings.from_env())


def create_tierrun_etcd(params: RendezvousParameters) -> RendezvousHandler:
    """``tierrun-etcd``: elastic, membership in etcd (needs ``pip install 'tierrun[etcd]'``)."""
    from .rendezvous import create
    from .settings import Settings

    _log_like_torch()
    return create("tierrun-etcd", params, Settings.from_env())


# the entry points: torch calls each with no arguments and registers what it returns
def tierrun() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_tierrun


def parallel() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_parallel


def tierrun_etcd() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_tierrun_etcd


def register() -> None:
    """Make ``parallel``, ``tierrun`` and ``tierrun-etcd`` known to torch's elastic
    registry (torch has done so already when tierrun's entry points are installed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    for name, creator in (("tierrun", create_tierrun), ("parallel", create_parallel),
                          ("tierrun-etcd", create_tierrun_etcd)):
        try:
            rendezvous_handler_registry.register(name, creator)
        except ValueError:  # another installation's entry point took the name: this one's wins
            rendezvous_handler_registry._registry[name] = creator
