"""Choosing the store of record from its spec: a file path (SQLite) or a postgresql:// URL.

The sidecar, ``kalos doctor`` and the CLI name a store by one string; this module is the one
place that tells the two kinds apart, so the SQLite path stays free of PostgreSQL imports.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Union

from kalos.store.sqlite import Store

__all__ = ["StoreSpec", "open_store", "is_store_url", "store_spec", "describe_store"]

# A store as the CLI and SidecarConfig carry it: a Path (SQLite) or a URL string (PostgreSQL).
StoreSpec = Union[str, "os.PathLike[str]"]


def is_store_url(spec: Any) -> bool:
    """True when ``spec`` is a postgresql:// (or postgres://) URL rather than a file path."""
    from kalos.store.postgres import is_postgres_url

    return is_postgres_url(spec if isinstance(spec, str) else None)


# Any URL scheme (RFC 3986: a letter, then letters, digits, + - .) followed by "://".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ACCEPTED_SCHEMES = ("postgresql", "postgres")


def _refuse_other_schemes(spec: Any) -> None:
    """InvalidArgument for a string that looks like a URL of another scheme: taken as a path it
    would become a SQLite file named after the URL (``postgress://u@h/db`` -> ./postgress:/u@h/db)."""
    if not isinstance(spec, str) or is_store_url(spec):
        return
    match = _SCHEME.match(spec)
    if match:
        from kalos.errors import InvalidArgument
        from kalos.store.postgres import mask_url

        raise InvalidArgument(
            f"store {mask_url(spec)!r} has the URL scheme {match.group(1)!r}; a store is a SQLite file path or a "
            f"URL of scheme {' or '.join(s + '://' for s in _ACCEPTED_SCHEMES)}"
        )


def store_spec(text: str) -> StoreSpec:
    """The CLI's ``--store`` value: a URL stays a string (Path would fold its ``//``), else a Path.
    InvalidArgument for a URL of a scheme other than postgresql/postgres."""
    _refuse_other_schemes(text)
    return text if is_store_url(text) else Path(text)


def describe_store(spec: StoreSpec) -> str:
    """``spec`` fit for a message or a log: a URL with its password masked, or the path."""
    if is_store_url(spec):
        from kalos.store.postgres import mask_url

        return mask_url(str(spec))
    return str(spec)


def open_store(spec: StoreSpec, *, dim: int | None = None, readonly: bool = False) -> Any:
    """A :class:`kalos.store.sqlite.Store` for a path, a :class:`kalos.store.postgres.PostgresStore` for a URL.
    InvalidArgument for a URL of another scheme (nothing is created)."""
    _refuse_other_schemes(spec)
    if is_store_url(spec):
        from kalos.store.postgres import PostgresStore

        return PostgresStore.open(str(spec), dim=dim, readonly=readonly)
    return Store.open(spec, dim=dim, readonly=readonly)
