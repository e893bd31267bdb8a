"""Which clients a pass waits for before it searches, so that a crowd shares one pass.

A pass answers every request pending when it starts; what arrives meanwhile waits for the
next. A crowd of agents recalling back to back then splits into cohorts that take turns: the
clients of pass N resubmit a few tens of microseconds after it, find pass N+1 already running
for the others, and wait for it to finish. Each pass pays the engine's fixed cost for a fraction
of the crowd, and each client waits for two passes or more.

:class:`Cohort` merges them. When a pass is about to start, the clients answered by the
previous pass that have not sent their next request yet, and that came back quickly before,
are waited for, until at most ``window_s`` after that pass published. One pass then serves
them all for about the price of one. A client that does not come back within the window (an
agent thinking between recalls, which is the usual case) is marked slow and not waited for
again until it shows it is quick once more (back before the next pass starts), so a lone
agent, or one among idle ones, never waits for anyone.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

__all__ = ["Cohort"]

_NO_SLOTS = np.empty(0, dtype=np.int64)


class Cohort:
    """The gathering policy of one sweep (its thread only)."""

    def __init__(self, n_slots: int, window_s: float) -> None:
        self.window_s = window_s
        self.quick = np.ones(n_slots, dtype=bool)
        self._seen = np.zeros(n_slots, dtype=bool)  # scratch: membership without np.isin's sort
        self._last = _NO_SLOTS  # the slots the previous pass answered
        self._last_at = 0.0  # when it published (perf_counter)
        self.waits = 0  # passes that waited for someone
        self.waited_s = 0.0
        self.joined = 0  # requests that joined a pass by waiting

    def answered(self, slots: np.ndarray) -> None:
        """Records the slots a pass just published to."""
        self._last = slots
        self._last_at = time.perf_counter()

    def gather(
        self,
        slots: np.ndarray,
        seqs: np.ndarray,
        pending: Callable[[], tuple[np.ndarray, np.ndarray]],
        requested: Callable[[np.ndarray], np.ndarray],
        active: np.ndarray,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pending requests ``slots`` / ``seqs`` (non-empty), or more of them: waits until
        the previous pass's quick clients are back or its window is over, or ``stop()`` says
        to go now (the GPU is about to idle). ``requested(slots)`` says which of ``slots``
        have a request pending (cheaper than ``pending()``)."""
        last, self._last = self._last, _NO_SLOTS
        if not self.window_s or not len(last):
            return slots, seqs
        seen = self._seen
        seen[slots] = True
        back = seen[last]
        seen[slots] = False
        self.quick[last[back]] = True
        awaited = last[~back]
        awaited = awaited[self.quick[awaited] & active[awaited]]
        if not len(awaited):
            return slots, seqs
        clock = time.perf_counter
        began = clock()
        until = self._last_at + self.window_s
        arrived = requested(awaited)
        while not arrived.all() and clock() < until and not (stop is not None and stop()):
            os.sched_yield()  # the GIL for a control thread meanwhile, the core for the clients
            arrived = requested(awaited)
        if clock() >= until:  # (not when stop() ended the wait: they had no window to come back in)
            self.quick[awaited[~arrived]] = False
        self.waits += 1
        self.waited_s += clock() - began
        before = len(slots)
        slots, seqs = pending()
        self.joined += max(0, len(slots) - before)
        return slots, seqs

    def forget(self, slot: int) -> None:
        """A slot changed hands: its new client starts as quick."""
        self.quick[slot] = True

    def stats(self) -> dict[str, float | int]:
        return {"gather_waits": self.waits, "gather_waited_s": round(self.waited_s, 6), "gather_joined": self.joined}
