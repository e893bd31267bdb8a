"""Kalos exceptions and the error codes that carry them across processes.

Every error the sidecar reports travels as an :class:`ErrorCode` plus a message (in a slot's
response header or a control-socket reply); :func:`error_from_code` turns the pair back into
the matching exception on the client side, so a caller catches the same class whether the
problem was found locally or in the sidecar.
"""
from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "KalosError",
    "InvalidArgument",
    "InvalidQuery",
    "DimensionMismatch",
    "UnknownNamespace",
    "UnknownKey",
    "UnknownFilter",
    "SidecarUnavailable",
    "SidecarAlreadyRunning",
    "ProtocolMismatch",
    "StoreError",
    "NotAKalosStore",
    "StoreLocked",
    "ServerError",
    "EmbedderUnavailable",
    "error_from_code",
]


class ErrorCode(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    INVALID_QUERY = 2
    DIMENSION_MISMATCH = 3
    UNKNOWN_NAMESPACE = 4
    PROTOCOL = 5
    STORE = 6
    INTERNAL = 7
    UNKNOWN_KEY = 8
    UNKNOWN_FILTER = 9
    EMBEDDER_UNAVAILABLE = 10


class KalosError(Exception):
    """Base class of every error Kalos raises."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidArgument(KalosError, ValueError):
    """A value passed to Kalos is wrong; nothing was changed."""

    code = ErrorCode.INVALID_ARGUMENT


class InvalidQuery(InvalidArgument):
    """A recall request is malformed: bad vector values, k, batch size or time range."""

    code = ErrorCode.INVALID_QUERY


class DimensionMismatch(InvalidArgument):
    """A vector's length differs from the store's dimension."""

    code = ErrorCode.DIMENSION_MISMATCH


class UnknownNamespace(InvalidArgument):
    """A recall named a namespace that holds no memories and never did."""

    code = ErrorCode.UNKNOWN_NAMESPACE


class UnknownKey(KalosError, KeyError):
    """An update named a key (or id) that holds no memory in that namespace; nothing was changed.

    A KeyError too, so ``except KeyError`` catches it like a missing dict key.
    """

    code = ErrorCode.UNKNOWN_KEY

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of its argument (quotes and escapes): the
        # message reads as written instead.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class UnknownFilter(InvalidArgument):
    """A recall named a where-clause handle the sidecar does not hold (it restarted, or the
    handle was evicted from its bounded table): the client registers the clause again."""

    code = ErrorCode.UNKNOWN_FILTER


class ProtocolMismatch(KalosError):
    """The peer speaks another protocol: wrong magic, version or layout sizes."""

    code = ErrorCode.PROTOCOL


class SidecarUnavailable(KalosError, ConnectionError):
    """No live sidecar answered within the client's timeout."""


class SidecarAlreadyRunning(KalosError):
    """Another sidecar already serves this name or this store."""


class StoreError(KalosError):
    """The durable store could not do what was asked."""

    code = ErrorCode.STORE


class NotAKalosStore(StoreError):
    """The store path holds a file that is not a Kalos store; it was left untouched."""


class StoreLocked(StoreError):
    """Another process has the store open for writing."""


class ServerError(KalosError):
    """The sidecar failed in a way that is not the caller's fault (a bug: please report it)."""

    code = ErrorCode.INTERNAL


class EmbedderUnavailable(KalosError, ImportError):
    """The embedding packages are not installed (the ``embed`` extra) or the model cannot load,
    in this process or in the sidecar that was asked to embed (``kalos.client.embed`` re-exports it)."""

    code = ErrorCode.EMBEDDER_UNAVAILABLE


_BY_CODE: dict[int, type[KalosError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.INVALID_QUERY: InvalidQuery,
    ErrorCode.DIMENSION_MISMATCH: DimensionMismatch,
    ErrorCode.UNKNOWN_NAMESPACE: UnknownNamespace,
    ErrorCode.UNKNOWN_KEY: UnknownKey,
    ErrorCode.UNKNOWN_FILTER: UnknownFilter,
    ErrorCode.PROTOCOL: ProtocolMismatch,
    ErrorCode.STORE: StoreError,
    ErrorCode.INTERNAL: ServerError,
    ErrorCode.EMBEDDER_UNAVAILABLE: EmbedderUnavailable,
}


def error_from_code(code: int, message: str) -> KalosError:
    """The exception for an error code received from the sidecar (unknown codes: ServerError)."""
    return _BY_CODE.get(code, ServerError)(message)
