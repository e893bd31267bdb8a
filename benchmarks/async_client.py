"""Recall latency from ``AsyncClient`` against ``Client``, side by side, on one CPU sidecar.

    PYTHONPATH=src python3 benchmarks/async_client.py [--sizes 1000,50000] [--dim 384] [--recalls 3000]

For each store size: a sidecar (``--device``, default cpu) is started on a fresh store of random
vectors, then single recalls (k=8, one query after another) are timed from the sync client and
from the async one (one coroutine awaiting each recall in turn), each with its default spin and
with none (``spin_us=0`` / ``max_spin_us=0``: every answer through the wake socket, in ``poll``
for the sync client, through ``loop.add_reader`` for the async one), and the async one with
``max_spin_us=50`` (its fixed spin before session 39), in alternating blocks so that a busy
shared machine skews all alike; ``ping`` (a bare round trip, no search) the same way.
Last, C coroutines (``--coroutines``, default 16) recall at once through one AsyncClient, one
query after another each: the latency each sees (queueing on the slot included), the recalls/s,
the requests the slot carried for them (concurrent single recalls go together, up to the
sidecar's max_batch a request) and wrong answers (every answer's ids against a float64
brute force). Only one client is connected while a side is timed: the channel stops spinning
once clients outnumber the cores (see ``ClientChannel.wait``). ``--only-coroutines`` skips the
one-at-a-time lines:

    PYTHONPATH=src python3 benchmarks/async_client.py --sizes 50000 --coroutines 1,4,16,64 --only-coroutines

``--text-coroutines 1,4,16``: instead, C coroutines each calling ``recall_text`` (one question
after another, ``kalos.tools.corpus.QUESTIONS``) through one AsyncClient against a CPU sidecar
that embeds (ONNX Runtime, ``--embed start``) over CPython's help topics
(``kalos.tools.corpus.passages``); each answer's top-8 ids are checked against what the same
question gets alone, before the crowd:

    PYTHONPATH=src python3 benchmarks/async_client.py --text-coroutines 1,4,16 --recalls 400
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


def reference_ids(matrix: np.ndarray, queries: np.ndarray, k: int) -> list[set[int]]:
    """The float64 brute-force top-k of each query, as sets of ids (ids are 1-based rows)."""
    unit = matrix.astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    scores = queries.astype(np.float64) @ unit.T
    return [set((np.argpartition(-row, k - 1)[:k] + 1).tolist()) for row in scores]


def crowd(name: str, queries: np.ndarray, want: list[set[int]], coroutines: int,
          per: int) -> tuple[list[float], float, int, int]:
    """C coroutines through one AsyncClient: latencies, recalls/s, slot requests, wrong answers."""
    async def main() -> tuple[list[float], float, int, int]:
        async with AsyncClient(name, timeout=10.0) as client:
            await asyncio.gather(*(client.recall(q, k=8) for q in queries[:coroutines]))  # warm
            latencies: list[float] = []
            wrong = 0
            requests = 0
            round_trip = client._round_trip

            async def counted(*args: Any, **kwargs: Any) -> Any:
                nonlocal requests
                requests += 1
                return await round_trip(*args, **kwargs)

            client._round_trip = counted  # type: ignore[method-assign]

            async def one(i: int) -> None:
                nonlocal wrong
                clock = time.perf_counter
                for j in range(per):
                    q = (i * per + j) % len(queries)
                    t = clock()
                    hits = await client.recall(queries[q], k=8)
                    latencies.append(clock() - t)
                    wrong += set(hits.ids.tolist()) != want[q]

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(coroutines)))
            return latencies, len(latencies) / (time.perf_counter() - start), requests, wrong

    return asyncio.run(main())


def text_crowd(name: str, questions: list[str], want: dict[str, list[int]], coroutines: int,
               per: int) -> tuple[list[float], float, int]:
    """C coroutines calling recall_text through one AsyncClient: latencies, recalls/s, wrong."""
    async def main() -> tuple[list[float], float, int]:
        async with AsyncClient(name, timeout=30.0) as client:
            await asyncio.gather(*(client.recall_text(q, k=8) for q in questions[:coroutines]))  # warm
            latencies: list[float] = []
            wrong = 0

            async def one(i: int) -> None:
                nonlocal wrong
                clock = time.perf_counter
                for j in range(per):
                    q = questions[(i * per + j) % len(questions)]
                    t = clock()
                    hits = await client.recall_text(q, k=8)
                    latencies.append(clock() - t)
                    wrong += [h.id for h in hits] != want[q]

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(coroutines)))
            return latencies, len(latencies) / (time.perf_counter() - start), wrong

    return asyncio.run(main())


def bench_text(coroutines: list[int], recalls: int) -> None:
    from kalos.tools.corpus import QUESTIONS, passages

    tmp = tempfile.mkdtemp(prefix="kat", dir="/tmp")
    name = f"async-text-{os.getpid()}"
    sidecar = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=384, device="cpu",
                             extra_args=["--embed", "start", "--embed-runtime", "onnx"])
    try:
        with Client(name, timeout=120.0) as client:
            texts = [p.text for p in passages()]
            for start in range(0, len(texts), 256):
                client.remember(texts[start:start + 256])
            questions = list(dict.fromkeys(QUESTIONS))
            want = {q: [h.id for h in client.recall_text(q, k=8)] for q in questions}
        print(f"\n{len(texts):,} passages x dim 384 (the sidecar embeds: ONNX Runtime), k=8, CPU sidecar, "
              f"{os.cpu_count()} cores, {len(questions)} questions")
        for c in coroutines:
            latencies, rate, wrong = text_crowd(name, questions, want, c, max(1, recalls // c))
            print(f"  {f'recall_text, {c} coroutines at once':<38} {percentiles(latencies)}   {rate:,.0f} recalls/s, "
                  f"{wrong} wrong of {len(latencies)}")
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_size(n_items: int, dim: int, recalls: int, rng: np.random.Generator, coroutines: list[int],
               only_coroutines: bool, device: str) -> None:
    tmp = tempfile.mkdtemp(prefix="kab", dir="/tmp")
    name = f"async-bench-{os.getpid()}-{n_items}"
    sidecar = SidecarProcess(os.path.join(tmp, "store.db"), name=name, dim=dim, device=device)
    try:
        matrix = rng.standard_normal((n_items, dim)).astype(np.float32)
        with Client(name, timeout=30.0) as client:
            for start in range(0, n_items, 5000):
                client.add(matrix[start:start + 5000])
        queries = rng.standard_normal((256, dim)).astype(np.float32)
        want = reference_ids(matrix, queries, 8)
        counter = iter(range(1 << 62))

        def next_query() -> np.ndarray:
            return queries[next(counter) % len(queries)]

        sides: dict[str, list[float]] = {k: [] for k in
                                         ("sync recall", "async recall", "async recall, max spin 50",
                                          "sync recall, spin 0", "async recall, spin 0",
                                          "sync ping", "async ping")}
        per_block = max(1, recalls // BLOCKS)
        print(f"\n{n_items:,} items x dim {dim}, k=8, {device} sidecar, {os.cpu_count()} cores")
        for _ in range(0 if only_coroutines else BLOCKS):
            sides["sync recall"] += time_sync(name, lambda c: c.recall(next_query(), k=8), per_block)
            sides["async recall"] += time_async(name, lambda c: c.recall(next_query(), k=8), per_block)
            sides["async recall, max spin 50"] += time_async(name, lambda c: c.recall(next_query(), k=8), per_block,
                                                             max_spin_us=50)
            sides["sync recall, spin 0"] += time_sync(name, lambda c: c.recall(next_query(), k=8), per_block,
                                                      spin_us=0)
            sides["async recall, spin 0"] += time_async(name, lambda c: c.recall(next_query(), k=8), per_block,
                                                        max_spin_us=0)
            sides["sync ping"] += time_sync(name, lambda c: c.ping(), per_block)
            sides["async ping"] += time_async(name, lambda c: c.ping(), per_block)
        for label, samples in sides.items() if not only_coroutines else ():
            print(f"  {label:<34} {percentiles(samples)} ({per_block * BLOCKS} recalls, {BLOCKS} alternating blocks)")
        for c in coroutines:
            latencies, rate, requests, wrong = crowd(name, queries, want, c, max(1, recalls // c))
            print(f"  {f'async, {c} coroutines at once':<34} {percentiles(latencies)}   max {max(latencies) * 1e3:,.1f} ms   "
                  f"{rate:,.0f} recalls/s, "
                  f"{len(latencies) / requests:.1f} recalls a request, {wrong} wrong of {len(latencies)}")
    finally:
        sidecar.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,50000", help="store sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=384,
                        help="the random vectors' dimension (--text-coroutines: always 384) (default: %(default)s)")
    parser.add_argument("--recalls", type=int, default=3000, help="timed recalls per line")
    parser.add_argument("--coroutines", default="16", help="coroutine counts of the last lines, comma-separated")
    parser.add_argument("--only-coroutines", action="store_true", help="only the coroutines' lines")
    parser.add_argument("--device", default="cpu", help="the sidecar's device, cpu or cuda (default: %(default)s)")
    parser.add_argument("--text-coroutines", default="", metavar="C1,C2,...",
                        help="instead: C coroutines calling recall_text against a CPU sidecar that embeds")
    args = parser.parse_args()
    runtime = tempfile.mkdtemp(prefix="kabr", dir="/tmp")
    os.chmod(runtime, 0o700)
    os.environ.setdefault("KALOS_RUNTIME_DIR", runtime)
    rng = np.random.default_rng(0)
    try:
        if args.text_coroutines:
            bench_text([int(c) for c in args.text_coroutines.split(",")], args.recalls)
            return 0
        for size in (int(s) for s in args.sizes.split(",")):
            bench_size(size, args.dim, args.recalls, rng, [int(c) for c in args.coroutines.split(",")],
                       args.only_coroutines, args.device)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
