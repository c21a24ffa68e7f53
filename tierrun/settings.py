"""Every ``TIERRUN_*`` environment variable tierrun reads, read in this one place.

The entry points read them once, with :meth:`Settings.from_env`, and hand what they need
to the code they run, which never looks at the environment itself:

- the ``tierrun`` launcher (``tierrun.launcher.cli``);
- the rendezvous handler creators torch's registry calls (``tierrun.rendezvous``);
- ``tierrun store``, ``tierrun proxy`` and the store's front-end processes
  (``tierrun.server.store_cli``).

The launcher and the handler creators read them with :meth:`Settings.take_from_env`,
which also takes the secret ones (``SECRETS``) out of the process's environment: torch's
agent gives every training worker a copy of that environment, and a secret there ends
up in whatever records a worker's environment (experiment trackers, crash reports, the
shell of a data-loader's subprocess). The store processes the launcher starts get the
job token through a pipe (``tierrun store --token-fd``), not their environment.

The variables:

``TIERRUN_TOKEN``
    The job token that authenticates the links between store processes (a secret).
``TIERRUN_TOKEN_FILE``
    A file holding the job token (surrounding whitespace ignored), when
    ``TIERRUN_TOKEN`` is unset or empty: a mounted Kubernetes Secret, a file written
    before ``srun``. Its name is no secret and stays in the environment.
``TIERRUN_LINK_HEARTBEAT``, ``TIERRUN_LINK_TIMEOUT``, ``TIERRUN_LINK_GRACE``,
``TIERRUN_LINK_BATCH_WINDOW``, ``TIERRUN_LINK_WRITE_HOLD``, ``TIERRUN_LINK_HOLD_GRID``,
``TIERRUN_LINK_RELAY_PACE``
    A link's timings in seconds (``LinkConfig``'s ``heartbeat_interval``,
    ``heartbeat_timeout``, ``grace``, ``batch_window``, ``contended_write_hold``,
    ``hold_grid`` and ``relay_pace``), which the launcher passes to every store process it starts (they
    inherit its environment).
``TIERRUN_LINK_BATCHES_IN_FLIGHT``
    ``LinkConfig.batches_in_flight`` (a whole number).
``TIERRUN_MAX_STORE_BYTES``, ``TIERRUN_MAX_STORE_KEYS``
    The store's budgets (``tierrun store``'s ``--max-store-bytes`` and
    ``--max-store-keys``, which win over them): how a job started by the launcher
    raises them (the launcher's store processes inherit its environment).
``TIERRUN_LINK_HANDSHAKE_TIMEOUT``, ``TIERRUN_LINK_HANDSHAKES_PER_ADDRESS``
    How long (seconds) a link connection may take to authenticate, and how many may be
    authenticating from one address at once (``LinkConfig``'s ``handshake_timeout`` and
    ``max_handshakes_per_address``).
``TIERRUN_LINK_LOOKUP_UDP_WAIT``
    Seconds a node of a store tree waits for the store host's answer to its LOOKUP
    datagram before asking over TCP (``LinkConfig.lookup_udp_wait``; 0: TCP only, for
    a network that filters UDP to the store's port).
``TIERRUN_LINK_LOOKUP_PACE``
    While LOOKUP datagrams come often, the store host reads them in batches this many
    seconds apart (``LinkConfig.lookup_pace``; 0: each as it comes).
``TIERRUN_LOG_LEVEL``
    The launcher's log level (DEBUG, INFO, WARNING, ERROR; default WARNING).
``TIERRUN_ETCD_PASSWORD``
    The password of ``--rdzv_conf username=`` for the ``tierrun-etcd`` rendezvous (a
    secret).
``TIERRUN_FRONTEND_TOKEN``
    Internal: the token a ``tierrun store --workers N`` process gives each front-end
    process it starts, for that process's link to it (hex).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from .link.config import LinkConfig

TOKEN = "TIERRUN_TOKEN"
TOKEN_FILE = "TIERRUN_TOKEN_FILE"
LOG_LEVEL = "TIERRUN_LOG_LEVEL"
ETCD_PASSWORD = "TIERRUN_ETCD_PASSWORD"
FRONTEND_TOKEN = "TIERRUN_FRONTEND_TOKEN"
#: The variables that hold secrets: no process tierrun starts inherits them.
SECRETS = (TOKEN, ETCD_PASSWORD)
MAX_STORE_BYTES = "TIERRUN_MAX_STORE_BYTES"
MAX_STORE_KEYS = "TIERRUN_MAX_STORE_KEYS"
#: ``LinkConfig`` field -> the variable that overrides its default.
LINK_VARIABLES = {
    "heartbeat_interval": "TIERRUN_LINK_HEARTBEAT",
    "heartbeat_timeout": "TIERRUN_LINK_TIMEOUT",
    "grace": "TIERRUN_LINK_GRACE",
    "batch_window": "TIERRUN_LINK_BATCH_WINDOW",
    "batches_in_flight": "TIERRUN_LINK_BATCHES_IN_FLIGHT",
    "contended_write_hold": "TIERRUN_LINK_WRITE_HOLD",
    "hold_grid": "TIERRUN_LINK_HOLD_GRID",
    "relay_pace": "TIERRUN_LINK_RELAY_PACE",
    "handshake_timeout": "TIERRUN_LINK_HANDSHAKE_TIMEOUT",
    "max_handshakes_per_address": "TIERRUN_LINK_HANDSHAKES_PER_ADDRESS",
    "lookup_udp_wait": "TIERRUN_LINK_LOOKUP_UDP_WAIT",
    "lookup_pace": "TIERRUN_LINK_LOOKUP_PACE",
}

class SettingsError(ValueError):
    """A variable holds something tierrun cannot use; the message names it."""


#: The secrets :meth:`Settings.take_from_env` took out of this process's environment, so
#: that a second call (a second launch in one process) still finds them.
_taken: dict[str, str] = {}


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
    #: ``$TIERRUN_MAX_STORE_BYTES``, ``$TIERRUN_MAX_STORE_KEYS`` (None when unset or empty).
    max_store_bytes: int | None = None
    max_store_keys: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Read every variable once. Raises :class:`SettingsError` naming a link
        timing that is not a number, a store budget that is not a positive whole
        number, or a log level that is not one."""
        return cls(
            token=environ.get(TOKEN) or None,
            token_file=environ.get(TOKEN_FILE) or None,
            link=_link_config(environ),
            log_level=_log_level(environ),
            etcd_password=environ.get(ETCD_PASSWORD),
            max_store_bytes=_count(MAX_STORE_BYTES, environ),
            max_store_keys=_count(MAX_STORE_KEYS, environ),
        )

    @classmethod
    def take_from_env(cls, environ: MutableMapping[str, str] = os.environ) -> Settings:
        """:meth:`from_env`, then remove the secret variables (``SECRETS``) from
        ``environ`` (by default this process's environment), so that no process started
        from then on inherits them: torch's agent copies ``os.environ`` into every
        worker's. Secrets taken out of ``os.environ`` by an earlier call count as set
        (unless set anew). Raises like :meth:`from_env`, and then removes nothing.

        It cannot scrub what the kernel shows in ``/proc/<pid>/environ`` of this very
        process (its environment at exec): a secret given in ``$TIERRUN_TOKEN`` stays
        readable there by the same user; ``$TIERRUN_TOKEN_FILE`` leaves nothing there."""
        taken = {name: environ[name] for name in SECRETS if name in environ}
        if environ is os.environ:
            taken = {**_taken, **taken}
        settings = cls.from_env({**environ, **taken})
        for name in SECRETS:
            environ.pop(name, None)
        if environ is os.environ:
            _taken.update(taken)
        return settings

    def job_token(self) -> bytes | None:
        """The job token: ``$TIERRUN_TOKEN``, else the contents of the file named by
        ``$TIERRUN_TOKEN_FILE`` (surrounding whitespace stripped), else None. Reads that
        file on each call (only callers that need a token read it); raises ``OSError`` if
        it cannot be read, :class:`SettingsError` if it holds nothing but whitespace (an
        empty secret would let anyone in)."""
        if self.token:
            return self.token.encode()
        if self.token_file:
            with open(self.token_file, "rb") as f:
                token = f.read().strip()
            if not token:
                raise SettingsError(f"$TIERRUN_TOKEN_FILE={self.token_file} is empty: write the job's "
                                    "secret in it (the same on every node)")
            return token
        return None


#: The most a relay may pace its batches (seconds): more would stall every request.
MAX_RELAY_PACE = 1.0


def _link_config(environ: Mapping[str, str]) -> LinkConfig:
    defaults = LinkConfig()
    overrides: dict[str, float | int] = {}
    for name, variable in LINK_VARIABLES.items():
        if variable in environ:
            whole = isinstance(getattr(defaults, name), int)
            value = overrides[name] = _number(variable, environ[variable], whole)
            if not 0 <= value < float("inf"):  # (also NaN)
                raise SettingsError(f"${variable}={environ[variable]!r}: write a number >= 0 "
                                    f"({'a whole number' if whole else 'seconds'})")
    pace = overrides.get("relay_pace", 0.0)
    if pace > MAX_RELAY_PACE:
        raise SettingsError(f"$TIERRUN_LINK_RELAY_PACE={environ['TIERRUN_LINK_RELAY_PACE']!r}: at most "
                            f"{MAX_RELAY_PACE:g} (seconds; the default is {defaults.relay_pace:g})")
    return LinkConfig(**overrides)  # type: ignore[arg-type]


#: The levels ``$TIERRUN_LOG_LEVEL`` may name (any case): Python logging's names.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET")


def _log_level(environ: Mapping[str, str]) -> str:
    """``$TIERRUN_LOG_LEVEL`` upper-cased, WARNING when unset or empty (a template that
    left it blank). Raises SettingsError for a name logging does not know."""
    text = environ.get(LOG_LEVEL, "").strip()
    if not text:
        return "WARNING"
    if text.upper() not in LOG_LEVELS:
        raise SettingsError(f"${LOG_LEVEL}={text!r}: write one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _count(variable: str, environ: Mapping[str, str]) -> int | None:
    """A positive whole number, or None when unset or empty. Raises SettingsError."""
    text = environ.get(variable)
    if not text:
        return None
    n = _number(variable, text, whole=True)
    if n < 1:
        raise SettingsError(f"${variable}={text!r}: write a positive whole number")
    return int(n)


def _number(variable: str, text: str, whole: bool) -> float | int:
    try:
        return int(text) if whole else float(text)
    except ValueError:
        raise SettingsError(f"${variable}={text!r}: write {'a whole number' if whole else 'a number of seconds'}") from None


def without_secrets(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` without the secret variables (``SECRETS``)."""
    return {name: value for name, value in environ.items() if name not in SECRETS}


def store_process_env() -> dict[str, str]:
    """The environment of a store process this process starts: its own without secrets
    (it gets the job token through a pipe: ``StoreProcess(token=...)``)."""
    return without_secrets()


def frontend_process_env(token: bytes) -> dict[str, str]:
    """The environment of one of the store's front-end processes: this process's without
    secrets, with the token of that process's link in ``$TIERRUN_FRONTEND_TOKEN``."""
    return {**without_secrets(), FRONTEND_TOKEN: token.hex()}


def take_frontend_token() -> bytes:
    """In a front-end process: its link's token, removed from the environment. Empty
    when the variable is unset; raises ``ValueError`` if it is not hex."""
    return bytes.fromhex(os.environ.pop(FRONTEND_TOKEN, ""))
