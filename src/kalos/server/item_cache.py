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
import threading
import time
from typing import Any, Callable, Sequence

from kalos.ipc.control import encode_value
from kalos.validation import Item

__all__ = ["ItemCache", "item_fields"]

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
        """The JSON of each id's item (``encode_value(item_fields(item))``), aligned with ``ids``
        (distinct): None where the store holds no live item. ``check_floor`` is called, before
        any item is encoded, with a size their JSON cannot be under (what is cached, and the
        texts of the rest); it raises to refuse a reply that would be too large."""
        now = time.time()
        revision = self._store.revision  # (before the store is read: see the module's note)
        found, gone = self._cached(ids, revision, now)
        missing = [item_id for item_id in ids if item_id not in found and item_id not in gone]
        if not missing:
            check_floor(sum(map(len, found.values())))
            return [found.get(item_id) for item_id in ids]
        read = self._store.get(missing)
        if self._store.revision != revision:
            # A write committed between the look here and the end of the store's read: what
            # was read may be newer than ``revision`` (so it is not kept under it), and what was
            # found here older than what was read (so all of them come from the store, in one
            # read: one state, as the store's own get gives).
            if found:
                found, gone, missing = {}, set(), list(ids)
                read = self._store.get(missing)
            revision = None
        items = [item for item in read if item is not None]
        check_floor(sum(map(len, found.values())) + sum(len(item.text or "") for item in items))
        fresh = [(item.id, encode_value(item_fields(item)), item.expires_at) for item in items]
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
