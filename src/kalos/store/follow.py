"""Following a PostgreSQL store's change log, so that a sidecar sees what other sidecars write.

A :class:`ChangeFollower` is one thread with two connections: a *listener* (autocommit,
``LISTEN kalos_changes``) that only waits for notifications, and a *reader* that fetches the
changes after its mark (the log's ``fetch``: :func:`kalos.store.postgres.fetch_changes`, one repeatable-read snapshot
per batch) and hands them to ``apply``. The mark advances only after ``apply`` returned, so
every change is applied at least once; :func:`apply_to_engine` makes applying twice harmless
(an add of an id the engine holds and a delete of an id it does not are skipped).

A notification is only a wake-up. One that arrives while the reader reads stays queued on the
listener's socket and wakes the next wait at once; one that is lost (the connection dropped)
costs at most ``poll_interval_s``, because the reader also reads on that interval. Any error
(the server restarted, the network went away) closes both connections; the follower logs it
with the password masked, waits with exponential backoff and starts again from its mark.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Protocol

import numpy as np

__all__ = ["ChangeFollower", "ChangeLog", "apply_to_engine"]

log = logging.getLogger("kalos.store.follow")

_BATCH = 1000  # changes per read (and per hold of the caller's lock)
_WAIT_SLICE_S = 0.25  # longest single wait, so stop() is noticed promptly
_BACKOFF_MIN_S = 0.1
_BACKOFF_MAX_S = 5.0


class ChangeLog(Protocol):
    """What a follower reads (:class:`kalos.store.postgres.ChangeLog` for PostgreSQL): the rows'
    ``dim``, ``where`` (the log's address, password masked), the NOTIFY ``channel``."""

    dim: int
    where: str
    channel: str

    def connect(self, *, autocommit: bool = True) -> Any:
        """A new connection to the log's database."""

    def fetch(self, conn: Any, after: int, limit: int) -> Any:
        """Up to ``limit`` changes after ``after``, as a ``kalos.store.postgres.ChangeBatch``."""

    def redact(self, message: str) -> str:
        """``message`` with the password masked."""


def apply_to_engine(engine: Any, namespaces: dict[bytes, int], batch: Any) -> tuple[int, int]:
    """Applies ``batch`` (a ``kalos.store.postgres.ChangeBatch``) to ``engine`` in log order; returns
    (rows added, rows deleted).

    Ids the engine already holds (this sidecar's own writes, or a batch applied before a
    reconnect) are not added again; deletes of ids it does not hold are ignored by the engine.
    ``namespaces`` (the sidecar's name -> id map) learns the namespaces of the batch.
    """
    for name, ns_id in batch.namespaces.items():
        namespaces[name.encode()] = int(ns_id)
    added = deleted = 0
    for change in batch.changes:
        if change.op == "add":
            if not len(change.ids):
                continue
            fresh = np.fromiter((int(i) not in engine for i in change.ids.tolist()), dtype=bool, count=len(change.ids))
            if fresh.any():
                meta = None if change.metadata is None else [m for m, f in zip(change.metadata, fresh) if f]
                engine.add(change.ids[fresh], change.vectors[fresh], change.namespace_ids[fresh],
                           change.created_at[fresh], meta)
                added += int(fresh.sum())
        elif change.op in ("upsert", "update"):
            # Each id's row swapped in one step (the caller holds the sidecar's state lock for
            # the whole batch): tombstone whatever version the engine holds, add the one read.
            # This sidecar's own upserts come back too; swapping in the same vector is harmless.
            # An update's row is swapped the same way (its vector may or may not have changed).
            if len(change.ids):
                deleted += int(engine.delete(change.ids))
                engine.add(change.ids, change.vectors, change.namespace_ids, change.created_at, change.metadata)
                added += len(change.ids)
        else:
            deleted += int(engine.delete(change.ids))
    return added, deleted


class ChangeFollower:
    """Applies every change after ``mark`` in ``log`` through ``apply(batch)``
    (:meth:`kalos.store.postgres.PostgresStore.follower` makes one).

    ``lock`` (optional) is held while a batch is read *and* applied: the sidecar passes its
    write lock, so a local add/delete never interleaves with a batch (a local delete cannot be
    overtaken by the remote add of the same item read just before it).
    """

    def __init__(self, log: ChangeLog, mark: int, *, apply: Callable[[Any], None],
                 lock: Any = None, poll_interval_s: float = 2.0) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self._log = log
        self._where = log.where
        self.dim = log.dim
        self.mark = int(mark)
        self._apply = apply
        self._lock = lock if lock is not None else nullcontext()
        self._poll_s = poll_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0  # connections re-made after a failure (for stats and tests)
        self.connected = threading.Event()  # set while both connections are up

    def start(self) -> "ChangeFollower":
        self._thread = threading.Thread(target=self._run, name="kalos-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = _BACKOFF_MIN_S
        while not self._stop.is_set():
            listener = reader = None
            try:
                listener = self._log.connect()
                listener.execute(f"LISTEN {self._log.channel}")
                reader = self._log.connect(autocommit=False)
                if self.reconnects:
                    log.warning("following %s again from change %d", self._where, self.mark)
                self.connected.set()
                backoff = _BACKOFF_MIN_S
                self._follow(listener, reader)
            except Exception as exc:  # the server went away, or apply failed: retry from the mark
                self.connected.clear()
                if self._stop.is_set():
                    break
                self.reconnects += 1
                log.warning("following %s failed (%s: %s); retrying from change %d in %.1f s", self._where,
                            type(exc).__name__, self._log.redact(str(exc).strip()), self.mark, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            finally:
                self.connected.clear()
                for conn in (listener, reader):
                    if conn is not None:
                        try:
                            conn.close()
                        except Exception:
                            pass

    def _follow(self, listener: Any, reader: Any) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            self._catch_up(reader)
            next_poll = time.monotonic() + self._poll_s
            # Wait for a notification, the poll interval, or stop(), whichever comes first.
            woken = False
            while not woken and not self._stop.is_set():
                remaining = next_poll - time.monotonic()
                if remaining <= 0:
                    break
                for _ in listener.notifies(timeout=min(_WAIT_SLICE_S, remaining), stop_after=1):
                    woken = True

    def _catch_up(self, reader: Any) -> None:
        while not self._stop.is_set():
            with self._lock:
                batch = self._log.fetch(reader, self.mark, _BATCH)
                if batch.changes:
                    self._apply(batch)
            self.mark = batch.mark
            if len(batch.changes) < _BATCH:
                return
