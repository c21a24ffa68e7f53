"""Optional features and the extras that install them (``pip install 'tierrun[etcd]'``).

A feature whose extra is missing fails with :class:`MissingExtraError`, whose message is
one line naming the command that installs it, instead of an ``ImportError`` traceback.
"""

from __future__ import annotations

import importlib

#: extra -> the modules it provides (import names)
EXTRAS: dict[str, tuple[str, ...]] = {
    "etcd": ("requests", "etcd3gw", "etcd"),  # etcd3gw (on requests): tierrun-etcd; etcd: python-etcd
    "plot": ("matplotlib",),
}


class MissingExtraError(RuntimeError):
    """A feature needs modules of an extra that is not installed; the message says which
    and the ``pip install`` command."""


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Import ``modules`` (default: all of ``extra``'s); raise :class:`MissingExtraError`
    naming ``feature``, the missing module and ``pip install 'tierrun[extra]'`` if one
    cannot be imported. Blocks for the imports only."""
    for name in modules if modules is not None else EXTRAS[extra]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = e.name or name
            raise MissingExtraError(
                f"{feature} needs the Python module '{missing}', which is not installed: "
                f"pip install 'tierrun[{extra}]'"
            ) from None
