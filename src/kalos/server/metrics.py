"""Counters and latency percentiles the sidecar reports through ``stats``."""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

__all__ = ["Metrics"]


class Metrics:
    """Batches served, queries answered, and a window of recent per-batch service times."""

    def __init__(self, window: int = 8192) -> None:
        self._lock = threading.Lock()
        self._service_s: collections.deque[float] = collections.deque(maxlen=window)
        self._stamps: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)
        self.queries = 0
        self.batches = 0
        self.errors = 0
        self.busy_s = 0.0  # time spent answering: with a crowd's wall time, how loaded the sweep is
        self._busy_to = 0.0  # when the last pass recorded ended (passes in flight overlap)
        self.started = time.time()

    def record(self, n_queries: int, service_s: float) -> None:
        """A pass that just ended, ``service_s`` after it began (busy time counts the part of
        it that no pass recorded before covered: passes queued on the GPU overlap)."""
        ended = time.perf_counter()
        with self._lock:
            self.queries += n_queries
            self.batches += 1
            self.busy_s += max(0.0, min(service_s, ended - self._busy_to))
            self._busy_to = ended
            self._service_s.append(service_s)
            self._stamps.append((time.monotonic(), n_queries))

    def record_error(self) -> None:
        with self._lock:
            self.errors += 1

    def snapshot(self, qps_window_s: float = 10.0) -> dict[str, float | int]:
        with self._lock:
            service = np.fromiter(self._service_s, dtype=np.float64)
            now = time.monotonic()
            recent = sum(n for t, n in self._stamps if now - t <= qps_window_s)
            span = min(qps_window_s, max(1e-9, now - (self._stamps[0][0] if self._stamps else now)))
            return {
                "queries": self.queries,
                "batches": self.batches,
                "errors": self.errors,
                "busy_s": round(self.busy_s, 6),
                "uptime_s": round(time.time() - self.started, 3),
                "qps": round(recent / span, 1) if recent else 0.0,
                "service_p50_us": round(float(np.percentile(service, 50)) * 1e6, 1) if len(service) else None,
                "service_p99_us": round(float(np.percentile(service, 99)) * 1e6, 1) if len(service) else None,
            }
