"""When the sidecar's served rows expire (TTL): the schedule, without its side effects.

The sidecar tombstones a row in the engine at its ``expires_at`` (before any recall that could
return it), and an expirer thread deletes expired rows from the store afterwards; both ask this
schedule what is due. It is a dict ``id -> expires_at`` (the truth) and a heap of
``(expires_at, id)`` whose entries are stale unless they agree with the dict: an upsert or a
delete changes the dict at once and leaves its old heap entry to be dropped when it surfaces.
Not thread-safe: the sidecar holds its state lock around every call.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

__all__ = ["ExpirySchedule"]

# The heap is rebuilt when stale entries outnumber live ones this much (upserts of expiring
# keys leave one each).
_STALE_SLACK = 1024


class ExpirySchedule:
    """The expiry times of the served rows that expire."""

    def __init__(self) -> None:
        self._at: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._at)

    def expires_at(self, row_id: int) -> float | None:
        """When ``row_id`` expires, or None if it does not (or is not served)."""
        return self._at.get(row_id)

    def note(self, ids: np.ndarray, expires_at: np.ndarray | None) -> bool:
        """Records when the rows of ``ids`` expire (NaN, or ``expires_at`` None: never; a row
        noted before takes the new time). True when the earliest expiry is now earlier than
        before (an expirer waiting for the old one should plan again)."""
        if expires_at is None:
            self.forget(ids)
            return False
        before = self.earliest()
        for i, t in zip(np.asarray(ids).tolist(), np.asarray(expires_at, dtype=np.float64).tolist()):
            if math.isnan(t):
                self._at.pop(i, None)
                continue
            self._at[i] = t
            heapq.heappush(self._heap, (t, i))
        if len(self._heap) > 2 * len(self._at) + _STALE_SLACK:
            self._heap = [(t, i) for i, t in self._at.items()]
            heapq.heapify(self._heap)
        after = self.earliest()
        return after is not None and (before is None or after < before)

    def forget(self, ids: np.ndarray) -> None:
        """Rows deleted (or no longer expiring): they expire no more."""
        if self._at:
            for i in np.asarray(ids).tolist():
                self._at.pop(i, None)

    def earliest(self) -> float | None:
        """The earliest expiry of a row still scheduled, or None (stale entries on top are
        dropped first, so a row deleted or re-timed since never counts)."""
        heap, at = self._heap, self._at
        while heap and at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[int]:
        """Removes and returns the rows whose expiry is at or before ``now``; costs one look at
        the heap's top when none is."""
        heap, at = self._heap, self._at
        if not heap or heap[0][0] > now:
            return []
        due = []
        while heap and heap[0][0] <= now:
            t, i = heapq.heappop(heap)
            if at.get(i) == t:
                del at[i]
                due.append(i)
        return due
