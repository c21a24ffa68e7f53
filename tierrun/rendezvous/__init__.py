"""Rendezvous backends on tierrun's store. :mod:`tierrun.torchrun_plugin` registers them
with torch's elastic registry (torch's ``torchrun`` finds it through the
``torchrun.handlers`` entry points; tierrun's launcher calls its ``register``): both
launchers create the same handlers.
"""

import difflib
import logging
import socket
from typing import Any, Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from ..extras import require
from ..settings import Settings
from . import elastic, parallel
from .conf import RendezvousSettingError

log = logging.getLogger("tierrun.rendezvous")

#: called with every handler tierrun's backends create (the launcher's reporting)
on_handler_created: list[Callable[[RendezvousHandler], None]] = []
#: What torch's launcher adds to every backend's ``--rdzv_conf`` when it has no
#: ``timeout`` (an int: what ``--rdzv_conf`` gives is a string), which tierrun's
#: elastic backends do not read (they wait ``join_timeout``).
_TORCH_TIMEOUT = ("timeout", 900)
#: Set by tierrun's launcher, not by a person: never offered as a setting to write.
_LAUNCHER_KEYS = frozenset({"local_world_size", "monitor_interval"})
#: Other backends' names of a setting (torch's etcd and static backends wait ``timeout``).
_SAME_AS = {"timeout": "join_timeout"}


class _ReadKeys(dict):
    """A backend's ``--rdzv_conf``, noting every key the backend looks up (present or
    not): what it knows, found by asking it, so no list of keys can fall behind it."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def _warn_unread(backend: str, node: str, config: _ReadKeys) -> None:
    """A ``--rdzv_conf`` key the backend never looked up is a typo or another backend's
    setting: torch's backends ignore those in silence (so a ``last_call_timout=5`` waits
    the default), tierrun's say so, once per node, with the closest setting it reads
    (not the value: it may be a secret, and every node's log would keep it)."""
    known = sorted(config.read - _LAUNCHER_KEYS)
    for key, value in config.items():
        if key in config.read or (key, value) == _TORCH_TIMEOUT and isinstance(value, int):
            continue
        plain = key.lower().replace("-", "_")
        if plain in known or _SAME_AS.get(plain) in known:
            close = [plain if plain in known else _SAME_AS[plain]]
        else:  # (a typo: one or two letters off)
            close = difflib.get_close_matches(plain, known, n=1, cutoff=0.85)
        hint = f"; did you mean {close[0]}?" if close else f" (it reads: {', '.join(known)})"
        log.warning("node %s: --rdzv_conf %s is not a setting of the %s backend: ignored%s", node, key, backend, hint)


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
    ``MissingExtraError`` for a missing extra; warns of ``--rdzv_conf`` keys the backend
    does not read."""
    node = params.local_addr or socket.gethostname()
    config = params.config = _ReadKeys(params.config)
    try:
        handler = _CREATORS[backend](params, settings)
    except ValueError as e:  # (a setting the backend cannot use: its message says which)
        raise RendezvousSettingError(f"node {node}: --rdzv_backend {backend}: {e}") from e
    _warn_unread(backend, node, config)
    for callback in on_handler_created:
        callback(handler)
    return handler
