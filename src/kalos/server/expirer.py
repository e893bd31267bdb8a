"""What the sidecar does when memories expire (TTL, issue 22): tombstones, store sweeps, a thread.

The schedule itself (kalos.server.expiry) is bookkeeping without side effects, tested against a
dict model. Its side effects live here, in one object that the recall loop (before every
answering pass), the control operations (writes that carry a ``ttl``), the change follower and
the lifecycle (rows that expired while no sidecar ran) share, so that a row is tombstoned the
same way whoever notices first.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from kalos.engine import Engine
from kalos.server.expiry import ExpirySchedule
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock

__all__ = ["Expirer"]

# The sidecar's one logger, whichever of its modules logs.
log = logging.getLogger("kalos.server.sidecar")

#: The expirer's longest sleep (it also wakes for each next expiry), and how often at most it
#: deletes expired rows from the store (recall, get and list skip them from their expiry on).
_EXPIRY_POLL_S = 0.5
_EXPIRY_STORE_S = 1.0
#: How long before a row's expiry the GPU's polling kernel is stopped (and not started again until
#: it has passed): the kernel knows nothing of expiries, the sweep tombstones each row in the first
#: pass at or after its ``expires_at``. The lead covers the sweep's own delay between two looks.
_EXPIRY_LEAD_S = 0.05


class Expirer:
    """Tombstones rows in the engine when they expire and deletes them from the store.

    ``schedule`` is read and changed under the sidecar's ``_state_lock`` (every method here
    but :meth:`run` expects it held, or is called before serving); :meth:`run` is the expirer
    thread's body.
    """

    def __init__(self, *, engine: Engine, store: Any, polling: SlotPolling, state_lock: StateLock,
                 write_lock: threading.Lock, wrote: threading.Event, stopping: threading.Event) -> None:
        self.schedule = ExpirySchedule()
        self._engine = engine
        self._store = store  # a Store or a PostgresStore
        self._polling = polling
        self._state_lock = state_lock
        self._write_lock = write_lock
        self._wrote = wrote
        self._stopping = stopping
        self._wake = threading.Event()  # an earlier expiry was noted: the thread re-plans
        # Rows may have expired in the store while these differ (they do at start): expire_due
        # counts each round that tombstoned rows, the thread the rounds it swept from the store.
        self._rounds = 1
        self._swept_rounds = 0

    def note(self, ids: np.ndarray, expires_at: np.ndarray | None) -> None:
        """Records when the rows of ``ids`` expire (NaN or None: never). A row whose expiry is
        already past is tombstoned by the next :meth:`expire_due`, before any recall."""
        if self.schedule.note(ids, expires_at):
            self._wake.set()

    def near(self) -> bool:
        """Whether a row expires within ``_EXPIRY_LEAD_S``: the sweep keeps the GPU's polling
        kernel off until then (rows deleted or re-timed since do not count)."""
        earliest = self.schedule.earliest()
        return earliest is not None and earliest - time.time() < _EXPIRY_LEAD_S

    def expire_due(self) -> None:
        """Tombstones in the engine every row whose expiry has come. Called before each
        answering pass, so no recall returns a row after its ``expires_at``; the cost when
        nothing is due is one look at the schedule's top. The thread deletes the rows from the
        store afterwards (get and list skip them meanwhile)."""
        due = self.schedule.due(time.time())
        if due:
            self._polling.pause()
            self._engine.delete(np.asarray(due, dtype=np.int64))
            self._rounds += 1
            self._wake.set()

    def run(self) -> None:
        """Tombstones rows when they expire while no recall comes (the GPU's polling is kept off
        around an expiry by the sweep: :meth:`near`), and deletes expired rows from the store,
        durably, at most once per ``_EXPIRY_STORE_S``."""
        next_store = 0.0
        while not self._stopping.is_set():
            with self._state_lock:
                self.expire_due()
                top = self.schedule.earliest()
            now = time.time()
            if self._swept_rounds != self._rounds and now >= next_store:
                next_store = now + _EXPIRY_STORE_S
                rounds = self._rounds  # read first: a round counted meanwhile is swept next time
                try:
                    self._delete_expired_rows()
                    self._swept_rounds = rounds
                except Exception as exc:  # noqa: BLE001 - the next round tries again; get/list skip them meanwhile
                    log.warning("deleting expired memories from the store failed (%s); trying again", exc)
            waits = [_EXPIRY_POLL_S]
            if top is not None:
                waits.append(top - now)
            if self._swept_rounds != self._rounds:
                waits.append(next_store - now)
            self._wake.wait(max(0.0, min(waits)))
            self._wake.clear()

    def _delete_expired_rows(self) -> None:
        with self._write_lock:
            deleted = self._store.delete_expired(time.time())
            if len(deleted):
                with self._state_lock:
                    self._polling.pause()
                    self._engine.delete(deleted)  # rows the heap did not know of (a follower's, say)
                    self.schedule.forget(deleted)
                self._wrote.set()
