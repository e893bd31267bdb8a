"""One engine over several: the rows split across shards (one per GPU), searched in parallel.

``make_engine("cuda:0,cuda:1")`` or ``make_engine("cuda:all")`` builds a :class:`ShardedEngine`
of :class:`~kalos.engine.gpu.engine.TorchEngine` shards, one per listed device (a device may
be listed twice: two shards on one card).

* **Adds** go, a whole batch at a time, to the shard with the fewest live rows, so shards
  stay within one batch of each other (the sidecar loads its store in batches of 65,536).
* **Deletes and compaction** go to every shard; each ignores ids it does not hold and
  compacts its own rows.
* **A search** is started on every shard (each queues its scan on its own stream and
  returns at once: :meth:`TorchEngine.search_start`), then the shards' answers are awaited
  and merged. Each shard returns its exact top-k of its rows, so the best k of the union of
  those lists is the exact top-k of all rows (ties aside): no candidate can be missing,
  because a row outside its own shard's top k has k better rows in that shard alone.

Nothing here is specific to two shards or to CUDA: the shards only need ``search_start``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kalos.engine.base import MISSING_ID, Engine, Filter
from kalos.errors import InvalidArgument, InvalidQuery

__all__ = ["ShardedEngine", "merge_topk"]


class ShardedEngine:
    """The :class:`~kalos.engine.base.Engine` interface over ``shards`` (engines of one dim)."""

    # The capabilities the Engine interface declares (kalos.engine.base): a search waits for
    # every shard, and no host buffer or slot server spans several devices.
    supports_search_start = False
    supports_attached_host = False
    supports_streams = True
    supports_gpu_polling = False
    max_k: int | None = None

    def __init__(self, shards: Sequence[Engine]) -> None:
        if len(shards) < 1:
            raise InvalidArgument("a sharded engine needs at least one shard")
        if len({id(shard) for shard in shards}) != len(shards):
            raise InvalidArgument("a shard is listed twice (two shards on one card are two engines)")
        dims = {shard.dim for shard in shards}
        if len(dims) != 1:
            raise InvalidArgument(f"shards must share one dimension, got {sorted(dims)}")
        for shard in shards:
            if not shard.supports_search_start:
                raise InvalidArgument(f"shard {shard!r} cannot start a search asynchronously (search_start)")
        self.shards = list(shards)
        self.dim = dims.pop()
        self.device = ",".join(str(shard.device) for shard in self.shards)
        self.name = f"sharded-{len(self.shards)}x-{self.shards[0].name}"
        self.precision = getattr(self.shards[0], "precision", "exact")
        limits = [shard.max_k for shard in self.shards]
        if all(limit is not None for limit in limits):
            self.max_k = min(limits)
        # Queries per round: each shard queues at most its max_batch at once (search_start).
        self._round = min(getattr(shard, "max_batch", 1 << 30) for shard in self.shards)

    def __repr__(self) -> str:
        return f"ShardedEngine({len(self)} rows on {self.device})"

    # -- the Engine interface --------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def __contains__(self, item_id: int) -> bool:
        return any(item_id in shard for shard in self.shards)

    @property
    def capacity(self) -> int:
        return sum(shard.capacity for shard in self.shards)

    @property
    def tombstones(self) -> int:
        return sum(shard.tombstones for shard in self.shards)

    def shard_sizes(self) -> list[int]:
        """Live rows per shard."""
        return [len(shard) for shard in self.shards]

    def add(self, ids: np.ndarray, vectors: np.ndarray, namespaces: np.ndarray, created_at: np.ndarray,
            metadata: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        """Appends the batch to the shard with the fewest live rows among those it fits as they
        are, else to the one with the fewest (ids new to every shard)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return
        target = self._target(len(ids))
        for shard in self.shards:
            if shard is target:
                continue  # its own add checks its ids
            clash = [i for i in ids.tolist() if i in shard]
            if clash:
                raise InvalidArgument(f"{len(clash)} ids already present, e.g. {clash[:5]}")
        target.add(ids, vectors, namespaces, created_at, metadata)

    def set_metadata(self, ids: np.ndarray, metadata: Sequence[Mapping[str, Any] | None]) -> int:
        """Each shard re-indexes the rows of ``ids`` it holds (an id lives in one shard)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return sum(shard.set_metadata(ids, metadata) for shard in self.shards)

    def ids_where(self, flt: Filter) -> np.ndarray:
        """Ids of the live rows that pass ``flt``, over every shard."""
        return np.concatenate([shard.ids_where(flt) for shard in self.shards])

    def _target(self, n: int) -> Any:
        """The shard an add of ``n`` rows goes to. One it fits goes first: room made by
        :meth:`reserve` (before the store commits) stays where it was made while live counts
        move (a delete, an expiry) until the add, which then grows nothing (issue 19)."""
        fitting = [shard for shard in self.shards if shard.has_room(n)]
        return min(fitting or self.shards, key=len)

    def has_room(self, extra: int) -> bool:
        """Whether some shard holds ``extra`` more rows as it is (the next add goes to one)."""
        return any(shard.has_room(extra) for shard in self.shards)

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` rows: where no shard has it, the one with the fewest live rows grows."""
        if not self.has_room(extra):
            min(self.shards, key=len).reserve(extra)

    def delete(self, ids: np.ndarray) -> int:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return sum(shard.delete(ids) for shard in self.shards)

    def compact(self) -> None:
        for shard in self.shards:
            shard.compact()

    def search(self, queries: np.ndarray, k: int, flt: Filter = Filter()) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine over every shard: ``(ids[Q, k] int64, scores[Q, k] float32)``."""
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise InvalidQuery(f"expected queries of shape (Q, {self.dim}), got {queries.shape}")
        if len(queries) <= self._round:
            return self._search_round(queries, k, flt)
        parts = [self._search_round(queries[s : s + self._round], k, flt) for s in range(0, len(queries), self._round)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def search_groups(
        self, groups: Sequence[tuple[np.ndarray, int, Filter]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`Engine.search_groups`: each group searched over every shard in turn."""
        return [self.search(queries, k, flt) for queries, k, flt in groups]

    def _search_round(self, queries: np.ndarray, k: int, flt: Filter) -> tuple[np.ndarray, np.ndarray]:
        waits: list[Callable[[], tuple[np.ndarray, np.ndarray]]] = []
        answers: list[tuple[np.ndarray, np.ndarray]] = []
        failure: BaseException | None = None
        try:
            for shard in self.shards:  # every shard's scan is queued before any is awaited
                waits.append(shard.search_start(queries, k, flt))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the waits
            failure = exc
        for wait in waits:  # await every started shard, even after a failure: none stays queued
            try:
                answers.append(wait())
            except BaseException as exc:  # noqa: BLE001
                failure = failure or exc
        if failure is not None:
            raise failure
        return merge_topk(answers, k)

    def memory_bytes(self) -> int:
        return sum(shard.memory_bytes() for shard in self.shards)

    # -- what the sidecar's zero-copy path asks of a GPU engine --------------------------------

    def bind_stream(self) -> None:
        """Nothing to bind: every shard's work runs under its own stream's context."""

    def unbind_stream(self) -> None:
        """Nothing was bound."""


def merge_topk(answers: Sequence[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of several ``(ids[Q, k], scores[Q, k])`` answers, best first.

    Padding (-1 / -inf) sorts last; equal scores keep the order of ``answers`` (stable).
    """
    if len(answers) == 1:
        return answers[0]
    ids = np.concatenate([a[0] for a in answers], axis=1)
    scores = np.concatenate([a[1] for a in answers], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    ids = np.take_along_axis(ids, order, axis=1)
    scores = np.take_along_axis(scores, order, axis=1)
    ids[np.isneginf(scores)] = MISSING_ID
    return ids, scores


Engine.register(ShardedEngine)
