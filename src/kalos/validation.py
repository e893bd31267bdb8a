"""The input checks every side shares: the client applies them before anything travels, the
sidecar and both stores (SQLite and PostgreSQL) apply them again, so that bad input gets the same
error that names the problem wherever it enters, and changes nothing.

Here too the values those checks produce and accept: :class:`Item` (one memory as ``get``
returns it), :class:`Update` (one checked update) and :data:`UNSET` (not given), and the limits
(namespace and key lengths, list pages).
"""
from __future__ import annotations

import json
import math
import numbers
import time
import unicodedata
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kalos.errors import DimensionMismatch, InvalidArgument, KalosError

__all__ = [
    "DEFAULT_NAMESPACE",
    "MAX_NAMESPACE_BYTES",
    "MAX_KEY_BYTES",
    "MAX_LIST_LIMIT",
    "Item",
    "UNSET",
    "Update",
    "check_vectors",
    "bad_vector_rows",
    "check_namespace",
    "check_texts",
    "encode_metadata",
    "check_add",
    "check_created_at",
    "check_keys",
    "check_update",
    "check_ttl",
    "check_ttl_seconds",
    "check_request_id",
    "check_embed_texts",
    "normalise_rows",
    "row_scales",
]

#: How far a stored vector's squared norm may be from 1. Every writer stores unit rows (the
#: sidecar normalises in float64 and rounds to float32: ~1e-7 off); a flipped bit is far out.
UNIT_NORM_TOLERANCE = 1e-3
_REQUEST_ID_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_")

DEFAULT_NAMESPACE = "default"


MAX_NAMESPACE_BYTES = 255  # the slot's field holds 256 (kalos.ipc.protocol.NAMESPACE_BYTES)


MAX_KEY_BYTES = 256


MAX_ID = (1 << 63) - 1


@dataclass(frozen=True)
class Item:
    """One memory as :meth:`Store.get` returns it (without its vector: see :meth:`Store.vectors`)."""

    id: int
    namespace: str
    text: str | None
    metadata: dict | None
    created_at: float
    # Defaults, so that every Item(...) built before keys existed still builds.
    key: str | None = None  # the caller's id, when the item was added with one
    updated_at: float | None = None  # unix seconds of the last upsert that replaced it; None: never revised
    expires_at: float | None = None  # unix seconds after which it is gone (an add's ttl); None: never
    # Only from Client.get(..., with_vectors=True): the stored, normalised float32 vector.
    vector: Any = field(default=None, compare=False, repr=False)


class _Unset:
    """The type of :data:`UNSET`."""

    _instance: "_Unset | None" = None

    def __new__(cls) -> "_Unset":  # one instance, so ``is UNSET`` holds after a copy or pickle too
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


#: "Not given" for :meth:`Store.update` and ``Client.update`` (None is a value there: no text,
#: no metadata).
UNSET: Any = _Unset()


@dataclass(frozen=True)
class Update:
    """One checked update: which item (by ``key`` in ``namespace``, or by ``id``) and what to set.

    ``text``/``metadata`` are UNSET when not given; ``metadata`` is a dict or None, merged into
    the stored one when ``merge``; ``vector`` is float32 ``[dim]`` or None (not given); ``ttl``
    is UNSET (the expiry kept), None (never expires) or seconds > 0 from the update's commit.
    """

    key: str | None
    id: int | None
    namespace: str
    text: Any
    metadata: Any
    vector: np.ndarray | None
    merge: bool
    ttl: Any = UNSET

    def describe(self) -> str:
        return f"key {self.key!r} in namespace {self.namespace!r}" if self.key is not None else f"id {self.id}"


def check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or int(dim) < 1:
        raise InvalidArgument(f"dim must be an integer >= 1, got {dim!r}")
    return int(dim)


def check_namespace(namespace: Any) -> str:
    """``namespace`` if it is a valid namespace name, else InvalidArgument saying why."""
    if not isinstance(namespace, str):
        raise InvalidArgument(f"namespace must be a str, got {type(namespace).__name__}")
    if not namespace:
        raise InvalidArgument("namespace must not be empty")
    try:
        size = len(namespace.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"namespace {namespace!r} is not valid Unicode (lone surrogate)") from None
    if size > MAX_NAMESPACE_BYTES:
        raise InvalidArgument(
            f"namespace {namespace[:20]!r}... is {size} UTF-8 bytes; the limit is {MAX_NAMESPACE_BYTES}"
        )
    for ch in namespace:
        # "Cc" is C0, DEL and C1: NUL and everything that would garble a log line or a slot.
        # "Cf" holds the bidi controls (U+202A-202E, U+2066-2069, U+200E/F, U+061C) and the
        # invisible characters (U+200B, U+2060, U+FEFF): a name shown in a log or a listing must
        # read as what it is, so "evil\u202egpj" cannot pose as "evilj pg" (issue 19). "Zl"/"Zp"
        # are the line and paragraph separators.
        category = unicodedata.category(ch)
        if category in ("Cc", "Cf", "Zl", "Zp"):
            kind = "control" if category == "Cc" else "invisible or bidi control" if category == "Cf" else "line separator"
            raise InvalidArgument(
                f"namespace {namespace!r} contains {kind} character U+{ord(ch):04X} ({unicodedata.name(ch, 'unnamed')})"
            )
    return namespace


def check_json_keys(value: Any, index: int) -> None:
    # json.dumps turns int/float/bool/None keys into strings without complaint, so such a dict
    # would come back different from what was stored; refuse it instead of changing it.
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, sub in v.items():
                if not isinstance(k, str):
                    raise InvalidArgument(f"metadata[{index}]: key {k!r} is not a str (JSON keys are strings)")
                stack.append(sub)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def encode_metadata(metadata: Sequence[dict | None] | None, n: int) -> list[str | None]:
    """The JSON text of each of the ``n`` metadata entries (None stays None), or InvalidArgument."""
    if metadata is None:
        return [None] * n
    if isinstance(metadata, (str, bytes, Mapping, AbstractSet)) or not hasattr(metadata, "__len__"):
        raise InvalidArgument(f"metadata must be a sequence of n={n} dicts or None, got {type(metadata).__name__}")
    if len(metadata) != n:
        raise InvalidArgument(f"metadata has {len(metadata)} entries for {n} vectors")
    out: list[str | None] = []
    for i, m in enumerate(metadata):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, dict):
            raise InvalidArgument(f"metadata[{i}] must be a dict or None, got {type(m).__name__}")
        check_json_keys(m, i)
        try:
            out.append(json.dumps(m, allow_nan=False, ensure_ascii=False, separators=(",", ":")))
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidArgument(f"metadata[{i}] is not JSON-serialisable: {e}") from None
        try:
            out[-1].encode("utf-8")  # type: ignore[union-attr]
        except UnicodeEncodeError:
            raise InvalidArgument(f"metadata[{i}] contains a lone surrogate (not valid Unicode)") from None
    return out


def check_texts(texts: Sequence[str | None] | None, n: int) -> list[str | None]:
    """``n`` texts (str or None) as a list, or InvalidArgument naming the bad entry."""
    if texts is None:
        return [None] * n
    # A str is a Sequence too: texts="abc" with three vectors would silently store "a", "b", "c".
    # A set pairs its texts with the vectors in hash order and a dict stores its keys: neither
    # has the vectors' order, so both are refused (issue 19).
    if isinstance(texts, (str, bytes, AbstractSet, Mapping)) or not hasattr(texts, "__len__"):
        raise InvalidArgument(
            f"texts must be an ordered sequence (list, tuple, array) of n={n} str or None, got {type(texts).__name__}"
        )
    if len(texts) != n:
        raise InvalidArgument(f"texts has {len(texts)} entries for {n} vectors")
    out: list[str | None] = []
    for i, t in enumerate(texts):
        if t is not None and not isinstance(t, str):
            raise InvalidArgument(f"texts[{i}] must be a str or None, got {type(t).__name__}")
        if t is not None:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(f"texts[{i}] contains a lone surrogate (not valid Unicode)") from None
        out.append(t)
    return out


def check_vectors(vectors: Any, dim: int) -> np.ndarray:
    """``vectors`` as C-contiguous little-endian float32 ``[n >= 1, dim]``: finite, no zero row."""
    try:
        v = np.asarray(vectors)
    except (ValueError, TypeError) as e:  # ragged nested lists and the like
        raise InvalidArgument(f"vectors is not an array of numbers: {e}") from None
    if v.dtype.kind not in "iuf":
        raise InvalidArgument(f"vectors must be numeric (float32-convertible), got dtype {v.dtype}")
    if v.ndim != 2:
        hint = " (one vector: pass v[None, :])" if v.ndim == 1 else ""
        raise InvalidArgument(f"vectors must be 2-D [n, {dim}], got shape {v.shape}{hint}")
    if v.shape[1] != dim:
        raise DimensionMismatch(f"vectors have dimension {v.shape[1]}, the store's dimension is {dim}")
    if v.shape[0] == 0:
        raise InvalidArgument("add needs at least one vector, got 0")
    # Little-endian float32, C order: these bytes are the blob. float64 values beyond float32's
    # range become inf here, which the finiteness check below then reports.
    with np.errstate(over="ignore"):
        v = np.ascontiguousarray(v, dtype="<f4")
    finite = np.isfinite(v).all(axis=1)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise InvalidArgument(f"vectors[{i}] contains NaN or inf")
    nonzero = (v != 0).any(axis=1)
    if not nonzero.all():
        i = int(np.flatnonzero(~nonzero)[0])
        raise InvalidArgument(f"vectors[{i}] is all zeros (it has no direction)")
    return v


def check_created_at(created_at: Any, n: int) -> np.ndarray:
    """float64[n] unix seconds from a scalar, an array of n, or None (now); all finite."""
    if created_at is None:
        return np.full(n, time.time(), dtype=np.float64)
    try:
        c = np.asarray(created_at)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"created_at is not a number or an array of numbers: {e}") from None
    if c.dtype.kind not in "iuf":
        raise InvalidArgument(f"created_at must be unix seconds (a number), got dtype {c.dtype}")
    if c.ndim == 0:
        c = np.full(n, c, dtype=np.float64)
    elif c.shape != (n,):
        raise InvalidArgument(f"created_at must be a scalar or have shape ({n},), got {c.shape}")
    c = np.array(c, dtype=np.float64)  # a copy: the caller's array is not handed back to them
    bad = ~np.isfinite(c)
    if bad.any():
        raise InvalidArgument(f"created_at[{int(np.flatnonzero(bad)[0])}] is not finite")
    return c


def check_add(
    vectors: Any, dim: int, namespace: Any, texts: Any, metadata: Any, created_at: Any,
) -> tuple[np.ndarray, str, list[str | None], list[str | None], np.ndarray]:
    """Every column of one add, checked: ``(vectors, namespace, texts, metadata JSON, created_at)``.

    What every store's ``add`` checks before it writes anything.
    """
    vecs = check_vectors(vectors, dim)
    n = len(vecs)
    return (vecs, check_namespace(namespace), check_texts(texts, n), encode_metadata(metadata, n),
            check_created_at(created_at, n))


def check_ttl(ttl: Any, n: int) -> np.ndarray | None:
    """An add's ``ttl`` as float64 seconds ``[n]`` (NaN: never expires), or None when nothing
    expires: a number of seconds for every row, or a sequence of n numbers or None. Each must be
    finite and > 0 (InvalidArgument naming the bad entry)."""
    if ttl is None:
        return None
    if isinstance(ttl, (str, bytes, Mapping, AbstractSet)):
        raise InvalidArgument(f"ttl must be seconds (a number) or a sequence of n={n} numbers or None, "
                              f"got {type(ttl).__name__}")
    scalar = not hasattr(ttl, "__len__")
    values = [ttl] * n if scalar else list(ttl)
    if len(values) != n:
        raise InvalidArgument(f"ttl has {len(values)} entries for {n} vectors")
    out = np.full(n, np.nan)
    for i, value in enumerate(values):
        if value is None and not scalar:
            continue
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
            where = "ttl" if scalar else f"ttl[{i}]"
            raise InvalidArgument(f"{where} must be seconds (a number), got {type(value).__name__} {value!r:.80}")
        try:
            seconds = float(value)
        except OverflowError:  # an int past float's range
            seconds = math.inf
        if not (math.isfinite(seconds) and seconds > 0):
            where = "ttl" if scalar else f"ttl[{i}]"
            raise InvalidArgument(f"{where} must be a finite number of seconds > 0, got {value!r:.80}")
        out[i] = seconds
    return None if np.isnan(out).all() else out


def check_ttl_seconds(ttl: Any) -> float:
    """One ttl (of an update or a renewal) as float seconds: finite and > 0 (InvalidArgument)."""
    if ttl is None or hasattr(ttl, "__len__"):
        raise InvalidArgument(f"ttl must be seconds (a number), got {type(ttl).__name__}")
    return float(check_ttl(ttl, 1)[0])  # type: ignore[index]


def expiry_column(expires_at: Any, n: int) -> list[float | None]:
    """The expires_at column of an add: unix seconds or None (NaN means never, as check_ttl)."""
    if expires_at is None:
        return [None] * n
    e = np.asarray(expires_at, dtype=np.float64)
    if e.shape != (n,):
        raise InvalidArgument(f"expires_at must have shape ({n},), got {e.shape}")
    if np.isinf(e).any():
        raise InvalidArgument("expires_at must be finite (NaN: never)")
    return [None if math.isnan(x) else x for x in e.tolist()]


def check_keys(keys: Any, n: int | None = None) -> list[str]:
    """``keys`` as a list of distinct str of 1 to MAX_KEY_BYTES UTF-8 bytes (``n`` of them when
    given), or InvalidArgument naming the bad key: before anything is written."""
    if isinstance(keys, (str, bytes, AbstractSet, Mapping)) or not hasattr(keys, "__len__"):
        # A str is a sequence of one-letter keys; a set or dict has no order to pair with the vectors.
        raise InvalidArgument(f"keys must be an ordered sequence (list, tuple) of str, got {type(keys).__name__}")
    if n is not None and len(keys) != n:
        raise InvalidArgument(f"keys has {len(keys)} entries for {n} vectors")
    out: list[str] = []
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            raise InvalidArgument(f"keys[{i}] must be a str, got {type(key).__name__} {key!r:.80}")
        if not key:
            raise InvalidArgument(f"keys[{i}] is empty; a key is 1 to {MAX_KEY_BYTES} UTF-8 bytes")
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(f"keys[{i}] {key!r:.80} is not valid Unicode (lone surrogate)") from None
        if size > MAX_KEY_BYTES:
            raise InvalidArgument(f"keys[{i}] {key[:40]!r}... is {size} UTF-8 bytes; the limit is {MAX_KEY_BYTES}")
        if key in seen:
            raise InvalidArgument(f"key {key!r} appears twice in one call (keys[{seen[key]}] and keys[{i}])")
        seen[key] = i
        out.append(key)
    return out


def check_update(item: Any, dim: int, *, namespace: Any = DEFAULT_NAMESPACE, text: Any = UNSET,
                 metadata: Any = UNSET, vector: Any = UNSET, merge: Any = False, ttl: Any = UNSET) -> Update:
    """An update's arguments checked (InvalidArgument naming the bad one) before anything is written.

    ``item`` is a key (str, looked up in ``namespace``) or an item id (int, global like get's
    ids). At least one of text, metadata, vector, ttl must be given; None clears text or
    metadata (or, for ttl, the expiry: the memory never expires), a vector cannot be cleared.
    ``merge=True`` merges ``metadata`` (a dict) into the stored one. ``ttl``: seconds from the
    update, as an add's.
    """
    if not isinstance(merge, bool):
        raise InvalidArgument(f"merge must be True or False, got {merge!r:.80}")
    key = item_id = None
    if isinstance(item, str):
        key = check_keys([item])[0]
        namespace = check_namespace(namespace)
    elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
        if not 0 <= int(item) <= MAX_ID:
            raise InvalidArgument(f"update: id {int(item)} is not an item id (0 to 2**63 - 1)")
        item_id = int(item)
        namespace = check_namespace(namespace)  # checked although an id is global: a typo still says so
    else:
        raise InvalidArgument(f"update takes a key (str) or an id (int), got {type(item).__name__} {item!r:.80}")
    if text is UNSET and metadata is UNSET and vector is UNSET and ttl is UNSET:
        raise InvalidArgument("update: nothing to change; give text=, metadata=, vector= or ttl=")
    if ttl is not UNSET and ttl is not None:
        ttl = check_ttl_seconds(ttl)
    if text is not UNSET:
        text = check_texts([text], 1)[0]
    if metadata is not UNSET:
        if merge and not isinstance(metadata, dict):
            raise InvalidArgument(
                f"update: merge=True merges a dict into the stored metadata, got {type(metadata).__name__}")
        encode_metadata([metadata], 1)  # JSON-serialisable, str keys, valid Unicode
    elif merge:
        raise InvalidArgument("update: merge=True needs metadata= (the dict to merge)")
    unit = None
    if vector is not UNSET:
        if vector is None:
            raise InvalidArgument("update: vector=None; a memory always has a vector (leave vector out to keep it)")
        v = np.asarray(vector) if not isinstance(vector, np.ndarray) else vector
        unit = check_vectors(v[None, :] if getattr(v, "ndim", 0) == 1 else v, dim)
        if len(unit) != 1:
            raise InvalidArgument(f"update takes one vector of shape ({dim},), got {len(unit)} rows")
        unit = unit[0]
    return Update(key, item_id, namespace, text, metadata, unit, merge, ttl)


#: The most items one page of :meth:`Store.list_items` (and ``Client.list``) holds.
MAX_LIST_LIMIT = 1000


def check_list_args(namespace: Any, limit: Any, after: Any) -> tuple[str | None, int, int]:
    ns = None if namespace is None else check_namespace(namespace)
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidArgument(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r:.80}")
    if isinstance(after, bool) or not isinstance(after, (int, np.integer)) or not 0 <= after <= MAX_ID:
        raise InvalidArgument(f"after must be an item id (an integer >= 0), got {after!r:.80}")
    return ns, int(limit), int(after)


def keys_for_lookup(keys: Any) -> list[str]:
    """Keys of a get or delete: checked like an add's, repeats allowed (each is looked up once)."""
    if isinstance(keys, (str, bytes, Mapping)) or not hasattr(keys, "__len__"):
        raise InvalidArgument(f"keys must be a sequence of str, got {type(keys).__name__}")
    keys = list(keys)
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            raise InvalidArgument(f"keys[{i}] must be a str, got {type(key).__name__} {key!r:.80}")
    check_keys(list(dict.fromkeys(keys)))  # length and Unicode of each distinct key
    return keys


def check_ids(ids: Any, what: str) -> np.ndarray:
    if isinstance(ids, (str, bytes)):
        raise InvalidArgument(f"{what} ids must be a sequence of ints, got {type(ids).__name__}")
    try:
        a = np.asarray(ids)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"{what} ids are not a sequence of ints: {e}") from None
    if a.ndim != 1:
        raise InvalidArgument(f"{what} ids must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.dtype.kind == "O":  # Python ints beyond int64 land here
        raise InvalidArgument(f"{what} ids must be int64 integers, got {ids!r:.80}")
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} ids must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.max() > MAX_ID:
        raise InvalidArgument(f"{what} id {int(a.max())} does not fit in int64")
    return a.astype(np.int64)


def bad_vector_rows(vectors: np.ndarray) -> np.ndarray:
    """Indices of the rows that are not finite unit vectors (within UNIT_NORM_TOLERANCE).

    One flipped exponent bit made a row the top-1 of half of all recalls (score 4e36) and a NaN
    component put a row into every answer (issue 19): such rows must never reach an engine.
    """
    # In float32 (a fraction of the float64 cost at load):
    # its rounding (~1e-6) is far inside the tolerance, and what overflows it is damage anyway.
    with np.errstate(over="ignore", invalid="ignore"):
        squared = np.einsum("ij,ij->i", vectors, vectors)
    bad = ~np.isfinite(squared) | (np.abs(squared - 1.0) > UNIT_NORM_TOLERANCE)
    return np.flatnonzero(bad)


def check_request_id(request_id: Any) -> str | None:
    """``request_id`` if it is None or 1-64 characters of [A-Za-z0-9_-], else InvalidArgument."""
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= 64 or not set(request_id) <= _REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id must be 1-64 characters of letters, digits, '-', '_', got {request_id!r:.80}")
    return request_id


def normalise_rows(rows: np.ndarray, *, what: str, error: type[KalosError]) -> np.ndarray:
    """Rows scaled to unit norm in place; ``error`` names the first NaN/inf or zero row."""
    rows *= row_scales(rows, what=what, error=error)[:, None]
    return rows


def row_scales(rows: np.ndarray, *, what: str, error: type[KalosError]) -> np.ndarray:
    """``1 / |row|`` per row, in float64; ``error`` names the first NaN/inf or zero row.

    ``rows * scales[:, None]`` rounded to float32 is the unit row, whether NumPy computes it
    on the host or a GPU kernel does it while copying the query (``search_attached``). A batch
    normalised on the GPU sums the squares in another order: its scale may differ in the last
    bit of the float64, so the unit row, rarely, in the last bit of a float32.
    """
    if len(rows) == 1:  # the common single query: one float64 dot product, Python floats
        row = rows[0].astype(np.float64)  # float64 as the batch's einsum: the same scale alone or batched
        squared1 = float(np.dot(row, row))
        if math.isfinite(squared1) and squared1 > 0:
            return np.array([1.0 / math.sqrt(squared1)])
        squared = np.array([squared1])
    else:
        squared = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
    if not (np.isfinite(squared).all() and squared.min() > 0):
        # Slow path, also for float32 overflow/underflow of the fast sum: decide in float64.
        with np.errstate(over="ignore", invalid="ignore"):
            squared = np.einsum("ij,ij->i", rows.astype(np.float64), rows.astype(np.float64))
        bad = ~np.isfinite(squared) | (squared <= 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            reason = "contains NaN or infinity" if not np.all(np.isfinite(rows[row])) else "is all zeros"
            raise error(f"{what} {row} {reason}; it has no direction to compare by cosine")
    # The scale stays float64: for a norm below float32's smallest normal its reciprocal
    # would overflow float32.
    return 1.0 / np.sqrt(squared)


def check_embed_texts(texts: Any) -> list[str]:
    """Texts to embed as a list of non-empty str (a lone str is refused: wrap it in a list)."""
    if isinstance(texts, str):
        raise InvalidArgument("embed takes a sequence of strings; wrap a single text in a list")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidArgument(f"texts[{i}] must be a str, got {type(t).__name__}")
        if not t.strip():
            raise InvalidArgument(f"texts[{i}] is empty: an empty text has no meaning to embed")
    return texts
