"""Every ``TIERRUN_*`` environment variable tierrun reads, read in this one place.

The entry points read them once, with :meth:`Settings.from_env`, and hand what they need
to the code they run, which never looks at the environment itself:

- the ``tierrun`` launcher (``tierrun.launcher.cli``);
- the rendezvous handler creators torch's registry calls (``tierrun.rendezvous``);
- ``tierrun store``, ``tierrun proxy`` and the store's front-end processes
  (``tierrun.server.store_cli``).

The variables:

``TIERRUN_TOKEN``
    The job token that authenticates the links between store processes.
``TIERRUN_TOKEN_FILE``
    A file holding the job token (surrounding whitespace ignored), when
    ``TIERRUN_TOKEN`` is unset or empty.
``TIERRUN_LINK_HEARTBEAT``, ``TIERRUN_LINK_TIMEOUT``, ``TIERRUN_LINK_GRACE``,
``TIERRUN_LINK_BATCH_WINDOW``, ``TIERRUN_LINK_WRITE_HOLD``, ``TIERRUN_LINK_HOLD_GRID``
    A link's timings in seconds (``LinkConfig``'s ``heartbeat_interval``,
    ``heartbeat_timeout``, ``grace``, ``batch_window``, ``contended_write_hold`` and
    ``hold_grid``), which the launcher passes to every store process it starts (they
    inherit its environment).
``TIERRUN_LINK_BATCHES_IN_FLIGHT``
    ``LinkConfig.batches_in_flight`` (a whole number).
``TIERRUN_LINK_HANDSHAKE_TIMEOUT``, ``TIERRUN_LINK_HANDSHAKES_PER_ADDRESS``
    How long (seconds) a link connection may take to authenticate, and how many may be
    authenticating from one address at once (``LinkConfig``'s ``handshake_timeout`` and
    ``max_handshakes_per_address``).
``TIERRUN_LOG_LEVEL``
    The launcher's log level (DEBUG, INFO, WARNING, ERROR; default WARNING).
``TIERRUN_ETCD_PASSWORD``
    The password of ``--rdzv_conf username=`` for the ``tierrun-etcd`` rendezvous.
``TIERRUN_FRONTEND_TOKEN``
    Internal: the token a ``tierrun store --workers N`` process gives each front-end
    process it starts, for that process's link to it (hex).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .link.config import LinkConfig

TOKEN = "TIERRUN_TOKEN"
TOKEN_FILE = "TIERRUN_TOKEN_FILE"
LOG_LEVEL = "TIERRUN_LOG_LEVEL"
ETCD_PASSWORD = "TIERRUN_ETCD_PASSWORD"
FRONTEND_TOKEN = "TIERRUN_FRONTEND_TOKEN"
#: ``LinkConfig`` field -> the variable that overrides its default.
LINK_VARIABLES = {
    "heartbeat_interval": "TIERRUN_LINK_HEARTBEAT",
    "heartbeat_timeout": "TIERRUN_LINK_TIMEOUT",
    "grace": "TIERRUN_LINK_GRACE",
    "batch_window": "TIERRUN_LINK_BATCH_WINDOW",
    "batches_in_flight": "TIERRUN_LINK_BATCHES_IN_FLIGHT",
    "contended_write_hold": "TIERRUN_LINK_WRITE_HOLD",
    "hold_grid": "TIERRUN_LINK_HOLD_GRID",
    "handshake_timeout": "TIERRUN_LINK_HANDSHAKE_TIMEOUT",
    "max_handshakes_per_address": "TIERRUN_LINK_HANDSHAKES_PER_ADDRESS",
}

class SettingsError(ValueError):
    """A variable holds something tierrun cannot use; the message names it."""


@dataclass(frozen=True)
class Settings:
    """What the environment says, as read by :meth:`from_env`."""

    #: ``$TIERRUN_TOKEN`` (None when unset or empty).
    token: str | None = None
    #: ``$TIERRUN_TOKEN_FILE`` (None when unset or empty).
    token_file: str | None = None
    link: LinkConfig = field(default_factory=LinkConfig)
    log_level: str = "WARNING"
    #: ``$TIERRUN_ETCD_PASSWORD`` (None when unset; an empty password is a password).
    etcd_password: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Read every variable once. Raises :class:`SettingsError` naming a link
        timing that is not a number."""
        return cls(
            token=environ.get(TOKEN) or None,
            token_file=environ.get(TOKEN_FILE) or None,
            link=_link_config(environ),
            log_level=environ.get(LOG_LEVEL, "WARNING"),
            etcd_password=environ.get(ETCD_PASSWORD),
        )

    def job_token(self) -> bytes | None:
        """The job token: ``$TIERRUN_TOKEN``, else the contents of the file named by
        ``$TIERRUN_TOKEN_FILE``, else None. Reads that file on each call (only callers
        that need a token read it); raises ``OSError`` if it cannot be read."""
        if self.token:
            return self.token.encode()
        if self.token_file:
            with open(self.token_file, "rb") as f:
                return f.read().strip()
        return None


def _link_config(environ: Mapping[str, str]) -> LinkConfig:
    defaults = LinkConfig()
    overrides: dict[str, float | int] = {}
    for name, variable in LINK_VARIABLES.items():
        if variable in environ:
            whole = isinstance(getattr(defaults, name), int)
            overrides[name] = _number(variable, environ[variable], whole)
    return LinkConfig(**overrides)  # type: ignore[arg-type]


def _number(variable: str, text: str, whole: bool) -> float | int:
    try:
        return int(text) if whole else float(text)
    except ValueError:
        raise SettingsError(f"${variable}={text!r}: write {'a whole number' if whole else 'a number of seconds'}") from None


def export_token(token: str) -> None:
    """Set ``$TIERRUN_TOKEN`` in this process's environment: the launcher's way to hand
    a token it made up to its rendezvous handlers and to every process it starts."""
    os.environ[TOKEN] = token


def store_process_env(token: str | None) -> dict[str, str]:
    """The environment of a store process this process starts: its own, with
    ``$TIERRUN_TOKEN`` set to ``token`` when given."""
    env = dict(os.environ)
    if token is not None:
        env[TOKEN] = token
    return env


def frontend_process_env(token: bytes) -> dict[str, str]:
    """The environment of one of the store's front-end processes: this process's, with
    the token of that process's link in ``$TIERRUN_FRONTEND_TOKEN``."""
    return {**os.environ, FRONTEND_TOKEN: token.hex()}


def take_frontend_token() -> bytes:
    """In a front-end process: its link's token, removed from the environment. Empty
    when the variable is unset; raises ``ValueError`` if it is not hex."""
    return bytes.fromhex(os.environ.pop(FRONTEND_TOKEN, ""))
