"""Reading ``--rdzv_conf`` values, and the error a wrong one raises.

A wrong value (``is_host=maybe``, ``join_timeout=abc``) is a :class:`RendezvousSettingError`:
a ``ValueError`` (what torch's own backends raise for it) that is also a
``RendezvousError``, so the ``tierrun`` command ends in one line naming the node, the
setting and what to write, as for every other rendezvous failure.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters

from ..settings import Settings

#: the spellings torch's ``RendezvousParameters.get_as_bool`` takes
TRUE = ("1", "true", "t", "yes", "y")
FALSE = ("0", "false", "f", "no", "n")


class RendezvousSettingError(RendezvousError, ValueError):
    """A rendezvous setting (a ``--rdzv_conf`` value, ``--nnodes`` for a backend) that
    cannot be used; the message says which and what to write."""


def conf_bool(params: RendezvousParameters, key: str) -> bool | None:
    """``--rdzv_conf key=...`` as torch's ``get_as_bool`` reads it (any case of 1/0,
    true/false, t/f, yes/no, y/n); None when not given. Raises
    :class:`RendezvousSettingError` for another value."""
    try:
        return params.get_as_bool(key)
    except ValueError:
        raise RendezvousSettingError(
            f"--rdzv_conf {key}={params.get(key)} is not a boolean: write {key}=true or {key}=false "
            f"(torch's spellings: {'/'.join(TRUE)} or {'/'.join(FALSE)})") from None


def conf_flag(config: dict, key: str) -> bool | None:
    """``--rdzv_conf key=...`` of a parsed config, in torch's boolean spellings (any
    case); None when not given. Raises :class:`RendezvousSettingError` for another value
    (a typo must not turn a setting off in silence)."""
    raw = config.get(key)
    if raw is None:
        return None
    value = str(raw).strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise RendezvousSettingError(
        f"--rdzv_conf {key}={raw} is not a boolean: write {key}=true or {key}=false "
        f"(torch's spellings: {'/'.join(TRUE)} or {'/'.join(FALSE)})")


def conf_float(config: dict, key: str, default: float, minimum: float | None = 0.0) -> float:
    """``--rdzv_conf key=SECONDS`` (or another number), ``default`` when not given.
    Raises :class:`RendezvousSettingError` for what is not a number, or below ``minimum``."""
    raw = config.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise RendezvousSettingError(f"--rdzv_conf {key}={raw} is not a number: write {key}=SECONDS") from None
    if minimum is not None and not value >= minimum:  # (NaN fails too)
        raise RendezvousSettingError(f"--rdzv_conf {key}={raw}: write a number of at least {minimum:g}")
    return value


def conf_int(config: dict, key: str, default: int, minimum: int | None = 0) -> int:
    """``--rdzv_conf key=N``, ``default`` when not given; raises like :func:`conf_float`."""
    raw = config.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise RendezvousSettingError(f"--rdzv_conf {key}={raw} is not a whole number: write {key}=N") from None
    if minimum is not None and value < minimum:
        raise RendezvousSettingError(f"--rdzv_conf {key}={raw}: write a whole number of at least {minimum}")
    return value


def token_from(config: dict, settings: Settings) -> bytes | None:
    """The job token when ``--rdzv_conf tiered=1`` (set by ``--tiered``; any of torch's
    boolean spellings), else None. Raises ValueError when there is none or its file is
    empty, or ``tiered`` is no boolean; ``OSError`` if its file cannot be read."""
    if not conf_flag(config, "tiered"):
        return None
    token = settings.job_token()
    if token is None:
        raise ValueError("tiered wire-up needs a job token: give every node the same secret, in a file "
                         "named by TIERRUN_TOKEN_FILE (or in TIERRUN_TOKEN)")
    return token


def public_clients_from(config: dict) -> bool:
    """``--rdzv_conf store_public_clients=true``: a tiered job's store host serves
    torch-protocol clients on its public port too (default: node links only)."""
    return str(config.get("store_public_clients", "0")).lower() in ("1", "true", "yes")


def store_workers_from(config: dict) -> int:
    """``--rdzv_conf store_workers=N`` (set by ``--store-workers N``): front-end
    processes of the store host. Raises ValueError."""
    n = int(config.get("store_workers", 1))
    if n < 1:
        raise ValueError(f"store_workers={n}: write 1 or more")
    return n
