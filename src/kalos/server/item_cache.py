"""The items of recent hits, kept as their replies encode them.

Why. A ``recall_text`` reply carries the items of its hits, and so does a ``get``: reading them
from the store and encoding them was about a fifth of the sidecar's work for a recall_text
(BENCHMARKS.md, text recall), and agents recall the same memories again and again. A hit found
here costs a dictionary lookup; its JSON is joined into the reply as it is.

Coherence. The store's :attr:`~kalos.store.sqlite.Store.revision` grows with every committed
write that changed rows already there; when it moved, the cache drops the items those writes
changed (:meth:`~kalos.store.sqlite.Store.changed_since`), or everything where the store cannot
tell. An item is kept only under the revision read before its read and still the store's after
it, and only while the cache has not moved past that revision; a reply that mixed what was held
here with what a read after a write returned is read again, all of it, from the store. A store
without a revision (None: a PostgreSQL store, whose rows other hosts change; a readonly or
closed one) is read every time and nothing is kept. An item past its expiry is absent here as
in the store's own read, whose live clause is the same. The cache holds at most ``max_bytes``
of JSON (least recently used first out).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any, Callable, Sequence

from kalos.errors import StoreError
from kalos.ipc.control import encode_value
from kalos.store.sqlite import ItemRow
from kalos.validation import Item

__all__ = ["ItemCache", "encode_item_row", "item_fields"]

# Accounted per entry beside its JSON: the ordered dictionary's node and slot, the key, the
# tuple, the bytes object's header, the expiry.
_ENTRY_OVERHEAD = 200

_ITEM_FIELDS = tuple(field.name for field in dataclasses.fields(Item) if field.name != "vector")


def item_fields(item: Item | None) -> dict[str, Any] | None:
    """An Item as a reply's JSON fields; its vector travels in the blob, never here (a client
    from before ``Item.vector`` builds ``Item(**fields)`` and knows no such field)."""
    if item is None:
        return None
    # A shallow copy: dataclasses.asdict deep-copies the metadata, which the reply only serialises.
    return {name: getattr(item, name) for name in _ITEM_FIELDS}


def encode_item_row(row: ItemRow) -> bytes:
    """The JSON of ``row``'s item in a reply: the value ``encode_value(item_fields(item))`` has,
    built from the row without an Item or a dictionary (a reply's items were most of the
    sidecar's own work for a recall_text that missed the cache). The metadata's JSON text goes
    in as stored once it parses as strict JSON (no NaN or Infinity, no number past a float's
    range), and the timestamps once they are finite numbers: a store that another tool wrote
    may hold anything, and a reply must still be JSON. What cannot be sent is a StoreError
    naming the item, as reading it through an Item and encode_value refused it."""
    try:
        return _encoded_row(row)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise StoreError(f"item {row.id}: a stored field cannot be sent ({type(exc).__name__}: {exc})") from None


def _encoded_row(row: ItemRow) -> bytes:
    item_id, namespace, text, metadata, created_at, key, updated_at, expires_at = row
    metadata_json = b"null"
    if metadata is not None:
        if isinstance(metadata, bytes):  # (a BLOB, as another tool may have bound it: read as json.loads reads bytes)
            metadata = metadata.decode(json.detect_encoding(metadata), "surrogatepass")
        try:
            value = _STRICT_JSON.decode(metadata)
        except ValueError as exc:
            raise StoreError(f"item {item_id}: its stored metadata is not JSON ({exc})") from None
        try:
            metadata_json = metadata.encode()
        except UnicodeEncodeError:  # (a lone surrogate in the text itself: escaped, as encode_value does)
            metadata_json = encode_value(value)
    return (b'{"id":%d,"namespace":%s,"text":%s,"metadata":%s,"created_at":%s,'
            b'"key":%s,"updated_at":%s,"expires_at":%s}') % (
        item_id, _json_string(namespace).encode(),
        b"null" if text is None else _json_string(text).encode(),
        metadata_json,
        _number(created_at, item_id, "created_at"),
        b"null" if key is None else _json_string(key).encode(),
        b"null" if updated_at is None else _number(updated_at, item_id, "updated_at"),
        b"null" if expires_at is None else _number(expires_at, item_id, "expires_at"))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(spelled: str) -> float:
    number = float(spelled)
    if not math.isfinite(number):
        raise ValueError(f"{spelled} is past a float's range")
    return number


#: JSON as encode_value writes it: no NaN or Infinity, no float literal past a float's range.
_STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _number(value: Any, item_id: int, field: str) -> bytes:
    """A stored timestamp as json spells a float (its repr)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise StoreError(f"item {item_id}: its stored {field} is not a finite number ({value!r})")
    return repr(number).encode()


class ItemCache:
    """The JSON of items by id, read through from ``store`` (a Store or a PostgresStore)."""

    def __init__(self, store: Any, max_bytes: int) -> None:
        self._store = store
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, tuple[bytes, float | None]] = collections.OrderedDict()
        self._bytes = 0
        self._revision: int | None = None
        self.hits = 0
        self.misses = 0

    def encoded(self, ids: Sequence[int], *, check_floor: Callable[[int], None]) -> list[bytes | None]:
        """The JSON of each id's item (:func:`encode_item_row`), aligned with ``ids`` (distinct):
        None where the store holds no live item. ``check_floor`` is called, before any item is
        encoded, with a size their JSON cannot be under (what is cached, and the texts of the
        rest); it raises to refuse a reply that would be too large."""
        now = time.time()
        revision = self._store.revision  # (before the store is read: see the module's note)
        found, gone = self._cached(ids, revision, now)
        missing = [item_id for item_id in ids if item_id not in found and item_id not in gone]
        if not missing:
            check_floor(sum(map(len, found.values())))
            return [found.get(item_id) for item_id in ids]
        read = self._store.get_rows(missing)
        if self._store.revision != revision:
            # A write committed between the look here and the end of the store's read: what
            # was read may be newer than ``revision`` (so it is not kept under it), and what was
            # found here older than what was read (so all of them come from the store, in one
            # read: one state, as the store's own get gives).
            if found:
                found, gone, missing = {}, set(), list(ids)
                read = self._store.get_rows(missing)
            revision = None
        rows = [row for row in read if row is not None]
        check_floor(sum(map(len, found.values())) + sum(len(row.text or "") for row in rows))
        # (The expiry as a float: the cache compares it with the clock, and the row's is the
        # store's value, which encode_item_row has just checked is a number.)
        fresh = [(row.id, encode_item_row(row), None if row.expires_at is None else float(row.expires_at))
                 for row in rows]
        found.update((item_id, body) for item_id, body, _ in fresh)
        with self._lock:
            self.misses += len(missing)
            if revision is not None and revision == self._revision:  # (no newer look moved it since)
                for item_id, body, expires_at in fresh:
                    self._keep(item_id, body, expires_at)
        return [found.get(item_id) for item_id in ids]

    def _cached(self, ids: Sequence[int], revision: int | None, now: float) -> tuple[dict[int, bytes], set[int]]:
        """The JSON of those ``ids`` held here and still valid at the store's ``revision``, and
        the ids held here that have expired since (absent, as the store's read would say)."""
        found: dict[int, bytes] = {}
        gone: set[int] = set()
        with self._lock:
            if revision is None or (self._revision is not None and revision < self._revision):
                # (No revision: nothing may be kept. An older one: this caller read it before a
                # newer look emptied the cache; what is held now is newer than its look.)
                return found, gone
            if revision != self._revision:
                changed = None if self._revision is None else self._store.changed_since(self._revision)
                if changed is None or len(changed) > len(self._entries):
                    self._entries.clear()
                    self._bytes = 0
                else:
                    for item_id in changed:
                        self._drop(item_id)
                self._revision = revision
            for item_id in ids:
                entry = self._entries.get(item_id)
                if entry is None:
                    continue
                if entry[1] is not None and entry[1] <= now:  # (the store's live clause: expires_at > now)
                    self._drop(item_id)
                    gone.add(item_id)
                    continue
                self._entries.move_to_end(item_id)
                found[item_id] = entry[0]
            self.hits += len(found)
        return found, gone

    def stats(self) -> dict[str, int]:
        """Entries, bytes held, and the hits and misses so far (ids looked up)."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses}

    def _keep(self, item_id: int, body: bytes, expires_at: float | None) -> None:
        size = len(body) + _ENTRY_OVERHEAD
        if size > self.max_bytes // 8:  # (one large item must not push out everything else)
            return
        self._drop(item_id)
        self._entries[item_id] = (body, expires_at)
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, item_id: int) -> None:
        entry = self._entries.pop(item_id, None)
        if entry is not None:
            self._bytes -= len(entry[0]) + _ENTRY_OVERHEAD
