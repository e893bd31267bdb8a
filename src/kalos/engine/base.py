"""The search-engine interface and the row bookkeeping every backend shares.

An engine holds one row per memory: the unit vector plus the columns the scan filters on
(namespace id, created_at, live flag). Rows are an implementation detail; everything that
crosses the interface is a store id (int64). Deleting marks a row dead (a tombstone) and the
scan skips it; once tombstones pass a quarter of the rows, :meth:`Engine.compact` squeezes
them out with one pass. Capacity doubles when full, so adding n items costs O(n) amortised.

Results: ``ids[Q, k]`` and ``scores[Q, k]``, best first. Where fewer than k rows pass the
filters, the tail is padded with id ``-1`` and score ``-inf`` (FAISS's convention).
"""
from __future__ import annotations

import collections
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from kalos.errors import InvalidArgument, InvalidQuery
from kalos.where import MetaColumns, Where

__all__ = ["Engine", "Filter", "MISSING_ID", "NAMESPACE_DTYPE", "RowTable"]

MISSING_ID = -1
#: A row's namespace id (``RowTable.namespaces``): its range is the namespace ids an engine holds.
NAMESPACE_DTYPE = np.int32
_COMPACT_FRACTION = 0.25
_COMPACT_MIN_TOMBSTONES = 1024
#: The masks a RowTable keeps made (one per filter, the oldest dropped first): a crowd of
#: agents each in a namespace of its own asks with that many filters in turn.
MASKS_KEPT = 64


@dataclass(frozen=True)
class Filter:
    """Which rows a search may return: one namespace (None: all), created_at in [since, until),
    and metadata passing ``where`` (None: any; :mod:`kalos.where`)."""

    namespace: int | None = None
    since: float | None = None
    until: float | None = None
    where: Where | None = None

    @property
    def is_trivial(self) -> bool:
        return self.namespace is None and self.since is None and self.until is None and self.where is None


class RowTable:
    """Host-side columns of an engine's rows: id, namespace, created_at, live, the metadata
    index that ``where`` filters read (:class:`~kalos.where.MetaColumns`); id -> row map."""

    def __init__(self, capacity: int = 1024) -> None:
        capacity = max(1, capacity)
        self.ids = np.full(capacity, MISSING_ID, dtype=np.int64)
        self.namespaces = np.zeros(capacity, dtype=NAMESPACE_DTYPE)
        self.created_at = np.zeros(capacity, dtype=np.float64)
        self.live = np.zeros(capacity, dtype=bool)
        self.meta = MetaColumns(capacity)
        self.size = 0  # rows in use, tombstones included
        self.live_count = 0
        self._row_of: dict[int, int] = {}
        self._masks: dict[Filter, np.ndarray] = {}
        #: Counts the changes that made the masks made so far stale (an engine's caches of
        #: what it derived from masks compare it).
        self.mask_generation = 0
        # A filter without its namespace condition, made once: simplify() runs on every pass.
        self._without_namespace: dict[Filter, Filter] = {}
        # Live rows per namespace id: a filter on a namespace that holds every live row is
        # no filter at all, and engines skip the mask for it.
        self.namespace_live: collections.Counter[int] = collections.Counter()

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def _masks_stale(self) -> None:
        self._masks.clear()
        self.mask_generation += 1

    @property
    def tombstones(self) -> int:
        return self.size - self.live_count

    def __contains__(self, item_id: int) -> bool:
        return int(item_id) in self._row_of

    def capacity_for(self, extra: int) -> int | None:
        """The new capacity if ``extra`` more rows do not fit, else None (doubling growth)."""
        needed = self.size + extra
        if needed <= self.capacity:
            return None
        return max(needed, 2 * self.capacity)

    def resize(self, capacity: int) -> None:
        for name in ("ids", "namespaces", "created_at", "live"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype) if name != "ids" else np.full(capacity, MISSING_ID, np.int64)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self.meta.resize(capacity)

    def check_new_ids(self, ids: np.ndarray) -> None:
        if len(np.unique(ids)) != len(ids):
            raise InvalidArgument("duplicate ids in one add")
        row_of = self._row_of
        clash = [i for i in ids.tolist() if i in row_of]
        if clash:
            raise InvalidArgument(f"{len(clash)} ids already present, e.g. {clash[:5]}")

    def append(self, ids: np.ndarray, namespaces: np.ndarray, created_at: np.ndarray,
               metadata: Sequence[Mapping[str, Any] | None] | None = None) -> slice:
        start, stop = self.size, self.size + len(ids)
        self.ids[start:stop] = ids
        self.namespaces[start:stop] = namespaces
        self.created_at[start:stop] = created_at
        self.live[start:stop] = True
        self.meta.write(slice(start, stop), metadata if metadata is not None else [None] * len(ids))
        self._row_of.update(zip(ids.tolist(), range(start, stop)))
        self.size = stop
        self.live_count += len(ids)
        values, counts = np.unique(namespaces, return_counts=True)
        self.namespace_live.update(dict(zip(values.tolist(), counts.tolist())))
        self._masks_stale()
        return slice(start, stop)

    def tombstone(self, ids: np.ndarray) -> np.ndarray:
        """Marks the live rows of ``ids`` dead; returns their row numbers (unknown ids ignored)."""
        rows = [self._row_of.pop(int(i)) for i in ids if int(i) in self._row_of]
        rows_arr = np.asarray(rows, dtype=np.int64)
        self.live[rows_arr] = False
        self.live_count -= len(rows_arr)
        values, counts = np.unique(self.namespaces[rows_arr], return_counts=True)
        self.namespace_live.subtract(dict(zip(values.tolist(), counts.tolist())))
        if len(rows_arr):
            self._masks_stale()
        return rows_arr

    def set_metadata(self, ids: np.ndarray, metadata: Sequence[Mapping[str, Any] | None]) -> int:
        """Replaces the indexed metadata of the live rows of ``ids`` (unknown ids ignored);
        returns how many rows changed."""
        if len(ids) != len(metadata):
            raise InvalidArgument(f"{len(metadata)} metadata entries for {len(ids)} ids")
        row_of = self._row_of
        pairs = [(row_of[int(i)], m) for i, m in zip(ids, metadata) if int(i) in row_of]
        if pairs:
            self.meta.write([r for r, _ in pairs], [m for _, m in pairs])
            self._masks_stale()
        return len(pairs)

    def simplify(self, flt: Filter) -> Filter:
        """``flt`` without a namespace condition that every live row meets (nor a ``{}`` where)."""
        if flt.where is not None and flt.where.is_trivial:
            flt = dataclasses.replace(flt, where=None)
        if flt.namespace is not None and self.namespace_live[flt.namespace] == self.live_count:
            plain = self._without_namespace.get(flt)
            if plain is None:
                if len(self._without_namespace) >= 1024:  # clients sweeping time windows
                    self._without_namespace.clear()
                plain = self._without_namespace[flt] = dataclasses.replace(flt, namespace=None)
            return plain
        return flt

    def should_compact(self) -> bool:
        dead = self.tombstones
        return dead >= _COMPACT_MIN_TOMBSTONES and dead > _COMPACT_FRACTION * self.size

    def compact(self) -> np.ndarray:
        """Drops dead rows, keeping order; returns the old row number of each kept row."""
        keep = np.flatnonzero(self.live[: self.size])
        n = len(keep)
        for name in ("ids", "namespaces", "created_at", "live"):
            column = getattr(self, name)
            column[:n] = column[keep]
        self.ids[n : self.size] = MISSING_ID
        self.live[n : self.size] = False
        self.meta.compact(keep)
        self.size = n
        self._row_of = dict(zip(self.ids[:n].tolist(), range(n)))
        self._masks_stale()
        return keep

    def mask(self, flt: Filter) -> np.ndarray | None:
        """Rows (of ``size``) a search under ``flt`` may return, or None when all rows may."""
        if flt.is_trivial and self.live_count == self.size:
            return None
        cached = self._masks.get(flt)
        if cached is not None:
            return cached
        n = self.size
        mask = self.live[:n].copy()
        if flt.namespace is not None:
            mask &= self.namespaces[:n] == flt.namespace
        if flt.since is not None:
            mask &= self.created_at[:n] >= flt.since
        if flt.until is not None:
            mask &= self.created_at[:n] < flt.until
        if flt.where is not None:
            mask &= flt.where.mask(self.meta, n)
        if len(self._masks) >= MASKS_KEPT:  # many time windows or where clauses: drop the oldest
            del self._masks[next(iter(self._masks))]
        self._masks[flt] = mask
        return mask

    def ids_where(self, flt: Filter) -> np.ndarray:
        """The ids of the live rows that pass ``flt`` (row order)."""
        n = self.size
        mask = self.mask(flt)
        return self.ids[:n][mask] if mask is not None else self.ids[:n][self.live[:n]]

    def ids_of_rows(self, rows: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """Store ids of ``rows``; MISSING_ID where the score is -inf (sorted: only in the tail)."""
        ids = self.ids[rows]
        if scores[:, -1].min() == -np.inf:
            ids[scores == -np.inf] = MISSING_ID
        return ids


class Engine(ABC):
    """Exact (or declared-approximate) top-k cosine search over unit vectors.

    Callers (the sidecar) validate and normalise vectors before they reach an engine; the
    engine still checks shapes, so a misuse fails loudly instead of corrupting rows.
    Engines are not thread-safe: the sidecar serialises calls.
    """

    #: "cpu" for NumPy, "cuda:0" or "cpu" (PyTorch's CPU device) for the GPU engine.
    device: str = "cpu"
    #: A short name for stats and benchmarks.
    name: str = "engine"

    # What an engine can do beyond this interface, declared by the class and checked once by
    # its user, never probed with getattr (LangGraph's BaseStore declares supports_ttl so).
    #: ``search_start(queries, k, flt) -> waiter``: a search queued now, its answer awaited later
    #: (the shards of :class:`~kalos.engine.sharded.ShardedEngine` scan at the same time).
    supports_search_start: bool = False
    #: ``attach_host(buffer)``, ``detach_host()``, ``search_attached(...)`` and its queued form
    #: ``search_attached_start(...)``: queries read and answers written in place in a host
    #: buffer (the sidecar's segment: zero copy); ``attach_places(...)`` and
    #: ``search_places_start(places, k, flt, namespaces=None)``: single queries at places of it
    #: declared once (each in a namespace of its own where ``namespaces`` says so).
    supports_attached_host: bool = False
    #: ``bind_stream()``, ``unbind_stream()``: the calling thread's GPU work on the engine's stream.
    supports_streams: bool = False
    #: A kernel may serve the slots itself (:mod:`kalos.engine.gpu.slot_server`, ``--gpu-polling``).
    supports_gpu_polling: bool = False
    #: Largest k a search may ask for (None: no limit of the engine's own).
    max_k: int | None = None

    def __init__(self, dim: int, *, capacity: int = 1024) -> None:
        if dim < 1:
            raise InvalidArgument(f"dimension must be >= 1, got {dim}")
        self.dim = dim
        self.rows = RowTable(capacity)

    # -- the interface -----------------------------------------------------------------

    def __len__(self) -> int:
        return self.rows.live_count

    def __contains__(self, item_id: int) -> bool:
        return item_id in self.rows

    @property
    def capacity(self) -> int:
        return self.rows.capacity

    @property
    def tombstones(self) -> int:
        return self.rows.tombstones

    def add(self, ids: np.ndarray, vectors: np.ndarray, namespaces: np.ndarray, created_at: np.ndarray,
            metadata: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        """Appends rows. ``vectors`` must already be unit-norm float32 ``[n, dim]``; ``metadata``
        (one dict or None per row; None: none) is indexed for ``where`` filters."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (n, self.dim):
            raise InvalidArgument(f"expected vectors of shape ({n}, {self.dim}), got {vectors.shape}")
        if metadata is not None and len(metadata) != n:
            raise InvalidArgument(f"{len(metadata)} metadata entries for {n} rows")
        namespaces = np.broadcast_to(np.asarray(namespaces, dtype=NAMESPACE_DTYPE), (n,))
        created_at = np.broadcast_to(np.asarray(created_at, dtype=np.float64), (n,))
        if n == 0:
            return
        self.rows.check_new_ids(ids)
        new_capacity = self.rows.capacity_for(n)
        if new_capacity is not None:
            self._resize(new_capacity)
            self.rows.resize(new_capacity)
        rows = self.rows.append(ids, namespaces, created_at, metadata)
        self._write(rows, vectors)

    def set_metadata(self, ids: np.ndarray, metadata: Sequence[Mapping[str, Any] | None]) -> int:
        """Replaces the metadata ``where`` filters see for the rows of ``ids`` (ids this engine
        does not hold are ignored); returns how many rows it holds of them."""
        return self.rows.set_metadata(np.asarray(ids, dtype=np.int64).reshape(-1), metadata)

    def ids_where(self, flt: Filter) -> np.ndarray:
        """Ids of the live rows that pass ``flt`` (namespace, time, where): count / scoped delete."""
        return self.rows.ids_where(self.rows.simplify(flt))

    def has_room(self, extra: int) -> bool:
        """Whether ``extra`` more rows fit as the engine is (:meth:`reserve` would change nothing)."""
        return self.rows.capacity_for(int(extra)) is None

    def reserve(self, extra: int) -> None:
        """Makes room for ``extra`` more rows now, so that an :meth:`add` of that many allocates
        nothing. The sidecar calls it before the store commits: an allocation that fails
        (MemoryError, CUDA out of memory) then fails an add that stored nothing (issue 19)."""
        new_capacity = self.rows.capacity_for(int(extra))
        if new_capacity is not None:
            self._resize(new_capacity)
            self.rows.resize(new_capacity)

    def delete(self, ids: np.ndarray) -> int:
        """Tombstones the live rows among ``ids``; returns how many. Compacts when due."""
        rows = self.rows.tombstone(np.asarray(ids, dtype=np.int64).reshape(-1))
        if len(rows):
            self._tombstoned(rows)
            if self.rows.should_compact():
                self.compact()
        return len(rows)

    def compact(self) -> None:
        """Removes tombstoned rows (one pass over the matrix)."""
        if self.rows.tombstones:
            keep = self.rows.compact()
            self._compacted(keep)

    def search(
        self, queries: np.ndarray, k: int, flt: Filter = Filter()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine for each unit-norm query row: ``(ids[Q, k] int64, scores[Q, k] float32)``."""
        queries = self._checked_queries(queries, k)
        q = len(queries)
        n = self.rows.size
        if q == 0:
            return np.empty((0, k), np.int64), np.empty((0, k), np.float32)
        if n == 0:
            return np.full((q, k), MISSING_ID, np.int64), np.full((q, k), -np.inf, np.float32)
        rows, scores = self._search(queries, min(k, n), self.rows.mask(self.rows.simplify(flt)))
        return self._answer_of_rows(rows, scores, k)

    def search_groups(
        self, groups: Sequence[tuple[np.ndarray, int, Filter]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`search` for several groups of queries, each with its own k and filter (a
        crowd's pass that mixes namespaces and time windows), answers in the groups' order.
        This searches them one after another; an engine that can read the rows once for all of
        them overrides it."""
        return [self.search(queries, k, flt) for queries, k, flt in groups]

    def _checked_queries(self, queries: np.ndarray, k: int) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {queries.shape}")
        if k < 1:
            raise InvalidQuery(f"k must be >= 1, got {k}")
        return queries

    def _answer_of_rows(self, rows: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the rows :meth:`_search` found, both padded to ``k`` columns."""
        n = self.rows.size
        ids = self.rows.ids_of_rows(rows, scores)
        if k > n:
            ids = np.pad(ids, ((0, 0), (0, k - n)), constant_values=MISSING_ID)
            scores = np.pad(scores, ((0, 0), (0, k - n)), constant_values=-np.inf)
        return ids, scores

    def memory_bytes(self) -> int:
        """Bytes this engine holds for vectors and row columns (device memory for GPU engines)."""
        return self._vector_bytes() + self.rows.meta.nbytes() + sum(
            c.nbytes for c in (self.rows.ids, self.rows.namespaces, self.rows.created_at, self.rows.live)
        )

    # -- what a backend implements -------------------------------------------------------

    @abstractmethod
    def _resize(self, capacity: int) -> None:
        """Grows vector storage to ``capacity`` rows, keeping rows ``[0, rows.size)``."""

    @abstractmethod
    def _write(self, rows: slice, vectors: np.ndarray) -> None:
        """Stores ``vectors`` at ``rows`` (row columns are already in ``self.rows``)."""

    def _tombstoned(self, rows: np.ndarray) -> None:
        """Hook: rows just marked dead in ``self.rows.live`` (device mirrors update here)."""

    @abstractmethod
    def _compacted(self, keep: np.ndarray) -> None:
        """Moves vector ``keep[i]`` to row ``i`` for every i (``self.rows`` is already compacted)."""

    @abstractmethod
    def _search(
        self, queries: np.ndarray, k: int, mask: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k rows among ``[0, rows.size)`` where ``mask`` (None: all) holds.

        ``1 <= k <= rows.size``. Returns ``(rows[Q, k] int64, scores[Q, k] float32)`` best
        first; a masked-out row may appear only with score ``-inf``.
        """

    @abstractmethod
    def _vector_bytes(self) -> int:
        """Bytes of vector storage."""


def as_unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Float32 rows scaled to unit norm (norms computed in float64 for accuracy)."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", v, v))
    return (v / norms[:, None]).astype(np.float32)


