"""The CPU engine: an exact scan with NumPy (BLAS mat-mul, then argpartition); the passes of
a few queries that a crowd of single recalls makes are scored by the native kalos.engine._dots."""
from __future__ import annotations

import collections
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from kalos.engine.base import MASKS_KEPT, Engine, Filter

try:  # built at install where a C compiler exists (setup.py); else BLAS scores every pass
    from kalos.engine import _dots
except ImportError:  # pragma: no cover - depends on the install
    _dots = None

__all__ = ["NumpyEngine", "native_scores", "NATIVE_SCORES_MISSING", "NATIVE_SCORES_FIX"]

#: What an install without kalos.engine._dots costs, and the fix (kalos doctor, the sidecar's log).
NATIVE_SCORES_MISSING = ("kalos.engine._dots was not built (no C compiler at install): a CPU sidecar answers a "
                         "crowd with BLAS alone, up to 3x slower per pass")
NATIVE_SCORES_FIX = "install a C compiler, then pip install the package again"


def native_scores() -> bool:
    """Whether the native scores of a crowd's passes (kalos.engine._dots) were built."""
    return _dots is not None


# A mask passing at most 1 row in this many is searched as a row list: only its rows are
# scored (a where clause that picks one user's memories reads a sliver of the matrix).
_ROW_LIST_FRACTION = 16
# Row lists are cached while the rows keep their masks (kalos.engine.base.RowTable.mask),
# the most recently used this many, and their rows kept gathered (a copy) up to this many
# bytes in all.
_ROW_LISTS = MASKS_KEPT
_ROW_LIST_CACHE_BYTES = 64 << 20


# Passes up to this many queries take the tall-by-narrow product.
_SMALL_BATCH = 64
# Passes up to this many queries take one mat-vec each: OpenBLAS's product by two to four
# queries costs more than that many mat-vecs (BENCHMARKS.md, the crowd on the CPU). Only
# where kalos.engine._dots is missing: it scores them all in one read of the rows.
_MATVECS_MAX = 4
# Passes of 2 up to this many queries are scored by kalos.engine._dots, one slice of the rows
# per core (BLAS copies the whole matrix before it multiplies it by a narrow batch);
# wider ones by BLAS, whose kernel wins once the batch fills it (benchmarks/small_batch.py
# --device cpu --numpy).
_DOTS_MAX_Q = 64
# _dots scores whole tiles of this many queries; a pass is padded with zero queries to one.
_DOTS_QUERY_TILE = 4
# No slice of the rows is smaller than this (a slice handed to another thread must pay for
# the hand-over).
_DOTS_MIN_SLICE = 4096
# The thread limits an operator sets for BLAS (to leave cores to an LLM, say) bound _dots too.
_THREAD_LIMITS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_helpers_lock = threading.Lock()
_helpers: tuple[ThreadPoolExecutor, int] | None = None  # (the pool, the threads a pass uses)


def _threads() -> int:
    """The cores this process may run on, at most the smallest thread limit set."""
    threads = len(os.sched_getaffinity(0))
    for name in _THREAD_LIMITS:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            threads = min(threads, int(value))
    return threads


def _slice_helpers() -> tuple[ThreadPoolExecutor, int]:
    """The process's threads that score slices beside the calling one (one per further core),
    and how many threads a pass uses, the caller's included (made at the first pass)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            threads = _threads()
            _helpers = (ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="kalos-dots"), threads)
        return _helpers


def _forget_helpers() -> None:
    """In a forked child, which inherits neither the threads nor a usable lock."""
    global _helpers, _helpers_lock
    _helpers_lock = threading.Lock()
    _helpers = None


os.register_at_fork(after_in_child=_forget_helpers)


class NumpyEngine(Engine):
    """Float32 rows in one growable host array; exact top-k by brute force."""

    name = "numpy"
    device = "cpu"

    def __init__(self, dim: int, *, capacity: int = 1024) -> None:
        super().__init__(dim, capacity=capacity)
        self._vectors = np.zeros((self.rows.capacity, dim), dtype=np.float32)
        # -inf where a row is masked out, 0 where it may be returned; added to the scores,
        # which costs one pass instead of a boolean gather.
        # Holding the mask itself (not its id) keeps the identity check below sound.
        self._bias_for: tuple[np.ndarray, np.ndarray] | None = None
        # id(mask) -> (a weak reference to the mask, (its rows, their vectors or None) or None
        # when not selective), least recently used first: _row_list. (Weak: the rows' own cache
        # decides how long a mask lives; the reference tells a reused id from the same mask.)
        self._row_lists: collections.OrderedDict[
            int, tuple[weakref.ref, tuple[np.ndarray, np.ndarray | None] | None]] = collections.OrderedDict()
        self._gathered_bytes = 0
        self._row_lists_of = 0  # the rows' mask_generation the row lists were made at

    def _resize(self, capacity: int) -> None:
        grown = np.zeros((capacity, self.dim), dtype=np.float32)
        grown[: self.rows.size] = self._vectors[: self.rows.size]
        self._vectors = grown

    def _write(self, rows: slice, vectors: np.ndarray) -> None:
        self._vectors[rows] = vectors

    def _compacted(self, keep: np.ndarray) -> None:
        n = len(keep)
        self._vectors[:n] = self._vectors[keep]

    def _vector_bytes(self) -> int:
        return self._vectors.nbytes + self._gathered_bytes  # (the row lists' copies too)

    def _bias(self, mask: np.ndarray) -> np.ndarray:
        cached = self._bias_for
        if cached is not None and cached[0] is mask:
            return cached[1]
        bias = np.where(mask, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        self._bias_for = (mask, bias)
        return bias

    def _search(self, queries: np.ndarray, k: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        n = self.rows.size
        vectors = self._vectors[:n]
        if mask is not None:
            selected = self._row_list(mask)
            if selected is not None:
                return self._search_list(queries, k, *selected)
        if len(queries) == 1:  # mat-vec and 1-D selection: a third of the batch path's calls
            scores = vectors @ queries[0]
            if mask is not None:
                scores += self._bias(mask)
                # The k best as the k smallest of the negated scores: NumPy's selection of the
                # last k among many equal -inf (a mask) degrades to O(n log n), of the first k not.
                if k < n:
                    top = np.argpartition(np.negative(scores, out=scores), k - 1)[:k]
                    np.negative(scores, out=scores)
                else:
                    top = np.arange(n)
            else:
                top = np.argpartition(scores, n - k)[n - k :] if k < n else np.arange(n)
            top_scores = scores[top]
            order = np.argsort(-top_scores, kind="stable")
            return top[order][None, :], top_scores[order][None, :]
        if _dots is not None and len(queries) <= _DOTS_MAX_Q:
            scores = self._dot_scores(vectors, queries)
        elif len(queries) <= _MATVECS_MAX:
            scores = np.empty((len(queries), n), np.float32)
            for row, query in zip(scores, queries):
                np.matmul(vectors, query, out=row)
        elif len(queries) <= _SMALL_BATCH:
            # A crowd's pass: OpenBLAS multiplies the tall rows by a few queries in about the time
            # of two mat-vecs this way round, and in several times that as queries @ rows.T
            # (benchmarks/small_batch.py --device cpu); the transposing copy is Q x n floats.
            scores = np.ascontiguousarray((vectors @ queries.T).T)
        else:
            scores = queries @ vectors.T  # [Q, n]
        return self._select(scores, k, mask)

    def _select(self, scores: np.ndarray, k: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The rows of the k best of each row of ``scores`` ([Q, n], overwritten) that ``mask``
        passes, best first, and their scores."""
        n = scores.shape[1]
        if mask is not None:
            scores += self._bias(mask)
        if k < n and mask is not None:  # (the negated selection, as in _search's single query)
            top = np.argpartition(np.negative(scores, out=scores), k - 1, axis=1)[:, :k]
            np.negative(scores, out=scores)
        elif k < n:
            top = np.argpartition(scores, n - k, axis=1)[:, n - k :]
        else:
            top = np.broadcast_to(np.arange(n), scores.shape)
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        return np.take_along_axis(top, order, axis=1), np.take_along_axis(top_scores, order, axis=1)

    def search_groups(
        self, groups: Sequence[tuple[np.ndarray, int, Filter]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`search` for several groups of queries, each with its own k and filter: the
        groups that scan every row (no filter, or one that passes too many rows for a row
        list) are scored together by _dots, each row read once for all of them (a crowd's pass
        that mixes namespaces and time windows); each then selects under its own filter. The
        answers are search()'s up to float32 rounding (a lone query there is a mat-vec)."""
        n = self.rows.size
        if _dots is None or n == 0 or len(groups) < 2:
            return super().search_groups(groups)

        def alone(queries: np.ndarray, k: int, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
            # search() past the checks and the mask this loop has made already
            return self._answer_of_rows(*self._search(queries, min(k, n), mask), k)

        answers: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(groups)
        shared: list[tuple[int, np.ndarray, int, np.ndarray | None]] = []  # (group, queries, k, mask)
        for at, (queries, k, flt) in enumerate(groups):
            queries = self._checked_queries(queries, k)
            if not len(queries):
                answers[at] = self.search(queries, k, flt)  # (the empty answer)
                continue
            mask = self.rows.mask(self.rows.simplify(flt))
            if mask is None or self._row_list(mask) is None:
                shared.append((at, queries, k, mask))
            else:  # a row list: only its own rows are read
                answers[at] = alone(queries, k, mask)
        if len(shared) < 2 or sum(len(queries) for _at, queries, _k, _mask in shared) > _DOTS_MAX_Q:
            for at, queries, k, mask in shared:
                answers[at] = alone(queries, k, mask)
            return answers  # type: ignore[return-value]
        scores = self._dot_scores(self._vectors[:n], np.concatenate([queries for _at, queries, _k, _m in shared]))
        first = 0
        for at, queries, k, mask in shared:
            rows, best = self._select(scores[first : first + len(queries)], min(k, n), mask)
            answers[at] = self._answer_of_rows(rows, best, k)
            first += len(queries)
        return answers  # type: ignore[return-value]

    def _dot_scores(self, vectors: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """[Q, n] scores by kalos.engine._dots: the rows cut into one slice per core, the calling
        thread scoring the first (the extension releases the GIL)."""
        n, q = len(vectors), len(queries)
        padded = -(-q // _DOTS_QUERY_TILE) * _DOTS_QUERY_TILE
        if padded != q:
            queries = np.concatenate([queries, np.zeros((padded - q, self.dim), np.float32)])
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        scores = np.empty((padded, n), np.float32)
        helpers, threads = _slice_helpers()
        slices = min(threads, max(1, n // _DOTS_MIN_SLICE))
        step = -(-n // slices)
        step += step % 2  # (an even number of rows: the kernel's tile)
        rest = []
        for lo in range(step, n, step):
            try:
                rest.append(helpers.submit(_dots.scores, vectors, queries, scores, lo, min(n, lo + step)))
            except RuntimeError:  # the interpreter is shutting down: no new threads; score it here
                _dots.scores(vectors, queries, scores, lo, min(n, lo + step))
        _dots.scores(vectors, queries, scores, 0, min(n, step))
        for slice_done in rest:
            slice_done.result()
        return scores[:q]

    def _row_list(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The rows of a selective ``mask`` and, while the cache's bytes hold them, their
        vectors gathered (cached while the rows keep the mask: until they change or drop it);
        None for a mask that passes more."""
        lists = self._row_lists
        if self._row_lists_of != self.rows.mask_generation:  # (the rows changed: new masks)
            lists.clear()
            self._gathered_bytes = 0
            self._row_lists_of = self.rows.mask_generation
        key = id(mask)
        cached = lists.get(key)
        if cached is not None and cached[0]() is mask:
            lists.move_to_end(key)
            selected = cached[1]
            if selected is not None and selected[1] is None:  # (bytes freed since: gather it now)
                selected = self._gathered(selected[0])
                lists[key] = (cached[0], selected)
            return selected
        for dead in [k for k, (ref, _selected) in lists.items() if ref() is None]:  # masks the rows dropped
            self._forget_row_list(dead)
        while len(lists) >= _ROW_LISTS:
            self._forget_row_list(next(iter(lists)))
        selected = None
        if np.count_nonzero(mask) * _ROW_LIST_FRACTION <= len(mask):
            selected = self._gathered(np.flatnonzero(mask))
        lists[key] = (weakref.ref(mask), selected)
        return selected

    def _gathered(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``rows`` and their vectors gathered, if the cache's bytes allow (none is dropped to
        make room: a crowd that asks with more masks in turn than the bytes hold would drop
        each just before its next use); else ``rows`` and None."""
        size = len(rows) * self.dim * 4
        if self._gathered_bytes + size > _ROW_LIST_CACHE_BYTES:
            return rows, None
        self._gathered_bytes += size
        return rows, self._vectors[rows]

    def _forget_row_list(self, key: int) -> None:
        _ref, selected = self._row_lists.pop(key)
        if selected is not None and selected[1] is not None:
            self._gathered_bytes -= selected[1].nbytes

    def _search_list(self, queries: np.ndarray, k: int, rows: np.ndarray,
                     gathered: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over ``rows`` only; short answers padded with row 0 at -inf (the base contract)."""
        nq, m = len(queries), len(rows)
        out_rows = np.zeros((nq, k), np.int64)
        out_scores = np.full((nq, k), -np.inf, np.float32)
        if m == 0:
            return out_rows, out_scores
        vectors = gathered if gathered is not None else self._vectors[rows]
        scores = queries @ vectors.T  # [Q, m]
        kk = min(k, m)
        if kk < m:
            top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        else:
            top = np.broadcast_to(np.arange(m), scores.shape)
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        out_rows[:, :kk] = rows[np.take_along_axis(top, order, axis=1)]
        out_scores[:, :kk] = np.take_along_axis(top_scores, order, axis=1)
        return out_rows, out_scores
