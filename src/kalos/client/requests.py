"""A call's arguments, checked and encoded before they travel: a recall's rows and slot words
(namespace, time window, where clause), keys or ids, list cursors. Shared by
:class:`kalos.client.client.Client` and :class:`kalos.client.aio.AsyncClient`, so that both
refuse the same bad input with the same words, before anything reaches the sidecar."""
from __future__ import annotations

import datetime as _dt
import re
from typing import Any

import numpy as np

from kalos.errors import DimensionMismatch, InvalidArgument, InvalidQuery, KalosError, SidecarUnavailable
from kalos.ipc.protocol import Layout, RequestFlag
from kalos.validation import MAX_ID, MAX_LIST_LIMIT, MAX_NAMESPACE_BYTES, check_keys, check_namespace
from kalos.where import Where, compile_where

__all__ = [
    "MAX_RECALL_MANY_ROWS", "TimeLike", "as_matrix", "check_k", "check_limit", "decode_cursor", "encode_cursor",
    "filter_words", "id_list", "key_or_id_message", "looks_like_ids", "recall_request", "request_words",
    "timestamps", "to_timestamp", "where_clause", "with_where",
]

TimeLike = float | int | _dt.datetime
#: recall_many splits a batch into requests of the sidecar's max_batch rows; past this many
#: rows in one call the caller is almost certainly passing the wrong array.
MAX_RECALL_MANY_ROWS = 1 << 20


_CURSOR = re.compile(r"1\.([0-9a-f]{1,16})")


def encode_cursor(after: int) -> str:
    return f"1.{after:x}"


def decode_cursor(cursor: Any) -> int:
    """The id a cursor pages on from (0: the first page), or InvalidArgument."""
    if cursor is None:
        return 0
    match = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) else None
    if match is None or int(match.group(1), 16) > MAX_ID:
        raise InvalidArgument(f"cursor {cursor!r:.80} is not one that list() returned")
    return int(match.group(1), 16)


def check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidArgument(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r:.80}")
    return int(limit)


_FLOAT32 = np.dtype(np.float32)


def as_matrix(
    value: Any, dim: int, *, single: bool, what: str = "query", error: type[KalosError] = InvalidQuery
) -> np.ndarray:
    if (single and type(value) is np.ndarray and (value.dtype is _FLOAT32 or value.dtype == _FLOAT32)
            and value.shape == (dim,)):  # (an unpickled array's float32 is equal, not the same object)
        return value[None]  # a recall's usual query passes every check below: skip them (the hot path)
    try:
        array = np.asarray(value)
        # Real numbers only, as add's check_vectors: float32 conversion dropped the imaginary
        # part of complex input, parsed strings and took bools as 0/1 (issue 19).
        if array.dtype.kind not in "iuf":
            raise TypeError(f"dtype {array.dtype} is not a real number type")
        array = array.astype(np.float32, copy=False)
    except (TypeError, ValueError) as exc:
        raise error(f"{what} is not a numeric array: {exc}") from None
    if single:
        if array.ndim != 1:
            raise error(f"recall takes one vector of shape ({dim},), got shape {array.shape}; use recall_many for a batch")
        array = array[None, :]
    elif array.ndim == 1 and what == "vector":
        array = array[None, :]
    if array.ndim != 2:
        raise error(f"expected a matrix of shape (n, {dim}), got shape {array.shape}")
    if array.shape[1] != dim:
        raise DimensionMismatch(f"{what} has dimension {array.shape[1]}, the store holds dimension {dim}")
    if len(array) == 0:
        raise error(f"empty batch: at least one {what} is needed")
    if len(array) > MAX_RECALL_MANY_ROWS:
        raise error(f"batch of {len(array)} rows exceeds {MAX_RECALL_MANY_ROWS}; split it")
    return array


_REQUESTS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def recall_request(
    queries: Any, k: Any, namespace: str | None, since: Any, until: Any, layout: Layout, *, single: bool
) -> tuple[np.ndarray, int, tuple[Any, ...]]:
    """A recall's query rows, its k and its request words, validated (Client and AsyncClient)."""
    rows = as_matrix(queries, layout.dim, single=single)
    k = check_k(k, layout.max_k)
    return rows, k, request_words(k, namespace, since, until)


def check_same_layout(layout: Layout, checked: Layout, k: int) -> None:
    """SidecarUnavailable unless the sidecar found again (``layout``) takes the request that was
    checked against ``checked``: the same dimension, at least its ``k``."""
    if layout.dim != checked.dim or layout.max_k < k:
        raise SidecarUnavailable("the sidecar came back with another dimension or max_k") from None


def check_k(k: Any, max_k: int) -> int:
    """``k`` as an int; InvalidQuery unless it is an integer (not a bool) in [1, max_k]."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= max_k:
        raise InvalidQuery(f"k={k!r} is out of range: 1 <= k <= {max_k}")
    return int(k)


def where_clause(where: Any) -> Where | None:
    """``where=`` compiled (InvalidArgument names a bad part); None for no filter or ``{}``.

    Compiled clauses are remembered by their structure: compiling (validation and the canonical
    JSON) costs several times the rest of a recall's client side."""
    if where is None or type(where) is Where:
        return None if where is None or where.is_trivial else where
    try:
        frozen = _freeze(where)
    except TypeError:  # not plain JSON-like data: compile_where names what is wrong
        frozen = None
    clause = _WHERES.get(frozen) if frozen is not None else None
    if clause is None:
        clause = compile_where(where)
        if frozen is not None:
            if len(_WHERES) >= 4096:
                _WHERES.clear()
            _WHERES[frozen] = clause
    return None if clause.is_trivial else clause


_WHERES: dict[Any, Where] = {}


def _freeze(value: Any) -> Any:
    """A hashable copy of JSON-like ``value`` that tells 1, 1.0 and True apart (TypeError otherwise)."""
    kind = type(value)
    if kind is dict:
        return (dict, tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if kind is list or kind is tuple:
        return (list, tuple(_freeze(v) for v in value))
    if kind is str or kind is int or kind is float or kind is bool:
        return (kind, value)
    raise TypeError(kind.__name__)


_HAS_WHERE = int(RequestFlag.HAS_WHERE)


def with_where(request: tuple[Any, ...], handle: int) -> tuple[Any, ...]:
    """Request words (as :func:`request_words`) that name the where clause ``handle``."""
    k, flags, since, until, namespace = request[:5]
    return (k, flags | _HAS_WHERE, since, until, namespace, handle)


def request_words(k: int, namespace: str | None, since: Any, until: Any) -> tuple[Any, ...]:
    """``(k, flags, since, until, namespace bytes)`` of a recall, remembered for the common
    arguments (validating and encoding them costs microseconds on every call otherwise)."""
    # Only plain numbers and None are remembered, and looked up: True == 1 and hashes alike, so
    # a lookup of since=True found since=1's words and skipped the check that refuses a bool.
    # (Datetimes are converted afresh: their timezone may change.)
    if type(since) not in _MEMO_TYPES or type(until) not in _MEMO_TYPES:
        return (k, *filter_words(namespace, since, until))
    key = (k, namespace, since, until)
    try:
        words = _REQUESTS.get(key)
    except TypeError:  # an unhashable namespace: no memo, the checks below still apply
        return (k, *filter_words(namespace, since, until))
    if words is None:
        words = (k, *filter_words(namespace, since, until))
        if len(_REQUESTS) >= 4096:  # callers sweeping time windows: keep it bounded
            _REQUESTS.clear()
        _REQUESTS[key] = words
    return words


_MEMO_TYPES = (int, float, type(None))


def filter_words(namespace: str | None, since: Any, until: Any) -> tuple[int, float, float, bytes]:
    flags = 0
    if namespace is None:
        flags |= RequestFlag.ALL_NAMESPACES
        encoded = b""
    elif isinstance(namespace, str):
        try:
            encoded = namespace.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: was a raw UnicodeEncodeError (issue 19)
            raise InvalidQuery(f"namespace {namespace!r} is not valid Unicode (lone surrogate)") from None
        if not encoded or len(encoded) > MAX_NAMESPACE_BYTES or b"\x00" in encoded:
            raise InvalidQuery(f"namespace {namespace[:40]!r} must be 1 to {MAX_NAMESPACE_BYTES} UTF-8 bytes without NUL")
    else:
        raise InvalidQuery(f"namespace must be a str or None, got {type(namespace).__name__}")
    bounds = []
    for label, flag, value in (("since", RequestFlag.HAS_SINCE, since), ("until", RequestFlag.HAS_UNTIL, until)):
        if value is None:
            bounds.append(0.0)
            continue
        flags |= flag
        bounds.append(to_timestamp(value, label))
    if since is not None and until is not None and bounds[0] >= bounds[1]:
        raise InvalidQuery(f"empty time range: since={bounds[0]} is not before until={bounds[1]}")
    return int(flags), bounds[0], bounds[1], encoded


def to_timestamp(value: Any, label: str) -> float:
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        if not np.isfinite(value):
            raise InvalidQuery(f"{label} must be a finite time, got {value}")
        return float(value)
    raise InvalidQuery(f"{label} must be unix seconds or a datetime, got {type(value).__name__}")


def timestamps(created_at: Any) -> Any:
    """``created_at`` with datetimes turned into unix seconds (like since/until)."""
    if isinstance(created_at, _dt.datetime):
        return created_at.timestamp()
    if isinstance(created_at, (list, tuple)):
        return [c.timestamp() if isinstance(c, _dt.datetime) else c for c in created_at]
    return created_at


def key_or_id_message(op: str, first: Any, ids: Any, namespace: str, *, keys: Any = None) -> dict[str, Any]:
    """The control message of a get or delete by keys or by ids, checked before it travels.
    Carries ``wanted`` (the checked keys or ids, repeats kept) for get.

    ``first`` is the call's positional first argument: keys, or ids when it is integers (the
    positional ids of every release before keys). ``keys`` is an explicit ``keys=`` argument and
    is only ever keys: ids are global, so taking ``keys=[5]`` for id 5 would reach past the
    namespace the caller named."""
    if first is not None:
        if keys is not None:
            if looks_like_ids(first):
                raise InvalidArgument(f"{op}: pass keys or ids (one of them), got ids (positionally) and keys=")
            raise InvalidArgument(f"{op}: keys given twice (positionally and as keys=)")
        if ids is None and looks_like_ids(first):
            ids = first
        else:
            keys = first
    if (keys is None) == (ids is None):
        raise InvalidArgument(f"{op}: pass keys or ids (one of them), got {'both' if keys is not None else 'neither'}")
    if ids is not None:
        wanted: list[Any] = id_list(ids)
        return {"op": op, "ids": wanted, "wanted": wanted}
    check_namespace(namespace)
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
        raise InvalidArgument(f"{op}: keys must be a sequence of str, got {type(keys).__name__} {keys!r:.80}")
    wanted = list(keys)
    for i, key in enumerate(wanted):
        if not isinstance(key, str):
            raise InvalidArgument(f"{op}: keys[{i}] must be a str, got {type(key).__name__} {key!r:.80}")
    check_keys(list(dict.fromkeys(wanted)))  # length and Unicode, each distinct key once
    return {"op": op, "keys": wanted, "namespace": namespace, "wanted": wanted}


def looks_like_ids(value: Any) -> bool:
    """True for an int, an integer array or a non-empty sequence of ints (bool excluded)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "iu"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return True
    if isinstance(value, (list, tuple)) and value:
        return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    return False


def id_list(ids: Any) -> list[int]:
    array = np.asarray(ids)
    if array.ndim == 0:
        array = array[None]
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise InvalidArgument(f"ids must be a 1-D sequence of integers, got dtype {array.dtype} shape {array.shape}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > MAX_ID:
        # [2**63] is a uint64 array, and astype(int64) wrapped it to -2**63 (issue 19).
        raise InvalidArgument(f"id {int(array.max())} does not fit in int64 (ids are below 2**63)")
    return array.astype(np.int64).tolist()
