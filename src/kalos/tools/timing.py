"""Timing helpers the benchmarks share: per-call wall times and their percentiles."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

__all__ = ["percentiles", "time_calls"]


def percentiles(samples_s: list[float] | np.ndarray) -> dict[str, float]:
    us = np.asarray(samples_s, dtype=np.float64) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)), "n": int(len(us))}


def time_calls(fn: Callable[[int], Any], repeats: int, warmup: int = 100) -> list[float]:
    """Per-call wall time of ``fn(i)`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for i in range(warmup):
        fn(i)
    clock = time.perf_counter
    samples = []
    for i in range(repeats):
        start = clock()
        fn(i)
        samples.append(clock() - start)
    return samples
