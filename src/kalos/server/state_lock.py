"""The sidecar's state lock: the sweep takes it for every pass, the writers when they change
the engine or the slots, and a waiting writer goes before the sweep's next pass.

Why not a plain lock. The sweep releases the lock at the end of a pass and takes it again at
the start of the next, microseconds later and without a blocking call in between, while a
writer blocked in ``acquire`` must first be woken and then win the GIL: under a crowd the
sweep wins nearly every time. A hello that stopped the GPU's polling kernel under this lock
(every hello once; now only one that finds no quiet free slot) then waited hundreds of
milliseconds, or timed out. Here a writer says that
it waits, and the sweep, before a pass, lets the writers that wait go first.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["StateLock"]

#: Longest the sweep defers to waiting writers before it competes for the lock as they do
#: (a steady stream of writers must not stop recalls).
WRITERS_FIRST_S = 0.005


class StateLock:
    """A lock (``with lock:``, :meth:`acquire`, :meth:`release`) whose :meth:`for_sweep` lets
    the threads already waiting for it go first."""

    writers_first_s = WRITERS_FIRST_S

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._none_waiting = threading.Event()
        self._none_waiting.set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if self._lock.acquire(blocking=False):  # (free: no need to announce anything)
            return True
        if not blocking:
            return False
        with self._count_lock:
            self._waiting += 1
            self._none_waiting.clear()
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count_lock:
                self._waiting -= 1
                if not self._waiting:
                    self._none_waiting.set()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> "StateLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def waiting(self) -> int:
        """Threads blocked in :meth:`acquire` now."""
        return self._waiting

    @contextlib.contextmanager
    def for_sweep(self) -> Iterator[None]:
        """Holds the lock for one pass of the sweep, after the threads that wait for it now
        (up to ``writers_first_s``)."""
        if self._waiting:
            self._none_waiting.wait(self.writers_first_s)
        with self._lock:
            yield
