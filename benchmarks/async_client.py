"""Recall latency from ``AsyncClient`` against ``Client``, side by side, on one CPU sidecar.

    PYTHONPATH=src python3 benchmarks/async_client.py [--sizes 1000,50000] [--dim 384] [--recalls 3000]

For each store size: a CPU sidecar is started on a fresh store of random vectors, then single
recalls (k=8, one query after another) are timed from the sync client and from the async one
(one coroutine awaiting each recall in turn), each with its default spin and with none
(``spin_us=0`` / ``max_spin_us=0``: every answer through the wake eventfd, in ``poll`` for the
sync client, through ``loop.add_reader`` for the async one), in alternating blocks so that a
busy shared machine skews both alike; ``ping`` (a bare round trip, no search) the same way.
Last, 16 coroutines recall at once through one AsyncClient: the latency each sees (queueing
on the slot included) and the recalls/s. Only one client is connected while a side is timed:
the channel stops spinning once clients outnumber the cores (see ``ClientChannel.wait``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from typing import Any, Awaitable, Callable

import numpy as np

from kalos import AsyncClient, Client
from kalos.server.launcher import SidecarProcess

BLOCKS = 3  # alternating blocks per side
WARMUP = 200


def percentiles(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e6
    return f"p50 {np.percentile(a, 50):8.1f} us   p99 {np.percentile(a, 99):8.1f} us"


def time_sync(name: str, fn: Callable[[Client], Any], n: int, **kwargs: Any) -> list[float]:
    with Client(name, timeout=10.0, **kwargs) as client:
        for _ in range(WARMUP):
            fn(client)
        out = []
        clock = time.perf_counter
        for _ in range(n):
            t = clock()
            fn(client)
            out.append(clock() - t)
        return out


def time_async(name: str, fn: Callable[[AsyncClient], Awaitable[Any]], n: int, **kwargs: Any) -> list[float]:
    async def main() -> list[float]:
        async with AsyncClient(name, timeout=10.0, **kwargs) as client:
            for _ in range(WARMUP):
                await fn(client)
            out = []
            clock = time.perf_counter
            for _ in range(n):
                t = clock()
                await fn(client)
                out.append(clock() - t)
            return out

    return asyncio.run(main())


def crowd(name: str, queries: np.ndarray, coroutines: int, per: int) -> tuple[list[float], float]:
    async def main() -> tuple[list[float], float]:
        async with AsyncClient(name, timeout=10.0) as client:
            await asyncio.gather(*(client.recall(q, k=8) for q in queries[:coroutines]))  # warm
            latencies: list[float] = []

            async def one(i: int) -> None:
                clock = time.perf_counter
                for j in range(per):
                    t = clock()
                    await client.recall(queries[(i * per + j) % len(queries)], k=8)
                    latencies.append(clock() - t)

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(coroutines)))
            return latencies, len(latencies) / (time.perf_counter() - start)

    return asyncio.run(main())


def bench_size(n_items: int, dim: int, recalls: int, rng: np.random.Generator) -> None:
    tmp = tempfile.mkdtemp(prefix="kab", dir="/tmp")
    name = f"async-bench-{os.getpid()}-{n_items}"
    sidecar = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=dim, device="cpu")
    try:
        with Client(name, timeout=30.0) as client:
            for start in range(0, n_items, 5000):
                client.add(rng.standard_normal((min(5000, n_items - start), dim)).astype(np.float32))
        queries = rng.standard_normal((256, dim)).astype(np.float32)
        counter = iter(range(1 << 62))

        def next_query() -> np.ndarray:
            return queries[next(counter) % len(queries)]

        sides: dict[str, list[float]] = {k: [] for k in
                                         ("sync recall", "async recall", "sync recall, spin 0",
                                          "async recall, spin 0",
                                          "sync ping", "async ping")}
        per_block = max(1, recalls // BLOCKS)
        for _ in range(BLOCKS):
            sides["sync recall"] += time_sync(name, lambda c: c.recall(next_query(), k=8), per_block)
            sides["async recall"] += time_async(name, lambda c: c.recall(next_query(), k=8), per_block)
            sides["sync recall, spin 0"] += time_sync(name, lambda c: c.recall(next_query(), k=8), per_block,
                                                      spin_us=0)
            sides["async recall, spin 0"] += time_async(name, lambda c: c.recall(next_query(), k=8), per_block,
                                                        max_spin_us=0)
            sides["sync ping"] += time_sync(name, lambda c: c.ping(), per_block)
            sides["async ping"] += time_async(name, lambda c: c.ping(), per_block)
        print(f"\n{n_items:,} items x dim {dim}, k=8, {per_block * BLOCKS} recalls per line "
              f"({BLOCKS} alternating blocks), CPU sidecar, {os.cpu_count()} cores")
        for label, samples in sides.items():
            print(f"  {label:<34} {percentiles(samples)}")
        latencies, rate = crowd(name, queries, 16, max(1, recalls // 16))
        print(f"  {'async, 16 coroutines at once':<34} {percentiles(latencies)}   {rate:,.0f} recalls/s")
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,50000", help="store sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--recalls", type=int, default=3000, help="timed recalls per line")
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kabr", dir="/tmp")
    os.chmod(runtime, 0o700)
    os.environ.setdefault("KALOS_RUNTIME_DIR", runtime)
    rng = np.random.default_rng(0)
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            bench_size(size, args.dim, args.recalls, rng)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
