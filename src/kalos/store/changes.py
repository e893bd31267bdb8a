"""Which rows a store's recent writes changed: for what keeps copies of rows between reads
(the sidecar's :mod:`kalos.server.item_cache`).

A :class:`ChangeLog` counts the committed writes that changed rows already there (its
``revision``) and remembers, for the last of them, the ids each changed: :meth:`since` tells
a copy made at revision r which of its rows are stale. It has its own lock, so that asking
never waits for a write transaction in progress (the store's lock is held through COMMIT and
its fsync); the revision and its entry change together under it.
"""
from __future__ import annotations

import collections
import threading

__all__ = ["ChangeLog"]


class ChangeLog:
    """The revision of a store's rows and the ids its last writes changed.

    At most ``max_writes`` writes and ``max_ids`` ids in all are remembered (the oldest go
    first); a write of more than ``max_ids_per_write`` rows, or one that did not name its rows,
    is remembered as "every row"."""

    def __init__(self, *, max_writes: int = 256, max_ids: int = 1 << 16, max_ids_per_write: int = 4096) -> None:
        self.max_writes = max_writes
        self.max_ids = max_ids
        self.max_ids_per_write = max_ids_per_write
        self.revision = 0
        self._lock = threading.Lock()
        self._log: collections.deque[tuple[int, frozenset[int] | None]] = collections.deque()
        self._ids = 0

    def record(self, changed: set[int] | None) -> None:
        """One more committed write that changed rows: ``changed``, their ids (None: not named)."""
        named = None if changed is None or len(changed) > self.max_ids_per_write else frozenset(changed)
        with self._lock:
            self.revision += 1
            self._log.append((self.revision, named))
            self._ids += len(named or ())
            while len(self._log) > self.max_writes or self._ids > self.max_ids:
                _, gone = self._log.popleft()
                self._ids -= len(gone or ())

    def since(self, revision: int) -> frozenset[int] | None:
        """The ids the writes after ``revision`` changed (up to the current revision), or None
        where that cannot be told: a write that named no rows, or one no longer remembered."""
        with self._lock:
            if revision >= self.revision:
                return frozenset()
            log = self._log
            if not log or log[0][0] > revision + 1:
                return None
            changed: set[int] = set()
            for at, ids in reversed(log):
                if at <= revision:
                    break
                if ids is None:
                    return None
                changed |= ids
            return frozenset(changed)
