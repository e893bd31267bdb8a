"""The CPU engine: an exact scan with NumPy (BLAS mat-mul, then argpartition)."""
from __future__ import annotations

import numpy as np

from kalos.engine.base import Engine

__all__ = ["NumpyEngine"]


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
        return self._vectors.nbytes

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
        if len(queries) == 1:  # mat-vec and 1-D selection: a third of the batch path's calls
            scores = vectors @ queries[0]
            if mask is not None:
                scores += self._bias(mask)
            top = np.argpartition(scores, n - k)[n - k :] if k < n else np.arange(n)
            top_scores = scores[top]
            order = np.argsort(-top_scores, kind="stable")
            return top[order][None, :], top_scores[order][None, :]
        scores = queries @ vectors.T  # [Q, n]
        if mask is not None:
            scores += self._bias(mask)
        if k < n:
            top = np.argpartition(scores, n - k, axis=1)[:, n - k :]
        else:
            top = np.broadcast_to(np.arange(n), scores.shape)
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1, kind="stable")
        return np.take_along_axis(top, order, axis=1), np.take_along_axis(top_scores, order, axis=1)
